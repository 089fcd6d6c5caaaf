"""Forward-only pointer files: a hint naming the newest file of a numbered series.

The log's snapshot hint and a manifest store's ``latest`` pointer work the same way: the
pointer is written after the file it names, without coordination, so it may lag (a crash
in between, a slower writer). Readers therefore take it as a starting point and probe
forward; writers move it forward only. A missing or unreadable pointer is not an error,
only a reason to look further (the caller decides how).

A pointer may carry a *copy* of the sealed record it names, so a cold reader gets it in
the same request as the pointer (the snapshot hint carries its header; manifest pointers
carry none, since a pointer moved back may name a pruned manifest). The copy is only a
shortcut: the reader checks its seal and reads the named file when the copy is absent,
unusable or for another number.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from replog.storage import Storage
from replog.storage.backends import Durability

logger = logging.getLogger(__name__)

COPY_FIELD = "copy"


@dataclass(frozen=True)
class PointerEntry:
    """What a pointer holds: the number, and the named record's bytes if it carries them."""

    value: int
    copy: bytes | None = None


class ForwardPointer:
    """The pointer file ``relative`` of ``storage``, holding ``{field: n}`` (and maybe
    ``{"copy": <the sealed record n>}``)."""

    def __init__(self, storage: Storage, relative: str, field: str) -> None:
        self.storage = storage
        self.relative = relative
        self.field = field
        self._known: int | None = None
        """The newest value this process read or wrote: a warm writer need not re-read."""

    def read_entry(self) -> PointerEntry | None:
        """What the pointer holds; None if the file is missing or unreadable (a warning)."""
        data = self.storage.read_optional(self.relative)
        if data is None:
            return None
        try:
            document = json.loads(data)
            value = document[self.field]
            copy = document.get(COPY_FIELD)
        except (ValueError, KeyError, TypeError, AttributeError):
            value, copy = None, None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            logger.warning(
                "ignoring unreadable pointer %s (%d bytes)",
                self.storage.path(self.relative),
                len(data),
            )
            return None
        self._known = max(self._known or 0, value)
        copied = json.dumps(copy).encode() if isinstance(copy, dict) else None
        return PointerEntry(value, copied)

    def read(self) -> int | None:
        """The number it holds; None if the file is missing or unreadable (a warning)."""
        entry = self.read_entry()
        return None if entry is None else entry.value

    def advance(self, value: int, copy: bytes | None = None) -> None:
        """Point at ``value`` (carrying ``copy``, the sealed record it names) unless the
        pointer is known to name ``value`` or later.

        The pointer is read only the first time; afterwards this process's last value
        stands for it. Another writer may have moved it further meanwhile, and is then
        moved back: harmless, since readers probe forward from wherever it points.
        """
        current = self._known if self._known is not None else self.read()
        if current is None or current < value:
            document: dict[str, object] = {self.field: value}
            if copy is not None:
                document[COPY_FIELD] = json.loads(copy)
            # A hint: readers probe past a stale or torn one, so no waiting for the disk.
            self.storage.write(
                self.relative, json.dumps(document).encode(), durability=Durability.BEST_EFFORT
            )
            self._known = value


def probe_forward(start: int, step: int, exists: Callable[[int], bool]) -> int:
    """The last of ``start, start + step, ...`` for which ``exists`` holds (``start`` if
    none after it does): how a reader catches up with a lagging pointer."""
    while exists(start + step):
        start += step
    return start

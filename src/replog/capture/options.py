"""What a capture is asked to do: checked before any connection is made (no driver needed)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from replog.errors import InvalidOptionError

SNAPSHOT_MODES = ("initial", "never")
DEFAULT_MAX_CHANGES = 20_000
"""Changes read from the slot per log commit (more when one transaction is bigger: a
transaction is never split)."""
DEFAULT_CHUNK_ROWS = 100_000
"""Rows a snapshot reads per chunk at most (between two watermarks; one commit of the log):
fewer when the table's rows are wide (:mod:`replog.capture.chunk_sizes`)."""
DEFAULT_STAGE_EVENTS = 20_000
"""Events a capture holds in memory before it stages them as segment files (a large
transaction is committed once, from the files staged as it was decoded)."""
DEFAULT_POLL_S = 0.05
"""How long a following capture waits after finding no new changes."""
DEFAULT_HEARTBEAT_S = 10.0
"""How often a following capture whose tables are idle confirms its position while the
server writes WAL (so its slot never holds WAL without bound)."""
_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")
CAPTURE_APP_PREFIX = "pg-capture."
"""The log records a capture's position as idempotent transaction ``pg-capture.<slot>``."""


def capture_app_id(slot: str) -> str:
    """The transaction app id under which the log records this slot's position."""
    return CAPTURE_APP_PREFIX + slot


def capture_slot(app_id: str) -> str | None:
    """The slot whose position ``app_id`` records, or None if it is no capture's."""
    slot = app_id.removeprefix(CAPTURE_APP_PREFIX)
    return slot if slot != app_id and _SLOT_NAME.fullmatch(slot) else None


@dataclass(frozen=True)
class CaptureOptions:
    """What to capture, and how."""

    dsn: str
    slot: str
    publication: str | None = None
    """An existing publication; default: one named after the slot, created for ``tables``."""
    tables: tuple[str, ...] = ()
    """``schema.table`` names (a bare name is in ``public``); default: the publication's."""
    snapshot: str = "initial"
    keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Key columns of tables without a primary key, by ``schema.table``."""
    follow: bool = False
    drop_slot: bool = False
    """Drop the slot when capture ends (the server then stops keeping WAL for it)."""
    max_changes: int = DEFAULT_MAX_CHANGES
    poll_s: float = DEFAULT_POLL_S
    snapshot_chunk_rows: int = DEFAULT_CHUNK_ROWS
    stage_events: int = DEFAULT_STAGE_EVENTS
    snapshot_workers: int = 1
    """Processes that read a snapshot chunk's key ranges at once (1: the capture alone)."""
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    """A following capture confirms its position at least this often while WAL moves (0:
    never: its slot then holds WAL for as long as its tables are idle)."""
    skip_truncate: bool = False
    """TRUNCATE is warned about and counted, not captured (as before replog 0.6)."""
    reset_slot: bool = False
    """Drop an existing slot this log does not own, and start over with a new one and a
    snapshot (the log that followed it can then never resume)."""
    tables_changed: bool = False
    """``tables`` may leave out tables the log's capture of the slot captures (they are no
    longer captured; their rows stay in tables built from the log)."""

    def check(self) -> None:
        if not _SLOT_NAME.fullmatch(self.slot):
            raise InvalidOptionError(
                f"slot name {self.slot!r} is not valid: lower-case letters, digits and '_', "
                f"at most 63 characters"
            )
        if self.snapshot not in SNAPSHOT_MODES:
            raise InvalidOptionError(
                f"snapshot mode {self.snapshot!r} is not one of {', '.join(SNAPSHOT_MODES)}"
            )
        if self.max_changes < 1:
            raise InvalidOptionError(f"max_changes must be >= 1, got {self.max_changes}")
        for name in ("snapshot_chunk_rows", "stage_events", "snapshot_workers"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heartbeat_s < 0:
            raise InvalidOptionError(f"heartbeat_s must be >= 0 (0: none), got {self.heartbeat_s}")

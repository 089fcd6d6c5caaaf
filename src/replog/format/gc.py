"""Garbage collection marks, and what they tell a writer about the files it staged.

``replog recover`` deletes segment files no commit names once they are older than its
grace period, and before it deletes anything it commits a :class:`GcMark` naming its
cut-off (FORMAT.md, "Garbage"). A writer's staged files are named by no commit until its
own commit lands, so a writer must know that no collection took them meanwhile:

* no mark since it began staging: no collection that follows FORMAT.md can have
  deleted them (its files are younger than every cut-off applied since);
* marks since then, all with a cut-off well before it began: neither;
* a mark since then with a cut-off near or after its start: they may be gone, or go
  between any check and the commit: it must not commit (it stages again instead),
  unless it holds a staging lease (then every collection keeps its files; it checks);
* a write that has staged for long, whose start is not known, or that began before the
  marks the state still knows: collectors that commit no mark (replog 0.2), or marks
  with unknown cut-offs, may have taken its files: it checks that they exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

CLOCK_SKEW_MS = 600_000
"""How far a writer's, a collector's and the storage's clocks may disagree."""
DEFAULT_GRACE_MS = 3_600_000
"""``replog recover`` keeps garbage younger than this: it may belong to a live writer or
a planned read."""
CHECK_AFTER_MS = 60_000
"""A write staging for longer than this checks its files before committing: collectors
that commit no mark (replog 0.2) with a grace at least this long are caught."""


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class GcMark:
    """A garbage collection begins: from this commit on, ``replog recover`` may delete
    unreferenced files stamped before ``cutoff_ms``."""

    cutoff_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"cutoff_ms": self.cutoff_ms}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GcMark:
        return cls(_int(data["cutoff_ms"], "gc.cutoff_ms"))


@dataclass(frozen=True)
class StagingStart:
    """When a writer began staging: a log version it knew then, and its clock (ms)."""

    version: int
    ms: int


class StagedFiles(Enum):
    """What a writer must do about its staged files before it commits them."""

    SAFE = "safe"
    CHECK = "check"
    REFUSE = "refuse"


MAX_KEPT_MARKS = 64
"""How many of the newest marks a state (and a checkpoint header) keeps with their
cut-offs; marks older than these count as unknown (see :func:`judge`)."""


def judge(
    start: StagingStart | None,
    *,
    marks: Sequence[tuple[int, int]],
    known_since: int,
    now_ms: int,
    leased: bool = False,
) -> StagedFiles:
    """The rule above, for a commit built on a state that lists ``marks`` as
    ``(version, cut-off)`` and knows every mark after version ``known_since`` (older ones
    were forgotten, or the state comes from a header written before marks existed).
    ``leased``: the writer holds a staging lease taken before it staged, which keeps its
    files from every collection that follows FORMAT.md: checked at most, never refused."""
    if start is None:
        return StagedFiles.CHECK
    covering = [c for v, c in marks if v > start.version and c >= start.ms - CLOCK_SKEW_MS]
    if covering:
        return StagedFiles.CHECK if leased else StagedFiles.REFUSE
    if start.version < known_since:  # marks with unknown cut-offs may lie in between
        return StagedFiles.CHECK
    if now_ms - start.ms > CHECK_AFTER_MS:
        return StagedFiles.CHECK
    return StagedFiles.SAFE

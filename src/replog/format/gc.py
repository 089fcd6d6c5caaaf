"""Garbage collection marks, and what they tell a writer about the files it staged.

``replog recover`` deletes segment files no commit names once they are older than its
grace period, and before it deletes anything it commits a :class:`GcMark` naming its
cut-off (FORMAT.md, "Garbage"). A writer's staged files are named by no commit until its
own commit lands, so a writer must know that no collection took them meanwhile:

* no mark since it began staging: no collection that follows FORMAT.md can have
  deleted them (its files are younger than every cut-off applied since);
* marks since then, all with a cut-off well before it began: neither;
* a mark since then with a cut-off near or after its start: they may be gone, or go
  between any check and the commit: it must not commit (it stages again instead);
* a write that has staged for long, or whose start is not known: collectors that
  commit no mark (replog 0.2) may have taken its files: it checks that they exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

CLOCK_SKEW_MS = 600_000
"""How far a writer's, a collector's and the storage's clocks may disagree."""
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


def judge(
    start: StagingStart | None, *, gc_version: int, gc_cutoff_ms: int | None, now_ms: int
) -> StagedFiles:
    """The rule above, for a commit built on a state whose newest gc mark is at
    ``gc_version`` and whose marks' largest cut-off is ``gc_cutoff_ms`` (None: unknown,
    as when the state comes from a header written before marks existed)."""
    if start is None:
        return StagedFiles.CHECK
    if gc_version > start.version:
        if gc_cutoff_ms is None:
            return StagedFiles.CHECK
        if gc_cutoff_ms >= start.ms - CLOCK_SKEW_MS:
            return StagedFiles.REFUSE
    if now_ms - start.ms > CHECK_AFTER_MS:
        return StagedFiles.CHECK
    return StagedFiles.SAFE

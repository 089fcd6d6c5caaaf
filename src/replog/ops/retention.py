"""Retention: raising shards' low watermarks without dropping what a consumer still needs.

A truncation is one ``truncate`` commit: each shard's low watermark rises to the first
sequence it keeps, and segments wholly below it leave the log. The commit is checked
against every known consumer (``_replog/consumers/*``) first: a shard may only be cut
up to the smallest offset any consumer has committed, unless the caller forces it.
The removed files are not deleted here; ``recover`` collects them after a grace period,
so a query that planned a task on them just before the truncation still reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replog.checkpoints import consumers
from replog.errors import InvalidOptionError, RetentionError
from replog.format.commits import TRUNCATE, CommitRecord
from replog.format.state import LogState
from replog.log import ReplicationLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blocker:
    """A consumer that has not committed events a truncation would drop."""

    consumer: str
    shard: int
    committed: int
    requested_low: int

    def __str__(self) -> str:
        return (
            f"consumer {self.consumer!r} has committed shard {self.shard} only up to "
            f"sequence {self.committed}; keeping from {self.requested_low} would drop "
            f"{self.requested_low - 1 - self.committed} events it has not read"
        )


@dataclass(frozen=True)
class TruncationPlan:
    """What a truncation would do: new low watermarks and the events they drop."""

    version: int
    lows: dict[int, int]
    dropped_events: dict[int, int]
    blockers: tuple[Blocker, ...]

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped_events.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "log_version": self.version,
            "lows": {str(s): low for s, low in sorted(self.lows.items())},
            "dropped_events": {str(s): n for s, n in sorted(self.dropped_events.items())},
            "total_dropped": self.total_dropped,
            "blockers": [str(blocker) for blocker in self.blockers],
        }


def consumed_lows(log: ReplicationLog) -> dict[int, int]:
    """Per shard, the first sequence some known consumer has not committed.

    With no known consumers nothing counts as consumed (every low is 1).
    """
    committed = consumers.all_committed(log).values()
    return {
        shard: min((offsets.get(shard, 0) for offsets in committed), default=0) + 1
        for shard in range(log.shards)
    }


def lows_older_than(state: LogState, cutoff_ms: int) -> dict[int, int]:
    """Per shard, the low watermark that drops the leading segments whose events all
    happened before ``cutoff_ms``."""
    lows = {}
    for shard, lane in enumerate(state.segments):
        low = state.lows[shard]
        for segment in lane:
            if segment.max_timestamp_ms >= cutoff_ms:
                break
            low = segment.last_sequence + 1
        lows[shard] = low
    return lows


def plan_truncation(log: ReplicationLog, requested: Mapping[int, int]) -> TruncationPlan:
    """Check ``requested`` (``{shard: first sequence to keep}``) against the log and its
    consumers. Lows below the current ones are ignored; lows past the head are errors."""
    state = log.refresh()
    lows: dict[int, int] = {}
    for shard, low in requested.items():
        if not 0 <= shard < log.shards:
            raise InvalidOptionError(
                f"truncate: shard {shard} does not exist (log has {log.shards} shards)"
            )
        if low > state.heads[shard] + 1:
            raise InvalidOptionError(
                f"truncate: shard {shard} cannot keep from sequence {low}: its head is "
                f"{state.heads[shard]} (at most head + 1 = {state.heads[shard] + 1})"
            )
        if low > state.lows[shard]:
            lows[shard] = low
    return TruncationPlan(
        version=state.version,
        lows=lows,
        dropped_events={shard: low - state.lows[shard] for shard, low in lows.items()},
        blockers=_blockers(log, lows),
    )


def _blockers(log: ReplicationLog, lows: Mapping[int, int]) -> tuple[Blocker, ...]:
    """The known consumers that have not committed what ``lows`` would drop."""
    return tuple(
        Blocker(name, shard, offsets.get(shard, 0), low)
        for name, offsets in consumers.all_committed(log).items()
        for shard, low in lows.items()
        if offsets.get(shard, 0) < low - 1
    )


def truncate(
    log: ReplicationLog, requested: Mapping[int, int], *, force: bool = False
) -> tuple[TruncationPlan, CommitRecord | None]:
    """Raise low watermarks to ``requested`` in one commit.

    Raises :class:`RetentionError` (writing nothing) when a known consumer has not
    committed events it would drop, unless ``force``. Returns the plan and the commit
    (None when nothing needed to change).
    """
    plan = plan_truncation(log, requested)
    if plan.blockers and not force:
        reasons = "; ".join(str(blocker) for blocker in plan.blockers)
        raise RetentionError(f"{log.url}: truncation refused: {reasons}. Nothing was changed.")
    if not plan.lows:
        return plan, None
    for blocker in plan.blockers:
        logger.warning("forced truncation of %s: %s", log.url, blocker)

    def build(state: LogState) -> CommitRecord | None:
        lows = {shard: low for shard, low in plan.lows.items() if low > state.lows[shard]}
        if not lows:
            return None
        # A consumer registered or set back since the plan was read: checked again on the
        # state each attempt commits on, so the window is one put, not the whole call.
        late = () if force else _blockers(log, lows)
        if late:
            reasons = "; ".join(str(blocker) for blocker in late)
            raise RetentionError(
                f"{log.url}: truncation refused: a consumer was registered or set back "
                f"while it was planned: {reasons}. Nothing was changed."
            )
        removed = tuple(
            segment
            for shard, low in lows.items()
            for segment in state.segments[shard]
            if segment.last_sequence < low
        )
        return CommitRecord.after(state.version, TRUNCATE, remove=removed, low_watermarks=lows)

    record = log.commit(build)
    if record is not None:
        logger.info(
            "truncated %s at version %d: lows %s, %d segments removed, %d events dropped",
            log.url,
            record.version,
            record.low_watermarks,
            len(record.remove),
            plan.total_dropped,
        )
    return plan, record

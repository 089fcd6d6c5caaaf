"""Time a test moves forward without sleeping, for the clock and retention attacks
(``test_clock_skew``, ``test_attack_32``): every clock replog reads (a writer's wall
clock, the monotonic clock, the storage's file times) is the real one plus
:attr:`Virtual.offset_s`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from replog.core import history
from replog.log import ReplicationLog
from replog.storage import Storage
from replog.timeutil import use_clock
from support.storages import as_class

MINUTE_S = 60.0
RETENTION_MS = 20 * 60_000
"""The retention of :func:`expiring_log`."""

STAMPS: dict[str, float] = {}
"""Per file written, the test's time (:attr:`Virtual.offset_s`) when it was written."""


class Virtual:
    """The test's time: every clock below adds :attr:`offset_s`; a file written is
    stamped :attr:`offset_s` plus :attr:`storage_step_s` (a storage clock ahead)."""

    offset_s = 0.0
    storage_step_s = 0.0
    """How far the storage's clock stepped ahead of everyone else's (file times only)."""

    @classmethod
    def clock(cls, skew_minutes: float = 0.0) -> Callable[[], float]:
        return lambda: time.time() + cls.offset_s + skew_minutes * MINUTE_S

    @classmethod
    def monotonic(cls) -> float:
        return time.monotonic() + cls.offset_s

    @classmethod
    def reset(cls) -> None:
        cls.offset_s = cls.storage_step_s = 0.0
        STAMPS.clear()


class Aged(Storage):
    """Storage whose file times move with the test's time."""

    def _create_once(self, path: str, data: bytes, durability: Any) -> None:
        super()._create_once(path, data, durability)
        STAMPS[path] = Virtual.offset_s + Virtual.storage_step_s

    def _replace_once(self, path: str, data: bytes, durability: Any) -> None:
        super()._replace_once(path, data, durability)
        STAMPS[path] = Virtual.offset_s + Virtual.storage_step_s

    def _modified_once(self, path: str) -> int | None:
        stamp = super()._modified_once(path)
        return None if stamp is None else stamp + int(STAMPS.get(path, 0.0) * 1000)


class AgedWithoutTimes(Aged):
    """A backend that reports no file times: expiry judges by the writers' clocks."""

    def _modified_once(self, path: str) -> int | None:
        return None


def expiring_log(url: str, options: Any = None) -> None:
    """A log of two shards, a table every 10 commits and :data:`RETENTION_MS` of
    retention, that no writer compacts by itself."""
    ReplicationLog.create(url, 2, snapshot_interval=10, retention_ms=RETENTION_MS,
                          auto_compact=False, storage_options=options)  # fmt: skip


def opened(url: str, cls: type[Storage] = Aged, options: Any = None) -> ReplicationLog:
    """A handle on the log whose storage is ``cls``."""
    log = ReplicationLog.open(url, auto_compact=False, storage_options=options)
    log.storage = as_class(log.storage, cls)
    return log


def append(
    log: ReplicationLog,
    tag: str,
    skew_minutes: float = 0.0,
    *,
    n: int = 3,
    monotonic: Callable[[], float] = Virtual.monotonic,
) -> int:
    """Append ``n`` events ``{tag}-{i}`` by a clock ``skew_minutes`` off; the version."""
    with use_clock(Virtual.clock(skew_minutes), monotonic):
        record = log.append(
            [{"key": f"{tag}-{i}", "event_id": f"{tag}-{i}", "data": {}} for i in range(n)]
        )
    assert record is not None
    return record.version


def expire_all(
    log: ReplicationLog,
    skew_minutes: float = 0.0,
    monotonic: Callable[[], float] | None = Virtual.monotonic,
) -> None:
    """An expiry from version 0, by ``log``'s handle and a clock ``skew_minutes`` off, of
    everything older than the retention (a late expiry that read an old hint);
    ``monotonic``: None leaves the caller's."""
    now = Virtual.clock(skew_minutes)
    with use_clock(now, monotonic):
        state = log.refresh()
        history.expire(
            history.LogSnapshots(log.storage, log.descriptor),
            version=state.version,
            retained_from=0,
            live=state.live_paths(),
            now_ms=now() * 1000,
        )

"""Clocks misbehaving (issue 32, hole 1): no acknowledged append is lost to retention,
whatever the writers' clocks say.

The setting the review found: retention 20 minutes; writers A and E 3 minutes fast, B
and W 3 minutes slow (no pair more than 6 minutes apart, within the 10 the format
allows). W reads the log at version 9 and stalls before its put of version 10; meanwhile
B commits 10..19 and, 14.5 minutes later, E commits 20 and expires below table 20:
judging header 10 (B's clock) by its own clock, it finds it 20.5 minutes old. W then
judged commit 9's stamp (A's clock) by its own, found it recent, skipped its check after
the put, filled slot 10 and was told "committed at version 10": no reader ever saw it.

Time passes here without sleeping: every clock replog reads (each writer's, the
monotonic one, the storage's file times) is the real one plus :attr:`Virtual.offset_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.logcheck import check_log
from support.virtual_time import (
    MINUTE_S,
    Aged,
    AgedWithoutTimes,
    Virtual,
    append,
    expire_all,
    expiring_log,
    opened,
)

from replog.format.commits import commit_path
from replog.log import ReplicationLog
from replog.storage import Storage
from replog.timeutil import use_clock

pytestmark = pytest.mark.usefixtures("virtual_time")


def run_skewed_stall(
    tmp_path: Path,
    storage: type[Storage],
    *,
    e_skew: float,
    minutes: float,
    w_monotonic: Callable[[], float] = Virtual.monotonic,
    s3: Any = None,
) -> tuple[int, list[str]]:
    """The review's interleaving; returns the version W was told and the event ids a
    process opening the log afterwards reads."""
    url = str(tmp_path / "log") if s3 is None else s3.url("log")
    options = None if s3 is None else s3.storage_options
    expiring_log(url, options)
    a, b, e = (opened(url, storage, options) for _ in range(3))
    for n in range(1, 10):
        append(a, f"a{n}", +3)  # commits 1..9, stamped by A's clock (3 minutes fast)

    class Stalls(storage):  # type: ignore[valid-type,misc]
        stalled = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            if path.endswith(commit_path(10)) and not type(self).stalled:
                type(self).stalled = True
                for n in range(10, 20):
                    append(b, f"b{n}", -3)  # commits 10..19, header 10 stamped by B
                Virtual.offset_s += minutes * MINUTE_S
                append(e, "e20", e_skew)  # table 20; E expires what it finds old
                e.flush()
            super()._create_once(path, data, durability)

    w = opened(url, Stalls, options)
    told = append(w, "w", -3, monotonic=w_monotonic)
    assert Stalls.stalled
    Virtual.offset_s = 0.0
    reader = ReplicationLog.open(url, storage_options=options)
    ids = reader.read_all().column("event_id").to_pylist()
    check_log(reader)
    return told, ids


def test_an_append_stalled_under_clock_skew_within_the_bound_is_not_lost(
    tmp_path: Path,
) -> None:
    """The review's run: skews within the bound, 14.5 minutes of stall. W's append was
    acknowledged at version 10 and never read (expiry had emptied slot 10)."""
    told, ids = run_skewed_stall(tmp_path, Aged, e_skew=+3, minutes=14.5)
    assert {f"w-{i}" for i in range(3)} <= set(ids), f"W was told version {told}"


def test_the_writer_guard_alone_holds_when_expiry_judges_by_writers_clocks(
    tmp_path: Path,
) -> None:
    """Storage without file times: expiry judges header 10 by E's and B's clocks and
    empties slot 10. W must see, by its own monotonic clock, that 14.5 minutes passed
    since it found the slot free (more than the retention less the skew) and check that
    commit 9 is still there: it is not, so W takes its commit back and commits again."""
    told, ids = run_skewed_stall(tmp_path, AgedWithoutTimes, e_skew=+3, minutes=14.5)
    assert {f"w-{i}" for i in range(3)} <= set(ids), f"W was told version {told}"
    assert told > 20


def test_expiry_by_storage_time_ignores_a_clock_beyond_the_bound(tmp_path: Path) -> None:
    """E's clock is two hours fast (far beyond the bound) and the stall lasts a second:
    judged by E's clock, header 10 is old and slot 10 is emptied while W, whose own
    clock says a second passed, rightly skips its check. Judged by storage time (file
    times), header 10 is seconds old and nothing is expired."""
    told, ids = run_skewed_stall(tmp_path, Aged, e_skew=+120, minutes=0)
    assert {f"w-{i}" for i in range(3)} <= set(ids), f"W was told version {told}"
    assert ReplicationLog.open(url := str(tmp_path / "log")).storage.exists(commit_path(1)), url


def test_a_writer_whose_monotonic_clock_stopped_while_paused_still_checks(
    tmp_path: Path,
) -> None:
    """W's machine is suspended for 25 minutes between finding slot 10 free and its put;
    its monotonic clock (CLOCK_MONOTONIC stops while suspended) says no time passed.
    Expiry, by storage time, rightly empties slot 10. W's wall clock, set right on
    resume, says commit 9 is 25 minutes old: W checks, and commits again."""
    paused = time.monotonic()
    told, ids = run_skewed_stall(tmp_path, Aged, e_skew=0, minutes=25, w_monotonic=lambda: paused)
    assert {f"w-{i}" for i in range(3)} <= set(ids), f"W was told version {told}"
    assert told > 20


@pytest.mark.parametrize("times", ["file times", "no file times"])
def test_on_s3_too(tmp_path: Path, s3: Any, times: str) -> None:
    """On remote storage a writer reads its base alongside the next commit: that read
    proves nothing about the order, so the proof it carries is the older one."""
    storage = Aged if times == "file times" else AgedWithoutTimes
    told, ids = run_skewed_stall(tmp_path, storage, e_skew=+3, minutes=14.5, s3=s3)
    assert {f"w-{i}" for i in range(3)} <= set(ids), f"W was told version {told}"


def test_a_base_read_alongside_the_miss_proves_no_order(tmp_path: Path, s3: Any) -> None:
    """On S3 a writer reads commit 9 (its base) and commit 10 at once. Here expiry
    deletes commits 1..10 between the two answers: commit 9 was there, commit 10 is
    not, yet slot 10 was emptied, not unwritten. The writer must keep the proof it had
    (slot 10 seen free 14.5 minutes ago: too old) and check after its put, rather than
    take the miss as a fresh proof and skip the check."""
    url, options = s3.url("log"), s3.storage_options
    expiring_log(url, options)
    a, b = opened(url, AgedWithoutTimes, options), opened(url, AgedWithoutTimes, options)
    for n in range(1, 10):
        append(a, f"a{n}", +3)
    released = threading.Event()
    fired: list[bool] = []

    class ExpiryBetweenTheAnswers(AgedWithoutTimes):
        armed = False

        def _read_once(self, path: str) -> bytes:
            if type(self).armed and path.endswith(commit_path(10)):
                released.wait(30)
            data = super()._read_once(path)
            if type(self).armed and path.endswith(commit_path(9)) and not fired:
                fired.append(True)
                expire_all(b, +3, monotonic=None)  # E, 3 minutes fast, expires
                assert not b.storage.exists(commit_path(10))
                released.set()
            return data

    w = opened(url, ExpiryBetweenTheAnswers, options)
    with use_clock(Virtual.clock(-3), Virtual.monotonic):
        assert w.refresh(verify_within=0).version == 9  # slot 10 seen free now
    for n in range(10, 21):
        append(b, f"b{n}", -3)  # commits 10..20 (table 20), header 10 stamped by B
    Virtual.offset_s += 14.5 * MINUTE_S
    ExpiryBetweenTheAnswers.armed = True
    told = append(w, "w", -3)
    assert fired
    Virtual.offset_s = 0.0
    ids = ReplicationLog.open(url, storage_options=options).read_all().column("event_id")
    assert {f"w-{i}" for i in range(3)} <= set(ids.to_pylist()), f"W was told version {told}"

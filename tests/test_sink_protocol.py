"""The sink's commit protocol without Spark: replays, aborts, zombies, fencing, doubt."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.counting import counting
from support.logcheck import check_intact, check_log
from support.logs import filled_log, log_rows
from support.replication import leave_pending

from replog.checkpoints.sinks import Batch, Outcome, SinkCommitter
from replog.errors import CommitOutcomeUnknownError, FencedError, ReplogError, StagingCollectedError
from replog.format.commits import COMMITS_DIR, WriterInfo, commit_path
from replog.format.events import events_from_records
from replog.format.gc import StagingStart
from replog.format.state import MAX_QUERIES_PER_SINK
from replog.log import ReplicationLog
from replog.ops import recovery
from replog.ops.verify import verify
from replog.storage import RetryPolicy, Storage
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage
from replog.timeutil import now_ms


def rows(start: int, count: int):
    return events_from_records(
        [
            {"event_id": f"e{i}", "key": f"k{i % 5}", "data": {"n": i}}
            for i in range(start, start + count)
        ]
    )


def batch(log: ReplicationLog, query: str, epoch: int, start: int, count: int, **kw) -> Batch:
    """One attempt of ``epoch``: the log version it began at, its tasks' staged files."""
    since_version, since_ms = log.refresh().version, now_ms()
    staged = tuple(log.stage(rows(start, count)))
    return Batch(query, epoch, staged, since_version=since_version, since_ms=since_ms, **kw)


def event_ids(log: ReplicationLog) -> list[str]:
    return sorted(r["event_id"] for r in check_log(ReplicationLog.open(log.url)))


def expected(n: int) -> list[str]:
    return sorted(f"e{i}" for i in range(n))


@pytest.fixture
def log(tmp_path: Path) -> ReplicationLog:
    return ReplicationLog.create(str(tmp_path / "B"), 2)


def test_a_replayed_epoch_is_committed_once(log: ReplicationLog) -> None:
    committer = SinkCommitter(log, "s")
    assert committer.commit(batch(log, "q", 0, 0, 10)) is Outcome.COMMITTED
    replay = batch(log, "q", 0, 0, 10)
    assert committer.commit(replay) is Outcome.REPLAYED
    assert not any(log.storage.exists(p) for p in replay.paths)  # the replay's files are gone
    assert event_ids(log) == expected(10)


def test_abort_after_commit_keeps_the_epoch(log: ReplicationLog) -> None:
    committer = SinkCommitter(log, "s")
    attempt = batch(log, "q", 0, 0, 10)
    committer.commit(attempt)
    committer.abort(attempt, reason="commit raised afterwards")
    assert verify(log).ok and event_ids(log) == expected(10)
    assert committer.store.load_latest().sink_commit_statuses["s"].is_committed


def test_a_zombie_abort_after_the_mark_moved_on_deletes_nothing(log: ReplicationLog) -> None:
    """The old driver's epoch 1 reaches the log, then it stalls. The restarted driver
    skips its replay of 1 and commits 2. The zombie's manifest save then fails and Spark
    aborts epoch 1 in it: the files the log names for epoch 1 must stay."""
    zombie = SinkCommitter(log, "s")
    zombie.commit(batch(log, "q", 0, 0, 10))
    stalled = batch(log, "q", 1, 10, 10)
    log.commit_staged(stalled.staged, writer=WriterInfo("s", "q", 1))  # step 5, then stall

    restarted = SinkCommitter(ReplicationLog.open(log.url), "s")
    assert restarted.commit(batch(restarted.log, "q", 1, 10, 10)) is Outcome.REPLAYED
    assert restarted.commit(batch(restarted.log, "q", 2, 20, 10)) is Outcome.COMMITTED

    zombie.abort(stalled, reason="manifest conflict")
    assert all(log.storage.exists(p) for p in stalled.paths)
    assert verify(ReplicationLog.open(log.url)).ok
    assert event_ids(log) == expected(30)


def test_a_zombie_committing_after_a_rollback_loses_nothing(log: ReplicationLog) -> None:
    """A restarted driver rolls back a Pending epoch while the crashed attempt's driver is
    still alive and then commits it: no missing files, no duplicates."""
    zombie = SinkCommitter(log, "s")
    zombie.commit(batch(log, "q", 0, 0, 10))
    zombie_files = log.stage(rows(10, 10))
    leave_pending(zombie, "q", 1, zombie_files)

    restarted = SinkCommitter(ReplicationLog.open(log.url), "s")
    resolution = restarted.recover()
    assert resolution is not None and resolution.committed is False
    assert all(log.storage.exists(s.path) for s in zombie_files)  # left for `recover`

    assert log.commit_staged(zombie_files, writer=WriterInfo("s", "q", 1)) is not None
    assert restarted.commit(batch(restarted.log, "q", 1, 10, 10)) is Outcome.REPLAYED
    assert verify(ReplicationLog.open(log.url)).ok and event_ids(log) == expected(20)
    assert restarted.store.load_latest().sink_epochs["s"] == 1


def test_a_newer_run_fences_the_older_one_and_replays_stay_replays(log: ReplicationLog) -> None:
    """Two live queries on one sink id: the second run takes the sink over; the first
    can no longer commit new epochs, and its replay of an epoch already in the log is
    still recognised after the second wrote (the log keeps each query's last epoch)."""
    first, second = SinkCommitter(log, "s"), SinkCommitter(ReplicationLog.open(log.url), "s")
    assert first.commit(batch(log, "q1", 5, 0, 10, run_id="r1")) is Outcome.COMMITTED
    assert second.commit(batch(log, "q2", 0, 10, 10, run_id="r2")) is Outcome.COMMITTED
    assert first.commit(batch(log, "q1", 5, 0, 10, run_id="r1")) is Outcome.REPLAYED
    doomed = batch(log, "q1", 6, 20, 10, run_id="r1")
    with pytest.raises(FencedError, match="r2"):
        first.commit(doomed)
    assert event_ids(log) == expected(20)
    assert second.commit(batch(log, "q2", 1, 20, 10, run_id="r2")) is Outcome.COMMITTED
    assert event_ids(log) == expected(30)


def test_a_sink_commit_whose_put_landed_unseen_is_committed_once(log: ReplicationLog) -> None:
    rates = FaultRates.only(retried_create=1.0)
    faulty = FaultyStorage.wrap(log.storage, FaultInjector(seed=3, rates=rates))
    committer = SinkCommitter(ReplicationLog.from_storage(faulty), "s")
    assert committer.commit(batch(log, "q", 0, 0, 10)) is Outcome.COMMITTED
    assert committer.commit(batch(log, "q", 1, 10, 10)) is Outcome.COMMITTED
    assert event_ids(log) == expected(20) and verify(ReplicationLog.open(log.url)).ok


class SilentCommits(Storage):
    """A store where commit ``silent_version`` lands, but no answer about it (nor a
    read-back) arrives while ``blind``."""

    silent_version = 2
    blind = False

    def _create_once(self, path: str, data: bytes, sync: bool) -> None:
        super()._create_once(path, data, sync)
        if path.endswith(commit_path(self.silent_version)):
            self.blind = True
            raise TimeoutError(f"no answer for {path}")

    def _read_once(self, path: str) -> bytes:
        if path.endswith(commit_path(self.silent_version)) and self.blind:
            raise ConnectionResetError(f"no answer for {path}")
        return super()._read_once(path)


def test_an_abort_while_the_log_commit_is_in_doubt_keeps_the_files(log: ReplicationLog) -> None:
    """Storage never answers the commit's put: the outcome is unknown, so neither the
    failed commit nor Spark's abort may delete the staged files."""
    committer = SinkCommitter(log, "s")
    committer.commit(batch(log, "q", 0, 0, 10))
    attempt = batch(log, "q", 1, 10, 10)
    storage = log.storage.child("")
    storage.__class__ = SilentCommits
    storage.retry = RetryPolicy(attempts=2, first_delay_s=0.0)
    blind = SinkCommitter(ReplicationLog.from_storage(storage), "s")
    with pytest.raises(CommitOutcomeUnknownError):
        blind.commit(attempt)
    committer.abort(attempt, reason="commit failed")
    assert all(log.storage.exists(p) for p in attempt.paths)
    # The write did land: the next commit resolves Pending as Committed, nothing doubles.
    assert committer.commit(batch(log, "q", 2, 20, 10)) is Outcome.COMMITTED
    assert event_ids(log) == expected(30) and verify(ReplicationLog.open(log.url)).ok


def test_a_second_commit_of_a_batch_whose_first_landed_unseen_keeps_its_files(
    log: ReplicationLog,
) -> None:
    """Spark calls commit again with the same messages after CommitOutcomeUnknownError;
    the first call had landed. The second takes the replay path: it must not delete the
    files the landed commit names."""
    committer = SinkCommitter(log, "s")
    committer.commit(batch(log, "q", 0, 0, 10))
    attempt = batch(log, "q", 1, 10, 10)
    storage = log.storage.child("")
    storage.__class__ = SilentCommits
    storage.retry = RetryPolicy(attempts=2, first_delay_s=0.0)
    with pytest.raises(CommitOutcomeUnknownError):
        SinkCommitter(ReplicationLog.from_storage(storage), "s").commit(attempt)
    assert committer.commit(attempt) is Outcome.REPLAYED
    assert all(log.storage.exists(p) for p in attempt.paths)
    assert event_ids(log) == expected(20) and verify(ReplicationLog.open(log.url)).ok


def test_an_abort_of_an_epoch_that_never_reached_the_log_cleans_up(log: ReplicationLog) -> None:
    committer = SinkCommitter(log, "s")
    attempt = batch(log, "q", 0, 0, 10)
    committer.abort(attempt, reason="task failed")
    assert not any(log.storage.exists(p) for p in attempt.paths)
    status = committer.store.load_latest().sink_commit_statuses["s"]
    assert status.is_failed


def test_an_abort_while_the_log_commit_is_still_in_flight_keeps_the_files(
    log: ReplicationLog,
) -> None:
    """The manifest says Pending for this very attempt and its log commit has not landed
    yet (a stalled driver thread may still send it): abort keeps the files, so the late
    commit names files that exist."""
    committer = SinkCommitter(log, "s")
    committer.commit(batch(log, "q", 0, 0, 10))
    attempt = batch(log, "q", 1, 10, 10)
    leave_pending(committer, "q", 1, list(attempt.staged))
    committer.abort(attempt, reason="driver gave up waiting")
    assert all(log.storage.exists(p) for p in attempt.paths)
    assert log.commit_staged(attempt.staged, writer=WriterInfo("s", "q", 1)) is not None
    assert verify(ReplicationLog.open(log.url)).ok and event_ids(log) == expected(20)


@pytest.mark.parametrize("trial", range(10))
def test_concurrent_attempts_of_one_epoch_commit_it_once(memory_url: str, trial: int) -> None:
    """Three attempts of one epoch race (a zombie driver, a restarted one, a retry); the
    ones that fail are aborted as Spark would. The epoch lands once; nothing is deleted
    that the log names."""
    from support.logcheck import run_concurrently

    ReplicationLog.create(memory_url, 2)

    def attempt() -> None:
        own = ReplicationLog.open(memory_url)
        committer = SinkCommitter(own, "s")
        staged = batch(own, "q", 0, 0, 10, run_id="r1")
        try:
            committer.commit(staged)
        except ReplogError:
            committer.abort(staged, "lost a race")

    run_concurrently(attempt, attempt, attempt)
    final = ReplicationLog.open(memory_url)
    assert event_ids(final) == expected(10) and verify(final).ok


@pytest.mark.parametrize("other", ["append", "same epoch"])
def test_a_commit_landing_between_the_sinks_check_and_its_put_is_caught(
    log: ReplicationLog, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """The sink builds its first attempt on the state it refreshed when the commit began;
    another writer's commit landing in between must make it rebuild on a fresh state, not
    fail or commit twice."""
    mine = batch(log, "q", 0, 0, 10)
    rival = ReplicationLog.open(log.url)
    put = log.storage.put_if_absent

    def meanwhile(relative: str, data: bytes, **kw) -> None:  # the sink's log commit
        if relative.startswith(COMMITS_DIR):
            monkeypatch.setattr(log.storage, "put_if_absent", put)
            if other == "append":
                rival.append(rows(100, 3))
            else:  # another attempt of the same epoch wins the race
                SinkCommitter(rival, "s").commit(batch(rival, "q", 0, 0, 10))
        put(relative, data, **kw)

    monkeypatch.setattr(log.storage, "put_if_absent", meanwhile)
    outcome = SinkCommitter(log, "s").commit(mine)
    if other == "append":
        assert outcome is Outcome.COMMITTED
        assert event_ids(log) == sorted([*expected(10), "e100", "e101", "e102"])
    else:
        assert outcome is Outcome.REPLAYED
        assert not any(log.storage.exists(p) for p in mine.paths)
        assert event_ids(log) == expected(10)


def crowd_out_r0(log: ReplicationLog) -> None:
    """Commit to sink ``s`` as run r1, r2, ... (each from a fresh process's committer)
    until the sink's mark has forgotten run r0."""
    for run in range(1, MAX_QUERIES_PER_SINK + 2):
        restarted = SinkCommitter(ReplicationLog.open(log.url), "s")
        outcome = restarted.commit(batch(log, f"q{run}", 0, run, 1, run_id=f"r{run}"))
        assert outcome is Outcome.COMMITTED
    assert log.refresh().sinks["s"].generation_of("r0") is None


def test_a_zombie_run_the_sink_mark_has_forgotten_is_still_fenced(memory_url: str) -> None:
    """The sink mark lists only the newest runs; a run that committed long ago and is
    still alive must not take the sink over when it comes back after all of them."""
    log = ReplicationLog.create(memory_url, 2)
    zombie = SinkCommitter(log, "s")
    assert zombie.commit(batch(log, "q0", 0, 0, 1, run_id="r0")) is Outcome.COMMITTED
    crowd_out_r0(log)
    with pytest.raises(FencedError):
        zombie.commit(batch(log, "q0", 1, 1000, 1, run_id="r0"))
    assert "e1000" not in event_ids(log)


def test_a_forgotten_zombie_run_is_fenced_from_a_fresh_process(memory_url: str) -> None:
    """Fencing never rests on memory alone: a zombie driver that builds a new committer
    (it restarted its sink, or the cache evicted it) after the mark forgot its run still
    finds the generation it committed with, and is fenced."""
    log = ReplicationLog.create(memory_url, 2)
    first = SinkCommitter(log, "s")
    assert first.commit(batch(log, "q0", 0, 0, 1, run_id="r0")) is Outcome.COMMITTED
    crowd_out_r0(log)
    zombie = SinkCommitter(ReplicationLog.open(log.url), "s")  # no memory of r0
    with pytest.raises(FencedError):
        zombie.commit(batch(log, "q0", 1, 1000, 1, run_id="r0"))
    assert "e1000" not in event_ids(log)
    owner = SinkCommitter(ReplicationLog.open(log.url), "s")  # the owning run, restarted
    last = MAX_QUERIES_PER_SINK + 1  # the last run crowd_out_r0 committed as
    outcome = owner.commit(batch(log, f"q{last}", 1, 2000, 1, run_id=f"r{last}"))
    assert outcome is Outcome.COMMITTED


@pytest.mark.parametrize("lost", ["run record write", "first commit's answer"])
def test_a_run_whose_record_was_never_written_is_still_fenced(tmp_path: Path, lost: str) -> None:
    """The run record is best effort: if writing it fails, or the run's first commit
    landed unseen (its retry is a replay), the committer still knows the generation its
    run committed with, and the run is fenced once the mark has forgotten it."""
    from replog.storage.backends import Durability

    url = str(tmp_path / "log")
    created = ReplicationLog.create(url, 2)

    class Faulty(SilentCommits):
        silent_version = 1 if lost == "first commit's answer" else 0  # 0: never silent
        fail_run_records = lost == "run record write"

        def _create_once(self, path: str, data: bytes, durability: Durability) -> None:
            if self.fail_run_records and "/runs/" in path:
                raise PermissionError("injected: run record refused")
            super()._create_once(path, data, durability)  # type: ignore[arg-type]

    storage = Faulty(url, retry=RetryPolicy(attempts=2, first_delay_s=0.001))
    log = ReplicationLog(storage, created.descriptor, auto_compact=False)
    zombie = SinkCommitter(log, "s")
    if lost == "run record write":
        assert zombie.commit(batch(log, "q0", 0, 0, 1, run_id="r0")) is Outcome.COMMITTED
    else:
        with pytest.raises(ReplogError):
            zombie.commit(batch(log, "q0", 0, 0, 1, run_id="r0"))
        storage.blind = False
        assert zombie.commit(batch(log, "q0", 0, 0, 1, run_id="r0")) is Outcome.REPLAYED
    Faulty.fail_run_records = False
    crowd_out_r0(log)
    with pytest.raises(FencedError):
        zombie.commit(batch(log, "q0", 1, 1000, 1, run_id="r0"))
    assert "e1000" not in event_ids(log)


def test_a_warm_commit_sends_only_what_the_protocol_needs(tmp_path: Path) -> None:
    """No staged file is probed (no gc began since the batch did), the Pending manifest
    moves no pointer, and the two pruned manifests go in one request."""
    url = str(tmp_path / "B")
    storage = counting(ReplicationLog.create(url, 4).storage)
    log = ReplicationLog.from_storage(storage)
    committer = SinkCommitter(log, "s")
    for epoch in range(12):  # warm, and past the kept window of manifests
        committer.commit(batch(log, "q", epoch, epoch * 10, 10))
    mine = batch(log, "q", 12, 120, 10)
    log.flush()  # a background merge of the small files would count as this commit's
    storage.requests.clear()
    assert committer.commit(mine) is Outcome.COMMITTED
    assert storage.matching("probe", "/shards/") == 0
    assert storage.matching("write", "/latest") == 1
    assert storage.counts["delete"] == 1
    assert storage.counts["create"] == 3  # Pending, the log commit, Committed
    assert event_ids(log) == expected(130) and verify(log).ok


def test_a_commit_refused_by_a_gc_mark_leaves_a_failed_manifest_and_a_clean_abort(
    tmp_path: Path,
) -> None:
    """A sink commit refused because a recover's cut-off covers it (StagingCollectedError)
    saves Failed over its provisional Pending, deletes only its own uncommitted files;
    Spark's abort afterwards deletes nothing a commit names; the replay commits the epoch
    once."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    committer = SinkCommitter(log, "s")
    since = StagingStart(log.refresh().version, now_ms())
    staged = tuple(log.stage(log_rows(6, 500)))
    time.sleep(0.01)
    recovery.recover(ReplicationLog.open(url), grace_ms=60_000)  # cut-off covers the write
    refused = Batch("q", 0, staged, since_version=since.version, since_ms=since.ms)
    with pytest.raises(StagingCollectedError):
        committer.commit(refused)
    latest = committer.store.load_latest()
    assert latest is not None and latest.sink_commit_statuses["s"].is_failed
    committer.abort(refused, reason="commit raised")
    check_intact(url)
    again = SinkCommitter(ReplicationLog.open(url), "s")
    since2 = again.log.refresh().version
    replay = Batch(
        "q", 0, tuple(again.log.stage(log_rows(6, 500))), since_version=since2, since_ms=now_ms()
    )
    assert again.commit(replay) is Outcome.COMMITTED
    assert len(check_log(ReplicationLog.open(url))) == 40 + 6

"""Adversarial tests of the gc-mark change (commit 0c57e01: gc marks instead of staged-file
probes, provisional Pending manifests, sealed copies in forward pointers, cold loads
without probing past the hint), written by an independent review.

Each "FINDING" test failed on a bug the review found: an event doubled, or a commit
naming a deleted file; its docstring says what was fixed. Tests marked "regression guard"
pin behaviour that held up under attack.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.logcheck import check_intact, check_log
from support.logs import filled_log, log_rows
from support.recovering import HeldRecover, commit_after_recover, commit_during_recover
from support.storages import NoTimes, WholeSeconds, as_class

from replog.checkpoints.consumers import OffsetCommitter, committed_position
from replog.checkpoints.manifest import SinkCommitStatus
from replog.checkpoints.sinks import Batch, Outcome, SinkCommitter, sink_store
from replog.checkpoints.store import LATEST_POINTER, ManifestStore
from replog.core import history
from replog.errors import FencedError, MissingFileError, StagingCollectedError
from replog.format.commits import FORMAT_VERSION
from replog.format.gc import CHECK_AFTER_MS, StagingStart
from replog.format.segments import SHARDS_DIR
from replog.log import ReplicationLog
from replog.ops import garbage, recovery
from replog.storage import Storage
from replog.timeutil import now_ms

# -- helpers ------------------------------------------------------------------------------


# == 1. Sealed copies in forward pointers ================================================


def _delay_pointer_writes(store: ManifestStore, monkeypatch: pytest.MonkeyPatch) -> list:
    """Hold back this store's writes of its ``latest`` pointer (a slow or retried PUT);
    returns the held writes, to be sent later."""
    held: list[tuple[str, bytes]] = []
    real = store.storage.write

    def write(relative: str, data: bytes, **options: bool) -> None:
        if relative == LATEST_POINTER:
            held.append((relative, data))
            return
        real(relative, data, **options)

    monkeypatch.setattr(store.storage, "write", write)
    return held


def test_a_late_pointer_write_makes_cold_readers_resume_a_consumer_from_pruned_offsets(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (doubles events). Run A commits consumer offsets (manifest 1) and its pointer
    PUT is slow; run B then commits 12 times (manifests 2..13; 1..3 are pruned); A's PUT
    lands last and moves ``latest`` back to 1, carrying a sealed copy of manifest 1.

    The pointer docstring calls a moved-back pointer harmless: readers probe forward. Here
    manifest 2 is pruned, so the probe stops at 1; before 0c57e01 loading 1 failed (pruned)
    and the store fell back to listing, finding 13. Now the copy of 1 is used: a cold
    reader resumes the consumer 12 commits back and re-delivers those events.

    Fixed: manifest pointers carry no copy (only the snapshot hint does; headers are
    never deleted), so reading the pruned manifest fails and the store lists."""
    log = filled_log(memory_url, commits=2, shards=2)
    run_a = OffsetCommitter(log, "etl", owner="run-a")
    held = _delay_pointer_writes(run_a.store, monkeypatch)
    run_a.commit({0: 1, 1: 1}, log_version=2, note="a")
    assert held  # A's pointer write is in flight

    run_b = OffsetCommitter(ReplicationLog.open(memory_url), "etl", owner="run-b")
    for n in range(2, 14):
        run_b.commit({0: n, 1: n}, log_version=2, note="b")
    run_a.store.storage.__class__.write(run_a.store.storage, *held[-1])  # A's PUT lands

    position = committed_position(ReplicationLog.open(memory_url), "etl")
    assert position is not None
    assert position.offsets == {0: 13, 1: 13}, (
        f"a cold reader resumes at manifest {position.checkpoint_id} ({position.offsets}, "
        f"owner {position.owner}) instead of 13: events 2..13 are delivered again"
    )


def test_a_late_pointer_write_lets_a_new_run_share_a_generation_with_the_live_one(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (doubles/loses events: fencing broken). As above, then a new run C takes the
    consumer over. From the pointer's copy it believes generation 1 is current, takes
    generation 2 (B's) and writes manifest 2 again (pruned, so its put-if-absent wins).
    B, warm, only probes past its own 13 and is never fenced: two live runs commit one
    consumer's offsets, each from its own fork of the store. Fixed as above."""
    log = filled_log(memory_url, commits=2, shards=2)
    run_a = OffsetCommitter(log, "etl", owner="run-a")
    held = _delay_pointer_writes(run_a.store, monkeypatch)
    run_a.commit({0: 1, 1: 1}, log_version=2, note="a")
    run_b = OffsetCommitter(ReplicationLog.open(memory_url), "etl", owner="run-b")
    for n in range(2, 14):
        run_b.commit({0: n, 1: n}, log_version=2, note="b")
    run_a.store.storage.__class__.write(run_a.store.storage, *held[-1])

    run_c = OffsetCommitter(ReplicationLog.open(memory_url), "etl", owner="run-c")
    taken = run_c.commit({0: 20, 1: 20}, log_version=2, note="c")
    assert taken.generation == 3, f"run C took generation {taken.generation}, B holds 2"
    with pytest.raises(FencedError):
        run_b.commit({0: 14, 1: 14}, log_version=2, note="b")


def test_a_pointer_copy_never_hides_a_pending_manifest(memory_url: str) -> None:
    """Regression guard: the Pending manifest is saved provisionally (the pointer stays
    at the previous, Committed manifest and carries its copy); a cold committer and
    ``recover`` still find and resolve the Pending epoch by probing past the pointer,
    also after a crash and two restarts."""
    log = ReplicationLog.create(memory_url, 2)
    first = SinkCommitter(log, "s")
    for epoch in range(3):
        since = log.refresh().version
        staged_now = tuple(log.stage(log_rows(5, epoch * 5)))
        first.commit(Batch("q", epoch, staged_now, since_version=since))
    # epoch 3: Pending saved, then the driver dies before its log commit
    since = log.refresh().version
    staged = tuple(log.stage(log_rows(5, 15)))
    store = sink_store(log, "s")
    base = store.load_latest()
    assert base is not None
    crashed = SinkCommitter(log, "s")
    pending = crashed._status(base, "q", 3, SinkCommitStatus.pending())
    pending.extra["pending_segments"] = {"s": [s.path for s in staged]}
    store.save(pending, provisional=True)
    pointer = json.loads(log.storage.read(f"_replog/sinks/s/{LATEST_POINTER}"))
    assert pointer["checkpoint_id"] == pending.checkpoint_id - 1 and "copy" not in pointer
    # restart 1 finds the Pending epoch through the probe
    found = SinkCommitter(ReplicationLog.open(memory_url), "s").pending()
    assert found is not None and found[1].epoch == 3 and not found[1].committed
    # restart 2 replays epoch 3 and commits it once
    again = SinkCommitter(ReplicationLog.open(memory_url), "s")
    since = again.log.refresh().version
    replay = Batch("q", 3, tuple(again.log.stage(log_rows(5, 15))), since_version=since)
    assert again.commit(replay) is Outcome.COMMITTED
    assert len(check_log(ReplicationLog.open(memory_url))) == 20
    del staged


# == 2. gc marks instead of probes: stamps taken on another clock =========================


def _stage_when_scan_lists(
    recover_log: ReplicationLog, writer: ReplicationLog, monkeypatch: pytest.MonkeyPatch
) -> dict:
    """When ``recover_log``'s scan starts listing ``shards/`` (after its gc mark), a writer
    begins (knows the log version, hence the mark) and stages a segment."""
    out: dict = {}
    real = recover_log.storage._list_once

    def list_once(path: str) -> list[str]:
        if path.rstrip("/").endswith("/" + SHARDS_DIR) and "staged" not in out:
            out["since"] = StagingStart(writer.refresh().version, now_ms())
            assert writer.state().gc_version == out["since"].version  # the mark is newest
            out["staged"] = writer.stage(log_rows(6, 500))
        return real(path)

    monkeypatch.setattr(recover_log.storage, "_list_once", list_once)
    return out


def test_recover_on_a_clock_ahead_of_storage_deletes_files_staged_after_its_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (commit names a deleted file, events lost). ``recover --grace 5m`` runs on a
    host whose clock is 6 minutes ahead of the storage's (the project budgets 10 minutes
    of such skew, CLOCK_SKEW_MS). A writer begins after the gc mark and
    stages; the scan compares the file's storage time with a cut-off taken on recover's
    clock, finds it 1 minute "too old" and deletes it. The writer saw no mark after its
    since_version, skips the probe it used to make, and commits a deleted file.

    Fixed: file times are also compared with the mark's own storage time stamp minus the
    grace, so a file written after the mark is never older than the cut-off."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    skew = 6 * 60_000
    monkeypatch.setattr(recovery, "now_ms", lambda: now_ms() + skew)
    monkeypatch.setattr(garbage, "now_ms", lambda: now_ms() + skew)
    collector = ReplicationLog.open(url)
    writer = ReplicationLog.open(url)
    begun = _stage_when_scan_lists(collector, writer, monkeypatch)
    report = recovery.recover(collector, grace_ms=5 * 60_000)
    assert begun["staged"]
    deleted = set(report.garbage) & {s.path for s in begun["staged"]}
    try:
        writer.commit_staged(begun["staged"], since=begun["since"])
    except (MissingFileError, StagingCollectedError):
        return  # the safe outcome: nothing names the deleted file
    assert not deleted, f"recover deleted {sorted(deleted)} and a commit now names them"
    check_intact(url)


def test_recover_with_a_subsecond_grace_on_whole_second_stamps_deletes_a_fresh_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (commit names a deleted file). ``--grace 250ms`` is accepted; on S3 a file's
    stamp is its ``Last-Modified`` second. A file staged after the mark, within the same
    second, is stamped up to 999 ms before it was written: before the cut-off. The writer
    skips its probe and commits the deleted file (before 0c57e01 the probe caught it).
    Fixed as above: the mark's stamp has the same whole-second truncation."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    collector = ReplicationLog.from_storage(as_class(Storage(url), WholeSeconds))
    writer = ReplicationLog.open(url)
    begun = _stage_when_scan_lists(collector, writer, monkeypatch)
    while not 400 <= now_ms() % 1000 < 600:  # recover's now: mid-second
        time.sleep(0.01)
    report = recovery.recover(collector, grace_ms=250)
    commit_after_recover(writer, begun["staged"], begun["since"], report)


def test_concurrent_recovers_on_a_backend_without_times_delete_a_file_staged_after_a_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (commit names a deleted file). Backend without modification times; grace
    5 min. Recover R1 takes its first-sight stamp ``listed_ms`` *before* listing
    ``shards/``, and its listing (a large log) takes 6 minutes. Meanwhile recover R2
    commits its mark; a writer begins after that mark and stages F; R1's listing then
    reaches F and records first_seen[F] = R1's listed_ms (6 minutes before R2's cut-off).
    R2's scan reads that note, finds F older than its cut-off and deletes it. The writer
    saw no mark after its since_version (R1's and R2's are both older) and commits F.
    Fixed: first sight is stamped with a time taken after the listing that found the
    file, so a stamp is never older than the file; and (second review) a collector reads
    the notes before it commits its mark, so it never uses a note about a file written
    after its mark, stamped on another collector's clock."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    clock = {"offset": 0}
    monkeypatch.setattr(recovery, "now_ms", lambda: now_ms() + clock["offset"])
    monkeypatch.setattr(garbage, "now_ms", lambda: now_ms() + clock["offset"])
    grace = 5 * 60_000

    slow = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    first = HeldRecover(slow, monkeypatch, grace_ms=grace)  # R1: mark in, listed_ms taken
    clock["offset"] = 6 * 60_000  # R1's listing goes on for 6 minutes

    second = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    writer = ReplicationLog.open(url)
    begun: dict = {}
    real_second_list = second.storage._list_once

    def second_list(path: str) -> list[str]:  # R2 lists after its mark: then F is staged
        if path.rstrip("/").endswith("/" + SHARDS_DIR) and "staged" not in begun:
            begun["since"] = StagingStart(writer.refresh().version, now_ms())  # R2's mark in
            begun["staged"] = writer.stage(log_rows(6, 500))
            first.join()  # R1's listing reaches F and notes it
        return real_second_list(path)

    monkeypatch.setattr(second.storage, "_list_once", second_list)
    report = recovery.recover(second, grace_ms=grace)
    assert writer.refresh().gc_version <= begun["since"].version  # no mark since it began
    commit_after_recover(writer, begun["staged"], begun["since"], report)


def test_a_collector_that_commits_no_mark_is_caught_by_a_write_that_staged_for_long(
    tmp_path: Path,
) -> None:
    """Was a FINDING (commit named a deleted file): a collector that commits no gc mark
    (replog 0.2's recover, run by cron during a rolling upgrade, or an implementation of
    the older FORMAT.md) deletes a running write's files; the new writer saw no mark and
    skipped its probe. A write that has staged for longer than CHECK_AFTER_MS now checks
    its files whatever the marks say, so such a collector (with a grace at least that
    long: it only takes files that old) is caught. Residual risk, documented: an
    unmarked collector with a shorter grace and a write younger than CHECK_AFTER_MS."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    since = StagingStart(log.refresh().version, now_ms() - CHECK_AFTER_MS - 1_000)
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    collector = ReplicationLog.open(url)  # the pre-0c57e01 recover: scan, delete; no mark
    found = garbage.scan(collector, grace_ms=0)
    for relative in found.garbage:
        collector.storage.delete(relative)
    assert {s.path for s in staged} <= set(found.garbage)
    with pytest.raises(MissingFileError, match="gone before their commit"):
        log.commit_staged(staged, since=since)
    check_intact(url)


def test_a_deletion_between_the_writers_probe_and_its_put_is_not_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was a FINDING, PRE-EXISTING (not caused by 0c57e01, but its message claimed the mark
    closes it: "stronger than the probes, which left a window between probe and put"). A writer
    that began before recover's mark builds its commit on a state showing the mark and
    probes its files (present); recover, past its mark, deletes them; the put lands.
    The mark orders the *mark* before the commit, not the *deletions*."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    since = StagingStart(log.refresh().version, now_ms())
    staged = log.stage(log_rows(6, 500))  # outlives --grace 0
    time.sleep(0.01)

    # Now refused before any put: the mark's cut-off (grace 0) is after the write began,
    # so its files may go at any moment; no check could make committing them safe.
    with pytest.raises(StagingCollectedError):  # a recover holds; it deletes before the put
        commit_during_recover(log, staged, since, monkeypatch, grace_ms=0)
    assert not any(log.storage.exists(s.path) for s in staged)
    check_intact(url)


def test_a_cold_writer_on_a_header_without_gc_version_still_probes(
    tmp_path: Path,
) -> None:
    """Regression guard: headers written by a replog older than 0c57e01 carry no
    ``gc_version`` (and hints no copy); a mark below such a header still makes a cold
    writer that began before the mark probe its files (the header counts as its own
    version)."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    since = StagingStart(log.refresh().version, now_ms())
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    recovery.recover(ReplicationLog.open(url), grace_ms=0)  # deletes them; mark at 2
    assert not any(log.storage.exists(s.path) for s in staged)
    filler = ReplicationLog.open(url)
    for n in range(25):
        filler.append(log_rows(1, 1000 + n))
    from replog.format.sealed import seal, unseal

    for version in (10, 20):  # rewrite as an older writer did
        relative = history.header_path(version)
        body = unseal(log.storage.read(relative), relative, max_version=FORMAT_VERSION)
        body.pop("gc_marks")
        body.pop("gc_known_since")
        body.pop("checksum", None)
        log.storage.delete(relative)
        log.storage.put_if_absent(relative, seal(body))
    log.storage.write(history.SNAPSHOT_HINT_PATH, json.dumps({"version": 20}).encode())
    cold = ReplicationLog.open(url)
    assert cold.refresh().gc_version == 20
    with pytest.raises((MissingFileError, StagingCollectedError)):
        cold.commit_staged(staged, since=since)
    check_intact(url)


def test_a_moved_back_hint_copy_older_than_the_mark_still_makes_a_cold_writer_probe(
    tmp_path: Path,
) -> None:
    """Regression guard: a slow writer moves the snapshot hint back to header 10 (with its
    sealed copy, gc_version 0) after a mark at version 13 and headers 20 and 30. A cold
    writer that began at version 12 reads one full window past 10, looks for newer headers,
    sees the mark and probes: its collected files are refused, not committed."""
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 2)
    for n in range(10):
        log.append(log_rows(1, n))
    old_hint = log.storage.read(history.SNAPSHOT_HINT_PATH)
    assert b"copy" in old_hint
    log.append(log_rows(1, 10))
    log.append(log_rows(1, 11))
    since = StagingStart(log.refresh().version, now_ms())
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    recovery.recover(ReplicationLog.open(url), grace_ms=0)
    assert not any(log.storage.exists(s.path) for s in staged)
    for n in range(22):
        log.append(log_rows(1, 100 + n))
    log.storage.write(history.SNAPSHOT_HINT_PATH, old_hint)  # the slow writer's hint
    cold = ReplicationLog.open(url)
    with pytest.raises((MissingFileError, StagingCollectedError)):
        cold.commit_staged(staged, since=since)
    check_intact(url)

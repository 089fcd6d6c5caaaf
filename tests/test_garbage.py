"""Garbage collection and what writers rely on from it: ``replog recover``'s scan
(:mod:`replog.ops.garbage`, :mod:`replog.ops.recovery`) and the gc marks that tell a
writer whether its staged files may have been taken (:mod:`replog.format.gc`, applied by
``ReplicationLog.commit_staged``).

The invariant throughout: no commit ever names a deleted file, and a healthy write is not
refused for a collection that cannot have taken its files.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from support.logcheck import check_intact
from support.logs import backdate, filled_log, log_rows
from support.recovering import HeldRecover, commit_after_recover, commit_during_recover
from support.storages import NoTimes, WholeSeconds, as_class

from replog.core import history
from replog.errors import CommitOutcomeUnknownError, MissingFileError, StagingCollectedError
from replog.format.commits import FORMAT_VERSION
from replog.format.gc import CHECK_AFTER_MS, StagingStart
from replog.format.sealed import seal, unseal
from replog.format.segments import SHARDS_DIR
from replog.log import ReplicationLog
from replog.ops import compaction, garbage, recovery
from replog.storage import Storage
from replog.timeutil import now_ms, use_clock

MINUTE = 60_000


def _stage_when_scan_lists(
    collector: ReplicationLog, writer: ReplicationLog, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """When ``collector``'s scan starts listing ``shards/`` (after its gc mark), ``writer``
    begins (it knows the log version, hence the mark) and stages a segment, on the real
    clock whatever clock the collector runs on. Returns ``since`` and ``staged``."""
    out: dict[str, Any] = {}
    real = collector.storage._list_once

    def list_once(path: str) -> list[str]:
        if path.rstrip("/").endswith("/" + SHARDS_DIR) and "staged" not in out:
            with use_clock(time.time):
                out["since"] = StagingStart(writer.refresh().version, now_ms())
                assert writer.state().gc_version == out["since"].version  # the mark is newest
                out["staged"] = writer.stage(log_rows(6, 500))
        return real(path)

    monkeypatch.setattr(collector.storage, "_list_once", list_once)
    return out


def _as_pre_mark_header(storage: Storage, version: int) -> None:
    """Rewrite header ``version`` as a replog without gc marks wrote it (no ``gc_marks``
    nor ``gc_known_since``), and point the snapshot hint at it without a copy."""
    relative = history.header_path(version)
    body = unseal(storage.read(relative), relative, max_version=FORMAT_VERSION)
    body.pop("gc_marks")
    body.pop("gc_known_since")
    body.pop("checksum", None)
    storage.delete(relative)
    storage.put_if_absent(relative, seal(body))
    storage.write(history.SNAPSHOT_HINT_PATH, json.dumps({"version": version}).encode())


# -- which files recover takes ---------------------------------------------------------


def test_recover_on_a_clock_ahead_of_the_storage_spares_files_staged_after_its_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``recover --grace 5m`` on a host whose clock is 6 minutes ahead of the storage's
    (within CLOCK_SKEW_MS): a file staged after its mark is stamped by the storage after
    the mark, so it is compared with the mark's own storage stamp minus the grace, not
    only with the cut-off on recover's clock. It is kept, and the writer's commit lands."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    collector = ReplicationLog.open(url)
    writer = ReplicationLog.open(url)
    begun = _stage_when_scan_lists(collector, writer, monkeypatch)
    with use_clock(lambda: time.time() + 6 * MINUTE / 1000):
        report = recovery.recover(collector, grace_ms=5 * MINUTE)
    assert begun["staged"]
    commit_after_recover(writer, begun["staged"], begun["since"], report)


def test_recover_with_a_subsecond_grace_on_whole_second_stamps_spares_a_fresh_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--grace 250ms`` on a backend with whole-second file times (S3's Last-Modified),
    recover's clock in mid-second: a file staged after the mark within the same second is
    stamped up to 999 ms early, before recover's cut-off; the mark's stamp is truncated
    the same way, so the file is not older than it minus the grace, and is kept."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    collector = ReplicationLog.from_storage(as_class(Storage(url), WholeSeconds))
    writer = ReplicationLog.open(url)
    begun = _stage_when_scan_lists(collector, writer, monkeypatch)
    with use_clock(lambda: math.floor(time.time()) + 0.5):  # recover's now: mid-second
        report = recovery.recover(collector, grace_ms=250)
    commit_after_recover(writer, begun["staged"], begun["since"], report)


def test_first_sight_stamps_are_taken_after_the_listing_that_found_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backend without file times, grace 5 min, two collectors. R1 commits its mark and
    lists ``shards/`` for 6 minutes; meanwhile R2 commits its mark, a writer begins after
    it and stages F, and R1's listing reaches F. R1 stamps F's first sight with a time
    taken after that listing (never older than F), and R2 reads the notes before its own
    mark (so never one about a file written after it): F is kept and commits."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    offset = {"s": 0.0}

    def clock() -> float:  # both collectors' clock: the test moves it 6 minutes on
        return time.time() + offset["s"]

    grace = 5 * MINUTE
    slow = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    first = HeldRecover(slow, monkeypatch, clock=clock, grace_ms=grace)  # R1 at its listing
    offset["s"] = 6 * MINUTE / 1000  # R1's listing goes on for 6 minutes

    second = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    writer = ReplicationLog.open(url)
    begun: dict[str, Any] = {}
    real_second_list = second.storage._list_once

    def second_list(path: str) -> list[str]:  # R2 lists after its mark: then F is staged
        if path.rstrip("/").endswith("/" + SHARDS_DIR) and "staged" not in begun:
            with use_clock(time.time):  # the writer's clock is right
                begun["since"] = StagingStart(writer.refresh().version, now_ms())
                begun["staged"] = writer.stage(log_rows(6, 500))
            first.join()  # R1's listing reaches F and notes it
        return real_second_list(path)

    monkeypatch.setattr(second.storage, "_list_once", second_list)
    with use_clock(clock):
        report = recovery.recover(second, grace_ms=grace)
    assert writer.refresh().gc_version <= begun["since"].version  # no mark since it began
    commit_after_recover(writer, begun["staged"], begun["since"], report)


def test_first_seen_notes_of_a_lagging_collector_are_read_before_the_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backend without file times, grace 5 min. Collector R1 (clock right) commits its
    mark; collector R2 (clock 9 minutes behind, within CLOCK_SKEW_MS) then runs whole: a
    write begins after both marks and stages F, which R2 notes as first seen at its
    lagging time. R1 read the notes before it committed its mark, so it never judges F by
    R2's note: F is kept and its write commits."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    grace = 5 * MINUTE
    first = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    second = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    writer = ReplicationLog.open(url)
    begun: dict[str, Any] = {}

    real_second_list = second.storage._list_once

    def second_lists(path: str) -> list[str]:
        if path.rstrip("/").endswith("/" + SHARDS_DIR) and "staged" not in begun:
            with use_clock(time.time):  # the writer's clock is right
                begun["since"] = StagingStart(writer.refresh().version, now_ms())
                begun["staged"] = writer.stage(log_rows(6, 500))
        return real_second_list(path)

    monkeypatch.setattr(second.storage, "_list_once", second_lists)

    real_first_put = first.storage.put_if_absent

    def first_puts(relative: str, data: bytes, **kw: Any) -> None:
        real_first_put(relative, data, **kw)
        if relative.startswith("_replog/commits/") and "second" not in begun:  # R1's mark
            with use_clock(lambda: time.time() - 9 * MINUTE / 1000):  # R2, lagging
                begun["second"] = recovery.recover(second, grace_ms=grace)

    monkeypatch.setattr(first.storage, "put_if_absent", first_puts)
    report = recovery.recover(first, grace_ms=grace)

    assert begun["second"].garbage == []
    assert writer.refresh().gc_version <= begun["since"].version  # no mark since it began
    commit_after_recover(writer, begun["staged"], begun["since"], report)


def test_recover_keeps_files_a_compaction_removed_before_a_lagging_writers_commit(
    tmp_path: Path,
) -> None:
    """A file removed by a commit within the grace is kept (a reader may have planned a
    task on it). Commit stamps come from each writer's clock: an append from a host 6
    minutes behind, right after a compaction, is stamped before ``now - 5 min``; recover
    reads commits back past it (to the cut-off less the clock skew) and still sees the
    compaction's removals."""
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 1)
    for n in range(3):
        log.append(log_rows(2, 10 * n))
    for path in log.refresh().live_paths():
        backdate(log, path, 3600)
    planned = {s.path for s in ReplicationLog.open(url).refresh().covering(0, 1, 6)}
    assert len(planned) == 3

    assert compaction.compact(ReplicationLog.open(url)).record is not None
    with use_clock(lambda: time.time() - 6 * MINUTE / 1000):  # another host, 6 minutes behind
        ReplicationLog.open(url).append(log_rows(1, 100))

    report = recovery.recover(ReplicationLog.open(url), grace_ms=5 * MINUTE)
    taken = set(report.garbage) & planned
    assert not taken, (
        f"recover deleted {sorted(taken)}, removed by a compaction seconds ago: a read "
        f"planned on them fails"
    )


# -- recover's own steps ---------------------------------------------------------------


def test_recover_dry_run_commits_no_mark_and_deletes_nothing(tmp_path: Path) -> None:
    """``recover --dry-run`` writes no mark (a write that began before it is neither
    refused nor made to probe), deletes and notes nothing."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    since = StagingStart(log.refresh().version, now_ms())
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    report = recovery.recover(ReplicationLog.open(url), grace_ms=0, dry_run=True)
    assert {s.path for s in staged} <= set(report.garbage)
    assert log.refresh().version == since.version and log.state().gc_version == 0
    assert all(log.storage.exists(s.path) for s in staged)
    log.commit_staged(staged, since=since)
    check_intact(url)


def test_recover_whose_mark_has_an_unknown_outcome_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the mark's put never gets an answer (CommitOutcomeUnknownError), recover raises
    before it lists or deletes anything."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    collector = ReplicationLog.open(url)

    def put(relative: str, data: bytes, **kw: Any) -> None:
        raise CommitOutcomeUnknownError(f"{relative}: no answer")

    monkeypatch.setattr(collector.storage, "put_if_absent", put)
    with pytest.raises(CommitOutcomeUnknownError):
        recovery.recover(collector, grace_ms=0)
    assert all(log.storage.exists(s.path) for s in staged)


# -- what a writer makes of the marks since it began staging ------------------------------


def test_a_mark_whose_cut_off_covers_a_write_refuses_it_before_its_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that began before a recover's mark, with the mark's cut-off (grace 0)
    after its start, is refused: its files may go between any check and its put (the
    recover here deletes them right before the put), so no check could make the commit
    safe. Nothing is committed."""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    since = StagingStart(log.refresh().version, now_ms())
    staged = log.stage(log_rows(6, 500))  # outlives --grace 0
    time.sleep(0.01)

    with pytest.raises(StagingCollectedError):
        commit_during_recover(log, staged, since, monkeypatch, grace_ms=0)
    assert not any(log.storage.exists(s.path) for s in staged)
    check_intact(url)


def test_only_marks_after_a_write_began_can_refuse_it(tmp_path: Path) -> None:
    """A short-grace recover (mark M1) before a write began, then a default-grace recover
    (M2, cut-off an hour back) while it stages: M1 cannot take the write's files (younger
    than its mark), M2's cut-off is long before the write: it commits, not refused."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    recovery.recover(ReplicationLog.open(url), grace_ms=5 * MINUTE)  # M1

    writer = ReplicationLog.open(url)
    since = StagingStart(writer.refresh().version, now_ms())
    assert writer.state().gc_version == since.version  # M1 is known to the write
    staged = writer.stage(log_rows(6, 500))

    report = recovery.recover(ReplicationLog.open(url))  # M2, default grace
    assert not set(report.garbage) & {s.path for s in staged}
    try:
        writer.commit_staged(staged, since=since)
    except StagingCollectedError as exc:
        pytest.fail(f"refused although no collection could take its files: {exc}")
    check_intact(url)


def test_a_mark_with_a_cut_off_long_before_the_write_neither_refuses_nor_probes(
    tmp_path: Path,
) -> None:
    """With only a default-grace recover (cut-off 1 h back) after a write began, the write
    commits without refusal and without probing its files."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    writer = ReplicationLog.open(url)
    since = StagingStart(writer.refresh().version, now_ms())
    staged = writer.stage(log_rows(6, 500))
    recovery.recover(ReplicationLog.open(url))
    probes: list[str] = []
    real = writer.storage.exists

    def exists(relative: str) -> bool:
        probes.append(relative)
        return real(relative)

    writer.storage.exists = exists  # type: ignore[method-assign]
    writer.commit_staged(staged, since=since)
    assert not [p for p in probes if p.startswith(SHARDS_DIR)]
    check_intact(url)


def test_a_write_staging_for_long_checks_its_files_even_without_a_mark(
    tmp_path: Path,
) -> None:
    """A collector that commits no gc mark (replog 0.2, or an implementation of the older
    FORMAT.md) deletes a running write's files: a write that has staged for longer than
    CHECK_AFTER_MS checks its files whatever the marks say, finds them gone and commits
    nothing. (An unmarked collector with a shorter grace and a younger write is the
    documented residual risk.)"""
    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    since = StagingStart(log.refresh().version, now_ms() - CHECK_AFTER_MS - 1_000)
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    collector = ReplicationLog.open(url)  # scans and deletes; commits no mark
    found = garbage.scan(collector, grace_ms=0)
    for relative in found.garbage:
        collector.storage.delete(relative)
    assert {s.path for s in staged} <= set(found.garbage)
    with pytest.raises(MissingFileError, match="gone before their commit"):
        log.commit_staged(staged, since=since)
    check_intact(url)


def test_a_cold_writer_on_headers_without_gc_marks_checks_its_files(tmp_path: Path) -> None:
    """Headers written before gc marks existed carry no ``gc_marks`` (and hints no copy);
    a mark below such a header still makes a cold writer that began before the mark
    check its files (the header counts as the version marks are known since): the
    collected files are found missing, nothing is committed."""
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
    for version in (10, 20):
        _as_pre_mark_header(log.storage, version)
    cold = ReplicationLog.open(url)
    assert cold.refresh().gc_version == 20
    with pytest.raises(MissingFileError):
        cold.commit_staged(staged, since=since)
    check_intact(url)


def test_a_cold_writer_reads_past_a_moved_back_hint_to_the_marks(tmp_path: Path) -> None:
    """A slow writer moves the snapshot hint back to header 10 (with its sealed copy, no
    marks) after a mark at version 13 and headers 20 and 30. A cold writer that began at
    version 12 reads past the hint to the newer headers, sees the mark whose cut-off
    covers it, and is refused: its collected files are not committed."""
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
    with pytest.raises(StagingCollectedError):
        cold.commit_staged(staged, since=since)
    check_intact(url)


def test_marks_after_a_header_without_marks_are_known_with_their_cut_offs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log whose header 10 was written before gc marks existed: marks below it are
    unknown (``gc_known_since`` 10), but marks committed after it are kept with their
    cut-offs, also in later headers. A write that began after that header is judged by
    them: a recover with grace 0 refuses it before its put (a check there could be
    overtaken by the deletion)."""
    url = str(tmp_path / "log")
    filled_log(url, commits=10, shards=2, auto_compact=False)
    storage = Storage(url)
    _as_pre_mark_header(storage, 10)
    upgraded = ReplicationLog.open(url)
    assert upgraded.refresh().gc_known_since == 10  # marks below header 10 unknown
    for n in range(10):
        upgraded.append(log_rows(1, 1000 + n))
    header_20 = unseal(storage.read(history.header_path(20)), "20", max_version=FORMAT_VERSION)
    assert header_20["gc_known_since"] == 10 and header_20["gc_marks"] == []

    writer = ReplicationLog.open(url)
    since = StagingStart(writer.refresh().version, now_ms())
    staged = writer.stage(log_rows(6, 500))
    time.sleep(0.01)

    with pytest.raises(StagingCollectedError):
        commit_during_recover(writer, staged, since, monkeypatch, grace_ms=0)
    assert [v for v, _ in writer.state().gc_marks] == [21]
    check_intact(url)


# -- a short grace and appends in flight (issue 32, hole 4) --------------------------------


def test_an_append_caught_by_a_short_grace_recover_is_staged_again(tmp_path: Path) -> None:
    """``recover --grace 5s`` commits its mark between an append's staging and its put:
    the append loses the race to the mark, and on the next version the mark's cut-off
    (within the 10 minutes of clock skew of its start) refuses it. It refused with
    ``StagingCollectedError`` (though it took milliseconds and nothing was committed);
    an append has its rows at hand, so it stages them again and commits."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    collector = ReplicationLog.open(url)

    class RecoverBeforeThePut(Storage):
        ran = False

        def _create_once(self, path: str, data: bytes, durability: Any) -> None:
            if "/_replog/commits/" in path and not type(self).ran:
                type(self).ran = True
                recovery.recover(collector, grace_ms=5000)
            super()._create_once(path, data, durability)

    writer = ReplicationLog.open(url, auto_compact=False)
    writer.refresh()
    writer.storage = as_class(writer.storage, RecoverBeforeThePut)
    record = writer.append([{"key": "k", "event_id": "caught", "data": {}}])
    assert RecoverBeforeThePut.ran
    assert record is not None
    ids = ReplicationLog.open(url).read_all().column("event_id").to_pylist()
    assert ids.count("caught") == 1
    check_intact(url)

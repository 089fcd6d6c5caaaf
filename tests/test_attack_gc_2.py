"""Second adversarial review of the gc-mark protocol (commits 0c57e01 and e0b91f0: gc marks,
``judge()`` with SAFE/CHECK/REFUSE, StagingStart recorded before staging, gc_cutoff_ms in
states and headers), written by an independent review. tests/test_attack_gc.py holds the
first review's tests; none is repeated here.

Each "FINDING" test fails on the bug it describes (an event lost, a commit naming a deleted
file, or a healthy write refused). Tests marked "Regression guard" pin behaviour that held.

The Spark sink is driven here exactly as PySpark 4.x drives a Python data source, without a
JVM: ``pyspark/sql/worker/write_into_data_source.py`` calls ``streamWriter()`` once to build
the writer whose ``write()`` runs in tasks, and ``pyspark/sql/worker/
python_streaming_sink_runner.py`` receives the pickled *DataSource* and calls
``data_source.streamWriter(schema, overwrite)`` again, in the commit process, right before
``writer.commit(messages, batch_id)`` or ``writer.abort(messages, batch_id)``. A batch
write's committer, by contrast, receives the pickled *writer*
(``commit_data_source_write.py``).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql.types import StringType, StructField, StructType
from support.logcheck import check_intact, check_log
from support.logs import filled_log, log_rows
from support.recovering import commit_after_recover, commit_during_recover
from support.storages import NoTimes, as_class

from replog.core import history
from replog.errors import MissingFileError, StagingCollectedError
from replog.format.commits import FORMAT_VERSION
from replog.format.gc import StagingStart
from replog.format.sealed import seal, unseal
from replog.format.segments import SHARDS_DIR
from replog.log import ReplicationLog
from replog.ops import garbage, recovery
from replog.ops.verify import verify
from replog.spark import sink as spark_sink
from replog.spark.sink import ReplogCommitMessage, ReplogSinkDataSource
from replog.storage import Storage
from replog.timeutil import now_ms, use_clock

SCHEMA = StructType([StructField("key", StringType()), StructField("data", StringType())])
MINUTE = 60_000

# -- helpers ------------------------------------------------------------------------------


@pytest.fixture
def fresh_spark_caches() -> Iterator[None]:
    """Each test gets the sink's per-process cache empty (a fresh driver)."""
    spark_sink.PROCESS.clear()
    yield
    spark_sink.PROCESS.clear()


def commit_process(source: ReplogSinkDataSource) -> spark_sink.ReplogStreamWriter:
    """What python_streaming_sink_runner.py does for every commit or abort: unpickle the
    data source and call ``streamWriter`` on it."""
    data_source = pickle.loads(pickle.dumps(source))
    return data_source.streamWriter(schema=SCHEMA, overwrite=False)


def task_message(
    url: str,
    planned: spark_sink.ReplogStreamWriter | spark_sink.ReplogBatchWriter,
    *,
    epoch: int,
    start: int,
    query: str = "q",
    run: str = "run-1",
) -> ReplogCommitMessage:
    """One task of a micro-batch: stages its rows and returns its commit message (what
    ``_Stager._stage_all`` of the ``planned`` writer, pickled into the task, returns)."""
    staged = tuple(ReplicationLog.open(url).stage(log_rows(6, start)))
    return ReplogCommitMessage(query, run, epoch, 0, staged, since=planned.since)


# == 1. The streaming sink's StagingStart is taken at commit time ==========================


def test_spark_stream_commit_takes_its_staging_start_after_staging_and_commits_collected_files(
    tmp_path: Path, fresh_spark_caches: None
) -> None:
    """FINDING (commit names a deleted file: events lost). PySpark's streaming commit runner
    calls ``streamWriter()`` afresh in the commit process right before ``commit()``, so the
    ``StagingStart`` the sink commits with (``ReplogStreamWriter.since``) is the log version
    and clock *after* every task staged, not before.

    1. micro-batch 0 is planned; its tasks stage their segment files;
    2. ``replog recover --grace`` shorter than the micro-batch commits its mark and deletes
       the (still unreferenced) staged files;
    3. the commit runner calls ``streamWriter()``: since = (version after the mark, now);
    4. ``judge()`` sees no mark after since.version and since.ms a moment ago: SAFE, no
       probe (CHECK_AFTER_MS never fires either); the commit names the deleted files.

    Before 0c57e01 the sink probed every staged file (caught). Suggested fix: carry the
    planning-time StagingStart to the committer in each task's ReplogCommitMessage (the
    task-side writer was pickled from the planning ``streamWriter()``) and commit with
    the smallest version and ms of the messages; never use a StagingStart taken in the
    commit process.

    Fixed: each task's commit message carries the StagingStart of the writer Spark planned
    with; the committer takes the earliest."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    source = ReplogSinkDataSource({"path": url, "sinkId": "s", "shards": "2"})
    planned = source.streamWriter(schema=SCHEMA, overwrite=False)  # write_into_data_source
    message = task_message(url, planned, epoch=0, start=500)
    assert planned.since.version == 1
    time.sleep(0.02)

    report = recovery.recover(ReplicationLog.open(url), grace_ms=10)
    deleted = set(report.garbage) & {s.path for s in message.segments}
    assert deleted  # the collection took the micro-batch's files

    writer = commit_process(source)
    with contextlib.suppress(MissingFileError, StagingCollectedError):  # the safe outcome
        writer.commit([message], 0)
    check_intact(url)


# == 2. The streaming sink's abort looks for its commit only after "now" ===================


def test_spark_stream_abort_after_the_commit_landed_deletes_the_committed_files(
    tmp_path: Path, fresh_spark_caches: None
) -> None:
    """FINDING (events lost; pre-existing, the since_version of abort has been fresh since
    before 0c57e01). Spark calls ``abort`` when ``commit`` raised for any reason, e.g. the
    commit runner's Python worker dies (or its socket breaks) after ``writer.commit``
    returned and before it reported success to the JVM (V2 writes call abort from the
    same catch). The abort runs in a fresh ``streamWriter()``, whose since.version is the
    current version: ``SinkCommitter.abort`` looks for the attempt's files only in commits
    made *after* the one that added them, finds none, sees the manifest Committed (not
    Pending, so not "in flight") and deletes files a commit names.

    Same with the project's zombie scenario (tests/test_sink_protocol.py, "a zombie abort
    after the mark moved on"): there the Batch's since_version comes from before staging;
    from Spark it never does. Suggested fix: as for the commit, the since of the attempt
    must come from the planning writer (commit messages); additionally abort could look
    the paths up in the sink's commits (the sink mark's version) rather than trust a
    window starting at since_version.

    Fixed: abort takes since_version from the commit messages too (the planning writer's)."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    source = ReplogSinkDataSource({"path": url, "sinkId": "s", "shards": "2"})
    planned = source.streamWriter(schema=SCHEMA, overwrite=False)  # planning
    message = task_message(url, planned, epoch=0, start=500)

    commit_process(source).commit([message], 0)  # lands; the worker then dies unreported
    assert verify(ReplicationLog.open(url)).ok

    commit_process(source).abort([message], 0)  # Spark's abort of the failed commit
    missing = [s.path for s in message.segments if not Path(url, s.path).exists()]
    assert not missing, f"abort deleted {missing}, which commit 2 names: events lost"
    check_intact(url)


# == 3. A leased batch write refused by a routine recover ==================================


def test_a_leased_batch_write_is_refused_by_a_default_recover_that_deleted_nothing(
    tmp_path: Path, fresh_spark_caches: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (spurious failure of a healthy write). ``df.write`` takes a staging lease
    so that "recover never collects its files however long it runs" (leases.py). A batch
    write began 55 minutes ago (driver: lease acquired, StagingStart taken); the hourly
    cron runs ``replog recover`` with the default grace (1 h): the lease keeps every file
    the write staged (nothing is deleted), but the mark's cut-off (now - 1 h) is within 10
    minutes of the write's start, so ``judge()`` says REFUSE and the whole job fails with
    StagingCollectedError. Every df.write longer than grace - 10 min that overlaps a
    recover is refused, although its files are exactly as safe as the lease promises.

    Suggested fix: a write that holds a live lease acquired before it staged (the batch
    writer; it is released only after the commit) never needs REFUSE: judge() should
    return CHECK at most for it (pass the lease, or a ``leased=True`` flag, to
    commit_staged).

    Fixed: the batch writer commits with leased=True: a covering mark makes it check its
    files, never refuse."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    began = now_ms() - 55 * MINUTE
    with use_clock(lambda: began / 1000):  # the driver, 55 minutes ago
        writer = ReplogSinkDataSource({"path": url}).writer(schema=SCHEMA, overwrite=False)
    messages = [
        task_message(url, writer, epoch=0, start=500),
        task_message(url, writer, epoch=0, start=600),
    ]
    staged = [s.path for m in messages for s in m.segments]

    report = recovery.recover(ReplicationLog.open(url))  # default grace: 1 hour
    assert not set(report.garbage) & set(staged)  # the lease kept them
    assert all(Path(url, p).exists() for p in staged)

    committer = pickle.loads(pickle.dumps(writer))  # commit_data_source_write.py
    try:
        committer.commit(messages)
    except StagingCollectedError as exc:
        pytest.fail(f"a leased write whose files recover kept was refused: {exc}")
    assert len(check_log(ReplicationLog.open(url))) == 40 + 12


# == 4. gc_cutoff_ms is a maximum over *all* marks, also those before the write began ======


def test_a_short_grace_recover_before_a_write_began_gets_it_refused_by_a_later_recover(
    tmp_path: Path,
) -> None:
    """FINDING (spurious failure). The state keeps one number, the largest cut-off of all
    marks, and judge() compares it with the write's start whenever *any* mark is newer
    than the write's since.version.

    1. an operator runs ``replog recover --grace 5m`` (mark M1, cut-off T - 5 min);
    2. a write begins after M1 (since.version >= M1) and stages;
    3. the cron's ``replog recover`` (default grace 1 h) commits M2, cut-off T - 1 h,
       deletes none of the write's files;
    4. the write commits: gc_version = M2 > since.version and gc_cutoff_ms = max(T - 5 min,
       T - 1 h) = T - 5 min >= start - 10 min: REFUSE.

    M1 cannot take the write's files (they are younger than M1's mark stamp); M2's own
    cut-off is 50 minutes before the write began. Suggested fix: judge with the largest
    cut-off of the marks *after* since.version (keep the recent marks' (version, cut-off)
    pairs in the state and headers; fall back to the maximum only for a since.version
    older than what is kept).

    Fixed: the state keeps the newest marks with their cut-offs (gc_marks, also in headers)
    and judge() looks only at marks after since.version."""
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


def test_a_long_grace_mark_after_the_write_began_alone_is_safe(tmp_path: Path) -> None:
    """Regression guard: with only the default-grace recover (cut-off 1 h back) after a
    write began, the write commits without refusal and without probing."""
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


# == 5. An unknown cut-off (upgraded log) stays unknown forever: back to probe-then-put =====


def _as_pre_mark_header(storage: Storage, version: int) -> None:
    """Rewrite header ``version`` as replog 0.2 wrote it (no gc members), hint w/o copy."""
    relative = history.header_path(version)
    body = unseal(storage.read(relative), relative, max_version=FORMAT_VERSION)
    body.pop("gc_marks")
    body.pop("gc_known_since")
    body.pop("checksum", None)
    storage.delete(relative)
    storage.put_if_absent(relative, seal(body))
    storage.write(history.SNAPSHOT_HINT_PATH, json.dumps({"version": version}).encode())


def test_on_a_log_upgraded_from_0_2_a_deletion_between_probe_and_put_still_loses_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (commit names a deleted file: events lost). e0b91f0 closed the window
    between a writer's probe and its put (first review) by REFUSING when a mark's cut-off
    may cover the write; with an unknown cut-off it still probes (CHECK). A state loaded
    from a header written before marks (every log written by replog 0.2, and logs whose
    headers came from 0c57e01) has gc_cutoff_ms None; ``LogState.apply`` keeps an unknown
    maximum unknown, and ``write_checkpoint`` writes that None into every later header:
    the log never learns a cut-off again, however many marks 0.3 commits.

    1. a 0.2 log (header 10 without gc members) is opened by 0.3; 0.3 appends ten more
       (header 20 written by 0.3: gc_cutoff_ms null);
    2. a write begins and stages; ``replog recover --grace 0`` commits its mark and lists;
    3. the write builds on the state with the mark: cut-off unknown -> CHECK, its files
       are there;
    4. recover deletes them; the write's put lands: the commit names deleted files.

    Suggested fix: an unknown cut-off can only concern marks at or below the pre-mark
    header; track the cut-offs of marks applied after it (known), and judge a write that
    began at or after that header by them (REFUSE when a known cut-off covers it). Or
    never CHECK when a mark after since.version has a known cut-off >= start - skew."""
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

    # Fixed: the state lists the marks after the old header with their cut-offs; this
    # write began after that header, so the mark's cut-off (grace 0) refuses it.
    with pytest.raises(StagingCollectedError):  # a recover holds; it deletes before the put
        commit_during_recover(writer, staged, since, monkeypatch, grace_ms=0)
    assert [v for v, _ in writer.state().gc_marks] == [21]
    check_intact(url)


# == 6. First-seen stamps on another collector's clock =====================================


def test_a_lagging_collectors_first_seen_note_gets_a_file_staged_after_both_marks_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (commit names a deleted file; backends without file times only, short grace).
    First-seen stamps are taken on the clock of whichever collector listed the file, and
    compared with another collector's cut-off; for file times e0b91f0 added the mark's
    storage stamp as a second bound, for first-seen stamps there is none.

    Collectors R1 (clock right) and R2 (clock 9 minutes behind: within CLOCK_SKEW_MS),
    grace 5 min, on a backend without file times:
    1. R1 commits mark M1; R2 commits mark M2;
    2. a write begins (since.version = M2) and stages F;
    3. R2 lists, notes F first seen at its clock (real time - 9 min), keeps it (young);
    4. R1 reads the notes: F's stamp is before R1's cut-off (real - 5 min): deleted;
    5. the write sees no mark after since.version: SAFE, commits F.

    Suggested fix: R1 should only trust notes that existed before its own mark (read
    first_seen.json before committing the mark), or notes should carry the log version of
    the mark of the collection that wrote them and be trusted only when older than R1's.

    Fixed: a collector reads the notes before it commits its mark. (R2 now runs right
    after R1's mark is committed, before R1 lists; in the first version of this test it
    ran when R1 read the notes, which R1 now does before its mark.)"""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    grace = 5 * MINUTE
    clock = {"offset": 0}
    monkeypatch.setattr(recovery, "now_ms", lambda: now_ms() + clock["offset"])
    monkeypatch.setattr(garbage, "now_ms", lambda: now_ms() + clock["offset"])

    first = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    second = ReplicationLog.from_storage(as_class(Storage(url), NoTimes))
    writer = ReplicationLog.open(url)
    begun: dict = {}

    real_second_list = second.storage._list_once

    def second_lists(path: str) -> list[str]:
        if path.rstrip("/").endswith("/" + SHARDS_DIR) and "staged" not in begun:
            begun["since"] = StagingStart(writer.refresh().version, now_ms())  # M1, M2 in
            begun["staged"] = writer.stage(log_rows(6, 500))
        return real_second_list(path)

    monkeypatch.setattr(second.storage, "_list_once", second_lists)

    real_first_put = first.storage.put_if_absent

    def first_puts(relative: str, data: bytes, **kw: object) -> None:
        real_first_put(relative, data, **kw)  # type: ignore[arg-type]
        if relative.startswith("_replog/commits/") and "second" not in begun:  # R1's mark
            clock["offset"] = -9 * MINUTE  # R2 runs now, on its lagging clock
            begun["second"] = recovery.recover(second, grace_ms=grace)
            clock["offset"] = 0

    monkeypatch.setattr(first.storage, "put_if_absent", first_puts)
    report = recovery.recover(first, grace_ms=grace)

    assert begun["second"].garbage == []
    assert writer.refresh().gc_version <= begun["since"].version  # no mark since it began
    commit_after_recover(writer, begun["staged"], begun["since"], report)


# == 7. Things that held up ================================================================


def test_a_refused_sink_commit_leaves_a_failed_manifest_and_a_clean_abort(
    tmp_path: Path,
) -> None:
    """Regression guard: a sink commit refused (StagingCollectedError) saves Failed over
    its provisional Pending, deletes only its own (uncommitted) files, and Spark's abort
    afterwards deletes nothing a commit names; the replay commits the epoch once."""
    from replog.checkpoints.sinks import Batch, Outcome, SinkCommitter

    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    committer = SinkCommitter(log, "s")
    since = StagingStart(log.refresh().version, now_ms())
    staged = tuple(log.stage(log_rows(6, 500)))
    time.sleep(0.01)
    recovery.recover(ReplicationLog.open(url), grace_ms=MINUTE)  # cut-off covers the write
    batch = Batch("q", 0, staged, since_version=since.version, since_ms=since.ms)
    with pytest.raises(StagingCollectedError):
        committer.commit(batch)
    latest = committer.store.load_latest()
    assert latest is not None and latest.sink_commit_statuses["s"].is_failed
    committer.abort(batch, reason="commit raised")
    check_intact(url)
    again = SinkCommitter(ReplicationLog.open(url), "s")
    since2 = again.log.refresh().version
    replay = Batch(
        "q", 0, tuple(again.log.stage(log_rows(6, 500))), since_version=since2, since_ms=now_ms()
    )
    assert again.commit(replay) is Outcome.COMMITTED
    assert len(check_log(ReplicationLog.open(url))) == 40 + 6


def test_recover_dry_run_commits_no_mark_and_deletes_nothing(tmp_path: Path) -> None:
    """Regression guard: ``recover --dry-run`` writes no mark (a write that began before it
    is neither refused nor made to probe), deletes and notes nothing."""
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


def test_a_mark_whose_outcome_is_unknown_stops_recover_before_any_deletion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression guard: if the mark's put never gets an answer (CommitOutcomeUnknownError),
    recover raises before it lists or deletes anything."""
    from replog.errors import CommitOutcomeUnknownError

    url = str(tmp_path / "log")
    log = filled_log(url, commits=1, shards=2)
    staged = log.stage(log_rows(6, 500))
    time.sleep(0.01)
    collector = ReplicationLog.open(url)

    def put(relative: str, data: bytes, **kw) -> None:
        raise CommitOutcomeUnknownError(f"{relative}: no answer")

    monkeypatch.setattr(collector.storage, "put_if_absent", put)
    with pytest.raises(CommitOutcomeUnknownError):
        recovery.recover(collector, grace_ms=0)
    assert all(log.storage.exists(s.path) for s in staged)


# == 8. Compaction: a lagging writer's commit hides a recent removal from recover ==========


def test_a_lagging_writers_commit_hides_a_compaction_from_recover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FINDING (pre-existing; a planned read fails: spurious failure of a healthy reader).
    FORMAT.md keeps a file that "a commit with timestamp_ms within g lists in remove" (a
    reader may have planned a task on it). ``garbage.removed_since`` reads commits
    backwards and *stops at the first* commit stamped at or before the cut-off; commit
    stamps come from each writer's clock and are not monotonic.

    1. a reader plans on segments A, B, C (old files);
    2. a compaction (clock right) commits: A, B, C removed;
    3. an append from a host whose clock is 6 minutes behind (within CLOCK_SKEW_MS)
       commits right after it: its timestamp_ms is before now - 5 min;
    4. ``replog recover --grace 5m`` walks back: its mark, then that append: stop. The
       compaction is never seen; A, B, C are deleted at once and the reader's tasks fail.

    Suggested fix: walk back until a commit older than cutoff - CLOCK_SKEW_MS (the skew
    budget), not the first one older than the cut-off.

    Fixed: removed_since reads back until a commit older than the cut-off by more than the
    clock skew."""
    from support.logs import backdate

    from replog.ops import compaction

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

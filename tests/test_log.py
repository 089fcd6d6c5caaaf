"""The log facade (replog.log): appends, reads, commit races and uncertain outcomes."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from support.counting import CountingStorage, counting
from support.logcheck import check_key_order, check_log, run_concurrently
from support.logs import append_commits

from replog.core import history
from replog.errors import (
    CommitOutcomeUnknownError,
    CorruptionError,
    InvalidEventError,
    InvalidOptionError,
    LogExistsError,
    LogNotFoundError,
    MissingFileError,
    StagingCollectedError,
    UnsupportedFormatError,
)
from replog.format.commits import (
    COMMITS_DIR,
    DESCRIPTOR_PATH,
    FORMAT_VERSION,
    Transaction,
    commit_path,
)
from replog.format.gc import CHECK_AFTER_MS, CLOCK_SKEW_MS, StagingStart
from replog.format.routing import shard_of
from replog.log import ReplicationLog
from replog.ops import garbage
from replog.ops.verify import verify
from replog.storage import RetryPolicy, Storage
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage
from replog.timeutil import now_ms


@pytest.fixture(params=["memory", "local"])
def log_url(request: pytest.FixtureRequest, memory_url: str, tmp_path: Path) -> str:
    return memory_url if request.param == "memory" else str(tmp_path / "log")


def events(n: int, start: int = 0, writer: str = "w") -> list[dict]:
    return [
        {
            "event_id": f"{writer}-{i}",
            "key": f"{writer}-k{i % 5}",
            "data": {"n": i},
            "collection": "orders",
            "operation": "update" if i % 3 else "insert",
        }
        for i in range(start, start + n)
    ]


def test_append_and_read_round_trip(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 4)
    assert log.append(events(50)).version == 1
    assert log.append(events(30, 50)).version == 2
    reopened = ReplicationLog.open(log_url)
    assert sum(reopened.head().values()) == 80
    rows = check_log(reopened)
    assert len(rows) == 80
    check_key_order(rows)
    for row in rows:
        assert row["shard"] == shard_of(row["key"], 4)


def test_read_sub_ranges_across_segments(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 1)
    log.append(events(10))
    log.append(events(10, 10))
    log.append(events(10, 20), segment_max_events=3)
    table = log.read_table(0, 8, 24)
    assert table.column("sequence").to_pylist() == list(range(8, 25))
    assert [json.loads(d)["n"] for d in table.column("data").to_pylist()] == list(range(7, 24))


def test_append_arrow_table(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 2)
    log.append(pa.table({"data": ["a", "b", "c"], "key": ["x", "y", "x"]}))
    assert sum(log.head().values()) == 3


def test_create_twice_and_open_missing(log_url: str) -> None:
    ReplicationLog.create(log_url, 2)
    with pytest.raises(LogExistsError):
        ReplicationLog.create(log_url, 2)
    with pytest.raises(LogNotFoundError, match="holds no replog log"):
        ReplicationLog.open(log_url + "-missing")


def test_bad_shard_count_and_scheme() -> None:
    with pytest.raises(InvalidOptionError, match="shards must be"):
        ReplicationLog.create("memory://x-bad", 0)
    with pytest.raises(InvalidOptionError, match="nosuchscheme"):
        ReplicationLog.open("nosuchscheme://x")


def test_invalid_batch_writes_nothing(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 2)
    with pytest.raises(InvalidEventError):
        log.append([*events(5), {"key": "no-data"}])
    assert log.refresh().version == 0
    assert log.storage.listdir("shards") == []


def test_newer_format_is_refused(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 2)
    document = json.loads(log.storage.read(DESCRIPTOR_PATH))
    document["format_version"] = FORMAT_VERSION + 1
    log.storage.write(DESCRIPTOR_PATH, json.dumps(document).encode())
    with pytest.raises(UnsupportedFormatError, match=f"format_version {FORMAT_VERSION + 1}"):
        ReplicationLog.open(log_url)


def test_torn_commit_record_is_reported(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 2)
    log.append(events(3))
    data = log.storage.read(commit_path(1))
    log.storage.write(commit_path(1), data[: len(data) // 2])
    with pytest.raises(CorruptionError, match=r"00000000000000000001\.json"):
        ReplicationLog.open(log_url).refresh()


def test_a_reader_opening_a_new_log_as_its_first_commit_lands_reads_it(log_url: str) -> None:
    """A process opening a log whose first commit lands between its look for commit 1
    and its listing of the commits (a monitor polling a capture that just started) reads
    the commit; commits without commit 1 mean retention ran, and this is not that."""
    ReplicationLog.create(log_url, 2)
    reader = ReplicationLog.open(log_url)
    real_exists = reader.storage.exists
    landed: list[int] = []

    def exists(relative: str) -> bool:
        found = real_exists(relative)
        if relative == commit_path(1) and not landed:
            landed.append(ReplicationLog.open(log_url).append(events(3)).version)
        return found

    reader.storage.exists = exists  # type: ignore[method-assign]
    assert reader.refresh().version == 1
    assert landed == [1]
    assert reader.read_table(0).num_rows + reader.read_table(1).num_rows == 3


def test_a_writers_temporary_file_beside_no_commit_is_not_expired_history(log_url: str) -> None:
    """On local disk a commit is written to a temporary file in ``_replog/commits/`` and
    then linked into place: a process opening the log in between lists the temporary
    file, not a commit (caught by CI: racing appenders failed to open a new log)."""
    ReplicationLog.create(log_url, 2)
    temporary = f"{COMMITS_DIR}/.{commit_path(1).rsplit('/', 1)[1]}.{uuid.uuid4().hex}.tmp"
    ReplicationLog.open(log_url).storage.write(temporary, b"{}")
    assert ReplicationLog.open(log_url).refresh().version == 0
    assert ReplicationLog.open(log_url).append(events(3)).version == 1


def test_verify_finds_flipped_byte_and_truncation(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 2)
    log.append(events(40))
    assert verify(log).ok
    lanes = [lane for lane in log.state().segments if lane]
    first, second = lanes[0][0], lanes[1][0]
    data = bytearray(log.storage.read(first.path))
    data[len(data) // 3] ^= 0x40
    log.storage.write(first.path, bytes(data))
    log.storage.write(second.path, log.storage.read(second.path)[:100])
    problems = verify(log).problems
    assert {p.path for p in problems} == {
        log.storage.path(first.path),
        log.storage.path(second.path),
    }
    assert all("checksum mismatch" in p.message for p in problems)
    with pytest.raises(CorruptionError, match=first.path):
        log.read_table(first.shard)


def test_racing_threads_lose_nothing(log_url: str) -> None:
    ReplicationLog.create(log_url, 3)

    def writer(name: str) -> None:
        own = ReplicationLog.open(log_url)
        for i in range(8):
            own.append(events(5, i * 5, writer=name))

    run_concurrently(*(lambda n=n: writer(f"t{n}") for n in range(4)))
    log = ReplicationLog.open(log_url)
    rows = check_log(log)
    assert len(rows) == 4 * 8 * 5
    assert append_commits(log) == 32  # and whatever merges the writers committed
    check_key_order(rows)


# -- uncertain outcomes ------------------------------------------------------------------


def faulty_log(url: str, **rates: float) -> ReplicationLog:
    """The log at ``url`` through storage that fails with exactly the given rates."""
    injector = FaultInjector(seed=7, rates=FaultRates.only(**rates))
    return ReplicationLog.from_storage(
        FaultyStorage.wrap(ReplicationLog.open(url).storage, injector)
    )


@pytest.mark.parametrize("fault", ["retried_create", "lost_response"])
def test_an_append_whose_commit_landed_unseen_is_not_repeated(memory_url: str, fault: str) -> None:
    """s3fs answers a retried PUT that had landed with 412 (FileExistsError); a timeout
    hides a landed write too. Either way the append happened once."""
    ReplicationLog.create(memory_url, 2)
    log = faulty_log(memory_url, **{fault: 1.0})
    record = log.append(events(10))
    assert record is not None and record.version == 1
    clean = ReplicationLog.open(memory_url)
    assert clean.refresh().version == 1
    assert len(check_log(clean)) == 10 and verify(clean).ok


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_a_failure_after_the_commit_landed_keeps_its_segments(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException]
) -> None:
    log = ReplicationLog.create(memory_url, 2, snapshot_interval=1)

    def broken_checkpoint(*args: object) -> None:
        raise interrupt("after the commit")

    monkeypatch.setattr(history, "write_checkpoint", broken_checkpoint)
    if interrupt is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            log.append(events(6))
    else:
        log.append(events(6))  # a checkpoint is best effort: logged, not raised
    monkeypatch.undo()
    clean = ReplicationLog.open(memory_url)
    assert clean.refresh().version == 1
    assert len(check_log(clean)) == 6 and verify(clean).ok


def test_a_commit_that_lost_a_race_deletes_nothing_it_does_not_own(memory_url: str) -> None:
    log = ReplicationLog.create(memory_url, 1)
    staged = log.stage(log_table(3))
    other = ReplicationLog.open(memory_url)
    other.append(events(2, writer="o"))  # takes version 1 first
    record = log.commit_staged(staged)
    assert record is not None and record.version == 2
    assert len(check_log(ReplicationLog.open(memory_url))) == 5


def test_a_staged_file_that_vanished_is_refused_before_commit(memory_url: str) -> None:
    log = ReplicationLog.create(memory_url, 1)
    staged = log.stage(log_table(3))
    log.storage.delete(staged[0].path)  # as a recover with a too-short grace would
    with pytest.raises(MissingFileError, match="gone before their commit"):
        log.commit_staged(staged)
    assert log.refresh().version == 0


def test_gc_marks_decide_whether_staged_files_are_checked(memory_url: str) -> None:
    """No mark since a write began: its staged files are not probed. A mark since then
    whose cut-off is long before it began: neither. A mark with a recent cut-off: the
    write is refused (its files may go between any check and the put). Long staging, or
    an unknown start: every staged file is probed."""
    writer = ReplicationLog.from_storage(counting(ReplicationLog.create(memory_url, 4).storage))
    storage = writer.storage
    assert isinstance(storage, CountingStorage)
    other = ReplicationLog.open(memory_url)

    def commit_probes(since: StagingStart | None, *, mark_cutoff: int | None = None) -> int:
        staged = writer.stage(log_table(20, start=writer.refresh().version * 20))
        if mark_cutoff is not None:
            garbage.begin(other, cutoff_ms=mark_cutoff)
        before = storage.matching("probe", "/shards/")
        writer.commit_staged(staged, since=since)
        return storage.matching("probe", "/shards/") - before

    def started(ago_ms: int = 0) -> StagingStart:
        return StagingStart(writer.refresh().version, now_ms() - ago_ms)

    assert commit_probes(started()) == 0
    assert commit_probes(None) == 4  # unknown start: every staged file
    assert commit_probes(started(CHECK_AFTER_MS + 1000)) == 4  # staged for long
    assert commit_probes(started(), mark_cutoff=now_ms() - 2 * CLOCK_SKEW_MS) == 0
    with pytest.raises(StagingCollectedError, match="began while this write was staging"):
        commit_probes(started(), mark_cutoff=now_ms() - 1000)
    assert commit_probes(started()) == 0  # began after the marks
    assert len(check_log(ReplicationLog.open(memory_url))) == 100


def test_a_gc_mark_is_an_empty_append_older_readers_ignore(memory_url: str) -> None:
    log = ReplicationLog.create(memory_url, 1)
    log.append(events(3))
    garbage.begin(log, cutoff_ms=123)
    record = history.read_commit(log.storage, 2)
    assert record is not None and record.gc is not None and record.gc.cutoff_ms == 123
    assert record.operation == "append" and not record.add and not record.remove
    body = json.loads(log.storage.read(commit_path(2)))
    assert body["gc"] == {"cutoff_ms": 123}
    assert "gc" not in json.loads(log.storage.read(commit_path(1)))  # absent unless a mark
    assert log.refresh().gc_version == 2 and len(check_log(log)) == 3 and verify(log).ok


def log_table(n: int, start: int = 0) -> pa.Table:
    from replog.format.events import events_from_records

    return events_from_records(events(n, start))


@pytest.mark.slow
def test_racing_processes_on_local_disk(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 4, snapshot_interval=7)
    worker = Path(__file__).parent / "procs" / "append_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), url, f"p{n}", "15", "20"], env={**os.environ}
        )
        for n in range(4)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    log = ReplicationLog.open(url)
    rows = check_log(log)
    assert len(rows) == 4 * 15 * 20
    assert append_commits(log) == 60
    check_key_order(rows)


class UnansweredCommit(Storage):
    """Commit 2 lands, but neither its answer nor a read-back of it ever arrives."""

    landed = False

    def _create_once(self, path: str, data: bytes, sync: bool) -> None:
        super()._create_once(path, data, sync)
        if path.endswith(commit_path(2)):
            self.landed = True
            raise TimeoutError(f"no answer for {path}")

    def _read_once(self, path: str) -> bytes:
        if self.landed and path.endswith(commit_path(2)):
            raise ConnectionResetError(f"no answer for {path}")
        return super()._read_once(path)


def test_an_append_with_a_transaction_can_be_run_again_after_an_unknown_outcome(
    tmp_path: Path,
) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    log.append([{"key": "a", "data": {"n": 0}}], transaction=Transaction("loader", 0))
    events = [{"event_id": f"e{i}", "key": f"k{i}", "data": {"n": i}} for i in range(5)]
    storage = log.storage.child("")
    storage.__class__ = UnansweredCommit
    storage.retry = RetryPolicy(attempts=2, first_delay_s=0.0)
    with pytest.raises(CommitOutcomeUnknownError):
        ReplicationLog.from_storage(storage).append(events, transaction=Transaction("loader", 1))
    # The operator runs it again: the log holds version 1 of "loader", nothing doubles.
    assert log.append(events, transaction=Transaction("loader", 1)) is None
    assert log.append(events, transaction=Transaction("loader", 0)) is None  # older: held too
    mine = {f"e{i}" for i in range(5)}  # the first event's id is a random UUID
    assert sorted(r["event_id"] for r in check_log(log) if r["event_id"] in mine) == sorted(mine)
    record = log.append([{"key": "b", "data": {}}], transaction=Transaction("loader", 2))
    assert record is not None and record.version == 3
    assert log.append([{"key": "c", "data": {}}], transaction=Transaction("other", 1))
    assert verify(ReplicationLog.open(log.url)).ok

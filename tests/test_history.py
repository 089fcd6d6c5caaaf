"""Snapshots and the history behind them (replog.format.history): cheap, and damage-proof."""

import pytest
from support.logcheck import check_log

from replog.format import history
from replog.format.commits import commit_path
from replog.log import ReplicationLog
from replog.ops.verify import verify
from replog.storage import Storage


class CountingStorage(Storage):
    """Counts requests by kind (reads, probes, lists)."""

    counts: dict[str, int]

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def _read_once(self, path: str) -> bytes:
        self._count("read")
        return super()._read_once(path)

    def _exists_once(self, path: str) -> bool:
        self._count("probe")
        return super()._exists_once(path)

    def _list_once(self, path: str) -> list[str]:
        self._count("list")
        return super()._list_once(path)


def counting(url: str) -> CountingStorage:
    storage = ReplicationLog.open(url).storage
    storage.__class__ = CountingStorage
    assert isinstance(storage, CountingStorage)
    storage.counts = {}
    return storage


def grow(url: str, commits: int, snapshot_interval: int = 20) -> ReplicationLog:
    log = ReplicationLog.create(url, 2, snapshot_interval=snapshot_interval)
    for i in range(commits):
        log.append([{"key": f"k{i % 3}", "data": {"i": i}}])
    return log


@pytest.mark.parametrize("commits", [9, 10, 19, 99, 137])
def test_a_cold_open_reads_a_bounded_number_of_files(memory_url: str, commits: int) -> None:
    grow(memory_url, commits, snapshot_interval=100)
    storage = counting(memory_url)
    state = ReplicationLog.from_storage(storage).refresh()
    assert state.version == commits
    requests = sum(storage.counts.values())
    # descriptor + hint + header + < 10 commits + their probes: never the whole history
    assert requests <= 25, storage.counts
    assert storage.counts.get("list", 0) == 0


def test_a_damaged_segment_table_falls_back_to_an_older_one(memory_url: str) -> None:
    log = grow(memory_url, 45)
    log.storage.write(history.table_path(40), b"not arrow")
    fresh = ReplicationLog.open(memory_url)
    rows = check_log(fresh)  # segments: table 20 + commits 21..45
    assert len(rows) == 45
    problems = verify(fresh).problems
    assert [p.path for p in problems] == [log.storage.path(history.table_path(40))]


def test_missing_tables_and_headers_fall_back_to_the_commits(memory_url: str) -> None:
    log = grow(memory_url, 45)
    for version in (20, 40):
        log.storage.delete(history.table_path(version))
    log.storage.write(history.header_path(40), b"{torn")
    fresh = ReplicationLog.open(memory_url)
    assert fresh.refresh().version == 45
    assert len(check_log(fresh)) == 45
    paths = {p.path for p in verify(fresh).problems}
    assert paths == {
        log.storage.path(history.table_path(20)),
        log.storage.path(history.header_path(40)),
    }


def test_a_lost_hint_is_found_again_by_probing(memory_url: str) -> None:
    log = grow(memory_url, 33)
    log.storage.delete(history.SNAPSHOT_HINT_PATH)
    storage = counting(memory_url)
    assert ReplicationLog.from_storage(storage).refresh().version == 33
    assert storage.counts["read"] <= 10  # a header and the commits after 30, not all 33


def test_verify_checks_every_checksummed_file(memory_url: str) -> None:
    from replog.checkpoints.consumers import OffsetCommitter, consumer_store
    from replog.checkpoints.store import manifest_name

    log = grow(memory_url, 25)
    OffsetCommitter(log, "reader", "test-run").commit({0: 1, 1: 1}, log_version=25, note="test")
    report = verify(log)
    assert report.ok and report.commits == 25 and report.snapshots == 2
    assert report.manifests == 1 and report.events == 25
    store = consumer_store(log, "reader")
    damaged = [
        (log.storage, commit_path(7)),
        (log.storage, history.header_path(10)),
        (log.storage, history.table_path(20)),
        (store.storage, manifest_name(1)),
    ]
    for storage, relative in damaged:
        data = bytearray(storage.read(relative))
        data[len(data) // 2] ^= 0x01
        storage.write(relative, bytes(data))
    found = {p.path for p in verify(log).problems}
    assert found == {storage.path(relative) for storage, relative in damaged}

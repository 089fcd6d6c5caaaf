import json
import threading
from pathlib import Path

import pytest
from support.counting import counting
from support.logcheck import check_log, run_concurrently
from support.logs import filled_log, log_rows

from replog.checkpoints.consumers import OffsetCommitter, committed_position
from replog.checkpoints.manifest import CheckpointManifest, ConnectorCheckpoint, SinkCommitStatus
from replog.checkpoints.sinks import Batch, Outcome, SinkCommitter, sink_store
from replog.checkpoints.store import LATEST_POINTER, QUARANTINE_DIR, ManifestStore, manifest_name
from replog.errors import (
    FencedError,
    ManifestConflictError,
    ManifestNotFoundError,
    UnsupportedFormatError,
)
from replog.format.sealed import seal
from replog.log import ReplicationLog


def sample(checkpoint_id: int = 1) -> CheckpointManifest:
    manifest = CheckpointManifest(
        checkpoint_id=checkpoint_id, epoch=7, timestamp_ms=1_700_000_000_000
    )
    manifest.source_offsets["replog:abc"] = ConnectorCheckpoint({"0": 41, "1": 0}, 7, {"url": "x"})
    manifest.sink_epochs["s1"] = 6
    manifest.sink_commit_statuses["s1"] = SinkCommitStatus.committed()
    manifest.sink_commit_statuses["s2"] = SinkCommitStatus.failed("task lost")
    manifest.sink_query_ids["s1"] = "q-1"
    manifest.source_names = ["replog:abc"]
    manifest.sink_names = ["s1", "s2"]
    manifest.pending_segments = {"s1": ["shards/shared/a.arrow", "shards/00000/b.arrow"]}
    return manifest


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, memory_url: str, tmp_path: Path) -> ManifestStore:
    url = memory_url if request.param == "memory" else str(tmp_path / "store")
    return ManifestStore(url, keep=3)


def test_json_round_trip() -> None:
    manifest = sample()
    again = CheckpointManifest.from_json(json.loads(json.dumps(manifest.to_json())))
    assert again == manifest
    assert manifest.to_json()["sink_commit_statuses"] == {
        "s1": "Committed",
        "s2": {"Failed": "task lost"},
    }
    assert manifest.validate() == []


def test_older_manifest_loads_with_defaults() -> None:
    old = {"version": 1, "checkpoint_id": 3, "epoch": 2, "timestamp_ms": 5}
    manifest = CheckpointManifest.from_json(old)
    assert manifest.sink_epochs == {} and manifest.pending_segments == {}
    assert manifest.validate() == []


def test_fields_replog_0_3_wrote_but_never_set_are_kept_as_they_were() -> None:
    old = {"version": 1, "checkpoint_id": 3, "epoch": 2, "timestamp_ms": 5,
           "pipeline_hash": None, "watermark": None, "state_checksum": None}  # fmt: skip
    manifest = CheckpointManifest.from_json(old)
    assert manifest.to_json()["watermark"] is None and "pipeline_hash" in manifest.extra


def test_newer_fields_survive_a_rewrite(store: ManifestStore) -> None:
    document = {**sample().to_json(), "operator_states": {"op": {"external": True}}, "shiny": 1}
    store.storage.put_if_absent(manifest_name(1), seal(document))
    loaded = store.load_latest()
    assert loaded is not None and loaded.extra == {
        "operator_states": {"op": {"external": True}},
        "shiny": 1,
    }
    store.save(loaded.successor(2))
    rewritten = json.loads(store.storage.read(manifest_name(2)))
    assert rewritten["shiny"] == 1 and rewritten["operator_states"] == {"op": {"external": True}}


def test_validate_lists_every_problem() -> None:
    manifest = CheckpointManifest(checkpoint_id=0, epoch=-1, timestamp_ms=0, version=0)
    manifest.sink_epochs["a"] = 3
    manifest.sink_commit_statuses["b"] = SinkCommitStatus.committed()
    manifest.sink_commit_statuses["c"] = SinkCommitStatus.failed("")
    manifest.source_offsets["ghost"] = ConnectorCheckpoint({"0": -4})
    manifest.source_names = ["real"]
    manifest.sink_names = ["a"]
    problems = manifest.validate()
    expected = [
        "manifest version is 0",
        "checkpoint_id is 0",
        "epoch is negative",
        "timestamp_ms is 0",
        "sink 'a' has epoch 3 but no commit status",
        "sink 'a' has epoch 3 but no query id",
        "sink 'b' is Committed but has no committed epoch",
        "sink 'c' is Failed without a reason",
        "source_offsets contains 'ghost' not in source_names",
        "sink 'b' is not in sink_names",
        "source 'ghost': offset of shard 0 is -4",
    ]
    for text in expected:
        assert any(text in problem for problem in problems), (text, problems)
    assert len(problems) == len(expected) + 1  # sink 'c' is not in sink_names either


def test_save_load_and_pointer(store: ManifestStore) -> None:
    assert store.load_latest() is None
    first = sample(1)
    store.save(first)
    second = first.successor(2)
    second.epoch = 8
    store.save(second)
    latest = store.load_latest()
    assert latest is not None and latest.checkpoint_id == 2 and latest.epoch == 8
    assert json.loads(store.storage.read(LATEST_POINTER))["checkpoint_id"] == 2


def test_pointer_left_behind_by_a_crash_is_probed_past(store: ManifestStore) -> None:
    store.save(sample(1))
    store.save(sample(2))
    store.storage.write(LATEST_POINTER, b'{"checkpoint_id": 1}')
    assert store.load_latest().checkpoint_id == 2  # type: ignore[union-attr]


def test_a_provisional_save_is_found_and_pruned_by_the_final_one(store: ManifestStore) -> None:
    """A sink's Pending manifest is saved provisionally (no pointer move, no pruning): a
    reader still finds it, and the final save that follows prunes for both."""
    store = ManifestStore(store.storage, keep=3)
    manifest = sample(1)
    for _ in range(5):
        store.save(manifest)
        manifest = store.next_manifest(manifest)
    store.save(manifest, provisional=True)  # id 6
    assert json.loads(store.storage.read(LATEST_POINTER))["checkpoint_id"] == 5
    assert ManifestStore(store.storage).load_latest().checkpoint_id == 6  # type: ignore[union-attr]
    assert store.list_ids() == [3, 4, 5, 6]
    store.save(store.next_manifest(manifest))  # id 7
    assert store.list_ids() == [5, 6, 7]
    assert json.loads(store.storage.read(LATEST_POINTER))["checkpoint_id"] == 7


def test_pruning_keeps_newest(store: ManifestStore) -> None:
    manifest = sample(1)
    for _ in range(7):
        store.save(manifest)
        manifest = store.next_manifest(manifest)
    assert store.list_ids() == [5, 6, 7]
    store.storage.put_if_absent(manifest_name(1), seal(sample(1).to_json()))  # a leftover
    assert store.prune() == [1]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: b"\x00\xffgarbage", id="garbage"),
        pytest.param(lambda data: data.replace(b'"epoch":7', b'"epoch":8'), id="wrong-checksum"),
    ],
)
def test_corrupt_latest_falls_back_with_warning(
    store: ManifestStore, damage, caplog: pytest.LogCaptureFixture
) -> None:
    store.save(sample(1))
    second = sample(1).successor(2)
    store.save(second)
    store.storage.write(manifest_name(2), damage(store.storage.read(manifest_name(2))))
    loaded = ManifestStore(store.storage, keep=3).load_latest()  # a reader elsewhere
    assert loaded is not None and loaded.checkpoint_id == 1
    assert manifest_name(2) in caplog.text


def test_all_corrupt_is_an_error(store: ManifestStore) -> None:
    store.save(sample(1))
    store.storage.write(manifest_name(1), b"{")
    with pytest.raises(ManifestNotFoundError, match=r"00000000000000000001\.json"):
        ManifestStore(store.storage, keep=3).load_latest()


def test_newer_manifest_version_is_refused(store: ManifestStore) -> None:
    store.storage.put_if_absent(manifest_name(1), seal({**sample().to_json(), "version": 9}))
    with pytest.raises(UnsupportedFormatError, match="version 9"):
        store.load_latest()


def test_racing_writers_exactly_one_wins(store: ManifestStore) -> None:
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def race(n: int) -> None:
        manifest = sample(1)
        manifest.epoch = n
        own = ManifestStore(store.storage, keep=3)
        barrier.wait()
        try:
            own.save(manifest)
            outcomes.append(f"won-{n}")
        except ManifestConflictError:
            outcomes.append("lost")

    run_concurrently(*(lambda n=n: race(n) for n in range(6)))
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and outcomes.count("lost") == 5
    assert f"won-{store.load_latest().epoch}" == winners[0]  # type: ignore[union-attr]


def test_request_count_does_not_grow(memory_url: str) -> None:
    storage = counting(ManifestStore(memory_url).storage)
    store = ManifestStore(storage, keep=5)
    manifest = sample(1)
    costs = []
    for _ in range(200):
        before = len(storage.requests)
        store.save(manifest)
        store.load_latest()
        costs.append(len(storage.requests) - before)
        manifest = store.next_manifest(manifest)
    # From save 6 on, every save also prunes old manifests; after that the cost is flat.
    assert costs[199] == costs[9], costs


def test_a_corrupt_newest_manifest_does_not_wedge_later_saves(store: ManifestStore) -> None:
    """After falling back from a corrupt newest manifest, the next save goes past it (and
    a copy of the corrupt file is kept), instead of conflicting with it forever."""
    store.save(sample(1))
    store.save(sample(1).successor(2))
    store.storage.write(manifest_name(2), b"{torn")
    fresh = ManifestStore(store.storage, keep=3)
    base = fresh.load_latest()
    assert base is not None and base.checkpoint_id == 1
    for expected in (3, 4, 5, 6):
        manifest = fresh.next_manifest(base)
        fresh.save(manifest)
        assert manifest.checkpoint_id == expected
        base = fresh.load_latest()
    assert store.storage.read(f"{QUARANTINE_DIR}/{2:020d}.json") == b"{torn"
    assert fresh.list_ids() == [4, 5, 6]


def test_a_lost_pointer_after_pruning_does_not_look_empty(store: ManifestStore) -> None:
    manifest = sample(1)
    for _ in range(6):
        store.save(manifest)
        manifest = store.next_manifest(manifest)
    store.storage.delete(LATEST_POINTER)  # manifests 4..6 remain: probing from 0 finds none
    fresh = ManifestStore(store.storage, keep=3)
    latest = fresh.load_latest()
    assert latest is not None and latest.checkpoint_id == 6
    store.storage.write(LATEST_POINTER, b"\x00garbage")
    assert ManifestStore(store.storage, keep=3).load_latest().checkpoint_id == 6  # type: ignore[union-attr]


def test_every_manifest_in_the_window_corrupt_looks_further_back(store: ManifestStore) -> None:
    manifest = sample(1)
    for _ in range(3):
        store.save(manifest)
        manifest = store.next_manifest(manifest)
    for checkpoint_id in (2, 3):
        store.storage.write(manifest_name(checkpoint_id), b"")
    narrow = ManifestStore(store.storage, keep=1)
    assert narrow.load_latest().checkpoint_id == 1  # type: ignore[union-attr]


def test_a_warm_store_reads_only_a_probe_per_load(memory_url: str) -> None:
    """After its own save, a store knows the newest manifest: loading it again costs one
    existence probe, and a manifest saved by another writer is still found."""
    store = ManifestStore(memory_url, keep=3)
    store.save(sample(1))
    requests: list[str] = []
    for name in ("_read_once", "_exists_once", "_list_once"):
        original = getattr(store.storage, name)
        setattr(
            store.storage,
            name,
            lambda path, _o=original, _n=name: (requests.append(_n), _o(path))[1],
        )
    assert store.load_latest().checkpoint_id == 1  # type: ignore[union-attr]
    assert requests == ["_exists_once"]
    other = ManifestStore(memory_url, keep=3)
    other.save(other.next_manifest(other.load_latest()))
    assert store.load_latest().checkpoint_id == 2  # type: ignore[union-attr]


def _move_the_pointer_back_over_pruned_manifests(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> OffsetCommitter:
    """Run A commits consumer ``etl``'s offsets (manifest 1) and its pointer PUT is slow;
    run B commits 12 times (manifests 2..13; 1..3 are pruned); A's PUT lands last and moves
    ``latest`` back to the pruned manifest 1. Returns run B (warm, at 13)."""
    log = filled_log(url, commits=2, shards=2)
    run_a = OffsetCommitter(log, "etl", owner="run-a")
    held: list[tuple[str, bytes]] = []
    real_write = run_a.store.storage.write

    def write(relative: str, data: bytes, **options: bool) -> None:
        if relative == LATEST_POINTER:
            held.append((relative, data))
            return
        real_write(relative, data, **options)

    monkeypatch.setattr(run_a.store.storage, "write", write)
    run_a.commit({0: 1, 1: 1}, log_version=2, note="a")
    assert held  # A's pointer write is in flight

    run_b = OffsetCommitter(ReplicationLog.open(url), "etl", owner="run-b")
    for n in range(2, 14):
        run_b.commit({0: n, 1: n}, log_version=2, note="b")
    real_write(*held[-1])  # A's PUT lands
    assert json.loads(run_a.store.storage.read(LATEST_POINTER))["checkpoint_id"] == 1
    return run_b


def test_a_pointer_moved_back_to_a_pruned_manifest_does_not_rewind_a_cold_reader(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Manifest pointers carry no copy of the manifest they name (a pointer moved back may
    name a pruned one): the probe from the pruned manifest 1 finds nothing, loading it
    fails, and the store lists: a cold reader resumes the consumer at 13, not 1."""
    _move_the_pointer_back_over_pruned_manifests(memory_url, monkeypatch)
    position = committed_position(ReplicationLog.open(memory_url), "etl")
    assert position is not None
    assert position.offsets == {0: 13, 1: 13}, (
        f"a cold reader resumes at manifest {position.checkpoint_id} ({position.offsets}, "
        f"owner {position.owner}) instead of 13: events 2..13 are delivered again"
    )


def test_a_pointer_moved_back_to_a_pruned_manifest_does_not_reuse_a_live_generation(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above; then run C takes the consumer over. It finds manifest 13 (generation 2,
    run B's), takes generation 3 and fences B: two runs never commit one consumer's
    offsets from two forks of the store."""
    run_b = _move_the_pointer_back_over_pruned_manifests(memory_url, monkeypatch)
    run_c = OffsetCommitter(ReplicationLog.open(memory_url), "etl", owner="run-c")
    taken = run_c.commit({0: 20, 1: 20}, log_version=2, note="c")
    assert taken.generation == 3, f"run C took generation {taken.generation}, B holds 2"
    with pytest.raises(FencedError):
        run_b.commit({0: 14, 1: 14}, log_version=2, note="b")


def test_a_provisional_pending_manifest_is_found_past_the_pointer_by_restarts(
    memory_url: str,
) -> None:
    """A sink's Pending manifest is saved provisionally: the pointer stays at the previous
    (Committed) manifest, with no copy. A restarted committer still finds the Pending
    epoch by probing past the pointer, and the next restart replays it and commits it
    once."""
    log = ReplicationLog.create(memory_url, 2)
    first = SinkCommitter(log, "s")
    for epoch in range(3):
        since = log.refresh().version
        staged_now = tuple(log.stage(log_rows(5, epoch * 5)))
        first.commit(Batch("q", epoch, staged_now, since_version=since))
    # epoch 3: Pending saved, then the driver dies before its log commit
    staged = tuple(log.stage(log_rows(5, 15)))
    store = sink_store(log, "s")
    base = store.load_latest()
    assert base is not None
    crashed = SinkCommitter(log, "s")
    pending = crashed._status(base, "q", 3, SinkCommitStatus.pending())
    pending.pending_segments = {"s": [s.path for s in staged]}
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

"""The log and manifest store against a real S3 endpoint over HTTP (moto server)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import replog
from support.logcheck import check_key_order, check_log
from support.logs import append_commits
from support.operators import run_operator_commands

from replog.checkpoints.manifest import CheckpointManifest
from replog.checkpoints.store import ManifestStore
from replog.errors import ManifestConflictError
from replog.log import ReplicationLog
from replog.ops import garbage
from replog.ops.verify import verify

WORKER = Path(__file__).parents[1] / "tests" / "procs" / "append_worker.py"


def test_cli_round_trip_on_s3(s3) -> None:
    url = s3.url("logs", "orders")
    assert replog("create", url, "--shards", "2", *s3.fs_cli_args).returncode == 0
    lines = "".join(json.dumps({"key": f"k{i}", "data": {"n": i}}) + "\n" for i in range(30))
    result = replog("append", url, "-", *s3.fs_cli_args, stdin=lines)
    assert result.returncode == 0, result.stderr
    info = json.loads(replog("info", url, "--json", *s3.fs_cli_args).stdout)
    assert sum(info["heads"].values()) == 30 and info["segments"] == 2
    read = replog("read", url, *s3.fs_cli_args)
    assert len(read.stdout.splitlines()) == 30
    assert replog("verify", url, *s3.fs_cli_args).returncode == 0
    # Secrets given on the command line never show up in errors.
    missing = replog("info", s3.url("nothing"), *s3.fs_cli_args)
    assert missing.returncode == 2 and "testing" not in missing.stderr


def test_put_if_absent_is_enforced_by_the_endpoint(s3) -> None:
    log = ReplicationLog.create(s3.url("log"), 2, storage_options=s3.storage_options)
    with pytest.raises(FileExistsError):
        log.storage.put_if_absent("_replog/log.json", b"{}")


def test_verify_finds_flipped_byte_on_s3(s3) -> None:
    log = ReplicationLog.create(s3.url("log"), 2, storage_options=s3.storage_options)
    log.append([{"key": f"k{i}", "data": {"n": i}} for i in range(20)])
    segment = next(lane[0] for lane in log.state().segments if lane)
    data = bytearray(log.storage.read(segment.path))
    data[50] ^= 0xFF
    log.storage.write(segment.path, bytes(data))
    problems = verify(log).problems
    assert [p.path for p in problems] == [log.storage.path(segment.path)]


@pytest.mark.slow
def test_racing_processes_on_s3(s3) -> None:
    url = s3.url("race")
    ReplicationLog.create(url, 3, storage_options=s3.storage_options, snapshot_interval=5)
    options = json.dumps(s3.storage_options)
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), url, f"p{n}", "8", "10", options])
        for n in range(3)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    log = ReplicationLog.open(url, storage_options=s3.storage_options)
    rows = check_log(log)
    assert len(rows) == 3 * 8 * 10 and append_commits(log) == 24
    check_key_order(rows)


def test_manifest_store_on_s3_races_and_falls_back(s3) -> None:
    store = ManifestStore(s3.url("chk"), storage_options=s3.storage_options, keep=2)
    manifest = CheckpointManifest(checkpoint_id=1, epoch=1, timestamp_ms=1)
    store.save(manifest)
    rival = manifest.successor(1)  # another writer's manifest for the same id
    rival.epoch = 2
    with pytest.raises(ManifestConflictError):
        ManifestStore(s3.url("chk"), storage_options=s3.storage_options).save(rival)
    # The same bytes again are this writer's own earlier attempt (a retried PUT): no error.
    ManifestStore(s3.url("chk"), storage_options=s3.storage_options).save(manifest)
    store.save(manifest.successor(2))
    store.save(manifest.successor(3))
    assert store.list_ids() == [2, 3]
    store.storage.write("manifests/00000000000000000003.json", b"{trunc")
    reader = ManifestStore(s3.url("chk"), storage_options=s3.storage_options, keep=2)
    assert reader.load_latest().checkpoint_id == 2  # type: ignore[union-attr]


def test_a_listing_never_hides_files_written_after_it(s3) -> None:
    import boto3

    log = ReplicationLog.create(s3.url("log"), 1, storage_options=s3.storage_options)
    log.append([{"key": "a", "data": 1}])
    assert garbage.scan(log, 0).garbage == []  # lists shards/00000
    # Another process (here: a plain S3 client) writes into the listed directory.
    boto3.client("s3", endpoint_url=s3.endpoint_url).put_object(
        Bucket=s3.bucket, Key="log/shards/00000/late.arrow", Body=b"late"
    )
    assert log.storage.exists("shards/00000/late.arrow")
    assert log.storage.read("shards/00000/late.arrow") == b"late"


def test_operator_commands_on_s3(s3) -> None:
    run_operator_commands(s3.url("ops"), s3.storage_options, tuple(s3.fs_cli_args))


@pytest.mark.parametrize("fault", ["retried_create", "lost_response"])
def test_uncertain_puts_on_s3_are_resolved_by_reading_back(s3, fault: str) -> None:
    """A PUT whose answer is lost (or whose retry gets 412) against a real endpoint: the
    append happens once."""
    from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage

    url = s3.url("doubt")
    ReplicationLog.create(url, 2, storage_options=s3.storage_options)
    injector = FaultInjector(seed=11, rates=FaultRates.only(**{fault: 1.0}))
    storage = ReplicationLog.open(url, storage_options=s3.storage_options).storage
    blind = ReplicationLog.from_storage(FaultyStorage.wrap(storage, injector))
    blind.append([{"key": f"k{i}", "data": i} for i in range(10)])
    log = ReplicationLog.open(url, storage_options=s3.storage_options)
    assert log.refresh().version == 1 and len(check_log(log)) == 10 and verify(log).ok

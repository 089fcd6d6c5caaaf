"""Storage: atomic create per backend, uncertain writes resolved by reading back, secrets."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from replog.errors import CommitOutcomeUnknownError, StorageError, UnsupportedStorageError
from replog.log import ReplicationLog
from replog.storage import RetryPolicy, Storage, coerce_option_value, redact
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage

FAST = RetryPolicy(attempts=4, first_delay_s=0.0, max_delay_s=0.0)


class CheckThenWriteFS(MemoryFileSystem):
    """A backend like sftp, hdfs or ftp: fsspec's generic create checks, then writes."""

    protocol = "checkthenwrite"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return "/" + path.removeprefix("checkthenwrite://").lstrip("/")


fsspec.register_implementation("checkthenwrite", CheckThenWriteFS, clobber=True)


def faulty(storage: Storage, **rates: float) -> FaultyStorage:
    return FaultyStorage.wrap(storage, FaultInjector(seed=1, rates=FaultRates.only(**rates)))


@pytest.fixture(params=["memory", "local"])
def storage(request: pytest.FixtureRequest, memory_url: str, tmp_path: Path) -> Storage:
    url = memory_url if request.param == "memory" else str(tmp_path / "store")
    return Storage(url, retry=FAST)


def test_put_if_absent_lets_exactly_one_writer_win(storage: Storage) -> None:
    storage.put_if_absent("a/x", b"first")
    with pytest.raises(FileExistsError):
        storage.put_if_absent("a/x", b"second")
    assert storage.read("a/x") == b"first"


@pytest.mark.parametrize("fault", ["lost_response", "retried_create"])
def test_a_write_that_landed_is_recognised_by_reading_it_back(storage: Storage, fault: str) -> None:
    """A timeout after the write landed, or the 412 a client retry gets for its own write:
    the write succeeded, and the caller must be told so."""
    flaky = faulty(storage, **{fault: 1.0})
    flaky.put_if_absent("c/1", b"mine")  # no exception: it is ours
    assert storage.read("c/1") == b"mine"
    assert sum(flaky.injector.faults.values()) >= 1


def test_a_retried_create_that_finds_another_writers_bytes_lost_the_race(storage: Storage) -> None:
    storage.put_if_absent("c/1", b"theirs")
    with pytest.raises(FileExistsError):
        faulty(storage, lost_response=1.0).put_if_absent("c/1", b"mine")


def test_transient_failures_are_retried_then_reported(storage: Storage) -> None:
    flaky = faulty(storage, unavailable=0.3)
    flaky.retry = RetryPolicy(attempts=12, first_delay_s=0.0, max_delay_s=0.0)
    for i in range(20):
        flaky.put_if_absent(f"r/{i}", b"x")
        assert flaky.read(f"r/{i}") == b"x"
    assert flaky.injector.faults["503/500 before request"] > 0
    down = faulty(storage, unavailable=1.0)
    with pytest.raises(StorageError, match="kept failing after 4 attempts"):
        down.read("r/0")
    with pytest.raises(CommitOutcomeUnknownError):
        down.put_if_absent("r/new", b"x")


def test_backends_without_an_atomic_create_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedStorageError) as caught:
        ReplicationLog.create("checkthenwrite://logs/a", 2)
    message = str(caught.value)
    assert "'checkthenwrite'" in message and "atomic create-if-absent" in message
    assert "s3://" in message  # names what is supported
    assert not CheckThenWriteFS().exists("/logs/a/_replog/log.json")  # nothing written
    # Reading works anywhere: a log copied there can be opened.
    ReplicationLog.create(str(tmp_path / "a"), 1)
    fs = CheckThenWriteFS()
    for path in Path(tmp_path / "a").rglob("*"):
        if path.is_file():
            fs.pipe_file(f"/copy/{path.relative_to(tmp_path / 'a')}", path.read_bytes())
    assert ReplicationLog.open("checkthenwrite://copy").shards == 1
    fs.rm("/copy", recursive=True)


def test_local_creates_and_replaces_fsync_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = os.fsync

    def record(descriptor: int) -> None:
        path = os.readlink(f"/proc/self/fd/{descriptor}")
        synced.append(path)
        real(descriptor)

    monkeypatch.setattr(os, "fsync", record)
    storage = Storage(str(tmp_path / "s"))
    storage.put_if_absent("commits/1.json", b"x")
    storage.write("latest", b"{}")
    directories = [p for p in synced if Path(p).is_dir()]
    assert str(tmp_path / "s" / "commits") in directories  # after the link
    assert str(tmp_path / "s") in directories  # after the replace


def test_nested_secrets_are_redacted() -> None:
    options = {
        "endpoint_url": "http://minio:9000",
        "secret": "s3cr3t",
        "client_kwargs": {"region_name": "eu", "aws_secret_access_key": "hidden"},
    }
    shown = repr(Storage("memory://x", options))
    assert "s3cr3t" not in shown and "hidden" not in shown
    assert redact(options)["client_kwargs"] == {"region_name": "eu", "aws_secret_access_key": "***"}


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("secret", "00123", "00123"),
        ("key", "true", "true"),
        ("anon", "true", True),
        ("max_concurrency", "8", 8),
        ("padded", "00123", "00123"),
        ("ratio", "0.5", 0.5),
        ("region", "none", None),
        ("endpoint_url", "http://x:9000", "http://x:9000"),
    ],
)
def test_option_values_are_coerced_only_when_unambiguous(
    name: str, value: str, expected: object
) -> None:
    assert coerce_option_value(name, value) == expected

"""Bad input, tried as a new user would (issue 32): one clear line naming what is wrong,
and nothing written. Each of these was taken silently or answered with a raw error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support.cli import replog

from replog.errors import InvalidEventError, InvalidOptionError
from replog.format.commits import Transaction
from replog.format.events import events_from_records
from replog.log import ReplicationLog
from replog.schemas import registry
from replog.storage import backends


def nothing_at(path: Path) -> bool:
    return not path.exists() or not any(path.iterdir())


# -- capture: the log is created only once the source checks pass -----------------------


def test_a_capture_of_an_unreachable_server_creates_no_log(tmp_path: Path) -> None:
    url = tmp_path / "log"
    failed = replog(
        "capture", "postgres", "postgresql://127.0.0.1:9/none?connect_timeout=2", str(url),
        "--slot", "s", "--tables", "t",
    )  # fmt: skip
    assert failed.returncode == 2
    assert nothing_at(url)


def test_a_capture_of_a_missing_table_creates_no_log_and_shards_count_later(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The failed run created the log with the default shard count, and the corrected
    run's ``--shards 4`` was ignored silently."""
    url = tmp_path / "log"
    failed = replog("capture", "postgres", pg_dsn, str(url), "--slot", "s", "--tables", "nope")
    assert failed.returncode == 2 and "'public.nope' does not exist" in failed.stderr
    assert nothing_at(url)
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE t (id int PRIMARY KEY)")
    done = replog("capture", "postgres", pg_dsn, str(url), "--slot", "s", "--tables", "t",
                  "--shards", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ReplicationLog.open(str(url)).shards == 4


def test_shards_that_differ_from_an_existing_log_are_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 1)
    failed = replog(
        "capture", "postgres", "postgresql://127.0.0.1:9/none", url, "--slot", "s",
        "--tables", "t", "--shards", "4",
    )  # fmt: skip
    assert failed.returncode == 2
    assert "--shards 4" in failed.stderr and "exists with 1 shards" in failed.stderr


# -- events -------------------------------------------------------------------------------


def test_an_event_without_a_key_is_refused_by_replog_append(tmp_path: Path) -> None:
    """The README says ``key`` is required; it was replaced by a random UUID silently."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    lines = '{"key": "a", "data": {}}\n{"data": {"n": 1}}\n'
    failed = replog("append", url, "-", stdin=lines)
    assert failed.returncode == 2
    assert "line 2: 'key' is required" in failed.stderr
    assert ReplicationLog.open(url).refresh().version == 0


def test_the_python_api_keys_an_event_without_a_key_by_its_event_id() -> None:
    """The documented choice of the API (and of the Spark sink): no order with others."""
    rows = events_from_records([{"event_id": "e1", "data": {}}]).to_pylist()
    assert rows[0]["key"] == "e1"
    with pytest.raises(InvalidEventError, match="event 0: 'key' is required"):
        events_from_records([{"data": {}}], require_key=True)


@pytest.mark.parametrize(
    ("stamp", "hint"),
    [
        (1764000000, "looks like seconds - pass milliseconds (1764000000000)"),
        (1764000000.5, "looks like seconds"),
        (1764000000000000, "looks like microseconds or nanoseconds"),
    ],
)
def test_a_timestamp_in_seconds_or_microseconds_is_refused(
    tmp_path: Path, stamp: float, hint: str
) -> None:
    """``"timestamp": 1764000000`` was stored as 1970-01-21."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    line = json.dumps({"key": "k", "data": {}, "timestamp": stamp}) + "\n"
    failed = replog("append", url, "-", stdin=line)
    assert failed.returncode == 2
    assert "line 1: 'timestamp'" in failed.stderr and hint in failed.stderr
    with pytest.raises(InvalidEventError, match=hint.split(" (", maxsplit=1)[0]):
        ReplicationLog.open(url).append([{"key": "k", "data": {}, "timestamp": stamp}])
    assert ReplicationLog.open(url).refresh().version == 0


def test_epoch_milliseconds_and_zero_are_still_taken() -> None:
    rows = events_from_records(
        [{"data": 1, "timestamp": 1764000000000}, {"data": 1, "timestamp": 0}]
    ).to_pylist()
    assert rows[0]["timestamp"].year == 2025 and rows[1]["timestamp"].year == 1970


# -- where a log goes ---------------------------------------------------------------------


def test_create_into_a_directory_that_holds_something_else_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "data"
    target.mkdir()
    (target / "part-0000.parquet").write_bytes(b"PAR1")
    failed = replog("create", str(target))
    assert failed.returncode == 2
    assert "not empty" in failed.stderr and "part-0000.parquet" in failed.stderr
    assert sorted(os.listdir(target)) == ["part-0000.parquet"]
    with pytest.raises(InvalidOptionError, match="not empty"):
        ReplicationLog.open_or_create(str(target), 2)  # the Spark sink's way in


@pytest.mark.spark
def test_the_sink_refuses_to_save_into_a_directory_that_holds_something_else(
    spark: Any, tmp_path: Path
) -> None:
    target = tmp_path / "table"
    target.mkdir()
    (target / "part-0000.parquet").write_bytes(b"PAR1")
    frame = spark.createDataFrame([("k", "{}")], "key string, data string")
    with pytest.raises(Exception, match="not empty"):
        frame.write.format("replog-sink").mode("append").save(str(target))
    assert sorted(os.listdir(target)) == ["part-0000.parquet"]


def test_create_where_a_log_is_says_it_exists(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    assert replog("create", url).returncode == 0
    again = replog("create", url)
    assert again.returncode == 2 and "already holds a replog log" in again.stderr


def test_create_on_a_file_is_refused_by_name(tmp_path: Path) -> None:
    target = tmp_path / "events.jsonl"
    target.write_text("{}\n")
    failed = replog("create", str(target))
    assert failed.returncode == 2
    assert "it is a file" in failed.stderr and "Errno" not in failed.stderr
    assert target.read_text() == "{}\n"


def test_a_url_with_one_slash_after_its_scheme_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``s3:/bucket/x`` was taken as a local path (a directory named ``s3:``)."""
    monkeypatch.chdir(tmp_path)
    for command in (("info",), ("create",)):
        failed = replog(*command, "s3:/bucket/x")
        assert failed.returncode == 2
        assert "write 's3://bucket/x'" in failed.stderr
    assert not (tmp_path / "s3:").exists()


def test_info_on_a_path_that_does_not_exist_says_so(tmp_path: Path) -> None:
    failed = replog("info", str(tmp_path / "nope"))
    assert failed.returncode == 2
    assert f"{tmp_path / 'nope'} does not exist" in failed.stderr


def test_a_read_only_log_names_the_log_not_a_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Tests run as root here, for whom nothing is read-only: the refusal is the one the
    operating system gives for the temporary file a local write begins with.)"""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)

    def refused(path: str, data: bytes, durability: object) -> str:
        tmp = os.path.join(os.path.dirname(path), backends.temporary_name(os.path.basename(path)))
        raise PermissionError(13, "Permission denied", tmp)

    monkeypatch.setattr(backends.LocalBackend, "_temporary", staticmethod(refused))
    failed = replog("append", url, "-", stdin='{"key": "k", "data": {}}\n')
    assert failed.returncode == 2
    assert "permission denied" in failed.stderr and "read-only" in failed.stderr
    assert ".tmp" not in failed.stderr and url in failed.stderr


# -- operator options ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-5", "0"])
def test_compact_refuses_a_target_size_below_one_byte(tmp_path: Path, value: str) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    for extra in ((), ("--dry-run",)):
        failed = replog("compact", url, "--target-bytes", value, *extra)
        assert failed.returncode == 2 and "--target-bytes must be at least 1" in failed.stderr
    assert not (tmp_path / "log" / "_replog" / "leases").exists()  # no lease taken either


def test_create_refuses_a_retention_below_the_clock_skew_and_warns_below_the_grace(
    tmp_path: Path,
) -> None:
    failed = replog("create", str(tmp_path / "a"), "--retention", "1s")
    assert failed.returncode == 2 and "--retention 1s: at least 10m" in failed.stderr
    assert not (tmp_path / "a").exists()
    warned = replog("create", str(tmp_path / "b"), "--retention", "30m")
    assert warned.returncode == 0
    assert "warning: --retention 30m" in warned.stderr and "--grace 20m" in warned.stderr
    quiet = replog("create", str(tmp_path / "c"), "--retention", "2h")
    assert quiet.returncode == 0 and quiet.stderr == ""


# -- schemas ------------------------------------------------------------------------------


def test_schemas_of_an_unknown_collection_name_the_known_ones(tmp_path: Path) -> None:
    """``--collection orders`` for ``public.orders`` printed "no schemas registered"
    and exited 0."""
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 2)
    schema = {"type": "struct", "fields": [{"field": "id", "type": "int32"}], "optional": False}
    registry.register(log.storage, "public.orders", schema)
    failed = replog("schemas", url, "--collection", "orders")
    assert failed.returncode == 2
    assert "public.orders" in failed.stderr and "did you mean 'public.orders'" in failed.stderr
    assert replog("schemas", url, "--collection", "public.orders").returncode == 0


# -- transactions -------------------------------------------------------------------------


@pytest.mark.parametrize("app_id", ["../../evil", "a\x01b", "", "x" * 129])
def test_the_python_api_refuses_the_app_ids_the_cli_refuses(tmp_path: Path, app_id: str) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    with pytest.raises(InvalidOptionError, match="not a valid name"):
        Transaction(app_id, 1)
    failed = replog("append", url, "-", "--txn-app-id", app_id, "--txn-version", "1",
                    stdin='{"key": "k", "data": {}}\n')  # fmt: skip
    assert failed.returncode == 2 and "not a valid name" in failed.stderr
    assert not (tmp_path / "log" / "_replog" / "sinks").exists()


def test_a_transaction_version_below_zero_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="version must be an integer >= 0"):
        Transaction("app", -1)

"""Bad input, tried as a new user would (issue 32): one clear line naming what is wrong,
and nothing written. Each of these was taken silently or answered with a raw error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from support.cli import replog, replog_process

import replog as replog_api
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format.commits import Transaction
from replog.format.events import events_from_records
from replog.log import ReplicationLog
from replog.schemas import registry
from replog.spark.options import SinkOptions
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


def test_an_event_without_a_key_is_keyed_by_its_event_id_on_every_way_in(tmp_path: Path) -> None:
    """One rule for ``replog append``, ``log.append`` (dicts or a table) and
    ``replog.append`` (issue 40: the CLI refused what the API took): an event without a
    key is keyed by its event id, and ``replog append`` says how many it took so."""
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 2)
    lines = '{"key": "a", "data": {}}\n{"event_id": "cli", "data": {"n": 1}}\n'
    appended = replog("append", url, "-", stdin=lines)
    assert appended.returncode == 0, appended.stderr
    assert "1 events had no key: each is keyed by its event_id" in appended.stdout
    keyless = '{"event_id": "json", "data": 2}\n'
    as_json = json.loads(replog("append", url, "-", "--json", stdin=keyless).stdout)
    assert as_json["unkeyed"] == 1 and as_json["without_source_position"] == 0
    log.append([{"event_id": "api", "data": {}}])
    log.append(pa.table({"event_id": ["table"], "data": ["x"]}))
    replog_api.append(url, [{"event_id": "face", "data": {}}])
    keys = {row["event_id"]: row["key"] for row in ReplicationLog.open(url).read_all().to_pylist()}
    assert [keys[e] for e in ("cli", "json", "api", "table", "face")] == [
        "cli", "json", "api", "table", "face"
    ]  # fmt: skip


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
    warned = replog_process("create", str(tmp_path / "b"), "--retention", "30m")  # its stderr
    assert warned.returncode == 0
    assert "a retention of 30m is below recover's default grace" in warned.stderr
    assert "--grace 20m" in warned.stderr
    quiet = replog("create", str(tmp_path / "c"), "--retention", "2h")
    assert quiet.returncode == 0 and quiet.stderr == ""


# -- one contract for every way in (issue 40) ----------------------------------------------


def test_create_log_takes_the_options_of_replication_log_create(tmp_path: Path) -> None:
    """``retention_ms`` went to fsspec as a storage option, and the log got 2 h."""
    url = str(tmp_path / "log")
    replog_api.create_log(url, 3, retention_ms=4 * 3_600_000, auto_compact=False,
                          snapshot_interval=20)  # fmt: skip
    descriptor = ReplicationLog.open(url).descriptor
    assert (descriptor.shards, descriptor.retention_ms) == (3, 4 * 3_600_000)
    assert (descriptor.auto_compact, descriptor.snapshot_interval) == (False, 20)


@pytest.mark.parametrize(
    ("call", "accepted"),
    [
        (lambda url: replog_api.create_log(url, 2, retention=600_000),
         "retention_ms, auto_compact, snapshot_interval, storage_options"),
        (lambda url: replog_api.create_log(url, 2, endpoint_url="http://s3"),
         "retention_ms, auto_compact, snapshot_interval, storage_options"),
        (lambda url: replog_api.open_log(url, autocompact=False), "auto_compact, storage_options"),
        (lambda url: replog_api.append(url, [], txn=1), "transaction, storage_options"),
        (lambda url: replog_api.read(url, 0, limit=1), "storage_options"),
    ],
)  # fmt: skip
def test_an_unknown_keyword_is_refused_naming_the_accepted_ones(
    tmp_path: Path, call: Any, accepted: str
) -> None:
    url = str(tmp_path / "log")
    with pytest.raises(InvalidOptionError, match=f"it takes {accepted} by name") as info:
        call(url)
    assert "storage_options={...}" in str(info.value)
    assert not (tmp_path / "log").exists()


def _python(url: str, option: str, value: Any) -> None:
    ReplicationLog.create(url, **{"shards": 2, option: value})


def _create_log(url: str, option: str, value: Any) -> None:
    replog_api.create_log(url, **{"shards": 2, option: value})


def _cli(url: str, option: str, value: Any) -> None:
    flag = {"retention_ms": "--retention", "snapshot_interval": "--snapshot-interval"}
    shown = f"{value // 1000}s" if option == "retention_ms" else str(value)
    failed = replog("create", url, flag.get(option, f"--{option}"), shown)
    assert failed.returncode == 2
    raise InvalidOptionError(failed.stderr)


def _sink(url: str, option: str, value: Any) -> None:
    SinkOptions.parse({"path": url, "sinkId": "s", option: str(value)}, streaming=True)


@pytest.mark.parametrize(
    ("option", "value", "names", "limit"),
    [
        ("shards", 0, ("shards", "--shards", "option 'shards'"), "from 1 to 4096"),
        ("shards", 4097, ("shards", "--shards", "option 'shards'"), "from 1 to 4096"),
        ("retention_ms", 60_000, ("retention_ms", "--retention", None), "at least 10m"),
        ("snapshot_interval", 0, ("snapshot_interval", "--snapshot-interval", None), ">= 1"),
    ],
)
def test_each_limit_is_the_same_on_every_way_in(
    tmp_path: Path, option: str, value: int, names: tuple[str | None, ...], limit: str
) -> None:
    """The CLI refused a retention under 10 minutes while the API took 1 s: each limit is
    stated once (replog.format.limits) and named in each way's own spelling. (The sink
    takes ``shards`` only: the other settings are the log's, set when it is created.)"""
    ways = [_python, _create_log, _cli, _sink]
    for way, name in zip(ways, (names[0], names[0], names[1], names[2]), strict=True):
        if name is None:
            continue
        url = str(tmp_path / f"{way.__name__}-{option}")
        with pytest.raises(InvalidOptionError) as info:
            way(url, option, value)
        assert name in str(info.value) and limit in str(info.value), (way, str(info.value))
        assert not Path(url).exists()


def test_a_retention_below_the_advised_one_is_warned_about_from_python_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    replog_api.create_log(str(tmp_path / "log"), 2, retention_ms=30 * 60_000)
    assert "a retention of 30m is below recover's default grace" in caplog.text


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

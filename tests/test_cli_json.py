"""Every command's ``--json`` output, as the command prints it, is one document valid
against the command's shipped schema (docs/OPERATIONS.md, "JSON output"); an error is
one too, with its exit code. ``capture``'s is checked in tests/test_cli_metrics.py (it
needs a server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.cli import replog
from support.logs import commit_offsets, filled_log, log_rows
from test_cli_output import validate

from replog.capture.options import capture_app_id
from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.cli.output import COMMAND_SCHEMAS
from replog.format.commits import Transaction
from replog.log import ReplicationLog
from replog.schemas import registry


def run_json(*args: str, schema: str, code: int = 0, stdin: str | None = None) -> Any:
    result = replog(*args, "--json", stdin=stdin)
    assert result.returncode == code, (args, result.stdout, result.stderr)
    assert result.stdout.count("\n") == 1, result.stdout  # one document, one line
    document = json.loads(result.stdout)
    validate(document, schema)
    return document


@pytest.fixture(scope="module")
def log_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("json") / "log")
    log = filled_log(url, commits=3, per_commit=10, shards=2, auto_compact=False)
    commit_offsets(log, "etl", {0: 4, 1: 3})
    since = log.refresh().version
    SinkCommitter(log, "s1").commit(
        Batch("q-1", 0, tuple(log.stage(log_rows(4, 900))), since_version=since)
    )
    log.append(
        [{"key": "b", "data": {}}], transaction=Transaction(capture_app_id("shop"), 0x4B80238)
    )
    registry.register(
        log.storage,
        "inventory.customers",
        {"type": "struct", "fields": [{"type": "int32", "optional": False, "field": "id"}]},
    )
    return url


COVERED: set[str] = set()


def covered(command: str) -> str:
    COVERED.add(command)
    return COMMAND_SCHEMAS[command]


def test_read_commands(log_url: str) -> None:
    info = run_json("info", log_url, schema=covered("info"))
    assert info["sinks"]["pg-capture.shop"]["lsn"] == "0/4B80238"
    run_json("schemas", log_url, schema=covered("schemas"))
    run_json("verify", log_url, schema=covered("verify"))
    history = run_json("history", log_url, "--limit", "2", schema=covered("history"))
    assert [c["kind"] for c in history["commits"]] == ["capture", "sink"]
    assert history["commits"][0]["capture"] == {"slot": "shop", "lsn": "0/4B80238"}
    status = run_json("status", log_url, schema=covered("status"))
    assert status["captures"][0]["lsn"] == "0/4B80238" and "position" not in status["captures"][0]
    as_format = replog("status", log_url, "--format", "json")
    assert json.loads(as_format.stdout).keys() == status.keys()
    for command in ("read", "tail"):
        result = replog(command, log_url, "--json")
        assert result.returncode == 0
        lines = result.stdout.splitlines()
        assert lines
        for line in lines:  # JSON lines: each one event
            validate(json.loads(line), covered(command))


def test_consumer_and_manifest_commands(log_url: str) -> None:
    listing = run_json("consumer", "list", log_url, schema=covered("consumer list"))
    assert listing == {"url": log_url, "consumers": ["etl"]}
    shown = run_json(
        "consumer", "show", log_url, "--consumer", "etl", schema=covered("consumer show")
    )
    assert shown["offsets"] == {"0": 4, "1": 3}
    run_json(
        "consumer", "set", log_url, "--consumer", "etl", "--shift-by", "-1",
        schema=covered("consumer set"),
    )  # fmt: skip
    run_json("consumer", "delete", log_url, "--consumer", "etl", schema=covered("consumer delete"))
    store = f"{log_url}/_replog/sinks/s1"
    manifests = run_json("manifest", "list", store, schema=covered("manifest list"))
    assert manifests["manifests"] and manifests["hint"] is None
    hinted = run_json("manifest", "list", log_url, schema="manifest-list")
    assert hinted["manifests"] == [] and f"{log_url}/_replog/sinks/s1" in hinted["hint"]
    run_json("manifest", "show", store, schema=covered("manifest show"))
    run_json("manifest", "validate", store, schema=covered("manifest validate"))


def test_operating_commands(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    created = run_json(
        "create", url, "--shards", "2", "--no-auto-compact", schema=covered("create")
    )
    assert created["shards"] == 2
    lines = "".join(f'{{"key": "k{i % 3}", "data": {{"n": {i}}}}}\n' for i in range(12))
    for _ in range(3):
        run_json("append", url, "-", stdin=lines, schema=covered("append"))
    commit_offsets(ReplicationLog.open(url), "etl", {0: 10, 1: 10})
    run_json("truncate", url, "--dry-run", schema=covered("truncate"))
    run_json("compact", url, "--dry-run", schema=covered("compact"))
    merged = run_json("compact", url, schema="compact")
    assert merged["by_key"] is False and merged["version"] is not None
    keyed = run_json("compact", url, "--by-key", schema="compact")
    assert keyed["by_key"] is True
    run_json("recover", url, "--grace", "0", schema=covered("recover"))
    done = run_json("truncate", url, "--keep-from", '{"0": 2, "1": 2}', schema="truncate")
    assert done["dry_run"] is False and done["version"] is not None


def test_errors_are_json_documents_with_their_exit_code(tmp_path: Path) -> None:
    missing = run_json("info", str(tmp_path / "nothing"), schema="error", code=2)
    assert missing["exit_code"] == 2 and "holds no replog log" in missing["error"]
    assert missing["type"] == "LogNotFoundError"
    usage = run_json("consumer", "list", schema="error", code=2)  # no URL
    assert usage["type"] == "UsageError" and "required: url" in usage["error"]
    port = run_json("capture", "postgres", "dsn", "u", "--slot", "s", "--metrics-port", "70000",
                    schema="error", code=2)  # fmt: skip
    assert (
        "--metrics-port: '70000' is not a TCP port (0..65535; 0: any free port)" in (port["error"])
    )
    slots = run_json("slots", "drop", "dsn", schema="error", code=2)
    assert "slots drop: give the DSN and the slot's name" in slots["error"]
    plain = replog("info", str(tmp_path / "nothing"))
    assert plain.stdout == "" and plain.stderr.startswith("replog: error: ")


def test_snapshot_request(pg_dsn: str) -> None:
    from support.capture import sql

    sql(  # what the capture of slot s made: its publication, named after the slot
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY)",
        "CREATE TABLE u (id int PRIMARY KEY)",
        "CREATE PUBLICATION s FOR TABLE t, u",
    )
    document = run_json(
        "snapshot",
        "postgres",
        pg_dsn,
        "--slot",
        "s",
        "--tables",
        "t,public.u",
        schema=covered("snapshot"),
    )
    assert document["tables"] == ["t", "public.u"] and document["slot"] == "s"
    assert document["signal_id"]


def test_slots_list_and_drop(pg_dsn: str) -> None:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    listed = run_json("slots", pg_dsn, schema=covered("slots"))
    assert [slot["name"] for slot in listed["slots"]] == ["s"]
    dropped = run_json("slots", "drop", pg_dsn, "s", "--force", schema=covered("slots drop"))
    assert dropped["dropped"] is True


def test_every_command_with_a_schema_was_run() -> None:
    """Runs last in this module: each command of COMMAND_SCHEMAS was validated above."""
    # capture's in tests/test_cli_metrics.py; MySQL's in tests/test_capture_mysql*.py
    # (they need a MariaDB server)
    assert set(COMMAND_SCHEMAS) - {"capture", "capture mysql", "snapshot mysql"} == COVERED

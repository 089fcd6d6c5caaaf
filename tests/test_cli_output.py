"""The CLI's results (:mod:`replog.cli.results`) and renderers (:mod:`replog.cli.output`):
every result renders as text for people and as one JSON document for scripts, the
document valid against the command's shipped JSON Schema. Results are computed on a small
real log with the core functions the commands call."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from support.logs import commit_offsets, filled_log, log_rows

from replog import ingest
from replog.capture.mysql.positions import BinlogPosition
from replog.capture.options import capture_app_id as app_id
from replog.capture.progress import CaptureProgress
from replog.capture.running import RunRecord
from replog.capture.slots import Holder, ServerSlots, SlotState
from replog.checkpoints.consumers import committed_position
from replog.checkpoints.sinks import Batch, SinkCommitter, sink_store
from replog.cli import results
from replog.cli.mysql import MySqlCaptured, MySqlSnapshotRequested
from replog.cli.output import (
    COMMAND_SCHEMAS,
    SCHEMAS_DIR,
    JsonOutput,
    TextOutput,
    age,
    event_json,
    json_schema,
)
from replog.format.commits import Transaction
from replog.log import ReplicationLog
from replog.merges import plan_full
from replog.ops import compaction, history, keys, recovery, retention, status, verify
from replog.schemas import registry
from replog.timeutil import use_clock

SCHEMA_FILES = sorted(
    path.stem for path in (Path(results.__file__).parent / SCHEMAS_DIR).glob("*.json")
)


def validate(document: Any, schema: str) -> None:
    """Raise unless ``document`` is valid against the shipped schema ``schema``."""
    checker = jsonschema.Draft202012Validator(
        json_schema(schema), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    checker.validate(document)


@dataclass(frozen=True)
class Case:
    """One result, and phrases its text must hold."""

    name: str
    result: results.Result
    text: tuple[str, ...]


def _cases(tmp_path: Path) -> list[Case]:
    url = str(tmp_path / "log")
    log = filled_log(url, commits=3, per_commit=10, shards=2, auto_compact=False)
    commit_offsets(log, "etl", {0: 4, 1: 3})
    sink = SinkCommitter(log, "s1")
    since = log.refresh().version
    sink.commit(Batch("q-1", 0, tuple(log.stage(log_rows(4, 900))), since_version=since))
    log.stage(log_rows(2, 950))  # an orphan staged file: garbage for recover

    appended = ingest.append_lines(log, ['{"key": "a", "data": {"n": 1}}'])
    # a capture's position, as replog capture records it (slot "orders", LSN 0/16B3748)
    log.append(
        [{"key": "b", "data": {"n": 2}}], transaction=Transaction(app_id("orders"), 0x16B3748)
    )
    info = log.info()
    verified = verify.verify(ReplicationLog.open(url))
    store = sink_store(log, "s1")
    listing: list[tuple[int, Any]] = [(i, store.load(i)) for i in store.list_ids()]
    listing.append((99, "99.json: unreadable"))
    latest = store.load_latest()
    assert latest is not None
    consumer = status.consumer_position(log, "etl")
    position = committed_position(log, "etl")
    assert position is not None
    RunRecord(log.storage, "orders", log.log_id).claim()  # a capture of "orders" running
    orders = _slot("orders", owner={"log_id": log.log_id, "log": url})
    log_status = status.with_server(status.log_status(log), 0x16B4000, {"orders": orders})
    server = ServerSlots(
        "shop",
        0x16B4000,
        orders.server_ms,
        "10GB",
        (
            orders,
            _slot("taken", holder=Holder(4711, "replog capture taken pid 9 on h", "h", 1)),
            _slot("debezium", plugin="decoderbufs", lag_note="measured for pgoutput only"),
        ),
    )
    plan = retention.plan_truncation(log, {0: 2, 1: 2})
    captured = CaptureProgress(
        rows=12,
        snapshot_rows=5,
        transactions=4,
        commits=2,
        position=0x16B3748,
        slot_dropped=True,
        publication_dropped="orders",
        table_events={"public.orders": {"read": 5, "insert": 10, "update": 2}},
    )
    kept = CaptureProgress(position=0x16B3748, retained_wal_bytes=81_920,
                           slot_wal_status="reserved", heartbeats=3, truncations=1)  # fmt: skip
    mysql_captured = CaptureProgress(
        rows=3, snapshot_rows=2, transactions=1, commits=2,
        table_events={"shop.orders": {"read": 2, "insert": 1}},
    )  # fmt: skip
    mysql_position = BinlogPosition("mariadb", "gtid", "binlog.000002", 4321, "0-1-7", 1)
    recovered = recovery.recover(ReplicationLog.open(url), grace_ms=0, dry_run=True)
    assert recovered.garbage
    merges = compaction.CompactionResult(tuple(plan_full(log.refresh())), None)
    compacted = compaction.compact(ReplicationLog.open(url))
    assert merges.merges and compacted.record is not None
    keyed = filled_log(str(tmp_path / "keyed"), commits=3, per_commit=10, auto_compact=False)
    key_compacted = keys.compact_by_key(keyed)
    assert key_compacted.record is not None
    described = history.log_history(ReplicationLog.open(url))

    registry.register(
        log.storage,
        "inventory.customers",
        {
            "type": "struct",
            "fields": [
                {"type": "int32", "optional": False, "field": "id"},
                {
                    "type": "bytes",
                    "optional": True,
                    "name": "org.apache.kafka.connect.data.Decimal",
                    "parameters": {"scale": "2"},
                    "field": "balance",
                },
            ],
        },
    )
    versions = registry.versions(log.storage)
    r = results
    return [
        Case("created", r.Created.of(info), (f"created {url} with 2 shards",)),
        Case(
            "schemas",
            r.Schemas.of(url, versions),
            ("inventory.customers  version", "decimal128(38, 2)", "Decimal"),
        ),
        Case(
            "appended",
            r.Appended.of(appended),
            (f"appended 1 events to {url} as version {appended.record.version}",),  # type: ignore[union-attr]
        ),
        Case(
            "info",
            r.Info.of(info),
            (
                f"log        {url}",
                "shards     2",
                "sink s1: epoch 0 of query q-1",
                "capture orders: LSN 0/16B3748",
            ),
        ),
        Case("verified", r.Verified.of(verified), ("ok: ",)),
        Case(
            "history",
            r.History.of(described),
            ("compact", "sink s1 epoch 0", "slot orders at LSN 0/16B3748", " +10 -0 "),
        ),
        Case(
            "manifests",
            r.Manifests.of(store.url, listing, latest.checkpoint_id),
            (f"* {latest.checkpoint_id:>8}  epoch 0", "UNREADABLE: 99.json: unreadable"),
        ),
        Case("manifest", r.Manifest.of(latest), ('"epoch": 0',)),
        Case(
            "validated",
            r.Validated.of(latest, ["no sink named"]),
            (f"INVALID checkpoint {latest.checkpoint_id}: no sink named",),
        ),
        Case("consumers", r.Consumers.of(url, ["etl", "other"]), ("etl\nother",)),
        Case(
            "consumer",
            r.Consumer.of(url, consumer),
            (f"consumer etl of {url}: checkpoint", "committed          4  head"),
        ),
        Case(
            "consumer_set",
            r.ConsumerSet.of(url, "etl", {0: 4}, {0: 1, 1: 2}, False),
            ("consumer etl:", "4 ->          1", "dry run: nothing changed"),
        ),
        Case(
            "consumer_deleted",
            r.ConsumerDeleted.of(url, "etl", position, True),
            ("deleted consumer etl (committed 0:4, 1:3)",),
        ),
        Case(
            "status",
            r.Status.of(log_status),
            (
                f"log {url}: version",
                "consumers (1):",
                "sinks (1):",
                "  etl ",
                "  s1 ",
                "captures (1):",
                "  orders                   running on ",
                "at LSN 0/16B3748 (log version ",
                "server at 0/16B4000, slot confirmed 0/16B3748: lag 2,232 bytes and 1.5s; "
                "2,272 bytes of WAL kept (reserved, 1,000,000 bytes before it is at risk)",
            ),
        ),
        Case(
            "slots",
            r.Slots.of(server),
            (
                "server at 0/16B4000, max_slot_wal_keep_size 10GB; 3 logical slot(s)",
                "orders  database shop, pgoutput: not read, last released ",
                f"    owner     log {url} (id {log.log_id})",
                "    confirmed 0/16B3748: 2,232 bytes of WAL behind; 1.5s behind (oldest "
                "unconfirmed commit)",
                "    keeps     2,272 bytes of WAL (wal_status reserved, 1,000,000 bytes before",
                "taken  database shop, pgoutput: captured by replog capture taken pid 9 on h "
                "(server process 4711, from h)",
                "debezium  database shop, decoderbufs: ",
                "seconds behind unknown: measured for pgoutput only",
            ),
        ),
        Case(
            "slot_dropped",
            r.SlotDropped.of(orders, dropped=True, publication="orders"),
            (
                "dropped slot orders and capture's own publication orders in database shop (it "
                "kept 2,272 bytes of WAL)",
                f"the capture of log {url} can no longer resume",
            ),
        ),
        Case(
            "truncation_plan",
            r.Truncated.of(url, plan, dry_run=True, force=False),
            (f"would drop {plan.total_dropped:,} events; new lows 0:2, 1:2",),
        ),
        Case(
            "truncated",
            r.Truncated.of(url, plan, dry_run=False, force=False, version=12, removed=3),
            (f"truncated {url} at version 12:", "removed 3 segments"),
        ),
        Case(
            "recovered",
            r.Recovered.of(url, recovered),
            (f"would delete {len(recovered.garbage)} garbage", "older than 0ms"),
        ),
        Case(
            "captured",
            r.Captured.of(url, captured, "orders", "replog slots drop 'dbname=shop' orders", 9),
            (
                f"captured 12 rows (5 in the snapshot) of 4 transactions into {url}",
                "position 0/16B3748",
                "  public.orders: 5 read, 10 insert, 2 update",
                "dropped the replication slot and its publication orders",
            ),
        ),
        Case(
            "captured_kept",
            r.Captured.of(url, kept, "orders", "replog slots drop 'dbname=shop' orders"),
            (
                "1 TRUNCATE(s) captured, 3 heartbeats written",
                "slot orders keeps 81,920 bytes of WAL on the server (wal_status reserved), "
                "growing with every write until a capture reads it again; if none will, drop "
                "it: replog slots drop 'dbname=shop' orders",
            ),
        ),
        Case(
            "snapshot_requested",
            r.SnapshotRequested.of("shop", ["public.orders"], 0x16B3748, "a1b2"),
            ("asked the capture of slot shop to snapshot public.orders", "LSN 0/16B3748"),
        ),
        Case(
            "mysql_captured",
            MySqlCaptured.of(url, "shop", mysql_captured, mysql_position, {"shop.t.d": 2}),
            (
                f"captured 3 rows (2 in the snapshot) of 1 transactions into {url}",
                "position binlog.000002:4321 (GTID 0-1-7)",
                "  shop.orders: 2 read, 1 insert",
                "note: 2 zero dates (0000-00-00) written as null, in shop.t.d",
            ),
        ),
        Case(
            "mysql_snapshot_requested",
            MySqlSnapshotRequested({"name": "shop", "tables": ["shop.orders"], "signal_id": "a1"}),
            ("asked the MySQL capture shop to snapshot shop.orders (signal a1",),
        ),
        Case(
            "compacted",
            r.Compacted.merged(url, compacted, False),
            (f"compacted {url} at version {compacted.record.version}: merged",),
        ),
        Case(
            "key_compacted",
            r.Compacted.by_key(url, key_compacted, False, 3),
            (f"key-compacted {url} at version {key_compacted.record.version}", "cleaner points"),
        ),
        Case(
            "failed",
            r.Failed.of("no such log", 2, "LogNotFoundError"),
            ("replog: error: no such log",),
        ),
    ]


def _slot(name: str, **given: Any) -> SlotState:
    """A slot as ``replog slots`` reads it: 2,232 bytes of WAL behind, 1.5 s."""
    fields: dict[str, Any] = {
        "name": name,
        "database": "shop",
        "plugin": "pgoutput",
        "temporary": False,
        "active_pid": None,
        "restart_lsn": 0x16B3720,
        "confirmed_lsn": 0x16B3748,
        "server_lsn": 0x16B4000,
        "server_ms": 1_800_000_001_500,
        "wal_status": "reserved",
        "safe_bytes": 1_000_000,
        "invalidation": None,
        "inactive_since_ms": 1_800_000_000_000,
        "oldest_unconfirmed_ms": 1_800_000_000_000,
        "lag_note": None,
        "publication": name,
    }
    return SlotState(**{**fields, **given})


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    return {case.name: case for case in _cases(tmp_path_factory.mktemp("output"))}


NAMES = [
    "created", "schemas", "appended", "info", "verified", "history", "manifests", "manifest",
    "validated", "consumers", "consumer", "consumer_set", "consumer_deleted", "status",
    "truncation_plan", "truncated", "recovered", "captured", "captured_kept",
    "snapshot_requested", "compacted", "key_compacted", "failed", "slots", "slot_dropped",
    "mysql_captured", "mysql_snapshot_requested",
]  # fmt: skip


def render(renderer: type[TextOutput | JsonOutput], result: results.Result) -> str:
    stream = io.StringIO()
    renderer(stream, verbose=True).show(result)
    return stream.getvalue()


def test_every_kind_of_result_has_a_case_and_a_schema(cases: dict[str, Case]) -> None:
    assert set(cases) == set(NAMES)
    assert {type(case.result) for case in cases.values()} == set(results.Result.kinds.values())
    shipped = set(SCHEMA_FILES)
    assert set(results.Result.kinds) | {"event"} == shipped
    assert set(COMMAND_SCHEMAS.values()) | {"error"} == shipped


@pytest.mark.parametrize("name", NAMES)
def test_text_renders_every_result(cases: dict[str, Case], name: str) -> None:
    text = render(TextOutput, cases[name].result)
    for phrase in cases[name].text:
        assert phrase in text, (phrase, text)
    assert text != render(JsonOutput, cases[name].result)  # words, not the JSON document


@pytest.mark.parametrize("name", NAMES)
def test_json_is_one_document_valid_against_its_schema(cases: dict[str, Case], name: str) -> None:
    result = cases[name].result
    text = render(JsonOutput, result)
    assert text.endswith("\n") and text.count("\n") == 1, text
    document = json.loads(text)
    assert document == json.loads(json.dumps(result.document))
    validate(document, result.schema)


def test_lsns_are_pg_text_everywhere(cases: dict[str, Case]) -> None:
    """One representation: PostgreSQL's text, named lsn (no LSN as a number anywhere)."""
    assert cases["captured"].result.document["lsn"] == "0/16B3748"
    assert "position" not in cases["captured"].result.document
    [capture] = cases["status"].result.document["captures"]
    assert (capture["lsn"], capture["server_lsn"], capture["slot_lsn"]) == (
        "0/16B3748",
        "0/16B4000",
        "0/16B3748",
    )
    assert "position" not in capture
    assert cases["info"].result.document["sinks"]["pg-capture.orders"]["lsn"] == "0/16B3748"
    [captured] = [c["capture"] for c in cases["history"].result.document["commits"] if c["capture"]]
    assert captured == {"slot": "orders", "lsn": "0/16B3748"}


def test_a_schema_refuses_what_it_does_not_describe(cases: dict[str, Case]) -> None:
    """The schemas are strict: an LSN as a number, a missing or an unknown field fails."""
    document = json.loads(json.dumps(cases["status"].result.document))
    document["captures"][0]["lsn"] = 0x16B3748
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        validate(document, "status")
    for change in ({"surprise": 1}, {"url": None}):
        bad = {**cases["consumers"].result.document, **change}
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, "consumer-list")


def test_every_schema_is_a_valid_draft_2020_12_schema() -> None:
    for name in SCHEMA_FILES:
        schema = json_schema(name)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$id"] == f"urn:replog:cli:{name}"
        lsn = schema.get("$defs", {}).get("lsn")
        if lsn is not None:  # the one LSN form, alike in every schema that has one
            assert lsn == json_schema("status")["$defs"]["lsn"]


def test_text_variants_of_results(cases: dict[str, Case]) -> None:
    """The other outcomes a result can report, in words."""
    plan = cases["truncation_plan"].result.document
    stream = io.StringIO()
    out = TextOutput(stream)
    out.show(results.Truncated({**plan, "dry_run": False, "version": None}))
    out.show(results.ConsumerSet.of("u", "etl", {}, {0: 1}, True))
    out.show(results.ConsumerDeleted.of("u", "gone", None, False))
    compacted = cases["compacted"].result.document
    out.show(results.Compacted({**compacted, "dry_run": True, "segments_after": 1}))
    out.show(results.Compacted({**compacted, "version": None}))
    out.show(results.Consumers.of("u", []))
    out.show(results.Manifests.of("u", [], 0))
    out.show(results.Validated({"checkpoint_id": 3, "valid": True, "problems": []}))
    keyed = cases["key_compacted"].result.document
    out.show(results.Compacted({**keyed, "shards": [], "segments_below_cleaner_points": 0}))
    out.show(results.Compacted({**keyed, "shards": [], "segments_below_cleaner_points": 2}))
    text = stream.getvalue()
    for phrase in (
        "nothing to truncate",
        "offsets set",
        "dry run: would delete consumer gone; add --execute",
        f"would merge {compacted['segments_before']} segments into 1",
        "nothing to compact\n",
        "no manifests in u",
        "is valid",
        "nothing to compact: no whole segment lies at or below the cleaner points",
        "nothing to compact: no event below the cleaner points is superseded",
    ):
        assert phrase in text, (phrase, text)


def test_recover_lists_the_garbage_only_when_verbose(cases: dict[str, Case]) -> None:
    result = cases["recovered"].result
    first = result.document["garbage"][0]
    assert f"  {first}" in render(TextOutput, result)
    quiet = io.StringIO()
    TextOutput(quiet).show(result)
    assert first not in quiet.getvalue()


def test_events_are_json_lines_valid_against_the_event_schema() -> None:
    row = {
        "key": "k",
        "shard": 0,
        "sequence": 1,
        "event_id": "e1",
        "operation": "insert",
        "collection": None,
        "metadata": None,
        "timestamp": datetime(2025, 1, 1, tzinfo=timezone.utc),
        "data": b'{"n": 1}',
        "before": b"\xff\xfe",
    }
    for renderer in (TextOutput, JsonOutput):
        stream = io.StringIO()
        renderer(stream).events([row, row])
        lines = stream.getvalue().splitlines()
        assert len(lines) == 2
        document = json.loads(lines[0])
        assert document["data"] == '{"n": 1}' and document["before_base64"] == "//4="
        assert document["timestamp"] == "2025-01-01T00:00:00Z"
        validate(document, "event")
    assert event_json({**row, "before": None})["before"] is None


@pytest.mark.parametrize(
    ("ago_ms", "shown"),
    [(None, "-"), (1_500, "1.5s ago"), (90_000, "1.5m ago"), (7_200_000, "2.0h ago")],
)
def test_age_in_words(ago_ms: int | None, shown: str) -> None:
    with use_clock(lambda: 1_800_000_000.0):
        assert age(None if ago_ms is None else 1_800_000_000_000 - ago_ms) == shown


def test_age_of_a_stamp_ahead_of_the_clock_is_never_negative() -> None:
    with use_clock(lambda: 1_800_000_000.0):
        assert age(1_800_000_000_000 + 5_000) == "0.0s ago"


def test_status_shows_captures_without_a_server(tmp_path: Path) -> None:
    """A capture is shown as such (not as a transaction); its lag needs the server."""
    log = filled_log(str(tmp_path / "log"), commits=1, per_commit=2, shards=1)
    log.append([{"key": "b", "data": {}}], transaction=Transaction(app_id("orders"), 0x16B3748))
    log.append([{"key": "c", "data": {}}], transaction=Transaction("nightly", 3))
    report = status.log_status(log)
    assert report.transactions == {"nightly": 3}
    [capture] = report.captures
    assert (capture.slot, capture.position, capture.lag_bytes) == ("orders", 0x16B3748, None)
    assert capture.log_version == log.refresh().version - 1
    assert capture.committed_ms is not None
    text = render(TextOutput, results.Status.of(report))
    assert "  nightly                  version 3" in text
    assert "at LSN 0/16B3748" in text and "lag: give --source-dsn" in text
    document = json.loads(render(JsonOutput, results.Status.of(report)))
    validate(document, "status")
    assert document["captures"][0]["lsn"] == "0/16B3748"
    assert document["captures"][0]["lag_bytes"] is None
    elsewhere = status.with_server(report, 0x16B4000, {})
    assert "the server has no slot 'orders'" in render(TextOutput, results.Status.of(elsewhere))


def test_status_says_why_a_capture_cannot_resume(tmp_path: Path) -> None:
    """An invalidated slot, and one consumed past the log's position: each named, with
    --reset-slot as the way on (the missing and foreign slots: tests/test_cli_slots.py)."""
    log = filled_log(str(tmp_path / "log"), commits=1, per_commit=2, shards=1)
    log.append([{"key": "b", "data": {}}], transaction=Transaction(app_id("orders"), 0x16B3748))
    report = status.log_status(log)
    lost = _slot("orders", wal_status="lost", invalidation="wal_removed", lag_note="invalidated")
    ahead = _slot("orders", confirmed_lsn=0x16B3800)
    for slot, said in (
        (lost, "the server invalidated slot 'orders' (wal_removed): the WAL after the log's "
               "position is gone; 'replog capture ... --reset-slot' starts over"),
        (ahead, "slot 'orders' was advanced to 0/16B3800, past the log's position 0/16B3748"),
    ):  # fmt: skip
        document = results.Status.of(status.with_server(report, 0x16B4000, {"orders": slot}))
        validate(document.document, "status")
        assert document.document["captures"][0]["problem"].startswith(said)
        assert f"CANNOT RESUME: {said}" in render(TextOutput, document)

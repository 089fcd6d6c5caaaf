"""The CLI's renderers (:mod:`replog.cli.output`): every result type renders as text for
people and as one JSON document for scripts. Results are computed on a small real log
with the core functions the commands call."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from support.logs import commit_offsets, filled_log, log_rows

from replog import ingest
from replog.capture.options import capture_app_id as app_id
from replog.capture.progress import CaptureProgress
from replog.checkpoints.consumers import committed_position
from replog.checkpoints.sinks import Batch, SinkCommitter, sink_store
from replog.cli.output import JsonOutput, Output, TextOutput, age, event_json
from replog.format.commits import Transaction
from replog.log import ReplicationLog
from replog.merges import plan_full
from replog.ops import compaction, keys, recovery, retention, status, verify
from replog.schemas import registry
from replog.timeutil import now_ms, use_clock


@dataclass(frozen=True)
class Case:
    """One call of an :class:`Output` method: its arguments, phrases its text must hold,
    and what its JSON document must be."""

    method: str
    args: tuple[Any, ...]
    text: tuple[str, ...]
    check_json: Callable[[Any], None]


def _equal(expected: Any) -> Callable[[Any], None]:
    def check(document: Any) -> None:
        assert document == json.loads(json.dumps(expected))

    return check


def _cases(tmp_path: Path) -> list[Case]:
    url = str(tmp_path / "log")
    log = filled_log(url, commits=3, per_commit=10, shards=2, auto_compact=False)
    commit_offsets(log, "etl", {0: 4, 1: 3})
    sink = SinkCommitter(log, "s1")
    since = log.refresh().version
    sink.commit(Batch("q-1", 0, tuple(log.stage(log_rows(4, 900))), since_version=since))
    log.stage(log_rows(2, 950))  # an orphan staged file: garbage for recover

    info = log.info()
    appended = ingest.append_lines(log, ['{"key": "a", "data": {"n": 1}}'])
    # a capture's position, as replog capture records it (slot "orders", LSN 0/16B3748)
    log.append(
        [{"key": "b", "data": {"n": 2}}], transaction=Transaction(app_id("orders"), 0x16B3748)
    )
    verified = verify.verify(ReplicationLog.open(url))
    store = sink_store(log, "s1")
    listing: list[tuple[int, Any]] = [(i, store.load(i)) for i in store.list_ids()]
    listing.append((99, "99.json: unreadable"))
    latest = store.load_latest()
    assert latest is not None
    consumer = status.consumer_position(log, "etl")
    position = committed_position(log, "etl")
    assert position is not None
    log_status = status.with_server(
        status.log_status(log), 0x16B4000, {"orders": 0x16B3748, "other": None}
    )
    plan = retention.plan_truncation(log, {0: 2, 1: 2})
    captured = CaptureProgress(
        rows=12, snapshot_rows=5, transactions=4, commits=2, position=0x16B3748
    )
    recovered = recovery.recover(ReplicationLog.open(url), grace_ms=0, dry_run=True)
    assert recovered.garbage
    merges = compaction.CompactionResult(tuple(plan_full(log.refresh())), None)
    compacted = compaction.compact(ReplicationLog.open(url))
    assert merges.merges and compacted.record is not None
    keyed = filled_log(str(tmp_path / "keyed"), commits=3, per_commit=10, auto_compact=False)
    key_compacted = keys.compact_by_key(keyed)
    assert key_compacted.record is not None

    def manifests_json(document: Any) -> None:
        assert [entry["checkpoint_id"] for entry in document] == [i for i, _ in listing]
        assert [entry["latest"] for entry in document] == [
            i == latest.checkpoint_id for i, _ in listing
        ]
        assert document[-1] == {
            "checkpoint_id": 99,
            "latest": False,
            "manifest": None,
            "error": "99.json: unreadable",
        }
        assert document[0]["manifest"] == json.loads(json.dumps(listing[0][1].to_json()))

    def consumer_json(document: Any) -> None:
        expected = json.loads(json.dumps(consumer.to_json(now_ms())))
        document.pop("oldest_unconsumed_age_s")
        expected.pop("oldest_unconsumed_age_s")
        assert document == expected

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

    return [
        Case("created", (info,), (f"created {url} with 2 shards",), _equal(info.to_json())),
        Case(
            "schemas",
            (url, versions),
            ("inventory.customers  version", "decimal128(38, 2)", "Decimal"),
            _equal({"url": url, "versions": [v.to_json() for v in versions]}),
        ),
        Case(
            "appended",
            (appended,),
            (f"appended 1 events to {url} as version {appended.record.version}",),  # type: ignore[union-attr]
            _equal(appended.to_json()),
        ),
        Case(
            "info",
            (info,),
            (f"log        {url}", "shards     2", "sink s1: epoch 0 of query q-1"),
            _equal(info.to_json()),
        ),
        Case("verified", (verified,), ("ok: ",), _equal(verified.to_json())),
        Case(
            "manifests",
            (store.url, listing, latest.checkpoint_id),
            (f"* {latest.checkpoint_id:>8}  epoch 0", "UNREADABLE: 99.json: unreadable"),
            manifests_json,
        ),
        Case("manifest", (latest,), ('"epoch": 0',), _equal(latest.to_json())),
        Case(
            "validated",
            (latest, ["no sink named"]),
            (f"INVALID checkpoint {latest.checkpoint_id}: no sink named",),
            _equal({"checkpoint_id": latest.checkpoint_id, "problems": ["no sink named"]}),
        ),
        Case("names", (["etl", "other"],), ("etl\nother",), _equal(["etl", "other"])),
        Case("consumer", (url, consumer), (f"consumer etl of {url}: checkpoint",), consumer_json),
        Case(
            "consumer_set",
            ("etl", {0: 4}, {0: 1, 1: 2}, False),
            ("consumer etl:", "-> ", "dry run: nothing changed"),
            _equal(
                {
                    "consumer": "etl",
                    "executed": False,
                    "before": {"0": 4},
                    "after": {"0": 1, "1": 2},
                }
            ),
        ),
        Case(
            "consumer_deleted",
            ("etl", position, True),
            (f"deleted consumer etl (committed {position.offsets})",),
            _equal({"consumer": "etl", "executed": True, "position": position.to_json()}),
        ),
        Case(
            "status",
            (log_status,),
            (
                f"log {url}: version",
                "consumers (1):",
                "sinks (1):",
                "  etl ",
                "  s1 ",
                "captures (1):",
                "  orders ",
                "at LSN 0/16B3748 (log version ",
                "server at 0/16B4000, lag 2,232 bytes, slot confirmed 0/16B3748",
            ),
            _equal(log_status.to_json()),
        ),
        Case(
            "truncation_plan",
            (plan, False),
            (f"would drop {plan.total_dropped:,} events",),
            _equal(plan.to_json()),
        ),
        Case(
            "truncated",
            (url, plan, 12, 3),
            (f"truncated {url} at version 12:", "removed 3 segments"),
            _equal({**plan.to_json(), "version": 12, "segments_removed": 3}),
        ),
        Case(
            "recovered",
            (recovered, "0", True),
            (f"would delete {len(recovered.garbage)} garbage", f"  {recovered.garbage[0]}"),
            _equal(recovered.to_json()),
        ),
        Case(
            "captured",
            (url, captured),
            (f"captured 12 rows (5 in the snapshot) of 4 transactions into {url}", "0/16B3748"),
            _equal({"url": url, **captured.to_json()}),
        ),
        Case(
            "compacted",
            (url, compacted, False),
            (f"compacted {url} at version {compacted.record.version}: merged",),
            _equal(compacted.to_json(False)),
        ),
        Case(
            "key_compacted",
            (url, key_compacted, False),
            (f"key-compacted {url} at version {key_compacted.record.version}", "cleaner points"),
            _equal(key_compacted.to_json(False)),
        ),
    ]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    return {case.method: case for case in _cases(tmp_path_factory.mktemp("output"))}


RESULTS = sorted(Output.__abstractmethods__)


def render(renderer: type[Output], case: Case) -> str:
    stream = io.StringIO()
    getattr(renderer(stream), case.method)(*case.args)
    return stream.getvalue()


def test_every_result_has_a_case(cases: dict[str, Case]) -> None:
    assert set(cases) == set(RESULTS)


@pytest.mark.parametrize("method", RESULTS)
def test_text_renders_every_result(cases: dict[str, Case], method: str) -> None:
    text = render(TextOutput, cases[method])
    for phrase in cases[method].text:
        assert phrase in text, (phrase, text)
    assert text != render(JsonOutput, cases[method])  # words, not the JSON document


@pytest.mark.parametrize("method", RESULTS)
def test_json_renders_every_result_as_one_document(cases: dict[str, Case], method: str) -> None:
    text = render(JsonOutput, cases[method])
    assert text.endswith("\n") and text.count("\n") == 1, text
    cases[method].check_json(json.loads(text))


@pytest.mark.parametrize("missing", RESULTS)
def test_a_renderer_missing_a_result_cannot_be_built(missing: str) -> None:
    methods = {name: lambda self, *args: None for name in RESULTS if name != missing}
    partial = type("Partial", (Output,), methods)
    with pytest.raises(TypeError, match=missing):
        partial(io.StringIO())


def test_text_variants_of_results(cases: dict[str, Case]) -> None:
    """The other outcomes a result can report, in words."""
    plan = cases["truncation_plan"].args[0]
    stream = io.StringIO()
    out = TextOutput(stream)
    out.truncated("u", plan, None, 0)
    out.consumer_set("etl", {}, {0: 1}, True)
    out.consumer_deleted("gone", None, False)
    dry = compaction.CompactionResult(cases["compacted"].args[1].merges, None)
    out.compacted("u", dry, True)
    out.compacted("u", compaction.CompactionResult((), None), False)
    out.names([])
    out.manifests("u", [], 0)
    out.validated(cases["manifest"].args[0], [])
    text = stream.getvalue()
    for phrase in (
        "nothing to truncate",
        "offsets set",
        "dry run: would delete consumer gone; add --execute",
        f"would merge {dry.segments_before} segments into {len(dry.merges)}",
        "nothing to compact",
        "no manifests in u",
        "is valid",
    ):
        assert phrase in text, (phrase, text)


def test_events_are_json_lines_under_both_renderers() -> None:
    row = {
        "key": "k",
        "shard": 0,
        "sequence": 1,
        "timestamp": datetime(2025, 1, 1, tzinfo=timezone.utc),
        "data": b'{"n": 1}',
        "before": b"\xff\xfe",
    }
    for renderer in (TextOutput, JsonOutput):
        stream = io.StringIO()
        renderer(stream).events([row, row])
        lines = stream.getvalue().splitlines()
        assert len(lines) == 2
        assert json.loads(lines[0]) == {
            "key": "k",
            "shard": 0,
            "sequence": 1,
            "timestamp": "2025-01-01T00:00:00Z",
            "data": '{"n": 1}',
            "before_base64": "//4=",
        }
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
    text = render(TextOutput, Case("status", (report,), (), lambda _: None))
    assert "  nightly                  version 3" in text
    assert "at LSN 0/16B3748" in text and "lag: give --source-dsn" in text
    document = json.loads(render(JsonOutput, Case("status", (report,), (), lambda _: None)))
    assert document["captures"][0]["lsn"] == "0/16B3748"
    assert document["captures"][0]["lag_bytes"] is None
    elsewhere = status.with_server(report, 0x16B4000, {})
    assert "the server has no slot 'orders'" in render(
        TextOutput, Case("status", (elsewhere,), (), lambda _: None)
    )

"""Debezium's PostgreSQL connector and ``replog capture postgres`` over one database and
one workload (tests/support/debezium_workload.py: inserts, updates, deletes, key changes,
unchanged TOASTed values under both identities, transactions of several tables, NULLs,
numeric, temporal, JSON, binary and array types, a TRUNCATE inside a transaction): for
every change, the two agree on ``op``, key, ``source.txId``, ``source.lsn``,
``source.ts_ms``, the place in its transaction and in the stream, and on the ``before``
and ``after`` values as :func:`replog.spark.functions.typed` reads them (Debezium's records
appended to a log of their own, as ``replog append --format debezium`` does).

Where the two differ by design (docs/CDC.md, "replog capture and Debezium, change by
change"), the comparison says so by name, column by column; every other difference fails.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from support.capture import captured
from support.debezium_peer import change_value
from support.debezium_workload import KEYS, SHARDS, TABLES, PeerRun

from replog import debezium
from replog.format import jsontext
from replog.ingest import append_lines
from replog.log import ReplicationLog

pytestmark = [pytest.mark.slow, pytest.mark.spark]

PLACEHOLDER = "__debezium_unavailable_value"
PLACEHOLDER_BYTES = PLACEHOLDER.encode()
PLACEHOLDER_BASE64 = base64.b64encode(PLACEHOLDER_BYTES).decode()
TOASTED_ARRAYS = ("big_ta", "big_ia")
"""``kinds``' TOASTed array columns (an unchanged one holds Debezium's array placeholder)."""
TOASTED_BYTES = ("big_b",)
DAYS_PER_MONTH = 365.25 / 12  # Debezium's MicroDuration.DAYS_PER_MONTH_AVG


@dataclass
class Change:
    """One change as either tool gave it, its row images typed."""

    op: str
    collection: str
    key: list[tuple[str, Any]] | None
    tx_id: int | None
    lsn: int
    ts_ms: int
    snapshot: str
    transaction: dict[str, Any] | None
    after: dict[str, Any] | None = None
    before: dict[str, Any] | None = None
    unavailable: frozenset[str] = frozenset()
    fetched: frozenset[str] = frozenset()
    copies: int = 1

    def order(self, name: str) -> int | None:
        """``total_order`` or ``data_collection_order`` of the change's transaction block."""
        return (self.transaction or {}).get(name)

    def place(self) -> tuple[Any, ...]:
        """What the stream says of the change, values aside."""
        order = self.order("total_order")
        return (self.op, self.collection, self.key, self.tx_id, self.lsn, self.ts_ms, order)


@dataclass
class Peers:
    """Debezium's changes and replog's, each in the order its tool gave them."""

    debezium: list[Change]
    replog: list[Change]
    replog_url: str
    messages: list[str]
    """The prefixes of the logical decoding messages Debezium gave as ``op`` m records."""
    notes: Counter[str] = field(default_factory=Counter)

    def streamed(self) -> Iterator[tuple[Change, Change]]:
        """Pairs of streamed changes (the snapshots aside), checked to be as many."""
        ours = [c for c in self.replog if c.op != "r"]
        theirs = [c for c in self.debezium if c.op != "r"]
        assert len(ours) == len(theirs), (len(ours), len(theirs))
        return zip(theirs, ours, strict=True)

    def snapshot(self) -> dict[tuple[str, str], tuple[Change, Change]]:
        """Snapshot reads of each tool by (collection, key), checked to be the same rows."""
        theirs = {(c.collection, json.dumps(c.key)): c for c in self.debezium if c.op == "r"}
        ours = {(c.collection, json.dumps(c.key)): c for c in self.replog if c.op == "r"}
        assert sorted(theirs) == sorted(ours)
        return {k: (theirs[k], ours[k]) for k in theirs}


def _typed_rows(spark: Any, url: str) -> dict[str, dict[str, Any]]:
    """event_id -> {"after", "before"} of every event of the log at ``url``, typed by
    :func:`typed` from the schemas registered there (the log read once, cached)."""
    from replog.spark.functions import typed

    frame = spark.read.format("replog").load(url).cache()
    rows: dict[str, dict[str, Any]] = {}
    try:
        for collection in TABLES:
            for row in (
                typed(frame, url, collection).select("event_id", "after", "before").collect()
            ):
                rows[row["event_id"]] = row.asDict(recursive=True)
    finally:
        frame.unpersist()
    return rows


def _placeholders(image: dict[str, Any] | None) -> frozenset[str]:
    """Columns of a Debezium row image (as JsonConverter wrote it, schemaless) holding the
    placeholder of an unchanged TOASTed value, in the form Debezium gives each type."""
    forms = (PLACEHOLDER, [PLACEHOLDER], PLACEHOLDER_BASE64, list(PLACEHOLDER_BYTES))
    return frozenset(name for name, value in (image or {}).items() if value in forms)


def _debezium_changes(records: list[dict[str, Any]], typed: dict[str, Any]) -> list[Change]:
    changes = []
    for record in records:
        envelope = change_value(record)
        if envelope is None or envelope["op"] == "m":  # replog's watermarks: CDC.md
            continue
        source = envelope["source"]
        collection = f"{source['schema']}.{source['table']}"
        key = None
        typed_row: dict[str, Any] = {}
        if record["key"] is not None:
            key = list(json.loads(record["key"])["payload"].items())
            line = '{"key":' + record["key"] + ',"value":' + record["value"] + "}"
            converted = debezium.debezium_record(jsontext.parse_object(line), KEYS[collection])
            assert isinstance(converted, dict), converted
            typed_row = typed[converted["event_id"]]
        after = typed_row.get("after") if envelope["after"] is not None else None
        unavailable = _placeholders(envelope.get("after"))
        changes.append(
            Change(
                envelope["op"],
                collection,
                key,
                source["txId"],
                source["lsn"],
                source["ts_ms"],
                source["snapshot"],
                envelope.get("transaction"),
                after,
                typed_row.get("before") if envelope["before"] is not None else None,
                unavailable,
            )
        )
    return changes


def _replog_changes(log: ReplicationLog, typed: dict[str, Any]) -> list[Change]:
    changes: list[Change] = []
    for event in captured(log):  # snapshot reads, then changes in commit order
        metadata = event["metadata"]
        source = metadata["source"]
        if event["op"] == "t" and changes and changes[-1].op == "t":
            last = changes[-1]
            if (last.tx_id, last.lsn, last.collection) == (event["txid"], event["lsn"],
                                                           event["collection"]):  # fmt: skip
                last.copies += 1  # the same TRUNCATE, on another shard
                continue
        typed_row = typed.get(event["event_id"], {})
        changes.append(
            Change(
                event["op"],
                event["collection"],
                None if event["op"] == "t" else list(json.loads(event["key"]).items()),
                source["txId"],
                source["lsn"],
                source["ts_ms"],
                source["snapshot"],
                metadata.get("transaction"),
                typed_row.get("after") if event["op"] not in ("d", "t") else None,
                typed_row.get("before"),
                frozenset(metadata.get("unavailable", ())),
                frozenset(metadata.get("fetched", ())),
            )
        )
    return changes


@pytest.fixture(scope="module")
def peers(peer_run: PeerRun, spark, tmp_path_factory) -> Peers:
    """Debezium's records appended (per table, each with its key columns) to a log, both
    logs read through ``typed``, and the changes of each tool in its order."""
    url = str(tmp_path_factory.mktemp("debezium-log") / "log")
    log = ReplicationLog.create(url, SHARDS)
    for collection in TABLES:
        topic = f"dbserver1.{collection}"
        lines = [
            '{"key":' + (r["key"] or "null") + ',"value":' + r["value"] + "}"
            for r in peer_run.records
            if r["topic"] == topic and r["value"] is not None
        ]
        append_lines(log, lines, format="debezium", key_fields=KEYS[collection])
    theirs = _debezium_changes(peer_run.records, _typed_rows(spark, url))
    ours = _replog_changes(peer_run.log, _typed_rows(spark, peer_run.log.url))
    messages = [
        envelope["message"]["prefix"]
        for record in peer_run.records
        if (envelope := change_value(record)) is not None and envelope["op"] == "m"
    ]
    return Peers(theirs, ours, peer_run.log.url, messages)


# -- values, and the differences by design -------------------------------------------------


def _micro_duration(parts: dict[str, int]) -> timedelta:
    """replog's interval (PostgreSQL's months, days and microseconds, exact) as Debezium's
    default ``interval.handling.mode=numeric`` writes it: MicroDuration, a month taken as
    30.4375 days, in Debezium's double arithmetic (``MicroDuration.durationMicros``)."""
    micros = parts["microseconds"]
    sign = -1 if micros < 0 else 1
    hours, rest = divmod(abs(micros), 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    days = parts["months"] * DAYS_PER_MONTH + parts["days"]
    seconds = ((days * 24 + sign * hours) * 60 + sign * minutes) * 60 + sign * rest / 1e6
    return timedelta(microseconds=int(seconds * 1e6))


def _variable_scale(theirs: Any, ours: Any) -> str | None:
    """``numeric`` without a scale: the same number (Debezium drops trailing zeros, 1.50 is
    1.5, and has no NaN: NULL; replog keeps the server's text)."""
    if theirs is None and ours is None:
        return None
    if theirs is None and ours == "NaN":
        return "numeric NaN: Debezium NULL, replog 'NaN'"
    if theirs is not None and ours is not None and Decimal(theirs) == Decimal(ours):
        return None if theirs == ours else "numeric: Debezium drops trailing zeros"
    return "differs"


def _interval(theirs: Any, ours: Any) -> str | None:
    """``interval``: Debezium's MicroDuration (a month as 30.4375 days), replog's parts."""
    if theirs is None or ours is None:
        return None if theirs is ours else "differs"
    return "interval: Debezium's MicroDuration" if theirs == _micro_duration(ours) else "differs"


BY_DESIGN: dict[str, Callable[[Any, Any], str | None]] = {"iv": _interval, "n": _variable_scale}
"""Columns whose typed values differ by design: name -> (Debezium's, replog's) -> the
difference's name, None when equal, "differs" when not as designed."""


def _image_differences(
    theirs: Change, ours: Change, side: str, notes: Counter[str]
) -> Iterator[str]:
    their_image, our_image = getattr(theirs, side), getattr(ours, side)
    if their_image is None or our_image is None:
        if their_image is not our_image:
            yield f"{side}: Debezium {their_image is not None}, replog {our_image is not None}"
        return
    assert set(our_image) == set(their_image), (sorted(our_image), sorted(their_image))
    for name, their_value in their_image.items():
        our_value = our_image[name]
        if side == "after" and name in ours.fetched and name in theirs.unavailable:
            notes["TOASTed value of a changed key: replog reads it (metadata.fetched)"] += 1
            continue
        if name in BY_DESIGN:
            verdict = BY_DESIGN[name](their_value, our_value)
            if verdict is None:
                continue
            if verdict != "differs":
                notes[verdict] += 1
                continue
        elif our_value == their_value:
            continue
        yield f"{side}.{name}: Debezium {their_value!r:.120}, replog {our_value!r:.120}"


def _described(change: Change) -> str:
    return f"{change.op} {change.collection} {change.key} txId {change.tx_id} lsn {change.lsn}"


# -- the tests -------------------------------------------------------------------------------


def test_the_same_changes_in_the_same_order_at_the_same_positions(peers: Peers) -> None:
    """Every streamed change (TRUNCATE included), in stream order: the same ``op``, table,
    key, ``source.txId``, ``source.lsn``, ``source.ts_ms`` (the commit time) and
    ``transaction.total_order``; the transaction id names the same transaction."""
    pairs = list(peers.streamed())
    differing = [(a.place(), b.place()) for a, b in pairs if a.place() != b.place()]
    assert not differing, differing[:10]
    for theirs, ours in pairs:
        assert theirs.transaction is not None and ours.transaction is not None
        # Debezium 3.6's id is "<txId>:<the change's own LSN>", replog's "<txId>:<commit LSN>"
        assert theirs.transaction["id"].split(":")[0] == ours.transaction["id"].split(":")[0]
        assert theirs.snapshot == ours.snapshot == "false"
    ops = Counter(a.op for a, _ in pairs)
    assert ops["c"] >= 30 and ops["u"] >= 60 and ops["d"] >= 20 and ops["t"] == 1, ops
    truncates = [ours for _, ours in pairs if ours.op == "t"]
    assert [t.copies for t in truncates] == [SHARDS]  # one per shard, Debezium one per table
    transactions = Counter(ours.tx_id for _, ours in pairs)
    assert max(transactions.values()) >= 20  # the large one
    assert sum(1 for a, _ in pairs if a.op == "d" and a.collection == "public.pairs") == 3
    # capture's WAL messages (its snapshot's watermarks) reach a Debezium connector beside it
    assert peers.messages and {p.split(".")[0] for p in peers.messages} == {"replog"}


def test_every_change_has_the_same_values_typed(peers: Peers) -> None:
    """``after`` and ``before`` of each streamed change, column by column, as ``typed``
    reads them: numeric, temporal, JSON, binary and array values, NULLs, the placeholders
    of unchanged TOASTed values (text, jsonb), the old row under REPLICA IDENTITY FULL."""
    differences = []
    compared = Counter[str]()
    for theirs, ours in peers.streamed():
        if theirs.op == "t":
            continue
        for side in ("after", "before"):
            found = list(_image_differences(theirs, ours, side, peers.notes))
            differences += [f"{_described(theirs)}: {d}" for d in found]
            compared[side] += getattr(theirs, side) is not None
        if theirs.collection == "public.orders" and theirs.op == "u":  # REPLICA IDENTITY FULL
            memo = (theirs.after or {}).get("memo")
            compared["TOASTed, from the old row"] += bool(memo and len(memo) > 2000)
        # the same unchanged TOASTed columns (replog's fetched ones Debezium leaves unsent)
        assert theirs.unavailable == ours.unavailable | ours.fetched, _described(theirs)
        compared["with placeholders"] += bool(theirs.unavailable)
    assert not differences, "\n".join(differences[:30])
    assert compared["after"] >= 100 and compared["before"] >= 40, compared
    assert compared["with placeholders"] >= 10, compared
    assert compared["TOASTed, from the old row"] >= 3, compared
    assert peers.notes["interval: Debezium's MicroDuration"] >= 5, peers.notes
    assert peers.notes["TOASTed value of a changed key: replog reads it (metadata.fetched)"]


def test_the_snapshots_read_the_same_rows(peers: Peers) -> None:
    """Both snapshots (taken before the changes) hold the same rows and values, typed."""
    differences = []
    for (collection, key), (theirs, ours) in peers.snapshot().items():
        assert theirs.after is not None and ours.after is not None, (collection, key)
        for name, their_value in theirs.after.items():
            our_value = ours.after[name]
            verdict = BY_DESIGN[name](their_value, our_value) if name in BY_DESIGN else (
                None if their_value == our_value else "differs")  # fmt: skip
            if verdict == "differs":
                differences.append(
                    f"{collection} {key} {name}: {their_value!r:.80} {our_value!r:.80}"
                )
    assert not differences, "\n".join(differences[:30])
    assert len(peers.snapshot()) == 20 + 20 + 7 + 6 + 5  # customers, orders, kinds, pairs, scratch


def test_data_collection_order_counts_each_tables_events(peers: Peers) -> None:
    differing = [
        (_described(a), a.order("data_collection_order"), b.order("data_collection_order"))
        for a, b in peers.streamed()
        if a.order("data_collection_order") != b.order("data_collection_order")
    ]
    assert not differing, differing[:5]


def test_an_unchanged_toasted_bytea_holds_debeziums_placeholder_bytes(peers: Peers) -> None:
    found = 0
    for theirs, ours in peers.streamed():
        if theirs.collection != "public.kinds" or theirs.after is None or ours.after is None:
            continue
        for name in TOASTED_BYTES:
            if theirs.after[name] == PLACEHOLDER_BYTES and name not in ours.fetched:
                found += 1  # (a key change's create reads the value: metadata.fetched)
                assert ours.after[name] == PLACEHOLDER_BYTES, _described(theirs)
    assert found >= 3


def test_an_unchanged_toasted_array_holds_debeziums_placeholder_array(peers: Peers) -> None:
    found = 0
    for their, our in peers.streamed():
        if our.unavailable & set(TOASTED_ARRAYS):
            found += 1
            assert their.after is not None and our.after is not None, _described(their)
            for name in TOASTED_ARRAYS:
                assert our.after[name] == their.after[name], (_described(their), name)
    assert found >= 3

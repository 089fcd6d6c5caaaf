"""Debezium redeliveries across appends: nothing lost, nothing doubled (adversarial cases).

Each test is an input (or an interleaving of appends) where a source position alone does
not say whether the log holds an event: several events sharing one position, rows that
carry no position, two appends of one connector racing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import replog

from replog import ingest
from replog.errors import TransactionOrderError
from replog.log import ReplicationLog

KEYS = ("id",)


def pg(op: str, key: int, lsn: int, *, commit: int = 100, before: int | None = None) -> str:
    """A PostgreSQL change of row ``key`` at ``lsn`` (``before``: the old key of a delete)."""
    source = {
        "version": "2.5.0.Final",
        "connector": "postgresql",
        "name": "pg",
        "ts_ms": 1700000000000 + lsn,
        "snapshot": "false",
        "db": "shop",
        "sequence": json.dumps([str(commit), str(lsn)]),
        "schema": "public",
        "table": "items",
        "txId": 7,
        "lsn": lsn,
        "xmin": None,
    }
    row = {"id": key, "n": lsn}
    old = {"id": before if before is not None else key, "n": 0}
    value = {
        "before": old if op in ("u", "d") else None,
        "after": None if op == "d" else row,
        "source": source,
        "op": op,
        "ts_ms": 1700000009000,
        "transaction": None,
    }
    return json.dumps(value, separators=(",", ":"))


def _append(log: ReplicationLog, lines: Any) -> ingest.AppendReport:
    return ingest.append_lines(log, lines, format="debezium", key_fields=KEYS)


def _events(log: ReplicationLog) -> list[dict[str, Any]]:
    return [row for shard in range(log.shards) for b in log.read(shard) for row in b.to_pylist()]


def _racing(log: ReplicationLog, lines: list[str], *, meanwhile: list[str]) -> Iterator[str]:
    """``lines``, with an append of ``meanwhile`` landing after the first is read (the
    position is read at the first event): two appends of one connector racing."""
    yield lines[0]
    assert _append(log, meanwhile).events == len(meanwhile)
    yield from lines[1:]


@pytest.fixture
def log(tmp_path: Path) -> ReplicationLog:
    return ReplicationLog.create(str(tmp_path / "log"), shards=2)


def test_events_sharing_the_recorded_position_are_not_lost_when_split(
    log: ReplicationLog,
) -> None:
    """An update of a primary key is, in Debezium, a delete of the old key and a create of
    the new one from one WAL record: one ``lsn``. A file cut between them recorded that
    position; the next file (the connector resent from its last offset) holds both."""
    earlier = pg("c", 1, 40)
    delete_old = pg("d", 1, 50)
    create_new = pg("c", 2, 50)
    first = _append(log, [earlier, delete_old])
    assert first.events == 2
    second = _append(log, [delete_old, create_new, pg("u", 2, 60)])
    assert second.behind == 1  # the delete, already appended
    assert second.events == 2  # the create at the same position, and the later update
    third = _append(log, [delete_old, create_new, pg("u", 2, 60)])  # resent once more
    assert third.events == 0 and third.behind == 3
    keys = sorted((row["key"], row["operation"]) for row in _events(log))
    assert keys == [
        ('{"id":1}', "delete"),
        ('{"id":1}', "insert"),
        ('{"id":2}', "insert"),
        ('{"id":2}', "update"),
    ]


def flat(key: int, value: str) -> str:
    """An ExtractNewRecordState row with ``add.fields=op,table``: no source position."""
    return json.dumps({"id": key, "v": value, "__op": "u", "__table": "items"})


def test_flattened_rows_without_a_position_are_never_collapsed(log: ReplicationLog) -> None:
    """Without a position, two changes of one row with equal values are not the same
    change: X, Y, X must leave the row at X (collapsing the second X left it at Y), and
    two different values must not be refused as one event id given twice."""
    lines = [flat(1, "X"), flat(1, "Y"), flat(1, "X"), flat(2, "A"), flat(2, "B")]
    report = _append(log, lines)
    assert report.duplicates == 0 and report.events == 5
    rows = _events(log)
    last = [row for row in rows if row["key"] == '{"id":1}'][-1]
    assert json.loads(last["data"])["v"] == "X"
    assert len({row["event_id"] for row in rows}) == 5


def test_overlapping_appends_racing_do_not_double_events(log: ReplicationLog) -> None:
    """Two appends of one connector read the log's position before either commits (a
    retry started while the first run still ran): the one that commits second must not
    land events the first already appended on top of them."""
    first = [pg("c", key, 10 * key) for key in range(1, 6)]  # lsn 10..50
    second = [pg("c", key, 10 * key) for key in range(3, 9)]  # lsn 30..80

    with pytest.raises(TransactionOrderError):
        _append(log, _racing(log, second, meanwhile=first))
    assert len(_events(log)) == 5
    again = _append(log, second)  # the re-run sees what the first append holds
    assert again.behind == 3 and again.events == 3
    keys = sorted(json.loads(row["key"])["id"] for row in _events(log))
    assert keys == list(range(1, 9))


def orders(op: str, key: int, lsn: int) -> str:
    """A change of table ``orders`` by the same connector (its own Debezium topic)."""
    return pg(op, key, lsn).replace('"table":"items"', '"table":"orders"')


def test_a_connectors_topics_appended_one_after_another_lose_nothing(
    log: ReplicationLog,
) -> None:
    """Debezium writes each table to a topic of its own, the position is the connector's:
    a file of `orders` appended after one of `items` holds positions older than the one
    the log records. They are new to the log (it does not hold them), so they are kept;
    each file given again is a redelivery, and is dropped whole."""
    items = [pg("c", key, 10 * key) for key in range(1, 6)]  # lsn 10..50
    order_lines = [orders("c", key, 10 * key + 5) for key in range(1, 6)]  # lsn 15..55
    assert _append(log, items).events == 5
    second = _append(log, order_lines)
    assert (second.events, second.behind) == (5, 0)
    for lines in (items, order_lines, items + order_lines):
        again = _append(log, lines)
        assert (again.events, again.behind) == (0, len(lines))
    assert _append(log, [orders("u", 1, 60), pg("u", 1, 45)]).events == 2
    collections = sorted(row["collection"] for row in _events(log))
    assert collections == ["public.items"] * 6 + ["public.orders"] * 6


def test_a_redelivery_reads_back_only_the_commits_that_can_hold_it(
    log: ReplicationLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telling a redelivery from a new event reads the log's commits back from the head,
    but only down to the first one that records a position older than the event's: a
    connector resending its last few changes costs a few commits, not the log's age."""
    for start in range(0, 200, 10):  # 20 appends of 10 changes each
        _append(log, [pg("c", key, key) for key in range(start + 1, start + 11)])
    log.flush()  # a merge still running would commit past the head read here
    head = log.refresh().version
    records = [ingest.history.read_commit(log.storage, v) for v in range(1, head + 1)]
    appends = [r.version for r in records if r is not None and r.writer is not None]
    recording_180 = appends[17]  # the 18th append: changes 171..180
    read: list[int] = []
    refreshed_while_reading = 0  # the lookups read from one state, refreshed once before
    read_one, refresh = ingest._History._read, ReplicationLog.refresh

    def counted(self: Any, version: int) -> None:
        read.append(version)
        read_one(self, version)
        read.append(-version)  # done

    def refresh_counted(self: ReplicationLog, **options: Any) -> Any:
        nonlocal refreshed_while_reading
        refreshed_while_reading += bool(read) and read[-1] > 0
        return refresh(self, **options)

    monkeypatch.setattr(ingest._History, "_read", counted)
    monkeypatch.setattr(ReplicationLog, "refresh", refresh_counted)
    resent = [pg("c", key, key) for key in range(185, 206)]  # 185..200 resent, 5 new
    again = _append(log, [orders("c", 1, 183), *resent])  # and another table's, new
    assert (again.events, again.behind) == (6, 16)
    # down to the commit recording 180 < 183 (merges commit in between): none below it
    versions = [version for version in read if version > 0]
    assert versions == list(range(head, recording_180 - 1, -1)) and len(versions) < 6
    assert refreshed_while_reading == 0


def test_events_older_than_the_history_left_count_as_appended(
    log: ReplicationLog, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the retention, the commits that would tell whether the log holds an old event
    are gone: it is dropped as a redelivery (as before lookups existed), with one warning."""
    for start in (0, 10, 20):
        _append(log, [pg("c", key, key) for key in range(start + 1, start + 11)])
    first_kept = log.refresh().version  # as if retention had removed every earlier commit
    read_commit = ingest.history.read_commit

    def expired_below(storage: Any, version: int) -> Any:
        return None if version < first_kept else read_commit(storage, version)

    monkeypatch.setattr(ingest.history, "read_commit", expired_below)
    with caplog.at_level("WARNING", logger="replog.ingest"):
        again = _append(log, [orders("c", 1, 3), orders("c", 2, 4), pg("c", 25, 25)])
    assert (again.events, again.behind) == (0, 3)
    warnings = [r.getMessage() for r in caplog.records if "taken as appended" in r.getMessage()]
    assert len(warnings) == 1 and "the history that would tell expired" in warnings[0]


def test_a_redelivery_of_an_event_key_compaction_removed_is_not_appended_again(
    log: ReplicationLog,
) -> None:
    """Key compaction drops the superseded events of a key: the log no longer holds their
    event ids, but it held them. A redelivery of one must not land after the newer change
    (the key would go back to its old value)."""
    from replog.ops import keys

    assert _append(log, [pg("c", 1, 10), pg("u", 1, 20), pg("c", 2, 30)]).events == 3
    assert keys.compact_by_key(log).record is not None
    assert len(_events(log)) == 2  # the create of key 1 is gone
    again = _append(log, [pg("c", 1, 10)])  # the connector resends it
    assert (again.events, again.behind) == (0, 1)
    assert len(_events(log)) == 2


def test_an_event_newer_than_the_history_read_is_kept_after_a_lookup_hit_expiry(
    log: ReplicationLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup of an old event reads back into expired history; a later event of the
    input whose position is past every commit already read is still told apart: the
    commits that could hold it were all read, and it is new."""
    for start in (0, 10, 20):
        _append(log, [pg("c", key, key) for key in range(start + 1, start + 11)])
    log.flush()  # a merge still running would commit past the head read here
    head = log.refresh().version
    records = [ingest.history.read_commit(log.storage, v) for v in range(1, head + 1)]
    recording = [r.version for r in records if r is not None and r.writer is not None]
    first_kept = recording[1]  # the commit recording 20 and later are left
    read_commit = ingest.history.read_commit

    def expired_below(storage: Any, version: int) -> Any:
        return None if version < first_kept else read_commit(storage, version)

    monkeypatch.setattr(ingest.history, "read_commit", expired_below)
    again = _append(log, [orders("c", 1, 3), orders("c", 2, 25)])
    assert (again.events, again.behind) == (1, 1)  # 3: unknown, dropped; 25: new, kept
    assert sorted(row["collection"] for row in _events(log)).count("public.orders") == 1


def test_events_appended_under_an_explicit_transaction_are_not_doubled_later(
    log: ReplicationLog,
) -> None:
    """An explicit transaction would take the place of the position: the events of that
    commit positioned, but no position of the connector recorded. A later commit of the
    connector recording an older position (a file of another topic) ended the lookup before
    them, and the file resent was appended again. Such an append is refused."""
    from replog.errors import InvalidOptionError
    from replog.format.commits import Transaction

    items = [pg("c", 1, 110), pg("c", 2, 120)]
    with pytest.raises(InvalidOptionError, match="explicit transaction"):
        ingest.append_lines(
            log, items, format="debezium", key_fields=KEYS, transaction=Transaction("mine", 1)
        )
    assert _events(log) == []
    assert _append(log, items).events == 2
    assert _append(log, [orders("c", k, 50 + k) for k in range(1, 6)]).events == 5  # older
    assert _append(log, [orders("c", 9, 130)]).events == 1
    again = _append(log, items)  # the items file resent
    assert (again.events, again.behind) == (0, 2)
    assert len(_events(log)) == 8
    # nothing past the position to record: an explicit transaction is still taken
    done = ingest.append_lines(
        log, items, format="debezium", key_fields=KEYS, transaction=Transaction("mine", 1)
    )
    assert (done.events, done.behind) == (0, 2)


def test_two_appends_of_an_older_topic_racing_do_not_double_it(log: ReplicationLog) -> None:
    """A file of another topic, all older than the recorded position, is kept (new to the
    log) and records no position: two runs of it racing both found it new."""
    assert _append(log, [pg("c", key, 10 * key) for key in range(1, 6)]).events == 5
    order_lines = [orders("c", key, 10 * key + 5) for key in range(1, 4)]  # 15..35

    with pytest.raises(TransactionOrderError):
        _append(log, _racing(log, order_lines, meanwhile=order_lines))
    assert len(_events(log)) == 8
    again = _append(log, order_lines)  # the re-run sees what the first run appended
    assert (again.events, again.behind) == (0, 3)
    assert _append(log, [pg("c", 9, 51)]).events == 1  # the position recorded is 51: new
    assert len(_events(log)) == 9


def test_two_files_of_other_topics_racing_lose_nothing(log: ReplicationLog) -> None:
    """Two different inputs whose commits would record one position: the one that commits
    second found the position held and was skipped as 'already applied', losing its
    events. It fails instead, and its re-run appends them."""
    assert _append(log, [pg("c", key, 10 * key) for key in range(1, 6)]).events == 5
    order_lines = [orders("c", key, 10 * key + 5) for key in range(1, 4)]  # 15..35
    other = [orders("c", key, 10 * key + 6) for key in range(4, 6)]  # 46..56: 56 is new

    def racing() -> Iterator[str]:
        yield order_lines[0]
        assert _append(log, [*other[:1], pg("c", 9, 56)]).events == 2  # records 56
        yield from order_lines[1:]
        yield other[1]  # newest 56 too

    with pytest.raises(TransactionOrderError):
        _append(log, racing())
    again = _append(log, [*order_lines, other[1]])
    assert (again.events, again.behind) == (4, 0)
    assert len(_events(log)) == 11


# -- positions that order nothing (issue 40, item 6) ----------------------------------------


def sentinel(key: int, lsn: Any, *, tx_id: Any = None, raw_lsn: str | None = None) -> str:
    """A Debezium 1.6 PostgreSQL snapshot read as a third party recorded it: ``lsn`` is
    Long.MIN_VALUE written through a double, ``txId`` null (``raw_lsn``: its exact text)."""
    line = pg("r", key, 1)
    value = json.loads(line)
    value["source"].update(version="1.6.0.Final", snapshot="true", lsn=lsn, txId=tx_id)
    value["source"]["sequence"] = json.dumps([None, "23891136"])
    text = json.dumps(value, separators=(",", ":"))
    return text if raw_lsn is None else text.replace(f'"lsn":{json.dumps(lsn)}', f'"lsn":{raw_lsn}')


@pytest.mark.parametrize(
    "lsn",
    [
        "-9223372036854776000",  # the file: the sentinel as a double prints it
        "-9.223372036854776E18",
        "-1",
        "18446744073709551616",  # 2**64: past what an LSN can be, would misorder others
        '"0/abc"',
        "1.5",
    ],
)
def test_an_event_whose_position_is_unusable_is_appended_with_its_file_and_counted(
    log: ReplicationLog, lsn: str
) -> None:
    """``replog append --format debezium`` refused the whole file ("transaction version
    must be an integer >= 0"). The event is appended with the rest, without redelivery
    detection (appended again when the file is), and the summary counts it; the others'
    position is recorded as before."""
    lines = [sentinel(1, 0, raw_lsn=lsn), pg("c", 2, 40), pg("u", 2, 41)]
    report = _append(log, lines)
    assert report.events == 3 and report.unpositioned == 1
    assert report.to_json()["without_source_position"] == 1
    assert report.transaction is not None and report.transaction.app_id == "debezium.pg"
    again = _append(log, lines)
    assert (again.events, again.behind, again.unpositioned) == (1, 2, 1)
    keys = sorted(str(event["key"]) for event in _events(log))
    assert keys == ['{"id":1}', '{"id":1}', '{"id":2}', '{"id":2}']


def test_the_append_summary_says_how_many_events_had_no_usable_position(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    stdin = "\n".join([sentinel(1, -9223372036854775808), pg("c", 2, 40)]) + "\n"
    result = replog("append", url, "-", "--format", "debezium", "--key-fields", "id", stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert "appended 2 events" in result.stdout
    assert "1 events had no usable source position" in result.stdout


def test_a_mysql_file_name_without_a_binlog_number_is_no_reason_to_refuse_the_file(
    log: ReplicationLog,
) -> None:
    """The same rule for MySQL: it refused the input ("does not end in a binlog number")."""
    value = json.loads(pg("c", 1, 1))
    value["source"] = {"connector": "mysql", "name": "my", "file": "binlog", "pos": 4,
                       "row": 0, "db": "shop", "table": "items", "snapshot": "false"}  # fmt: skip
    report = _append(log, [json.dumps(value)])
    assert report.events == 1 and report.unpositioned == 1 and report.transaction is None

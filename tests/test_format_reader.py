"""FORMAT.md is precise enough for a second implementation: a reader written from it
alone (tests/independent/format_reader.py, which imports nothing of replog) reads every
log replog writes, and agrees with replog event for event."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import string
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from independent import format_reader
from independent.format_reader import LogReader, read_log
from support.logs import short_retention_log

from replog.core import files, history
from replog.errors import CorruptionError
from replog.format.commits import APPEND, COMPACT, CommitRecord, commit_path
from replog.format.events import events_from_records
from replog.format.sealed import seal, unseal
from replog.format.segments import (
    HOLED_SCHEMA,
    SEQUENCE_COLUMN,
    Part,
    SegmentInfo,
    entry_rows,
)
from replog.log import ReplicationLog
from replog.ops import compaction, retention
from replog.schemas import registry

V2_LOG = Path(__file__).parent / "data" / "v2log"
"""A log written by replog 0.3 (format 2): 24 appends, a compaction and a truncation."""


def events(c: int, n: int = 10) -> list[dict[str, Any]]:
    return [
        {
            "key": f"k{(c * n + j) % 37}",
            "data": {"n": c * n + j},
            "collection": "orders",
            "operation": ("insert", "update", "delete")[j % 3],
            "metadata": {"c": c},
            "before": None if j % 2 else {"old": j},
        }
        for j in range(n)
    ]


def replog_view(url: str) -> dict[str, Any]:
    log = ReplicationLog.open(url)
    state = log.refresh()
    rows = log.read_all().to_pylist()
    return {
        "log_id": log.log_id,
        "version": state.version,
        "heads": dict(enumerate(state.heads)),
        "lows": dict(enumerate(state.lows)),
        "events": [
            {**row, "timestamp": int(row["timestamp"].timestamp() * 1_000_000)} for row in rows
        ],
    }


def assert_same(log: ReplicationLog) -> None:
    log.flush()  # no merge of its own lands between the two reads
    assert_agree(log.url)


def assert_agree(url: str, expected: dict[str, Any] | None = None) -> None:
    """replog and the independent reader read the same log (and, if given, ``expected``:
    what replog read before the log was tampered with)."""
    mine, theirs = replog_view(url), read_log(url)
    if expected is not None:
        assert mine == expected
    for member in ("log_id", "version", "heads", "lows"):
        assert theirs[member] == mine[member], member
    assert len(theirs["events"]) == len(mine["events"]) > 0
    for event, found in zip(mine["events"], theirs["events"], strict=True):
        assert {k: found[k] for k in event} == event


def test_small_commits_merged_as_they_go(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8, snapshot_interval=20)
    for c in range(130):
        log.append(events(c))
    assert_same(log)


def test_a_big_write_between_small_ones_and_a_full_compaction(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4, snapshot_interval=20)
    for c in range(15):
        log.append(events(c))
    log.append([{"key": f"b{i % 50}", "data": {"n": i, "pad": "y" * 900}} for i in range(5000)])
    for c in range(15, 45):
        log.append(events(c))
    assert_same(log)
    compaction.compact(log)
    assert_same(log)


def test_expired_history_and_a_truncation(tmp_path: Path) -> None:
    log = short_retention_log(str(tmp_path / "log"), 4, 1000, snapshot_interval=20)
    for c in range(50):
        log.append(events(c))
    time.sleep(1.1)
    for c in range(50, 110):
        log.append(events(c))
    heads = log.head()
    retention.truncate(log, {s: max(h - 20, 1) for s, h in heads.items()}, force=True)
    log.append(events(999))
    log.flush()  # retention runs in the writer's background thread
    assert log.refresh().retained_from > 0
    assert_same(log)


def test_a_log_written_by_replog_0_3_and_then_by_this_replog(tmp_path: Path) -> None:
    url = str(tmp_path / "v2log")
    shutil.copytree(V2_LOG, url)
    descriptor = json.loads((Path(url) / "_replog" / "log.json").read_bytes())
    assert descriptor["format_version"] == 2
    before = replog_view(url)
    assert before["version"] == 26 and before["lows"][0] == 3
    log = ReplicationLog.open(url)
    assert_same(log)
    for c in range(40):
        log.append(events(100 + c, 3))
    assert_same(log)
    assert len(replog_view(url)["events"]) == len(before["events"]) + 120


# -- hints that name deleted headers --------------------------------------------------------


@pytest.mark.parametrize("stale", [0, 20])
def test_a_hint_moved_back_past_retention_still_finds_the_log(tmp_path: Path, stale: int) -> None:
    """A slow writer can move the hint back to a header that retention has since deleted
    (or to 0): readers must not see an empty or broken log."""
    log = short_retention_log(str(tmp_path / "log"), 4, 1000, snapshot_interval=20)
    for c in range(50):
        log.append(events(c))
    time.sleep(1.1)
    for c in range(50, 110):
        log.append(events(c))
    log.flush()
    expected = replog_view(log.url)
    assert not log.storage.exists(history.header_path(20))
    log.storage.write(history.SNAPSHOT_HINT_PATH, json.dumps({"version": stale}).encode())
    assert replog_view(log.url) == expected


# -- rules a second implementation had to guess (issue 35) ----------------------------------


def forge_commit(log: ReplicationLog, record: CommitRecord) -> None:
    """Put ``record`` as the next commit, bypassing every check a writer makes."""
    record = dataclasses.replace(record, log_id=log.log_id)
    log.storage.put_if_absent(commit_path(record.version), record.to_bytes())


def three_runs(tmp_path: Path) -> tuple[ReplicationLog, Any]:
    """A one-shard log whose live entries are sequences 1-5, 6-9 and 10-15."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1, auto_compact=False)
    for c, n in enumerate((5, 4, 6)):
        log.append(events(c, n))
    state = log.refresh()
    assert [(s.first_sequence, s.last_sequence) for s in state.segments[0]] == [
        (1, 5), (6, 9), (10, 15)
    ]  # fmt: skip
    return log, state


def test_a_compaction_may_skip_a_file_between_those_it_merges(tmp_path: Path) -> None:
    """Sequences 1-5 and 10-15 merged into one file of two parts, 6-9 left alone: covers
    exactly what it removes, though not one run."""
    log, state = three_runs(tmp_path)
    first, _, last = state.segments[0]
    rows = pa.concat_tables([files.read_stored(log.storage, s) for s in (first, last)])
    head, tail = files.write_files(log.storage, [([Part(0, 0, 5), Part(0, 5, 6)], lambda: rows)])
    expected = replog_view(log.url)
    forge_commit(
        log,
        CommitRecord.after(
            state.version, COMPACT, add=(head.at(1), tail.at(10)), remove=(first, last)
        ),
    )
    assert_agree(log.url, {**expected, "version": state.version + 1})


def test_a_compaction_that_covers_other_sequences_is_refused_by_both_readers(
    tmp_path: Path,
) -> None:
    """Removing 1-5 and 10-15 and adding 1-1 and 6-15 keeps the lowest and highest
    sequence and the count, yet leaves 2-5 uncovered and 6-9 twice: corruption at the
    commit, not a gap found later by whoever reads 2-5."""
    log, state = three_runs(tmp_path)
    first, _, last = state.segments[0]
    added = (first._replace(last_sequence=1), last._replace(first_sequence=6))
    forge_commit(log, CommitRecord.after(state.version, COMPACT, add=added, remove=(first, last)))
    bad = commit_path(state.version + 1)
    with pytest.raises(CorruptionError, match=bad):
        ReplicationLog.open(log.url).refresh()
    with pytest.raises(format_reader.CorruptionError, match=bad):
        read_log(log.url)


def reseal(document: dict[str, Any], **changes: Any) -> bytes:
    return seal({**{k: v for k, v in document.items() if k != "checksum"}, **changes})


def checkpointed(tmp_path: Path, commits: int) -> ReplicationLog:
    log = ReplicationLog.create(str(tmp_path / "log"), 3, snapshot_interval=20, auto_compact=False)
    for c in range(commits):
        log.append(events(c, 4))
    log.flush()
    return log


def test_a_header_of_another_log_is_passed_over_by_both_readers(tmp_path: Path) -> None:
    """A header (and the hint's copy of it) naming another log_id, in a log whose
    descriptor names its own: written late by a writer of a log deleted there before.
    Unusable, like a corrupt header; not a re-created log."""
    log = checkpointed(tmp_path, 25)
    expected = replog_view(log.url)
    path = Path(log.url) / history.header_path(20)
    header = json.loads(path.read_bytes())
    forged = reseal(header, log_id=str(uuid.uuid4()))
    path.write_bytes(forged)
    hint = {"version": 20, "copy": json.loads(forged)}
    (Path(log.url) / history.SNAPSHOT_HINT_PATH).write_text(json.dumps(hint))
    with pytest.warns(format_reader.FormatWarning, match="another log"):
        assert_agree(log.url, expected)


def upsert_log(tmp_path: Path, column: str, value: str) -> ReplicationLog:
    """A log whose second commit holds rows with ``column`` set to ``value`` (which
    writers refuse: the file is written beneath them)."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1, auto_compact=False)
    log.append(events(0, 3))
    rows = events_from_records(events(1, 3))
    index = rows.schema.get_field_index(column)
    rows = rows.set_column(index, rows.schema.field(index), pa.array([value] * 3, pa.string()))
    log.commit_staged(files.write_files(log.storage, [([Part(0, 0, 3)], lambda: rows)]))
    return log


def test_an_unknown_operation_is_refused_by_both_readers(tmp_path: Path) -> None:
    log = upsert_log(tmp_path, "operation", "upsert")
    with pytest.raises(CorruptionError, match="'upsert'"):
        ReplicationLog.open(log.url).read_all()
    with pytest.raises(format_reader.CorruptionError, match="'upsert'"):
        read_log(log.url)


def test_metadata_that_is_not_an_object_is_passed_on_by_both_readers(tmp_path: Path) -> None:
    """Writers refuse it; readers do not parse every row's metadata."""
    log = upsert_log(tmp_path, "metadata", "[1, 2]")
    assert_agree(log.url)
    assert replog_view(log.url)["events"][-1]["metadata"] == "[1, 2]"


def test_a_format_3_changes_file_applies_to_a_format_2_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A format 2 log continued by this replog: header 30's changes file (format 3
    columns) on table 20 (format 2 columns). Both readers take the layout of each file
    from its columns, and neither falls back to the commits."""
    url = str(tmp_path / "v2log")
    shutil.copytree(V2_LOG, url)
    log = ReplicationLog.open(url, auto_compact=False)
    while log.refresh().version < 30:
        log.append(events(200 + log.refresh().version, 3))
    assert log.refresh().version < 40
    log.flush()
    snapshots = Path(url) / "_replog" / "snapshots"
    table = pa.ipc.open_file(pa.memory_map(str(snapshots / f"{20:020d}.segments.arrow")))
    changes = pa.ipc.open_file(pa.memory_map(str(snapshots / f"{30:020d}.changes.arrow")))
    assert "offset" not in table.schema.names and "change" not in table.schema.names
    assert {"offset", "change"} <= set(changes.schema.names)
    with caplog.at_level("WARNING"):
        assert_agree(url)
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]
    state = LogReader(url).load_state()
    assert state.source.startswith(history.changes_path(30)), state.source


# -- a header its commit does not carry (issue 32 item 5) -----------------------------------


def test_the_newest_header_whose_token_its_commit_does_not_carry_is_passed_over(
    tmp_path: Path,
) -> None:
    """Header 30 (and the hint's copy) describe a commit 30 that lost to another: the
    commit there is another writer's. The header is not the log's history, although it
    reads well: both readers fall back to header 20 and the commits after it, and read
    what the commits say (replog used to give up: "the log cannot be rebuilt")."""
    url = tmp_path / "log"
    log = checkpointed(tmp_path, 29)
    before = tmp_path / "before"
    shutil.copytree(url, before)
    log.append(events(1000, 7))  # commit 30, header 30: the history that is not kept
    log.flush()
    lost = tmp_path / "lost"
    shutil.copytree(url, lost)
    shutil.rmtree(url)
    shutil.copytree(before, url)
    log = ReplicationLog.open(str(url), auto_compact=False)
    log.append(events(2000, 2))  # commit 30 as the log has it
    log.flush()
    expected = replog_view(str(url))
    assert expected["version"] == 30
    for name in (history.header_path(30), history.changes_path(30), history.SNAPSHOT_HINT_PATH):
        shutil.copyfile(lost / name, url / name)
    for segment in (lost / "shards").rglob("*.arrow"):  # the lost history's files
        target = url / segment.relative_to(lost)
        if not target.exists():
            shutil.copyfile(segment, target)
    assert json.loads((url / history.header_path(30)).read_bytes())["heads"] != {
        str(s): h for s, h in expected["heads"].items()
    }
    with pytest.warns(format_reader.FormatWarning, match="unusable"):
        assert_agree(str(url), expected)


def test_a_newest_header_whose_commit_is_gone_is_passed_over(tmp_path: Path) -> None:
    """Commit 30 deleted (damage: retention never deletes the newest commits), header 30
    the newest: no newer header exists, so header 30 is unusable and the log is read up
    to commit 29, by both readers, rather than called unrebuildable."""
    log = checkpointed(tmp_path, 30)
    (Path(log.url) / commit_path(30)).unlink()
    with pytest.warns(format_reader.FormatWarning, match="unusable"):
        assert_agree(log.url)
    assert replog_view(log.url)["version"] == 29


def test_low_watermarks_outside_a_truncation_are_refused_by_both_readers(
    tmp_path: Path,
) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 2, auto_compact=False)
    log.append(events(0, 6))
    version = log.refresh().version
    forge_commit(log, CommitRecord.after(version, APPEND, low_watermarks={0: 2}))
    bad = commit_path(version + 1)
    with pytest.raises(CorruptionError, match=f"{bad}.*low watermarks"):
        ReplicationLog.open(log.url).refresh()
    with pytest.raises(format_reader.CorruptionError, match=bad):
        read_log(log.url)


def test_a_dense_entry_never_names_rows_of_a_file_with_a_sequence_column() -> None:
    """Only holed entries take their sequences from the file (FORMAT.md, "Segment
    files"): a dense one naming such a file is corruption, not rows read with a stray
    column."""
    rows = events_from_records(events(0, 3))
    holed = rows.append_column(HOLED_SCHEMA.field(SEQUENCE_COLUMN), pa.array([1, 2, 3]))
    dense = SegmentInfo("shards/00000/x.arrow", 0, 1, 3, 10, "0" * 64, 0, 0)
    with pytest.raises(CorruptionError, match="dense entry"):
        entry_rows(holed, dense)
    with pytest.raises(CorruptionError, match="no sequence column"):
        entry_rows(rows, dense._replace(rows=3))
    assert entry_rows(holed, dense._replace(rows=3)).num_rows == 3


# -- schema registry and sealed records, from FORMAT.md's words -----------------------------


def schema_json(value: Any) -> str:
    """The schema registry's canonical JSON as FORMAT.md spells it (not replog's code)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        escapes = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n"}
        escapes |= {"\f": "\\f", "\r": "\\r"}
        text = "".join(
            escapes.get(ch, f"\\u{ord(ch):04x}" if ord(ch) < 0x20 else ch) for ch in value
        )
        return f'"{text}"'
    if isinstance(value, list):
        return "[" + ",".join(schema_json(v) for v in value) + "]"
    return "{" + ",".join(f"{schema_json(k)}:{schema_json(value[k])}" for k in sorted(value)) + "}"


def folder(collection: str) -> str:
    """A collection's folder as FORMAT.md spells it."""
    safe = string.ascii_letters + string.digits + ".-_~"
    encoded = "".join(chr(b) if chr(b) in safe else f"%{b:02X}" for b in collection.encode("utf-8"))
    return encoded.replace(".", "%2E") if encoded in (".", "..") else encoded


@pytest.mark.parametrize("collection", ["a/b ö~", "inventory.customers", "..", "日本"])
def test_a_schema_is_stored_where_format_md_says(tmp_path: Path, collection: str) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    text = (
        '{"type":"struct","name":"Ünïcode \\u00e9\\n\\u0001\\u007f\\"","optional":false,'
        '"default":1.5,"tiny":0.00001,"big":1E16,"int":12345678901234567890,"neg":-0,'
        '"fields":[{"field":"b","type":"int32"},{"field":"a","type":"string"}]}'
    )
    schema = json.loads(text)
    digest = hashlib.sha256(schema_json(schema).encode("utf-8")).hexdigest()
    assert registry.register(log.storage, collection, schema) == digest
    path = f"_replog/schemas/{folder(collection)}/{digest}.json"
    assert registry.schema_path(collection, digest) == path
    assert log.storage.exists(path)
    [version] = registry.versions(log.storage, collection)
    assert (version.collection, version.digest) == (collection, digest)


def test_a_schema_file_whose_collection_is_not_its_folder_is_refused(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    digest = registry.register(log.storage, "orders", {"type": "struct", "fields": []})
    path = registry.schema_path("orders", digest)
    document = json.loads(log.storage.read(path))
    log.storage.write(path, json.dumps({**document, "collection": "customers"}).encode())
    with pytest.raises(CorruptionError, match="collection"):
        registry.versions(log.storage, "orders")


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1.5", "1e3"])
def test_a_sealed_record_holding_a_non_integer_is_corruption(number: str) -> None:
    with pytest.raises(CorruptionError, match="integers only"):
        unseal(f'{{"format_version": 3, "n": {number}}}'.encode(), "x.json", max_version=3)

"""Helpers for capture tests: the log's events with the commit that added each."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from replog.capture.options import CaptureOptions, capture_app_id
from replog.capture.postgres import PostgresCapture, capture
from replog.capture.progress import CaptureProgress
from replog.format.commits import APPEND, CommitRecord, commit_path
from replog.log import ReplicationLog
from support.logcheck import check_log


def run(dsn: str, url: str, **options: Any) -> CaptureProgress:
    """One capture of ``dsn`` into the log at ``url`` (created with 4 shards if absent)
    until caught up; slot ``cap`` unless ``slot=`` is given."""
    log = ReplicationLog.open_or_create(url, 4)
    return capture(CaptureOptions(dsn=dsn, slot=options.pop("slot", "cap"), **options), log)


def sql(dsn: str, *statements: str) -> None:
    """Run each statement in its own transaction (autocommit)."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def query(dsn: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        return connection.execute(statement).fetchall()


def commit_of_events(log: ReplicationLog) -> dict[tuple[int, int], int]:
    """(shard, sequence) -> the version of the append commit that added the event."""
    found: dict[tuple[int, int], int] = {}
    for version in range(1, log.refresh().version + 1):
        path = commit_path(version)
        record = CommitRecord.from_bytes(log.storage.read(path), path)
        if record.operation != APPEND:
            continue
        for segment in record.add:
            for sequence in range(segment.first_sequence, segment.last_sequence + 1):
                found[(segment.shard, sequence)] = version
    return found


def captured(log: ReplicationLog) -> list[dict[str, Any]]:
    """Every event (checked gapless, ids unique) in source order, payloads parsed, each
    with the commit version that added it."""
    rows = check_log(log)
    commits = commit_of_events(log)
    events = []
    for row in rows:
        metadata = json.loads(row["metadata"])
        source = metadata["source"]
        events.append(
            {
                "op": metadata["op"],
                "collection": row["collection"],
                "key": row["key"],
                "data": row["data"].decode(),
                "before": row["before"].decode() if row["before"] is not None else None,
                "metadata": metadata,
                "lsn": source["lsn"],
                "txid": source["txId"],
                "order": (metadata.get("transaction") or {}).get("total_order", 0),
                "commit_lsn": int(
                    (metadata.get("transaction") or {"id": "0:0"})["id"].split(":")[1]
                ),
                "version": commits[(row["shard"], row["sequence"])],
                "event_id": row["event_id"],
            }
        )
    snapshot = [e for e in events if e["op"] == "r"]
    changes = [e for e in events if e["op"] != "r"]
    # commit order, then source commit order, then change order
    changes.sort(key=lambda e: (e["version"], e["commit_lsn"], e["order"]))
    return snapshot + changes


@contextmanager
def following(
    dsn: str, url: str, slot: str, tables: tuple[str, ...]
) -> Iterator[threading.Thread]:
    """A capture of ``dsn`` into the log at ``url`` following ``tables`` in a thread while
    the block runs, from once the log holds its first commit (its errors are raised when
    the block ends); the block is given the thread (alive while the capture runs)."""
    stop = threading.Event()
    errors: list[BaseException] = []
    options = CaptureOptions(dsn=dsn, slot=slot, tables=tables, follow=True, poll_s=0.05)
    log = ReplicationLog.open_or_create(url, 2)
    with PostgresCapture(options, log, stop=stop) as running:

        def body() -> None:
            try:
                running.run()
            except BaseException as exc:  # raised when the block ends
                errors.append(exc)

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        try:
            while log.transaction_version(capture_app_id(slot)) is None:
                assert thread.is_alive(), errors
                time.sleep(0.05)
            yield thread
        finally:
            stop.set()
            thread.join(300)
    assert not errors, errors

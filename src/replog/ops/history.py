"""``replog history``: what each retained commit of a log did (Delta's ``DESCRIBE HISTORY``).

Read from the commit records alone (FORMAT.md, "Commit records"): the version, when, the
operation, who wrote it (an idempotent app's transaction, a capture's slot and LSN, a
sink's epoch) and how many events and files it added and removed. Commits older than the
log's retention are gone, so the history starts at the oldest one kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from replog.capture.mysql.options import capture_name as mysql_capture_name
from replog.capture.options import capture_slot
from replog.capture.pgoutput import lsn_to_text
from replog.core.history import read_commit
from replog.format.commits import APPEND, COMPACT, TXN_QUERY, CommitRecord
from replog.format.segments import SegmentInfo
from replog.log import ReplicationLog

logger = logging.getLogger(__name__)

KINDS = ("append", "transaction", "capture", "sink", "compact", "key-compact", "truncate", "gc")
"""What a commit was, finer than its recorded operation: a plain ``append``; an append
under an idempotent ``transaction`` (``--txn-app-id``, ``txnAppId``, a Debezium
connector's position); a ``capture``'s commit (``replog capture postgres``, its slot and
LSN); a ``sink`` epoch (``replog-sink``); a ``compact`` (``replog compact`` and the
writers' automatic merges, which the log does not tell apart); a ``key-compact``
(``compact --by-key``: its files have holes); a ``truncate`` (retention); a ``gc`` mark
(``replog recover`` began deleting garbage)."""


def _files(entries: tuple[SegmentInfo, ...]) -> int:
    return len({entry.path for entry in entries})


@dataclass(frozen=True)
class HistoryEntry:
    """One commit of the log, described."""

    record: CommitRecord

    @property
    def kind(self) -> str:
        """One of :data:`KINDS`."""
        record, writer = self.record, self.record.writer
        if record.gc is not None:
            return "gc"
        if record.operation == COMPACT:
            return "key-compact" if any(entry.holed for entry in record.add) else "compact"
        if record.operation != APPEND:
            return record.operation
        if writer is None:
            return "append"
        if writer.query_id != TXN_QUERY:
            return "sink"
        captured = capture_slot(writer.sink_id) or mysql_capture_name(writer.sink_id)
        return "capture" if captured is not None else "transaction"

    def to_json(self) -> dict[str, Any]:
        record, writer, kind = self.record, self.record.writer, self.kind
        document: dict[str, Any] = {
            "version": record.version,
            "timestamp_ms": record.timestamp_ms,
            "operation": record.operation,
            "kind": kind,
            "events_added": sum(entry.events for entry in record.add),
            "events_removed": sum(entry.events for entry in record.remove),
            "files_added": _files(record.add),
            "files_removed": _files(record.remove),
            "segments_added": len(record.add),
            "segments_removed": len(record.remove),
            "bytes_added": sum(entry.bytes for entry in {e.path: e for e in record.add}.values()),
            "low_watermarks": {str(s): low for s, low in sorted(record.low_watermarks.items())},
            "transaction": None,
            "capture": None,
            "sink": None,
            "gc_cutoff_ms": record.gc.cutoff_ms if record.gc is not None else None,
        }
        if writer is not None and kind == "transaction":
            document["transaction"] = {"app_id": writer.sink_id, "version": writer.epoch}
        elif writer is not None and kind == "capture":
            name = mysql_capture_name(writer.sink_id)
            if name is not None:
                document["capture"] = {"source": "mysql", "name": name, "version": writer.epoch}
            else:
                slot = capture_slot(writer.sink_id)
                document["capture"] = {"slot": slot, "lsn": lsn_to_text(writer.epoch)}
        elif writer is not None and kind == "sink":
            document["sink"] = {
                "sink_id": writer.sink_id,
                "query_id": writer.query_id,
                "epoch": writer.epoch,
                "run_id": writer.run_id,
                "generation": writer.generation,
                "sources": [source.to_json() for source in writer.sources],
            }
        return document


@dataclass(frozen=True)
class LogHistory:
    url: str
    version: int
    """The log's newest version when read."""
    retained_from: int
    """The oldest version whose commit may still be there (older ones expired)."""
    entries: tuple[HistoryEntry, ...]
    """Newest first."""

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "retained_from": self.retained_from,
            "commits": [entry.to_json() for entry in self.entries],
        }


def log_history(log: ReplicationLog, limit: int | None = None) -> LogHistory:
    """The log's retained commits, newest first; at most ``limit`` of them."""
    state = log.refresh()
    oldest = max(state.retained_from, 1)
    if limit is not None:
        oldest = max(oldest, state.version - limit + 1)
    versions = list(range(state.version, oldest - 1, -1))
    records = log.storage.map(lambda v: read_commit(log.storage, v), versions, threads=8)
    entries = []
    for index, record in enumerate(records):
        if record is not None:
            entries.append(HistoryEntry(record))
        elif any(older is not None for older in records[index + 1 :]):
            logger.warning(  # damage, not retention (it deletes the oldest first)
                "%s: commit %d is missing, though older ones exist: left out of the history "
                "('replog verify' names the damage)",
                log.url,
                versions[index],
            )
        else:  # expired (retention runs oldest first): nothing older is left
            break
    return LogHistory(log.url, state.version, state.retained_from, tuple(entries))

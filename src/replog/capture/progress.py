"""How far a capture went: what ``replog capture`` reports (no database driver needed).

The capture fills a :class:`CaptureProgress` and hands it to its ``progress=`` callback
after each step (a snapshot chunk, a log commit, a poll of the slot). The CLI's live
display, its plain progress lines, its ``--json`` summary and the Prometheus metrics of
``--metrics-port`` are all read from these fields alone, so a field the capture does not
fill reads as its default (0, False or None) everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replog.capture.pgoutput import lsn_to_text


@dataclass
class CaptureProgress:
    """Counts since this capture started, and how far behind the server it is."""

    rows: int = 0
    """Changes captured from the slot into the log (the snapshot's rows are
    :attr:`snapshot_rows`): Debezium's TotalNumberOfEventsSeen."""
    snapshot_rows: int = 0
    """Rows the snapshot has committed to the log so far."""
    transactions: int = 0
    """Source transactions captured from the slot (not counting the snapshot)."""
    commits: int = 0
    """Log commits this capture made."""
    skipped_transactions: int = 0
    """Transactions the log already held (a restart after a kill)."""
    truncations: int = 0
    """``TRUNCATE`` of a captured table (or of partitions of one) captured as events."""
    skipped_truncations: int = 0
    """``TRUNCATE`` of a captured table not captured (``--skip-truncate``)."""
    heartbeats: int = 0
    """Heartbeats this capture wrote while its tables were idle and the server wrote WAL."""
    retained_wal_bytes: int | None = None
    """WAL the server keeps for the slot (from its ``restart_lsn``), when last looked."""
    slot_wal_status: str | None = None
    """The slot's ``wal_status`` when last looked (``reserved``, ``extended``,
    ``unreserved``, ``lost``)."""
    skipped_changes: int = 0
    """Changes of tables a user's publication publishes and ``--tables`` leaves out."""
    position: int = 0
    """The slot position the log holds (end LSN of the last captured transaction, as a
    number; shown and written as PostgreSQL's text, ``0/16B3748``)."""
    lag_bytes: int = 0
    """WAL written by the server past :attr:`position` when last looked."""
    last_commit_ms: int | None = None
    """Source commit time of the last captured transaction."""
    lag_ms: int | None = None
    """How far the capture is behind the source in time: when the last transaction was
    captured, the time since its source commit (Debezium's MilliSecondsBehindSource).
    None until a transaction was captured."""
    snapshot_running: bool = False
    """The initial snapshot is being read (Debezium's SnapshotRunning)."""
    snapshot_completed: bool = False
    """This capture's snapshot is committed whole (Debezium's SnapshotCompleted); False
    also when it took none (``--snapshot never``, or resuming a log that has one)."""
    snapshot_table: str | None = None
    """``schema.table`` the snapshot is reading now (None when not snapshotting)."""
    snapshot_tables_left: int = 0
    """Tables whose snapshot is owed, the one being read included."""
    snapshot_rows_total: int | None = None
    """The snapshot's size estimate: the captured tables' rows as the server's
    statistics give them (``pg_class.reltuples``; None if unknown). Rows read can pass
    it: it is an estimate."""
    errors: int = 0
    """Errors the capture met: one that stops it counts before it ends (the metrics
    endpoint shows it to a last scrape); retried ones count too when it retries."""
    slot_dropped: bool = False
    """``--drop-slot``: the slot was dropped when capture ended."""
    publication_dropped: str | None = None
    """``--drop-slot``: the name of the publication this capture had created and dropped
    with the slot (None: none dropped; a ``--publication`` given is never dropped)."""
    table_events: dict[str, dict[str, int]] = field(default_factory=dict)
    """Events written to the log per collection (``schema.table``) and operation
    (``insert``, ``update``, ``delete``, ``truncate``; ``read``: snapshot rows)."""

    def count(self, events: Mapping[tuple[str, str], int]) -> None:
        """Add a commit's events, by (collection, operation), to :attr:`table_events`."""
        for (collection, operation), number in events.items():
            table = self.table_events.setdefault(collection, {})
            table[operation] = table.get(operation, 0) + number

    @property
    def snapshot_fraction(self) -> float | None:
        """The share of the snapshot read, from the estimate (at most 1); None if unknown."""
        if not self.snapshot_rows_total:
            return None
        return min(self.snapshot_rows / self.snapshot_rows_total, 1.0)

    def to_json(self) -> dict[str, Any]:
        """The counts as ``replog capture --json`` writes them (schema ``capture``):
        LSNs as PostgreSQL's text (``0/16B3748``)."""
        return {
            "rows": self.rows,
            "snapshot_rows": self.snapshot_rows,
            "snapshot_rows_total": self.snapshot_rows_total,
            "snapshot_running": self.snapshot_running,
            "snapshot_completed": self.snapshot_completed,
            "transactions": self.transactions,
            "commits": self.commits,
            "skipped_transactions": self.skipped_transactions,
            "truncations": self.truncations,
            "skipped_truncations": self.skipped_truncations,
            "heartbeats": self.heartbeats,
            "retained_wal_bytes": self.retained_wal_bytes,
            "slot_wal_status": self.slot_wal_status,
            "skipped_changes": self.skipped_changes,
            "snapshot_table": self.snapshot_table,
            "snapshot_tables_left": self.snapshot_tables_left,
            "lsn": lsn_to_text(self.position),
            "lag_bytes": self.lag_bytes,
            "lag_ms": self.lag_ms,
            "last_commit_ms": self.last_commit_ms,
            "errors": self.errors,
            "slot_dropped": self.slot_dropped,
            "publication_dropped": self.publication_dropped,
            "tables": {table: dict(ops) for table, ops in sorted(self.table_events.items())},
        }

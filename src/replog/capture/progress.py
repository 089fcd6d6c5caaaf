"""How far a capture went: what ``replog capture`` reports (no database driver needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replog.capture.pgoutput import lsn_to_text


@dataclass
class CaptureProgress:
    """Counts since this capture started, and how far behind the server it is."""

    rows: int = 0
    snapshot_rows: int = 0
    transactions: int = 0
    commits: int = 0
    skipped_transactions: int = 0
    """Transactions the log already held (a restart after a kill)."""
    skipped_truncations: int = 0
    """``TRUNCATE`` of a captured table: not captured (the log has no such event)."""
    skipped_changes: int = 0
    """Changes of tables a user's publication publishes and ``--tables`` leaves out."""
    snapshot_table: str | None = None
    """The table whose snapshot is being read (None: none owed)."""
    snapshot_tables_left: int = 0
    """Tables whose snapshot is owed, the one being read included."""
    position: int = 0
    """The slot position the log holds (end LSN of the last captured transaction)."""
    lag_bytes: int = 0
    """WAL written by the server past :attr:`position` when last looked."""
    last_commit_ms: int | None = None
    """Source commit time of the last captured transaction."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "snapshot_rows": self.snapshot_rows,
            "transactions": self.transactions,
            "commits": self.commits,
            "skipped_transactions": self.skipped_transactions,
            "skipped_truncations": self.skipped_truncations,
            "skipped_changes": self.skipped_changes,
            "snapshot_table": self.snapshot_table,
            "snapshot_tables_left": self.snapshot_tables_left,
            "position": lsn_to_text(self.position),
            "lag_bytes": self.lag_bytes,
            "last_commit_ms": self.last_commit_ms,
        }

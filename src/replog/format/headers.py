"""Snapshot headers: the state of a log at a checkpoint version, sealed (FORMAT.md,
"Finding the head").

A header holds what finding the head and committing need (heads, low watermarks, sink
marks, gc marks) and names the segment table or the changes file that hold the live
segments at its version.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replog.errors import CorruptionError
from replog.format.commits import FORMAT_VERSION
from replog.format.sealed import seal, unseal


@dataclass(frozen=True)
class ChangesEntry:
    """Names a header's changes file: the segments changed by the commits after version
    ``since`` (the previous checkpoint; in format 2 the table below itself), on top of
    table ``table_version`` (whose digest is ``table_sha256``; None for version 0, the
    empty log)."""

    table_version: int
    table_sha256: str | None
    sha256: str
    since: int

    def to_json(self) -> dict[str, Any]:
        return {
            "table_version": self.table_version,
            "table_sha256": self.table_sha256,
            "sha256": self.sha256,
            "since_version": self.since,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ChangesEntry:
        table_sha256 = data["table_sha256"]
        table_version = int(data["table_version"])
        return cls(
            table_version=table_version,
            table_sha256=None if table_sha256 is None else str(table_sha256),
            sha256=str(data["sha256"]),
            # Format 2 changes files hold everything since the table.
            since=int(data.get("since_version", table_version)),
        )


@dataclass(frozen=True)
class SnapshotHeader:
    """``_replog/snapshots/<version>.json``.

    ``gc_marks`` are ``(version, cut-off)`` of the newest gc marks, complete after
    ``gc_known_since`` (a header of replog 0.2 knows none: ``gc_known_since`` is then its
    own version). ``table_sha256`` is set at table versions, ``changes`` between them
    (absent in headers written before changes files). ``retained_from``: commits and
    snapshots below this version may have been deleted by retention. ``log_id`` is empty
    in headers of formats 1 and 2.
    """

    version: int
    timestamp_ms: int
    shards: int
    heads: tuple[int, ...]
    lows: tuple[int, ...]
    sinks: Mapping[str, Mapping[str, Any]]
    total_bytes: int
    segment_count: int
    gc_marks: tuple[tuple[int, int], ...] = ()
    gc_known_since: int = 0
    table_sha256: str | None = None
    changes: ChangesEntry | None = None
    log_id: str = ""
    retained_from: int = 0
    token: str | None = None
    """The token of commit :attr:`version` (absent before replog 0.4)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Members this replog does not know (kept, ignored)."""

    def to_bytes(self) -> bytes:
        document: dict[str, Any] = {
            **self.extra,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "log_id": self.log_id,
            "timestamp_ms": self.timestamp_ms,
            "shards": self.shards,
            "heads": {str(s): head for s, head in enumerate(self.heads)},
            "lows": {str(s): low for s, low in enumerate(self.lows)},
            "sinks": {name: dict(mark) for name, mark in sorted(self.sinks.items())},
            "bytes": self.total_bytes,
            "segment_count": self.segment_count,
            "gc_marks": [[version, cutoff] for version, cutoff in self.gc_marks],
            "gc_known_since": self.gc_known_since,
            "retained_from": self.retained_from,
        }
        if self.token is not None:
            document["token"] = self.token
        if self.table_sha256 is not None:
            document["table_sha256"] = self.table_sha256
        if self.changes is not None:
            document["changes"] = self.changes.to_json()
        return seal(document)

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> SnapshotHeader:
        """Parse and check a sealed header (corruption names ``path``)."""
        body = unseal(data, path, max_version=FORMAT_VERSION)
        return cls.from_json(body, path)

    @classmethod
    def from_json(cls, body: Mapping[str, Any], path: str) -> SnapshotHeader:
        known = {
            "format_version", "version", "log_id", "timestamp_ms", "shards", "heads", "lows",
            "sinks", "bytes", "segment_count", "gc_marks", "gc_known_since", "table_sha256",
            "segments_sha256", "changes", "retained_from", "token",
        }  # fmt: skip
        try:
            version = int(body["version"])
            shards = int(body["shards"])
            marks_known = "gc_marks" in body
            changes = body.get("changes")
            # Format 1 named the table's digest segments_sha256.
            table_sha256 = body.get("table_sha256", body.get("segments_sha256"))
            return cls(
                version=version,
                timestamp_ms=int(body["timestamp_ms"]),
                shards=shards,
                heads=tuple(int(body["heads"][str(s)]) for s in range(shards)),
                lows=tuple(int(body["lows"][str(s)]) for s in range(shards)),
                sinks={str(name): dict(mark) for name, mark in body["sinks"].items()},
                total_bytes=int(body["bytes"]),
                segment_count=int(body["segment_count"]),
                # A header written before gc marks: any mark may lie below it.
                gc_marks=tuple((int(v), int(c)) for v, c in body["gc_marks"])
                if marks_known
                else (),
                gc_known_since=int(body["gc_known_since"]) if marks_known else version,
                table_sha256=None if table_sha256 is None else str(table_sha256),
                changes=ChangesEntry.from_json(changes) if isinstance(changes, dict) else None,
                log_id=str(body.get("log_id", "")),
                retained_from=int(body.get("retained_from", 0)),
                token=None if body.get("token") is None else str(body["token"]),
                extra={name: value for name, value in body.items() if name not in known},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptionError(path, f"malformed snapshot header: {exc}") from exc

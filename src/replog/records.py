"""The JSON records of the log format: descriptor, commits and snapshots (FORMAT.md).

Each record carries ``format_version`` and a ``checksum`` (SHA-256 of its canonical
JSON without the checksum field), so a torn or edited record is detected, and a
reader refuses a version it does not know instead of misreading it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from replog.errors import CorruptionError, UnsupportedFormatError
from replog.segments import SegmentInfo

FORMAT_VERSION = 1
META_DIR = "_replog"
DESCRIPTOR_PATH = f"{META_DIR}/log.json"
COMMITS_DIR = f"{META_DIR}/commits"
SNAPSHOTS_DIR = f"{META_DIR}/snapshots"
SNAPSHOT_HINT_PATH = f"{META_DIR}/_last_snapshot"
SHARDS_DIR = "shards"

APPEND, COMPACT, TRUNCATE = "append", "compact", "truncate"
COMMIT_OPERATIONS = (APPEND, COMPACT, TRUNCATE)


def commit_path(version: int) -> str:
    return f"{COMMITS_DIR}/{version:020d}.json"


def snapshot_path(version: int) -> str:
    return f"{SNAPSHOTS_DIR}/{version:020d}.json"


def snapshot_segments_path(version: int) -> str:
    return f"{SNAPSHOTS_DIR}/{version:020d}.segments.arrow"


def canonical_json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode("utf-8")


def seal(document: dict[str, Any]) -> bytes:
    """``document`` with its checksum added, as pretty, person-readable JSON bytes."""
    body = {name: value for name, value in document.items() if name != "checksum"}
    sealed = {**body, "checksum": hashlib.sha256(canonical_json(body)).hexdigest()}
    return (json.dumps(sealed, indent=1, sort_keys=True) + "\n").encode("utf-8")


def unseal(
    data: bytes,
    path: str,
    *,
    version_field: str = "format_version",
    max_version: int = FORMAT_VERSION,
) -> dict[str, Any]:
    """Parse a sealed record, checking its checksum and that its version is one we read."""
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise CorruptionError(path, f"not valid JSON ({len(data)} bytes): {exc}") from exc
    if not isinstance(document, dict):
        raise CorruptionError(path, "expected a JSON object")
    version = document.get(version_field)
    if isinstance(version, int) and version > max_version:
        raise UnsupportedFormatError(
            f"{path}: written with {version_field} {version}; this replog reads up to "
            f"{max_version} - upgrade pyspark-replog"
        )
    recorded = document.get("checksum")
    body = {name: value for name, value in document.items() if name != "checksum"}
    actual = hashlib.sha256(canonical_json(body)).hexdigest()
    if recorded != actual:
        raise CorruptionError(path, f"checksum mismatch: recorded {recorded}, computed {actual}")
    return body


@dataclass(frozen=True)
class LogDescriptor:
    """``_replog/log.json``: the immutable facts of a log."""

    shards: int
    log_id: str
    created_ms: int
    snapshot_interval: int = 100
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return seal(
            {
                "format_version": self.format_version,
                "shards": self.shards,
                "log_id": self.log_id,
                "created_ms": self.created_ms,
                "snapshot_interval": self.snapshot_interval,
                "routing": "fnv1a64-utf8-mod-shards",
                "segment_format": "arrow-ipc-file",
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> LogDescriptor:
        body = unseal(data, path)
        try:
            return cls(
                shards=int(body["shards"]),
                log_id=str(body["log_id"]),
                created_ms=int(body["created_ms"]),
                snapshot_interval=int(body.get("snapshot_interval", 100)),
                format_version=int(body["format_version"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(path, f"malformed log descriptor: {exc}") from exc


@dataclass(frozen=True)
class WriterInfo:
    """Who made a commit: a sink id with the Spark query id and epoch (micro-batch id)."""

    sink_id: str
    query_id: str
    epoch: int

    def to_json(self) -> dict[str, Any]:
        return {"sink_id": self.sink_id, "query_id": self.query_id, "epoch": self.epoch}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WriterInfo:
        return cls(str(data["sink_id"]), str(data["query_id"]), int(data["epoch"]))


@dataclass(frozen=True)
class CommitRecord:
    """``_replog/commits/<version>.json``: one atomic change to the log."""

    version: int
    timestamp_ms: int
    operation: str
    add: tuple[SegmentInfo, ...] = ()
    remove: tuple[SegmentInfo, ...] = ()
    low_watermarks: dict[int, int] = field(default_factory=dict)
    writer: WriterInfo | None = None

    def to_bytes(self) -> bytes:
        return seal(
            {
                "format_version": FORMAT_VERSION,
                "version": self.version,
                "timestamp_ms": self.timestamp_ms,
                "operation": self.operation,
                "add": [segment.to_json() for segment in self.add],
                "remove": [segment.to_json() for segment in self.remove],
                "low_watermarks": {str(s): seq for s, seq in self.low_watermarks.items()},
                "writer": self.writer.to_json() if self.writer else None,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> CommitRecord:
        body = unseal(data, path)
        try:
            record = cls(
                version=int(body["version"]),
                timestamp_ms=int(body["timestamp_ms"]),
                operation=str(body["operation"]),
                add=tuple(SegmentInfo.from_json(item) for item in body.get("add", [])),
                remove=tuple(SegmentInfo.from_json(item) for item in body.get("remove", [])),
                low_watermarks={
                    int(s): int(seq) for s, seq in body.get("low_watermarks", {}).items()
                },
                writer=WriterInfo.from_json(body["writer"]) if body.get("writer") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(path, f"malformed commit record: {exc}") from exc
        if record.operation not in COMMIT_OPERATIONS:
            raise CorruptionError(path, f"unknown commit operation {record.operation!r}")
        return record

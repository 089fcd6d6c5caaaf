"""Checkpoint manifests: the durable state of one consumer or one sink of a log.

Modelled on laminardb's checkpoint manifest: source offsets per source, last committed
epoch and commit status per sink, topology and integrity fields. JSON, readable by a
person; FORMAT.md ("Checkpoint manifests") specifies every field. Fields missing in an
older manifest take defaults; fields this version does not know (from a newer writer) are
kept in :attr:`CheckpointManifest.extra` and written back.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from replog.errors import CorruptionError
from replog.timeutil import now_ms

MANIFEST_VERSION = 1

PENDING, COMMITTED, FAILED = "Pending", "Committed", "Failed"


@dataclass(frozen=True)
class SinkCommitStatus:
    """Pending, Committed, or Failed with a reason; JSON ``"Pending"`` / ``{"Failed": "..."}``."""

    state: str
    reason: str | None = None

    @classmethod
    def pending(cls) -> SinkCommitStatus:
        return cls(PENDING)

    @classmethod
    def committed(cls) -> SinkCommitStatus:
        return cls(COMMITTED)

    @classmethod
    def failed(cls, reason: str) -> SinkCommitStatus:
        return cls(FAILED, reason)

    @property
    def is_pending(self) -> bool:
        return self.state == PENDING

    @property
    def is_committed(self) -> bool:
        return self.state == COMMITTED

    @property
    def is_failed(self) -> bool:
        return self.state == FAILED

    def to_json(self) -> Any:
        return {FAILED: self.reason or ""} if self.is_failed else self.state

    @classmethod
    def from_json(cls, value: Any, path: str = "<manifest>") -> SinkCommitStatus:
        if value in (PENDING, COMMITTED):
            return cls(value)
        if isinstance(value, dict) and set(value) == {FAILED}:
            return cls.failed(str(value[FAILED]))
        raise CorruptionError(path, f"unknown sink commit status {value!r}")

    def __str__(self) -> str:
        return f"Failed({self.reason})" if self.is_failed else self.state


@dataclass
class ConnectorCheckpoint:
    """One source's position: an offsets map (JSON primitives), its epoch, and metadata."""

    offsets: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    metadata: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"offsets": self.offsets, "epoch": self.epoch, "metadata": self.metadata}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConnectorCheckpoint:
        return cls(
            offsets=dict(data.get("offsets", {})),
            epoch=int(data.get("epoch", 0)),
            metadata={str(k): str(v) for k, v in data.get("metadata", {}).items()},
        )


@dataclass
class CheckpointManifest:
    """A point-in-time record of a consumer's offsets and/or a sink's commit state."""

    checkpoint_id: int = 0
    epoch: int = 0
    timestamp_ms: int = 0
    version: int = MANIFEST_VERSION
    source_offsets: dict[str, ConnectorCheckpoint] = field(default_factory=dict)
    sink_epochs: dict[str, int] = field(default_factory=dict)
    sink_commit_statuses: dict[str, SinkCommitStatus] = field(default_factory=dict)
    sink_query_ids: dict[str, str] = field(default_factory=dict)
    """replog's addition: the Spark query id each sink's epochs belong to."""
    source_names: list[str] = field(default_factory=list)
    sink_names: list[str] = field(default_factory=list)
    pending_segments: dict[str, list[str]] = field(default_factory=dict)
    """While a sink's epoch is Pending: the staged files it commits (``recover`` keeps
    them until the epoch is resolved)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this replog does not know (a newer replog's, or replog 0.3's unused
    ``pipeline_hash``, ``watermark`` and ``state_checksum``), kept verbatim."""

    _KNOWN = (
        "version",
        "checkpoint_id",
        "epoch",
        "timestamp_ms",
        "source_offsets",
        "sink_epochs",
        "sink_commit_statuses",
        "sink_query_ids",
        "source_names",
        "sink_names",
        "pending_segments",
        "checksum",
    )

    def successor(self, checkpoint_id: int) -> CheckpointManifest:
        """A copy to be changed and saved as ``checkpoint_id``, with a fresh timestamp
        (:meth:`~replog.checkpoints.store.ManifestStore.next_manifest` picks the id)."""
        successor = copy.deepcopy(self)
        successor.checkpoint_id = checkpoint_id
        successor.timestamp_ms = now_ms()
        return successor

    def to_json(self) -> dict[str, Any]:
        document = dict(self.extra)
        document.update(
            {
                "version": self.version,
                "checkpoint_id": self.checkpoint_id,
                "epoch": self.epoch,
                "timestamp_ms": self.timestamp_ms,
                "source_offsets": {k: v.to_json() for k, v in sorted(self.source_offsets.items())},
                "sink_epochs": dict(sorted(self.sink_epochs.items())),
                "sink_commit_statuses": {
                    k: v.to_json() for k, v in sorted(self.sink_commit_statuses.items())
                },
                "sink_query_ids": dict(sorted(self.sink_query_ids.items())),
                "source_names": sorted(self.source_names),
                "sink_names": sorted(self.sink_names),
            }
        )
        if self.pending_segments:
            document["pending_segments"] = {
                sink: list(paths) for sink, paths in sorted(self.pending_segments.items())
            }
        return document

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str = "<manifest>") -> CheckpointManifest:
        try:
            return cls(
                version=int(data.get("version", MANIFEST_VERSION)),
                checkpoint_id=int(data.get("checkpoint_id", 0)),
                epoch=int(data.get("epoch", 0)),
                timestamp_ms=int(data.get("timestamp_ms", 0)),
                source_offsets={
                    str(k): ConnectorCheckpoint.from_json(v)
                    for k, v in data.get("source_offsets", {}).items()
                },
                sink_epochs={str(k): int(v) for k, v in data.get("sink_epochs", {}).items()},
                sink_commit_statuses={
                    str(k): SinkCommitStatus.from_json(v, path)
                    for k, v in data.get("sink_commit_statuses", {}).items()
                },
                sink_query_ids={str(k): str(v) for k, v in data.get("sink_query_ids", {}).items()},
                source_names=[str(n) for n in data.get("source_names", [])],
                sink_names=[str(n) for n in data.get("sink_names", [])],
                pending_segments={
                    str(sink): [str(path) for path in paths]
                    for sink, paths in data.get("pending_segments", {}).items()
                },
                extra={k: v for k, v in data.items() if k not in cls._KNOWN},
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise CorruptionError(path, f"malformed manifest: {exc}") from exc

    def validate(self) -> list[str]:
        """Every consistency problem of this manifest (empty when it is sound)."""
        return [
            *self._header_problems(),
            *self._sink_problems(),
            *self._name_problems(),
            *self._offset_problems(),
        ]

    def _header_problems(self) -> list[str]:
        problems = []
        if self.version == 0:
            problems.append("manifest version is 0")
        elif self.version > MANIFEST_VERSION:
            problems.append(f"manifest version {self.version} is newer than {MANIFEST_VERSION}")
        if self.checkpoint_id <= 0:
            problems.append(f"checkpoint_id is {self.checkpoint_id} (must be >= 1)")
        if self.epoch < 0:
            problems.append(f"epoch is negative ({self.epoch})")
        if self.timestamp_ms <= 0:
            problems.append("timestamp_ms is 0 (missing creation time)")
        return problems

    def _sink_problems(self) -> list[str]:
        problems = []
        for sink, epoch in sorted(self.sink_epochs.items()):
            if sink not in self.sink_commit_statuses:
                problems.append(f"sink {sink!r} has epoch {epoch} but no commit status")
            if epoch < 0:
                problems.append(f"sink {sink!r} has negative epoch {epoch}")
            if sink not in self.sink_query_ids:
                problems.append(f"sink {sink!r} has epoch {epoch} but no query id")
        for sink, status in sorted(self.sink_commit_statuses.items()):
            if status.is_committed and sink not in self.sink_epochs:
                problems.append(f"sink {sink!r} is Committed but has no committed epoch")
            if status.is_failed and not status.reason:
                problems.append(f"sink {sink!r} is Failed without a reason")
        return problems

    def _name_problems(self) -> list[str]:
        problems = []
        if self.source_names:
            problems += [
                f"source_offsets contains {name!r} not in source_names"
                for name in sorted(self.source_offsets)
                if name not in self.source_names
            ]
        if self.sink_names:
            problems += [
                f"sink {name!r} is not in sink_names"
                for name in sorted(set(self.sink_epochs) | set(self.sink_commit_statuses))
                if name not in self.sink_names
            ]
        return problems

    def _offset_problems(self) -> list[str]:
        return [
            f"source {name!r}: offset of shard {key} is {value!r} (must be a non-negative integer)"
            for name, checkpoint in sorted(self.source_offsets.items())
            for key, value in sorted(checkpoint.offsets.items())
            if key.isdigit() and (not isinstance(value, int) or value < 0)
        ]

"""The log's JSON records: the descriptor and the commit records (FORMAT.md).

Both are sealed (:mod:`replog.format.sealed`): a torn or edited record is detected, and a
reader refuses a format version it does not know instead of misreading it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replog.errors import CorruptionError, InvalidOptionError
from replog.format.gc import CLOCK_SKEW_MS, GcMark
from replog.format.limits import MAX_SHARDS
from replog.format.sealed import seal, unseal
from replog.format.segments import DENSE, SegmentInfo
from replog.names import check_name
from replog.timeutil import now_ms

FORMAT_VERSION = 3
"""Written by this replog. Version 3 added shared files (segment entries with an
``offset``), the log id in commits and headers, and metadata retention; version 2 added
``before``, commit tokens, fencing and source positions. Logs of versions 1 and 2 stay
readable and writable (FORMAT.md, "Changes")."""

META_DIR = "_replog"
DESCRIPTOR_PATH = f"{META_DIR}/log.json"
COMMITS_DIR = f"{META_DIR}/commits"

APPEND, COMPACT, TRUNCATE = "append", "compact", "truncate"
COMMIT_OPERATIONS = (APPEND, COMPACT, TRUNCATE)

DEFAULT_SHARDS = 8
DEFAULT_SNAPSHOT_INTERVAL = 100
DEFAULT_CHECKPOINT_INTERVAL = 10
DEFAULT_RETENTION_MS = 2 * 3_600_000
"""How long commits, snapshots and files that left the log are kept (at least ``replog
recover``'s default grace plus the clock skew it allows)."""


def commit_path(version: int) -> str:
    return f"{COMMITS_DIR}/{version:020d}.json"


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


@dataclass(frozen=True)
class LogDescriptor:
    """``_replog/log.json``: the immutable facts of a log."""

    shards: int
    log_id: str
    created_ms: int
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL
    format_version: int = FORMAT_VERSION
    retention_ms: int = DEFAULT_RETENTION_MS
    """Commits, snapshots and files that left the log are deleted this long after."""
    auto_compact: bool = True
    """Writers merge small files after their commits (format 3; older logs: on too)."""

    @property
    def surely_kept_ms(self) -> int:
        """How long a commit is surely kept, whatever clock expiry judges it by: the
        retention less the clock skew writers may have."""
        return self.retention_ms - CLOCK_SKEW_MS

    def to_bytes(self) -> bytes:
        document: dict[str, Any] = {
            "format_version": self.format_version,
            "shards": self.shards,
            "log_id": self.log_id,
            "created_ms": self.created_ms,
            "snapshot_interval": self.snapshot_interval,
            "checkpoint_interval": self.checkpoint_interval,
            "routing": "fnv1a64-utf8-mod-shards",
            "segment_format": "arrow-ipc-file",
        }
        if self.format_version >= 3:
            document["retention_ms"] = self.retention_ms
            document["auto_compact"] = self.auto_compact
        return seal(document)

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> LogDescriptor:
        body = unseal(data, path, max_version=FORMAT_VERSION)
        try:
            snapshot_interval = _int(body.get("snapshot_interval", 100), "snapshot_interval")
            descriptor = cls(
                shards=_int(body["shards"], "shards"),
                log_id=_str(body["log_id"], "log_id"),
                created_ms=_int(body["created_ms"], "created_ms"),
                snapshot_interval=snapshot_interval,
                # Format 1 logs have no header-only checkpoints.
                checkpoint_interval=_int(
                    body.get("checkpoint_interval", snapshot_interval), "checkpoint_interval"
                ),
                format_version=_int(body["format_version"], "format_version"),
                retention_ms=_int(body.get("retention_ms", DEFAULT_RETENTION_MS), "retention_ms"),
                auto_compact=_bool(body.get("auto_compact", True), "auto_compact"),
            )
        except (KeyError, ValueError) as exc:
            raise CorruptionError(path, f"malformed log descriptor: {exc}") from exc
        if descriptor.retention_ms < 1:  # logs of replog 0.5 and earlier may hold 1 s
            raise CorruptionError(path, f"retention_ms {descriptor.retention_ms} is not positive")
        if not 1 <= descriptor.shards <= MAX_SHARDS or descriptor.snapshot_interval < 1:
            raise CorruptionError(path, "shards or snapshot_interval out of range")
        if descriptor.snapshot_interval % descriptor.checkpoint_interval:
            raise CorruptionError(
                path, "snapshot_interval is not a multiple of checkpoint_interval"
            )
        return descriptor


@dataclass(frozen=True)
class SourcePosition:
    """How far a sink's commit has read one source: the consumer of log ``log_id`` at
    ``offsets`` (last processed sequence per shard) when this commit's data was read."""

    log_id: str
    consumer: str
    offsets: Mapping[int, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "log_id": self.log_id,
            "consumer": self.consumer,
            "offsets": {str(shard): seq for shard, seq in sorted(self.offsets.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SourcePosition:
        return cls(
            _str(data["log_id"], "log_id"),
            _str(data["consumer"], "consumer"),
            {int(shard): _int(seq, "offset") for shard, seq in data["offsets"].items()},
        )


TXN_QUERY = "txn"
"""The query id of idempotent appends: their epochs are the transaction versions."""


@dataclass(frozen=True)
class Transaction:
    """Delta's idempotent-write contract: ``version`` of ``app_id`` is appended once.

    Recorded like a sink's epoch (sink id ``app_id``, query id :data:`TXN_QUERY`), so a
    re-run of an append whose outcome was unknown is recognised and skipped.
    """

    app_id: str
    version: int
    follows: int | None = None
    """If set, the version of ``app_id`` the log must hold when this one commits (0: none):
    a writer that is the only one of its app says so, and another writer of the app that
    committed meanwhile makes the commit fail (:class:`~replog.errors.TransactionOrderError`)
    instead of landing on top of what that writer committed."""

    def __post_init__(self) -> None:
        """The one check of a transaction, wherever it comes from (the CLI, Spark's
        ``txnAppId``, the Python API): the app id names a sink mark and a directory
        under ``_replog/sinks/``."""
        check_name(self.app_id, "transaction app id")
        for name, value in (("version", self.version), ("follows", self.follows)):
            if value is None and name == "follows":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidOptionError(
                    f"transaction {name} must be an integer >= 0, got {value!r}"
                )

    def writer(self) -> WriterInfo:
        return WriterInfo(self.app_id, TXN_QUERY, self.version)


@dataclass(frozen=True)
class WriterInfo:
    """Who made a commit: a sink id with the Spark query id and epoch (micro-batch id).

    ``run_id`` and ``generation`` fence writers (the newest run of a sink wins);
    ``sources`` records what the commit's data covers in the logs it was read from.
    """

    sink_id: str
    query_id: str
    epoch: int
    run_id: str | None = None
    generation: int = 0
    sources: tuple[SourcePosition, ...] = ()

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "sink_id": self.sink_id,
            "query_id": self.query_id,
            "epoch": self.epoch,
        }
        if self.run_id is not None:
            document["run_id"] = self.run_id
            document["generation"] = self.generation
        if self.sources:
            document["sources"] = [source.to_json() for source in self.sources]
        return document

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WriterInfo:
        run_id = data.get("run_id")
        return cls(
            sink_id=_str(data["sink_id"], "sink_id"),
            query_id=_str(data["query_id"], "query_id"),
            epoch=_int(data["epoch"], "epoch"),
            run_id=None if run_id is None else _str(run_id, "run_id"),
            generation=_int(data.get("generation", 0), "generation"),
            sources=tuple(SourcePosition.from_json(item) for item in data.get("sources", [])),
        )


PART_FIELDS = (
    "shard",
    "first_sequence",
    "last_sequence",
    "offset",
    "bytes",
    "min_timestamp_ms",
    "max_timestamp_ms",
)
"""The members of a part, in the order a format 3 commit lists them."""


def files_to_json(entries: tuple[SegmentInfo, ...], *, ordered: bool) -> list[dict[str, Any]]:
    """Segment entries as format 3 writes them: one object per file, each entry a part
    ``[shard, first_sequence, ...]``. ``ordered``: the list order of the entries counts
    (``add``: sequences follow it), so only consecutive entries of a file share an
    object; otherwise (``remove``) every entry of a file does."""
    files: list[dict[str, Any]] = []
    by_file: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in entries:
        part = [getattr(entry, name) for name in PART_FIELDS]
        if entry.holed:
            part.append(entry.rows)  # an eighth member: the rows a holed entry holds
        identity = (entry.path, entry.sha256)
        group = by_file.get(identity)
        if group is None or (ordered and group is not files[-1]):
            group = {"path": entry.path, "sha256": entry.sha256, "parts": []}
            files.append(group)
            by_file[identity] = group
        group["parts"].append(part)
    return files


_INT = {int}


def files_from_json(items: list[Any]) -> tuple[SegmentInfo, ...]:
    """Segment entries from a commit: format 3 files with parts, or format 2 entries."""
    entries = []
    for item in items:
        if "parts" not in item:  # format 1 and 2: one flat entry per segment
            entries.append(SegmentInfo.from_json(item))
            continue
        path, sha256 = _str(item["path"], "path"), _str(item["sha256"], "sha256")
        for part in item["parts"]:
            if (
                type(part) is not list
                or len(part) not in (len(PART_FIELDS), len(PART_FIELDS) + 1)
                or {*map(type, part)} != _INT
            ):
                raise ValueError(
                    f"a part must list {', '.join(PART_FIELDS)} (and rows, if holed), got {part!r}"
                )
            shard, first, last, offset, size, low, high = part[: len(PART_FIELDS)]
            rows = part[len(PART_FIELDS)] if len(part) > len(PART_FIELDS) else DENSE
            if offset < 0 or size < 0 or rows < DENSE:
                raise ValueError(f"a part has a negative offset, size or rows: {part!r}")
            entries.append(
                SegmentInfo(path, shard, first, last, size, sha256, low, high, offset, rows)
            )
    return tuple(entries)


@dataclass(frozen=True)
class CommitRecord:
    """``_replog/commits/<version>.json``: one atomic change to the log.

    ``token`` is random and unique to the record, so a writer that cannot tell whether its
    put-if-absent landed recognises its own record when it reads the version back.
    ``log_id`` names the log it was written to (empty in records of formats 1 and 2), so
    a process that still holds a log deleted and re-created at its URL notices.
    """

    version: int
    timestamp_ms: int
    operation: str
    token: str = ""
    add: tuple[SegmentInfo, ...] = ()
    remove: tuple[SegmentInfo, ...] = ()
    low_watermarks: dict[int, int] = field(default_factory=dict)
    writer: WriterInfo | None = None
    gc: GcMark | None = None
    log_id: str = ""

    @classmethod
    def after(
        cls,
        version: int,
        operation: str,
        *,
        add: tuple[SegmentInfo, ...] = (),
        remove: tuple[SegmentInfo, ...] = (),
        low_watermarks: Mapping[int, int] | None = None,
        writer: WriterInfo | None = None,
        gc: GcMark | None = None,
    ) -> CommitRecord:
        """The record that follows ``version``: the one way replog builds a commit (the
        log stamps its id on it when it commits)."""
        return cls(
            version=version + 1,
            timestamp_ms=now_ms(),
            operation=operation,
            token=uuid.uuid4().hex,
            add=tuple(add),
            remove=tuple(remove),
            low_watermarks=dict(low_watermarks or {}),
            writer=writer,
            gc=gc,
        )

    def to_bytes(self) -> bytes:
        document: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "log_id": self.log_id,
            "timestamp_ms": self.timestamp_ms,
            "operation": self.operation,
            "token": self.token,
            "add": files_to_json(self.add, ordered=True),
            "remove": files_to_json(self.remove, ordered=False),
            "low_watermarks": {str(s): seq for s, seq in sorted(self.low_watermarks.items())},
            "writer": self.writer.to_json() if self.writer else None,
        }
        if self.gc is not None:  # absent otherwise: older readers ignore unknown members
            document["gc"] = self.gc.to_json()
        return seal(document)

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> CommitRecord:
        body = unseal(data, path, max_version=FORMAT_VERSION)
        try:
            writer = body.get("writer")
            gc = body.get("gc")
            record = cls(
                version=_int(body["version"], "version"),
                timestamp_ms=_int(body["timestamp_ms"], "timestamp_ms"),
                operation=_str(body["operation"], "operation"),
                token=_str(body.get("token", ""), "token"),
                add=files_from_json(body.get("add", [])),
                remove=files_from_json(body.get("remove", [])),
                low_watermarks={
                    int(s): _int(seq, "low watermark")
                    for s, seq in body.get("low_watermarks", {}).items()
                },
                writer=WriterInfo.from_json(writer) if writer is not None else None,
                gc=GcMark.from_json(gc) if gc is not None else None,
                log_id=_str(body.get("log_id", ""), "log_id"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptionError(path, f"malformed commit record: {exc}") from exc
        if record.operation not in COMMIT_OPERATIONS:
            raise CorruptionError(path, f"unknown commit operation {record.operation!r}")
        if record.operation == APPEND and record.remove:
            raise CorruptionError(path, "an append commit removes segments")
        if record.operation == TRUNCATE and record.add:
            raise CorruptionError(path, "a truncate commit adds segments")
        if record.operation != TRUNCATE and record.low_watermarks:
            raise CorruptionError(path, f"a {record.operation!r} commit sets low watermarks")
        if record.gc is not None and (record.operation != APPEND or record.add):
            raise CorruptionError(path, "a gc mark must be an append of no segments")
        return record

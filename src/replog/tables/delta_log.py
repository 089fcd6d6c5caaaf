"""A Delta table's log as replog writes it: the files (with their deletion vectors), and
commits made with put-if-absent.

delta-rs (``deltalake`` 1.6) reads tables with deletion vectors but neither writes them
nor shows an ``add`` action's ``deletionVector`` descriptor, which a writer must name
again when it replaces a file's DV (PROTOCOL.md, "Add File and Remove File": the
``remove`` of the old ``(path, dvId)`` beside the ``add`` of the new). So this module
replays the log's file actions itself: the newest checkpoint (classic, single or multi-
part Parquet, as delta-rs and Spark write them), then the JSON commits after it, keeping
per path its newest ``add`` (PROTOCOL.md, "Action Reconciliation"); a state is advanced
by the commits after it, so a long-running writer reads each commit once.

A commit is the file ``_delta_log/<version:020>.json`` created only if absent (the
storage's atomic create, as delta-rs's own commits on local disk), so of two writers of
one version exactly one wins and the other sees :class:`CommitConflictError`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replog.errors import CommitConflictError, UnsupportedFormatError
from replog.storage import Storage
from replog.tables.deletion_vectors import Descriptor

logger = logging.getLogger(__name__)

LOG = "_delta_log"
DELETION_VECTORS = "deletionVectors"
ENABLE_DELETION_VECTORS = "delta.enableDeletionVectors"

WRITER_FEATURES = frozenset(
    {DELETION_VECTORS, "timestampNtz", "appendOnly", "invariants", "variantType"}
)
"""The writer features a table may list for replog to write it: deletion vectors (what it
writes), timestamps without time zone (files hold them as they are), and those delta-rs
lists on the tables it upgrades, which replog respects by refusing tables where they are
active (:func:`LogState.writable`)."""


def commit_name(version: int) -> str:
    return f"{LOG}/{version:020d}.json"


@dataclass
class LogState:
    """A table's state at ``version``: its live files (path -> ``add`` action), the
    application transactions, the protocol and the metadata."""

    version: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    txns: dict[str, int] = field(default_factory=dict)
    protocol: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    """Paths whose rows a change removed (a ``remove`` with ``dataChange``, no ``add``)."""

    def copy(self) -> LogState:
        return LogState(
            self.version, dict(self.files), dict(self.txns), self.protocol, self.metadata,
            set(self.removed),
        )  # fmt: skip

    def apply(self, actions: Iterable[Mapping[str, Any]]) -> None:
        """One commit's actions, in the protocol's reconciliation: the last of each wins."""
        for action in actions:
            if "add" in action:
                add = dict(action["add"])
                self.files[str(add["path"])] = add
                self.removed.discard(str(add["path"]))
            elif "remove" in action:
                removed = action["remove"]
                path = str(removed["path"])
                current = self.files.get(path)
                if current is not None and _dv_id(current) == _dv_id(removed):
                    del self.files[path]
                    if removed.get("dataChange", True):
                        self.removed.add(path)
            elif "txn" in action:
                self.txns[str(action["txn"]["appId"])] = int(action["txn"]["version"])
            elif "protocol" in action:
                self.protocol = dict(action["protocol"])
            elif "metaData" in action:
                self.metadata = dict(action["metaData"])

    @property
    def configuration(self) -> dict[str, str]:
        return dict(self.metadata.get("configuration") or {})

    @property
    def deletion_vectors(self) -> bool:
        """Whether replog may write DVs here: the protocol supports them and the table's
        ``delta.enableDeletionVectors`` is true (PROTOCOL.md: writers write new DVs only
        then)."""
        supported = DELETION_VECTORS in (self.protocol.get("writerFeatures") or ())
        enabled = self.configuration.get(ENABLE_DELETION_VECTORS, "false").lower() == "true"
        return supported and enabled

    def writable(self) -> str | None:
        """Why replog's own writer must not write this table (None: it may): a writer
        feature it does not know, an append-only table, column invariants, partitions."""
        if int(self.protocol.get("minWriterVersion", 0)) != 7:
            return f"writer version {self.protocol.get('minWriterVersion')}"
        unknown = set(self.protocol.get("writerFeatures") or ()) - WRITER_FEATURES
        if unknown:
            return f"writer features {sorted(unknown)}"
        if self.configuration.get("delta.appendOnly", "false").lower() == "true":
            return "delta.appendOnly"
        if "delta.invariants" in str(self.metadata.get("schemaString", "")):
            return "column invariants"
        if self.metadata.get("partitionColumns"):
            return "partition columns"
        return None


def _dv_id(action: Mapping[str, Any]) -> str | None:
    found = action.get("deletionVector")
    return None if not found else Descriptor.from_json(found).unique_id


def deletion_vector(add: Mapping[str, Any]) -> Descriptor | None:
    found = add.get("deletionVector")
    return None if not found else Descriptor.from_json(found)


def num_records(add: Mapping[str, Any]) -> int | None:
    stats = add.get("stats")
    if not stats:
        return None
    found = json.loads(stats).get("numRecords")
    return None if found is None else int(found)


class DeltaLog:
    """The log of the Delta table at ``storage``'s root: its state, kept up to date, and
    commits. Not thread-safe: one per writer thread."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._state: LogState | None = None
        self._tip: int | None = None
        """The modification time of the commit file of the state's version, as read."""

    def state(self) -> LogState:
        """The newest state: the last one read, advanced by the commits after it (the whole
        log from the newest checkpoint the first time, and when the table was replaced)."""
        if self._state is not None and self._replaced(self._state.version):
            logger.warning(
                "%s: the table was replaced (deleted and created again); its log is read anew",
                self.storage.url,
            )
            self.forget()
        if self._state is None:
            self._state = self._from_checkpoint()
        start = self._state.version
        while True:
            data = self.storage.read_optional(commit_name(self._state.version + 1))
            if data is None:
                break
            self._state.apply(_actions(data))
            self._state.version += 1
        if self._state.version != start or self._tip is None:
            self._tip = self.storage.modified_ms(commit_name(self._state.version))
        return self._state

    def _replaced(self, version: int) -> bool:
        """Whether the commit file of ``version`` is gone or another than the one read: the
        table at this path is not the one the state describes (a state kept by a long-lived
        process outlives a table dropped and created again)."""
        return self.storage.modified_ms(commit_name(version)) != self._tip

    def forget(self) -> None:
        """Read the log again from its newest checkpoint next time (another writer's
        checkpoint, or a commit of ours whose outcome is unknown)."""
        self._state = None
        self._tip = None

    def _from_checkpoint(self) -> LogState:
        pointer = self.storage.read_optional(f"{LOG}/_last_checkpoint")
        if pointer is None:
            state = LogState(version=-1)
            if not self.storage.exists(commit_name(0)):
                raise FileNotFoundError(f"{self.storage.path(LOG)}: no Delta table there")
            return state
        checkpoint = json.loads(pointer)
        version = int(checkpoint["version"])
        if checkpoint.get("v2Checkpoint") or checkpoint.get("checkpointSchema", {}).get(
            "checkpointMetadata"
        ):
            raise UnsupportedFormatError(f"{self.storage.url}: a v2 checkpoint at {version}")
        parts = int(checkpoint.get("parts") or 0)
        names = (
            [f"{LOG}/{version:020d}.checkpoint.parquet"]
            if not parts
            else [
                f"{LOG}/{version:020d}.checkpoint.{i:010d}.{parts:010d}.parquet"
                for i in range(1, parts + 1)
            ]
        )
        state = LogState(version=version)
        for name in names:
            table = pq.read_table(pa.BufferReader(self.storage.read(name)))
            state.apply(_checkpoint_actions(table))
        return state

    def commit(self, version: int, actions: Sequence[Mapping[str, Any]]) -> None:
        """Create commit ``version`` holding ``actions``.

        Raises:
            CommitConflictError: another writer committed ``version`` first (nothing of
                this commit is in the table).
        """
        text = "\n".join(json.dumps(a, separators=(",", ":")) for a in actions) + "\n"
        try:
            self.storage.put_if_absent(commit_name(version), text.encode())
        except FileExistsError as exc:
            self.forget()
            raise CommitConflictError(
                f"{self.storage.url}: Delta version {version} was committed by another writer"
            ) from exc
        if self._state is not None and self._state.version == version - 1:
            self._state.apply(actions)
            self._state.version = version
            self._tip = self.storage.modified_ms(commit_name(version))
        else:  # a state of another table (one created here since): read anew
            self.forget()


def _actions(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def _checkpoint_actions(table: pa.Table) -> list[dict[str, Any]]:
    """A checkpoint's live actions as JSON-like dicts (maps as dicts; nulls dropped)."""
    found: list[dict[str, Any]] = []
    for kind in ("protocol", "metaData", "txn", "add"):
        if kind not in table.column_names:
            continue
        column = table.column(kind)
        for value in column.filter(column.is_valid()).to_pylist():
            found.append({kind: _plain(value)})
    return found


def _plain(value: Any) -> Any:
    """A checkpoint's value as the JSON commit holds it: Arrow maps (lists of pairs) as
    dicts, null members dropped."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return {str(k): v for k, v in value}
    return value


def commit_info(operation: str, read_version: int, **extra: Any) -> dict[str, Any]:
    return {
        "commitInfo": {
            "timestamp": int(time.time() * 1000),
            "operation": operation,
            "operationParameters": {},
            **({"readVersion": read_version} if read_version >= 0 else {}),
            "engineInfo": "replog",
            **extra,
        }
    }

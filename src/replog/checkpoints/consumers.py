"""Consumers of a log: their committed offsets, who may commit them, and where they resume.

A consumer's manifests live inside the log it reads, ``_replog/consumers/<name>/``, so
retention (``truncate``) and ``status`` find every consumer without configuration. Its
committed offsets are ``source_offsets["replog:<log id>"]``; keying by log id means a log
recreated at the same URL is never mistaken for the old one.

Two rules keep a consumer's position truthful:

* **fencing**: each reader run takes the consumer over with a higher generation when it
  first commits; a run that finds a newer generation stops with :class:`FencedError`, so
  two live queries never interleave one consumer's offsets;
* **sink links**: a sink that writes what this consumer read records the positions it
  covers in its own log commit (atomically with the data) and leaves a link here, so a
  query that resumes this consumer from a new Spark checkpoint starts after everything
  that sink already wrote (:func:`resume_offsets`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from replog.checkpoints.manifest import CheckpointManifest, ConnectorCheckpoint
from replog.checkpoints.store import ManifestStore, named_stores
from replog.core.history import read_commit
from replog.errors import (
    ConsumerResetError,
    FencedError,
    InvalidOptionError,
    LogNotFoundError,
    ManifestConflictError,
    ManifestNotFoundError,
    ReplogError,
)
from replog.format.commits import META_DIR
from replog.log import ReplicationLog
from replog.names import check_name
from replog.offsets import Offsets
from replog.storage import Storage
from replog.storage.backends import is_temporary

logger = logging.getLogger(__name__)

CONSUMERS_DIR = f"{META_DIR}/consumers"
LINKS_DIR = "links"
COMMIT_ATTEMPTS = 5
OPERATOR_NOTE = "replog consumer set"
"""How ``replog consumer set`` signs the positions it sets (a reset a reader resuming
from elsewhere must not silently undo)."""


def consumer_storage(log_storage: Storage, consumer: str) -> Storage:
    return log_storage.child(f"{CONSUMERS_DIR}/{check_name(consumer, 'consumer')}")


def consumer_store(log: ReplicationLog, consumer: str) -> ManifestStore:
    return ManifestStore(consumer_storage(log.storage, consumer))


def list_consumers(log: ReplicationLog) -> list[str]:
    """Every consumer of ``log`` (stray entries skipped: :func:`named_stores`)."""
    return named_stores(log.storage, CONSUMERS_DIR)[0]


def source_key(log_id: str) -> str:
    """The key of a log in a consumer manifest's ``source_offsets``."""
    return f"replog:{log_id}"


@dataclass(frozen=True)
class ConsumerPosition:
    """A consumer's committed position in one log."""

    consumer: str
    offsets: Offsets
    log_version: int
    checkpoint_id: int
    timestamp_ms: int
    owner: str | None
    generation: int
    committed_by: str = ""

    @property
    def set_by_operator(self) -> bool:
        return self.committed_by == OPERATOR_NOTE

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["offsets"] = {str(s): seq for s, seq in sorted(self.offsets.items())}
        return document


@dataclass(frozen=True)
class ConsumerMetadata:
    """Who committed a consumer's position, and at which log version: the ``metadata`` of
    its connector checkpoint, typed (stored as strings, FORMAT.md "Checkpoint manifests")."""

    consumer: str
    log_url: str
    log_version: int
    owner: str | None
    generation: int
    committed_by: str = ""

    def to_metadata(self) -> dict[str, str]:
        metadata = {
            "consumer": self.consumer,
            "log_url": self.log_url,
            "log_version": str(self.log_version),
            "generation": str(self.generation),
            "committed_by": self.committed_by,
        }
        if self.owner is not None:
            metadata["owner"] = self.owner
        return metadata

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], consumer: str) -> ConsumerMetadata:
        def number(name: str) -> int:
            value = metadata.get(name, "0")
            return int(value) if value.isdigit() else 0  # damaged: as if never set

        return cls(
            consumer=metadata.get("consumer", consumer),
            log_url=metadata.get("log_url", ""),
            log_version=number("log_version"),
            owner=metadata.get("owner"),
            generation=number("generation"),
            committed_by=metadata.get("committed_by", ""),
        )


def _position(
    log: ReplicationLog, consumer: str, manifest: CheckpointManifest
) -> ConsumerPosition | None:
    checkpoint = manifest.source_offsets.get(source_key(log.log_id))
    if checkpoint is None:
        return None
    meta = ConsumerMetadata.from_metadata(checkpoint.metadata, consumer)
    return ConsumerPosition(
        consumer=consumer,
        offsets={int(k): int(v) for k, v in checkpoint.offsets.items() if k.isdigit()},
        log_version=meta.log_version,
        checkpoint_id=manifest.checkpoint_id,
        timestamp_ms=manifest.timestamp_ms,
        owner=meta.owner,
        generation=meta.generation,
        committed_by=meta.committed_by,
    )


def committed_position(log: ReplicationLog, consumer: str) -> ConsumerPosition | None:
    """The consumer's committed position in ``log``, or None if it never committed here."""
    manifest = consumer_store(log, consumer).load_latest()
    return None if manifest is None else _position(log, consumer, manifest)


def all_committed(log: ReplicationLog) -> dict[str, Offsets]:
    """Every known consumer's committed offsets (empty for one that never committed)."""
    found = {}
    for name in list_consumers(log):
        position = committed_position(log, name)
        found[name] = position.offsets if position else {}
    return found


class OffsetCommitter:
    """Commits one consumer's offsets on behalf of one reader run (``owner``).

    The first commit takes the consumer over (generation + 1); a later commit that finds a
    newer generation raises :class:`FencedError` naming the run that took over.
    """

    def __init__(self, log: ReplicationLog, consumer: str, owner: str) -> None:
        self.log = log
        self.consumer = check_name(consumer, "consumer")
        self.owner = owner
        self.generation: int | None = None
        self.store = consumer_store(log, consumer)

    def commit(self, offsets: Offsets, *, log_version: int, note: str) -> ConsumerPosition:
        """Record ``offsets`` (complete: every shard) as the consumer's position."""
        if set(offsets) != set(range(self.log.shards)):
            raise InvalidOptionError(
                f"consumer {self.consumer!r}: offsets must name shards 0..{self.log.shards - 1}, "
                f"got {sorted(offsets)}"
            )
        for _ in range(COMMIT_ATTEMPTS):
            base = self.store.load_latest()
            current = _position(self.log, self.consumer, base) if base else None
            current_generation = current.generation if current else 0
            if self.generation is None:
                if current is not None and note != OPERATOR_NOTE:
                    self._check_not_undoing_a_reset(current, offsets)
                self.generation = current_generation + 1
            elif current is not None and (
                current.generation > self.generation
                or (current.generation == self.generation and current.owner != self.owner)
            ):
                raise FencedError(
                    f"consumer {self.consumer!r} of {self.log.url} was taken over by "
                    f"{current.owner} (generation {current.generation}); this reader "
                    f"({self.owner}, generation {self.generation}) stops: two live queries "
                    f"must not share a consumer"
                )
            manifest = self.store.next_manifest(base)
            key = source_key(self.log.log_id)
            previous = manifest.source_offsets.get(key)
            manifest.source_offsets[key] = ConnectorCheckpoint(
                offsets={str(shard): int(seq) for shard, seq in sorted(offsets.items())},
                epoch=(previous.epoch + 1) if previous else 1,
                metadata=ConsumerMetadata(
                    consumer=self.consumer,
                    log_url=self.log.url,
                    log_version=log_version,
                    owner=self.owner,
                    generation=self.generation,
                    committed_by=note,
                ).to_metadata(),
            )
            if key not in manifest.source_names:
                manifest.source_names.append(key)
            try:
                self.store.save(manifest)
            except ManifestConflictError:
                continue  # another writer saved first: look again (it may have fenced us)
            logger.info(
                "consumer %s of %s committed %s (log version %d)",
                self.consumer,
                self.log.url,
                offsets,
                log_version,
            )
            position = _position(self.log, self.consumer, manifest)
            assert position is not None
            return position
        raise ManifestConflictError(
            f"consumer {self.consumer!r} of {self.log.url}: lost {COMMIT_ATTEMPTS} manifest "
            f"races in a row; is another query committing as this consumer?"
        )

    def _check_not_undoing_a_reset(self, current: ConsumerPosition, offsets: Offsets) -> None:
        """A reader taking the consumer over where an operator's reset is the latest word
        must start from it: one that resumes from somewhere else (a query restarted on
        its old checkpoint) would silently move the consumer back. Raise instead."""
        if not current.set_by_operator or current.offsets == dict(offsets):
            return
        wanted = json.dumps({str(s): seq for s, seq in sorted(current.offsets.items())})
        raise ConsumerResetError(
            f"consumer {self.consumer!r} of {self.log.url} was set to {wanted} by "
            f"'replog consumer set' (checkpoint {current.checkpoint_id}); this reader "
            f"resumes from {dict(sorted(offsets.items()))} instead, which would undo that. "
            f"To apply the reset, start the query on a new checkpoint (it starts from the "
            f"consumer's offsets); to keep this reader's position, set the consumer to it "
            f"with 'replog consumer set --offsets ... --execute'"
        )


def delete_consumer(log: ReplicationLog, consumer: str) -> None:
    """Forget a consumer: its manifests and links (retention stops waiting for it)."""
    storage = consumer_storage(log.storage, consumer)
    store = ManifestStore(storage)
    if store.latest_id() == 0 and not storage.listdir(LINKS_DIR):
        raise ManifestNotFoundError(f"{log.url} has no consumer {consumer!r}")
    storage.delete_tree("")
    logger.info("deleted consumer %s of %s", consumer, log.url)


# -- sink links: where a replaced checkpoint resumes -------------------------------------


@dataclass(frozen=True)
class SinkLink:
    """A sink that writes what a consumer reads: log ``log_id`` at ``log_url``, sink id."""

    log_url: str
    log_id: str
    sink_id: str

    @property
    def name(self) -> str:
        digest = hashlib.sha256(f"{self.log_id}/{self.sink_id}".encode()).hexdigest()[:16]
        return f"{LINKS_DIR}/{self.sink_id[:64]}-{digest}.json"


def write_link(source_storage: Storage, consumer: str, link: SinkLink) -> None:
    """Record (idempotently) that ``link``'s sink writes what ``consumer`` reads from the
    log at ``source_storage``."""
    storage = consumer_storage(source_storage, consumer)
    data = json.dumps(asdict(link), sort_keys=True).encode()
    try:
        storage.put_if_absent(link.name, data)
    except FileExistsError:
        if storage.read_optional(link.name) != data:  # the target log moved: update it
            storage.write(link.name, data)


def links(log: ReplicationLog, consumer: str) -> list[SinkLink]:
    storage = consumer_storage(log.storage, consumer)
    found = []
    for name in storage.listdir(LINKS_DIR):
        if is_temporary(name):  # a link being written
            continue
        relative = f"{LINKS_DIR}/{name}"
        data = storage.read_optional(relative)
        if data is None:
            continue
        try:
            found.append(SinkLink(**json.loads(data)))
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring unreadable sink link %s: %s", storage.path(relative), exc)
    return found


def sink_positions(
    log: ReplicationLog, consumer: str, link: SinkLink, storage_options: dict[str, Any]
) -> Offsets | None:
    """The positions of ``log`` that ``link``'s sink recorded, for ``consumer``, in its
    latest commit; None if that commit records none (or the target log is gone)."""
    try:
        target = ReplicationLog.open(link.log_url, storage_options=storage_options)
    except LogNotFoundError:
        logger.warning(
            "consumer %s: linked sink %s wrote to %s, which no longer holds a log; ignored",
            consumer,
            link.sink_id,
            link.log_url,
        )
        return None
    if target.log_id != link.log_id:
        logger.warning(
            "consumer %s: %s holds another log than the one sink %s wrote to; ignored",
            consumer,
            link.log_url,
            link.sink_id,
        )
        return None
    mark = target.refresh().sinks.get(link.sink_id)
    if mark is None:
        return None
    sources = mark.sources
    if not sources:  # a mark of a log written before marks kept them: its commit does
        record = read_commit(target.storage, mark.version)
        if record is None and mark.version <= target.state().retained_from:
            raise ReplogError(
                f"sink {link.sink_id!r} in {link.log_url}: its last commit (version "
                f"{mark.version}) was deleted by retention before its positions were kept "
                f"with its mark; resume from explicit startingOffsets"
            )
        sources = () if record is None or record.writer is None else record.writer.sources
    for source in sources:
        if source.log_id == log.log_id and source.consumer == consumer:
            return dict(source.offsets)
    return None


def resume_offsets(
    log: ReplicationLog, consumer: str, storage_options: dict[str, Any]
) -> ConsumerPosition | None:
    """Where ``consumer`` resumes: its committed offsets, raised per shard to what any
    linked sink has already written (a sink commits before Spark's own commit log, so a
    replaced checkpoint would otherwise repeat that micro-batch). Offsets an operator
    set (``replog consumer set``) are taken as they are: a rewind is meant to repeat."""
    position = committed_position(log, consumer)
    offsets = dict(position.offsets) if position else None
    if position is not None and position.set_by_operator:
        return position
    for link in links(log, consumer):
        try:
            written = sink_positions(log, consumer, link, storage_options)
        except (ReplogError, OSError) as exc:
            raise ReplogError(
                f"consumer {consumer!r}: cannot read sink {link.sink_id!r} in {link.log_url} "
                f"to learn what it already wrote ({exc}); give the source the storage options "
                f"of that log too (fs.*), or delete the link "
                f"{consumer_storage(log.storage, consumer).path(link.name)} if that sink is gone"
            ) from exc
        if written is None:
            continue
        base = offsets or {}
        merged = {
            shard: max(base.get(shard, 0), written.get(shard, 0)) for shard in range(log.shards)
        }
        if merged != offsets:
            logger.warning(
                "consumer %s resumes at %s: sink %s in %s already wrote up to there "
                "(its committed offsets were %s)",
                consumer,
                merged,
                link.sink_id,
                link.log_url,
                offsets,
            )
        offsets = merged
    if offsets is None:
        return None
    if position is None:
        return ConsumerPosition(consumer, offsets, 0, 0, 0, None, 0)
    return ConsumerPosition(
        consumer,
        offsets,
        position.log_version,
        position.checkpoint_id,
        position.timestamp_ms,
        position.owner,
        position.generation,
    )

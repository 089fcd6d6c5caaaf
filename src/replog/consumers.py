"""Where consumers and sinks of a log keep their checkpoint manifests, and consumer offsets.

Both live inside the log, so retention (``truncate``) and ``status`` can find every
consumer and sink of a log without configuration:

* ``_replog/consumers/<name>/``: the manifest store of consumer ``name``; its
  ``source_offsets[<log id>]`` holds the committed offsets.
* ``_replog/sinks/<sink id>/``: the manifest store of sink ``sink id``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from replog.errors import InvalidOptionError
from replog.log import ReplicationLog
from replog.manifest import CheckpointManifest, ConnectorCheckpoint
from replog.manifest_store import ManifestStore
from replog.offsets import Offsets
from replog.records import META_DIR

logger = logging.getLogger(__name__)

CONSUMERS_DIR = f"{META_DIR}/consumers"
SINKS_DIR = f"{META_DIR}/sinks"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str, option: str) -> str:
    if not _NAME.match(name):
        raise InvalidOptionError(
            f"option {option!r}: {name!r} is not a valid name (letters, digits, '.', '_', '-'; "
            f"at most 128 characters, starting with a letter or digit)"
        )
    return name


def consumer_store(log: ReplicationLog, consumer: str) -> ManifestStore:
    return ManifestStore(log.storage.child(f"{CONSUMERS_DIR}/{check_name(consumer, 'consumer')}"))


def sink_store(log: ReplicationLog, sink_id: str) -> ManifestStore:
    return ManifestStore(log.storage.child(f"{SINKS_DIR}/{check_name(sink_id, 'sinkId')}"))


def list_consumers(log: ReplicationLog) -> list[str]:
    return log.storage.list(CONSUMERS_DIR)


def list_sinks(log: ReplicationLog) -> list[str]:
    return log.storage.list(SINKS_DIR)


def source_name(log: ReplicationLog) -> str:
    """The key of this log in a consumer manifest's ``source_offsets``."""
    return f"replog:{log.descriptor.log_id}"


@dataclass(frozen=True)
class ConsumerPosition:
    consumer: str
    offsets: Offsets
    epoch: int
    checkpoint_id: int
    timestamp_ms: int


def committed_offsets(log: ReplicationLog, consumer: str) -> ConsumerPosition | None:
    """The consumer's committed offsets, or None if it never committed."""
    manifest = consumer_store(log, consumer).load_latest()
    if manifest is None:
        return None
    checkpoint = manifest.source_offsets.get(source_name(log))
    if checkpoint is None:
        return None
    offsets = {int(k): int(v) for k, v in checkpoint.offsets.items() if k.isdigit()}
    return ConsumerPosition(
        consumer, offsets, checkpoint.epoch, manifest.checkpoint_id, manifest.timestamp_ms
    )


def all_committed(log: ReplicationLog) -> dict[str, Offsets]:
    """Every known consumer's committed offsets (empty for one that never committed)."""
    found = {}
    for name in list_consumers(log):
        position = committed_offsets(log, name)
        found[name] = position.offsets if position else {}
    return found


def commit_offsets(
    log: ReplicationLog, consumer: str, offsets: Offsets, *, epoch: int, note: str = "spark"
) -> CheckpointManifest:
    """Record ``offsets`` as the consumer's committed position (a new manifest)."""
    if set(offsets) - set(range(log.shards)):
        raise InvalidOptionError(f"offsets name shards outside 0..{log.shards - 1}: {offsets}")
    store = consumer_store(log, consumer)
    previous = store.load_latest()
    manifest = (previous or CheckpointManifest()).next(epoch=epoch)
    name = source_name(log)
    manifest.source_offsets[name] = ConnectorCheckpoint(
        offsets={str(shard): int(seq) for shard, seq in sorted(offsets.items())},
        epoch=epoch,
        metadata={"log_url": log.url, "consumer": consumer, "committed_by": note},
    )
    if name not in manifest.source_names:
        manifest.source_names.append(name)
    store.save(manifest)
    logger.info("consumer %s of %s committed %s (epoch %d)", consumer, log.url, offsets, epoch)
    return manifest


@dataclass(frozen=True)
class Lag:
    shard: int
    committed: int
    head: int

    @property
    def events(self) -> int:
        return max(self.head - self.committed, 0)


def consumer_lag(log: ReplicationLog, offsets: Offsets) -> list[Lag]:
    heads = log.head()
    return [Lag(shard, offsets.get(shard, 0), heads[shard]) for shard in range(log.shards)]

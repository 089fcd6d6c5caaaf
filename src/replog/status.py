"""What ``replog status`` reports: each consumer's position and lag, each sink's state.

Lag is given two ways: events behind the head, and the age of the oldest unconsumed
event (the event time of the next event each shard would deliver, the oldest over all
shards), which is what an operator alerts on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from replog import consumers
from replog.log import ReplicationLog, now_ms, read_segment
from replog.state import LogState


@dataclass(frozen=True)
class ConsumerStatus:
    name: str
    checkpoint_id: int | None
    committed_ms: int | None
    offsets: dict[int, int]
    lag_events: dict[int, int]
    oldest_unconsumed_ms: int | None

    @property
    def total_lag(self) -> int:
        return sum(self.lag_events.values())


@dataclass(frozen=True)
class SinkStatus:
    sink_id: str
    checkpoint_id: int | None
    epoch: int | None
    status: str | None
    query_id: str | None
    updated_ms: int | None
    log_epoch: int | None
    log_version: int | None


def next_event_ms(log: ReplicationLog, state: LogState, shard: int, sequence: int) -> int | None:
    """Event time of ``shard``'s event at ``sequence`` (None if it has no such event)."""
    sequence = max(sequence, state.lows[shard])
    if sequence > state.heads[shard]:
        return None
    for segment in state.covering(shard, sequence, sequence):
        for batch in read_segment(log.storage, segment, sequence, sequence):
            value = batch.column("timestamp")[0].value
            return int(value) // 1000 if value is not None else None
    return None


def consumer_status(log: ReplicationLog, state: LogState, name: str) -> ConsumerStatus:
    position = consumers.committed_offsets(log, name)
    committed = position.offsets if position else {}
    offsets = {shard: committed.get(shard, 0) for shard in range(log.shards)}
    lag = {shard: max(state.heads[shard] - offset, 0) for shard, offset in offsets.items()}
    times = [
        next_event_ms(log, state, shard, offsets[shard] + 1) for shard in offsets if lag[shard]
    ]
    known = [t for t in times if t is not None]
    return ConsumerStatus(
        name=name,
        checkpoint_id=position.checkpoint_id if position else None,
        committed_ms=position.timestamp_ms if position else None,
        offsets=offsets,
        lag_events=lag,
        oldest_unconsumed_ms=min(known) if known else None,
    )


def sink_status(log: ReplicationLog, state: LogState, sink_id: str) -> SinkStatus:
    manifest = consumers.sink_store(log, sink_id).load_latest()
    mark = state.sinks.get(sink_id)
    status = manifest.sink_commit_statuses.get(sink_id) if manifest else None
    return SinkStatus(
        sink_id=sink_id,
        checkpoint_id=manifest.checkpoint_id if manifest else None,
        epoch=manifest.sink_epochs.get(sink_id) if manifest else None,
        status=str(status) if status else None,
        query_id=manifest.sink_query_ids.get(sink_id) if manifest else None,
        updated_ms=manifest.timestamp_ms if manifest else None,
        log_epoch=mark.epoch if mark else None,
        log_version=mark.version if mark else None,
    )


def log_status(log: ReplicationLog) -> dict[str, Any]:
    """The whole report as JSON-ready data (``replog status --json``)."""
    state = log.refresh()
    now = now_ms()
    report_consumers = []
    for name in consumers.list_consumers(log):
        found = consumer_status(log, state, name)
        entry = asdict(found)
        entry["total_lag"] = found.total_lag
        entry["oldest_unconsumed_age_s"] = (
            round((now - found.oldest_unconsumed_ms) / 1000, 3)
            if found.oldest_unconsumed_ms is not None
            else None
        )
        entry["offsets"] = {str(k): v for k, v in found.offsets.items()}
        entry["lag_events"] = {str(k): v for k, v in found.lag_events.items()}
        report_consumers.append(entry)
    sink_ids = sorted(set(consumers.list_sinks(log)) | set(state.sinks))
    return {
        "url": log.url,
        "version": state.version,
        "heads": state.heads_json(),
        "lows": state.lows_json(),
        "consumers": report_consumers,
        "sinks": [asdict(sink_status(log, state, sink_id)) for sink_id in sink_ids],
    }

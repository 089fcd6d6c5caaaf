"""What ``replog status`` reports: each consumer's position and lag, each sink's state.

Lag is given two ways: events behind the head, and the age of the oldest unconsumed
event (the event time of the next event each shard would deliver, the oldest over all
shards), which is what an operator alerts on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from replog.capture import running
from replog.capture.mysql.options import capture_name as mysql_capture_name
from replog.capture.mysql.positions import BinlogPosition, PositionRecord
from replog.capture.options import capture_app_id, capture_slot
from replog.capture.pgoutput import lsn_to_text
from replog.checkpoints import consumers, sinks
from replog.core.files import read_segment
from replog.core.history import read_commit
from replog.errors import ManifestNotFoundError
from replog.format.commits import TXN_QUERY
from replog.format.state import LogState, retained_events
from replog.log import ReplicationLog
from replog.timeutil import now_ms

if TYPE_CHECKING:  # psycopg is the 'postgres' extra's: status works without it
    from replog.capture.slots import SlotState


@dataclass(frozen=True)
class ConsumerStatus:
    name: str
    checkpoint_id: int | None
    committed_ms: int | None
    offsets: dict[int, int]
    heads: dict[int, int]
    oldest_unconsumed_ms: int | None
    owner: str | None

    @property
    def lag_events(self) -> dict[int, int]:
        return {s: max(self.heads[s] - offset, 0) for s, offset in self.offsets.items()}

    @property
    def total_lag(self) -> int:
        return sum(self.lag_events.values())

    def to_json(self, now: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "checkpoint_id": self.checkpoint_id,
            "committed_ms": self.committed_ms,
            "owner": self.owner,
            "offsets": {str(s): v for s, v in self.offsets.items()},
            "heads": {str(s): v for s, v in self.heads.items()},
            "lag_events": {str(s): v for s, v in self.lag_events.items()},
            "total_lag": self.total_lag,
            "oldest_unconsumed_ms": self.oldest_unconsumed_ms,
            "oldest_unconsumed_age_s": (
                None
                if self.oldest_unconsumed_ms is None
                else round((now - self.oldest_unconsumed_ms) / 1000, 3)
            ),
        }


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
    generation: int | None
    owner_run: str | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CaptureStatus:
    """A PostgreSQL capture's position in the log (transaction ``pg-capture.<slot>``), how
    its last run is (its run record) and, when the server was asked (:func:`with_server`),
    its slot there: how far behind it is, the WAL it keeps, whether it can resume."""

    slot: str
    position: int
    """The end LSN of the last source transaction the log holds (a number here; every
    JSON document writes it as PostgreSQL's text, ``lsn``)."""
    log_version: int
    """The log commit that recorded it."""
    committed_ms: int | None
    """When that commit was made (None once retention removed its record)."""
    log_id: str = ""
    run: running.CaptureRun | None = None
    """The last run's record (None: no run wrote one: a capture of an older replog)."""
    generated_ms: int = 0
    server_lsn: int | None = None
    """The server's ``pg_current_wal_lsn()`` when asked."""
    server: SlotState | None = None
    """The slot on that server (None: not asked, or no such slot there)."""

    @property
    def slot_lsn(self) -> int | None:
        """The slot's ``confirmed_flush_lsn`` on the server."""
        return None if self.server is None else self.server.confirmed_lsn

    @property
    def lag_bytes(self) -> int | None:
        """WAL the server wrote past the slot's confirmed position (an upper bound of what
        capture has to read: it counts every database's WAL); None unless the server was
        asked and has the slot."""
        return None if self.server is None else self.server.lag_bytes

    @property
    def problem(self) -> str | None:
        """Why this log's capture cannot resume the slot, with the way on (None: it can,
        or the server was not asked)."""
        reset = "'replog capture ... --reset-slot' starts over with a new slot and a snapshot"
        slot, name = self.server, repr(self.slot)
        if self.server_lsn is None:
            return None
        if slot is None:
            return (
                f"the server has no slot {name}: the changes after the log's position are "
                f"gone; {reset}"
            )
        if slot.lost:
            return (
                f"the server invalidated slot {name} ({slot.invalidation or 'wal_status lost'}): "
                f"the WAL after the log's position is gone; {reset}"
            )
        owner = slot.owner
        if owner is not None and self.log_id and owner.get("log_id") != self.log_id:
            return (
                f"slot {name} belongs to log {owner.get('log', '?')} (id {owner['log_id']}): this "
                f"log's capture can never resume it; capture into another slot, or {reset}"
            )
        if slot.confirmed_lsn is not None and slot.confirmed_lsn > self.position:
            return (
                f"slot {name} was advanced to {lsn_to_text(slot.confirmed_lsn)}, past the log's "
                f"position {lsn_to_text(self.position)}: the changes between were consumed "
                f"elsewhere; {reset}"
            )
        return None

    def to_json(self) -> dict[str, Any]:
        slot = self.server
        return {
            "slot": self.slot,
            "app_id": capture_app_id(self.slot),
            "lsn": lsn_to_text(self.position),
            "log_version": self.log_version,
            "committed_ms": self.committed_ms,
            "run": None if self.run is None else _run_json(self.run, self.generated_ms),
            "server_lsn": None if self.server_lsn is None else lsn_to_text(self.server_lsn),
            "slot_lsn": None if self.slot_lsn is None else lsn_to_text(self.slot_lsn),
            "lag_bytes": self.lag_bytes,
            "lag_s": None if slot is None else slot.lag_s,
            "lag_note": None if slot is None else slot.lag_note,
            "oldest_unconfirmed_commit_ms": None if slot is None else slot.oldest_unconfirmed_ms,
            "retained_wal_bytes": None if slot is None else slot.retained_bytes,
            "wal_status": None if slot is None else slot.wal_status,
            "safe_wal_bytes": None if slot is None else slot.safe_bytes,
            "holder": None if slot is None or slot.holder is None else slot.holder.to_json(),
            "owner": None if slot is None else slot.owner,
            "problem": self.problem,
        }


def _run_json(run: running.CaptureRun, at_ms: int) -> dict[str, Any]:
    return {
        "state": run.state(at_ms),
        "host": run.host,
        "pid": run.pid,
        "started_ms": run.started_ms,
        "beat_ms": run.beat_ms,
        "stopped_ms": run.stopped_ms,
        "error": run.error,
        "lsn": lsn_to_text(run.position),
    }


@dataclass(frozen=True)
class MySqlCaptureStatus:
    """A MySQL capture's position in the log (transaction ``mysql-capture.<name>``), where
    that is in the binlog (its position record), its run, and, when the server was asked
    (:func:`with_mysql_server`), how far the log is behind it."""

    name: str
    version: int
    log_version: int
    committed_ms: int | None
    position: BinlogPosition | None
    """The binlog position of :attr:`version` (None: no record of it)."""
    run_state: str | None = None
    """``running``, ``stopped``, ``failed`` or ``gone`` (its run record), None: none."""
    run_error: str | None = None
    server_file: str | None = None
    server_pos: int | None = None
    lag_bytes: int | None = None
    """Binlog bytes the server wrote past the position (with ``--source-dsn``)."""

    def to_json(self) -> dict[str, Any]:
        position = self.position
        return {
            "name": self.name,
            "app_id": f"mysql-capture.{self.name}",
            "version": self.version,
            "log_version": self.log_version,
            "committed_ms": self.committed_ms,
            "file": position.file if position else None,
            "pos": position.pos if position else None,
            "gtids": (position.gtids or None) if position else None,
            "server_id": position.server_id if position else None,
            "run": self.run_state,
            "error": self.run_error,
            "server_file": self.server_file,
            "server_pos": self.server_pos,
            "lag_bytes": self.lag_bytes,
        }


@dataclass(frozen=True)
class LogStatus:
    url: str
    version: int
    heads: dict[int, int]
    lows: dict[int, int]
    consumers: tuple[ConsumerStatus, ...]
    sinks: tuple[SinkStatus, ...]
    generated_ms: int
    transactions: dict[str, int] = field(default_factory=dict)
    """Idempotent appends' app ids and the last version of each the log holds (captures'
    are in :attr:`captures`)."""
    captures: tuple[CaptureStatus, ...] = ()
    server_asked: bool = False
    """Whether :attr:`captures` carry the source server's positions (``--source-dsn``)."""
    mysql_captures: tuple[MySqlCaptureStatus, ...] = ()

    @property
    def events(self) -> int:
        return retained_events(self.heads, self.lows)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "heads": {str(s): v for s, v in self.heads.items()},
            "lows": {str(s): v for s, v in self.lows.items()},
            "events": self.events,
            "consumers": [c.to_json(self.generated_ms) for c in self.consumers],
            "sinks": [s.to_json() for s in self.sinks],
            "transactions": dict(self.transactions),
            "captures": [c.to_json() for c in self.captures],
            "mysql_captures": [c.to_json() for c in self.mysql_captures],
        }


class _EventTimes:
    """Event time of (shard, sequence), reading each segment at most once per report."""

    def __init__(self, log: ReplicationLog, state: LogState) -> None:
        self.log, self.state = log, state
        self._known: dict[tuple[int, int], int | None] = {}

    def at(self, shard: int, sequence: int) -> int | None:
        sequence = max(sequence, self.state.lows[shard])
        if sequence > self.state.heads[shard]:
            return None
        if (shard, sequence) not in self._known:
            found = None
            for segment in self.state.covering(shard, sequence, sequence):
                for batch in read_segment(self.log.storage, segment, sequence, sequence):
                    found = int(batch.column("timestamp")[0].value) // 1000
            self._known[(shard, sequence)] = found
        return self._known[(shard, sequence)]


def consumer_status(
    log: ReplicationLog, state: LogState, name: str, times: _EventTimes
) -> ConsumerStatus:
    position = consumers.committed_position(log, name)
    committed = position.offsets if position else {}
    offsets = {shard: committed.get(shard, 0) for shard in range(log.shards)}
    heads = dict(enumerate(state.heads))
    pending = [times.at(s, offsets[s] + 1) for s in offsets if heads[s] > offsets[s]]
    known = [t for t in pending if t is not None]
    return ConsumerStatus(
        name=name,
        checkpoint_id=position.checkpoint_id if position else None,
        committed_ms=position.timestamp_ms if position else None,
        offsets=offsets,
        heads=heads,
        oldest_unconsumed_ms=min(known) if known else None,
        owner=position.owner if position else None,
    )


def sink_status(log: ReplicationLog, state: LogState, sink_id: str) -> SinkStatus:
    manifest = sinks.sink_store(log, sink_id).load_latest()
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
        generation=mark.generation if mark else None,
        owner_run=mark.owner if mark else None,
    )


def log_status(log: ReplicationLog) -> LogStatus:
    """Every consumer's position and lag and every sink's state."""
    state = log.refresh()
    times = _EventTimes(log, state)
    sink_dirs = set(sinks.list_sinks(log))
    transactions = {
        app_id: version
        for app_id, mark in state.sinks.items()
        if app_id not in sink_dirs and (version := mark.epoch_of(TXN_QUERY)) is not None
    }
    sink_ids = sorted((sink_dirs | set(state.sinks)) - set(transactions))
    captures = []
    mysql_captures = []
    generated = now_ms()
    for app_id in sorted(transactions):
        name = mysql_capture_name(app_id)
        if name is not None:
            mysql_captures.append(_mysql_capture(log, state, name, transactions.pop(app_id)))
            continue
        slot = capture_slot(app_id)
        if slot is not None:
            record = read_commit(log.storage, state.sinks[app_id].version)
            captures.append(
                CaptureStatus(
                    slot=slot,
                    position=transactions.pop(app_id),
                    log_version=state.sinks[app_id].version,
                    committed_ms=record.timestamp_ms if record else None,
                    log_id=log.log_id,
                    run=running.read(log.storage, slot),
                    generated_ms=generated,
                )
            )
    return LogStatus(
        url=log.url,
        version=state.version,
        heads=dict(enumerate(state.heads)),
        lows=dict(enumerate(state.lows)),
        consumers=tuple(
            consumer_status(log, state, name, times) for name in consumers.list_consumers(log)
        ),
        sinks=tuple(sink_status(log, state, sink_id) for sink_id in sink_ids),
        generated_ms=generated,
        transactions=transactions,
        captures=tuple(captures),
        mysql_captures=tuple(mysql_captures),
    )


def _mysql_capture(
    log: ReplicationLog, state: LogState, name: str, version: int
) -> MySqlCaptureStatus:
    mark = state.sinks[f"mysql-capture.{name}"]
    record = read_commit(log.storage, mark.version)
    positions = PositionRecord.load(log.storage, name, log.log_id)
    run = running.read(log.storage, f"mysql.{name}")
    return MySqlCaptureStatus(
        name=name,
        version=version,
        log_version=mark.version,
        committed_ms=record.timestamp_ms if record else None,
        position=positions.at(version) if positions else None,
        run_state=run.state(now_ms()) if run else None,
        run_error=run.error if run else None,
    )


def with_mysql_server(
    report: LogStatus, file: str, pos: int, files: Mapping[str, int]
) -> LogStatus:
    """``report`` with its MySQL captures' lag behind a server: its binlog position now
    (``file``, ``pos``) and its binlog files' sizes (``replog status --source-dsn
    mysql://...``). The lag counts the binlog after each capture's position, every
    database's (as MySQL writes one binlog)."""
    captures = []
    for capture in report.mysql_captures:
        lag = None
        if capture.position is not None and capture.position.file in files:
            names = list(files)
            at = names.index(capture.position.file)
            lag = max(files[capture.position.file] - capture.position.pos, 0) + sum(
                files[n] for n in names[at + 1 :]
            )
        captures.append(replace(capture, server_file=file, server_pos=pos, lag_bytes=lag))
    return replace(report, mysql_captures=tuple(captures), server_asked=True)


def with_server(report: LogStatus, server_lsn: int, slots: Mapping[str, SlotState]) -> LogStatus:
    """``report`` with its captures' slots on a source server (``replog status
    --source-dsn``): the server's WAL position and each capture's slot there."""
    captures = tuple(
        replace(c, server_lsn=server_lsn, server=slots.get(c.slot)) for c in report.captures
    )
    return replace(report, captures=captures, server_asked=True)


def consumer_position(log: ReplicationLog, name: str) -> ConsumerStatus:
    """One consumer's status (``replog consumer show``); raises if it is unknown."""
    if name not in consumers.list_consumers(log):
        raise ManifestNotFoundError(f"{log.url} has no consumer {name!r}")
    state = log.refresh()
    return consumer_status(log, state, name, _EventTimes(log, state))

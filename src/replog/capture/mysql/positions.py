"""Where a MySQL capture is in the source's binlog, as one number that only grows: the
version of the capture's idempotent transaction ``mysql-capture.<name>`` (docs/CDC.md,
"Capturing MySQL and MariaDB"; FORMAT.md "Capture plans").

DESIGN: a position is the end of a source transaction: its binlog file and offset, and,
where the server has GTIDs, the GTID state after it (MariaDB: the last GTID of each
replication domain, ``0-1-42,1-2-7``; MySQL: the executed GTID set,
``uuid:1-42:44-50``). Its version is

* with GTIDs, the number of transactions the state holds (MariaDB: the sum of each
  domain's sequence number; MySQL: the size of the set): it rises by one per
  transaction whichever server of a replication topology wrote it, so a capture moved
  to another server (a failover) resumes by GTID and its versions go on rising;
* without (MySQL with ``gtid_mode=OFF``), ``file number << 32 | offset``: ordered like
  the binlog of the one server it belongs to (its ``server_id`` is kept beside it).

A version does not say where in the binlog it is: the capture writes its position
(:class:`PositionRecord`) before each commit, and a restart takes the one whose version
the log holds.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from replog.capture.records import read_record
from replog.errors import CaptureError, CorruptionError
from replog.format.sealed import seal
from replog.storage import Storage

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MARIADB, MYSQL = "mariadb", "mysql"
GTID, FILE = "gtid", "file"
"""Position modes: by GTID (the server has GTIDs) or by binlog file and offset."""

_MARIADB_GTID = re.compile(r"^(\d+)-(\d+)-(\d+)$")


def binlog_number(file: str) -> int:
    """``binlog.000042`` -> 42."""
    try:
        return int(file.rsplit(".", 1)[1])
    except (IndexError, ValueError) as exc:
        raise CaptureError(f"binlog file {file!r} does not end in a number") from exc


# -- GTID states -------------------------------------------------------------------------


def mariadb_state(text: str) -> dict[int, tuple[int, int]]:
    """``0-1-42,1-2-7`` -> {domain: (server id, sequence number)}."""
    state: dict[int, tuple[int, int]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        found = _MARIADB_GTID.match(part)
        if found is None:
            raise CaptureError(f"{part!r} is not a MariaDB GTID (domain-server-sequence)")
        domain, server, sequence = (int(g) for g in found.groups())
        state[domain] = (server, sequence)
    return state


def mariadb_text(state: dict[int, tuple[int, int]]) -> str:
    return ",".join(f"{d}-{s}-{n}" for d, (s, n) in sorted(state.items()))


def mysql_set(text: str) -> dict[str, list[tuple[int, int]]]:
    """``uuid:1-5:7,uuid2:3`` -> {uuid: [(1, 5), (7, 7)], ...} (intervals merged)."""
    found: dict[str, list[tuple[int, int]]] = {}
    for part in filter(None, (p.strip() for p in text.replace("\n", "").split(","))):
        sid, *ranges = part.split(":")
        intervals = found.setdefault(sid.lower(), [])
        for item in ranges:
            low, _, high = item.partition("-")
            intervals.append((int(low), int(high or low)))
    return {sid: _merged(intervals) for sid, intervals in found.items()}


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(intervals):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def mysql_text(gtids: dict[str, list[tuple[int, int]]]) -> str:
    return ",".join(
        sid + "".join(f":{lo}" if lo == hi else f":{lo}-{hi}" for lo, hi in intervals)
        for sid, intervals in sorted(gtids.items())
    )


def gtid_count(flavor: str, text: str) -> int:
    """The number of transactions a GTID state holds (the version of a GTID position)."""
    if flavor == MARIADB:
        return sum(sequence for _, sequence in mariadb_state(text).values())
    return sum(hi - lo + 1 for intervals in mysql_set(text).values() for lo, hi in intervals)


def with_gtid(flavor: str, state: str, gtid: str) -> tuple[str, bool]:
    """``state`` with one more transaction's ``gtid``; and whether it is new (False: the
    state holds it already: a transaction seen before)."""
    if flavor == MARIADB:
        found = mariadb_state(state)
        [(domain, (server, sequence))] = mariadb_state(gtid).items()
        previous = found.get(domain)
        if previous is not None and sequence <= previous[1]:
            return state, False
        found[domain] = (server, sequence)
        return mariadb_text(found), True
    sid, _, number = gtid.rpartition(":")
    gtids = mysql_set(state)
    intervals = gtids.setdefault(sid.lower(), [])
    if any(lo <= int(number) <= hi for lo, hi in intervals):
        return state, False
    intervals.append((int(number), int(number)))
    gtids[sid.lower()] = _merged(intervals)
    return mysql_text(gtids), True


# -- positions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BinlogPosition:
    """The end of a source transaction (or where a capture starts)."""

    flavor: str
    """``mariadb`` or ``mysql`` (their GTIDs differ)."""
    mode: str
    """``gtid`` or ``file`` (see the module docstring)."""
    file: str
    pos: int
    gtids: str = ""
    """The GTID state after it (``gtid`` mode)."""
    server_id: int = 0
    """The ``server_id`` of the server whose binlog ``file`` is."""
    server_uuid: str = ""
    """MySQL's ``server_uuid`` of that server (MariaDB: empty)."""

    @property
    def version(self) -> int:
        if self.mode == GTID:
            return gtid_count(self.flavor, self.gtids)
        return (binlog_number(self.file) << 32) | self.pos

    def text(self) -> str:
        """As messages and ``replog status`` show it."""
        where = f"{self.file}:{self.pos}"
        return f"{where} (GTID {self.gtids or 'none'})" if self.mode == GTID else where

    def after(self, file: str, pos: int, gtid: str | None) -> tuple[BinlogPosition, bool]:
        """The position after a transaction that ended at ``file``:``pos`` with ``gtid``
        (None: it had none); and whether the transaction is new to this position (a GTID
        the state holds, or a binlog offset not past this one, was read before)."""
        if self.mode == GTID and gtid is not None:
            gtids, new = with_gtid(self.flavor, self.gtids, gtid)
            return replace(self, file=file, pos=pos, gtids=gtids), new
        moved = replace(self, file=file, pos=pos)
        if self.mode == GTID:  # a transaction without a GTID on a server with them
            return moved, (binlog_number(file), pos) > (binlog_number(self.file), self.pos)
        return moved, moved.version > self.version

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> BinlogPosition:
        return cls(**{key: body[key] for key in cls.__dataclass_fields__ if key in body})


# -- the record of positions in the log --------------------------------------------------


def record_path(name: str) -> str:
    return f"_replog/captures/mysql.{name}.position.json"


@dataclass
class PositionRecord:
    """The positions of a capture's last commits, written before each commit: the one
    being committed and the one the log holds now (after the commit, or a crash before
    it, the log holds one of the two)."""

    name: str
    log_id: str
    positions: list[BinlogPosition]

    @classmethod
    def load(cls, storage: Storage, name: str, log_id: str) -> PositionRecord | None:
        path = record_path(name)
        body = read_record(storage, path, log_id, RECORD_VERSION)
        if body is None:
            return None
        try:
            positions = [BinlogPosition.from_json(item) for item in body["positions"]]
        except (KeyError, TypeError) as exc:
            raise CorruptionError(storage.path(path), f"malformed position record: {exc}") from exc
        return cls(name, log_id, positions)

    def at(self, version: int) -> BinlogPosition | None:
        """The recorded position whose version is ``version``."""
        return next((p for p in reversed(self.positions) if p.version == version), None)

    def write(self, storage: Storage, position: BinlogPosition, *, logged: int) -> None:
        """Record ``position`` (about to be committed), keeping the one of version
        ``logged``, the log's now. (Keeping merely the newest before ``position`` lost it
        when a record was written and its commit never made: after a kill between the
        two, the next run's first record dropped the position the log still held, and
        the run after that could not resume.)"""
        kept = [p for p in self.positions if p.version == logged][-1:]
        self.positions = [*kept, position]
        document = {
            "format_version": RECORD_VERSION,
            "name": self.name,
            "log_id": self.log_id,
            "positions": [p.to_json() for p in self.positions],
        }
        storage.write(record_path(self.name), seal(document))

"""A capture's records in the log (the snapshot plan, MySQL's position record) belong to
one log: read back by it, refused by another (a log re-created over a stale record must
not resume from a position of the log that was there before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replog.capture.mysql.positions import FILE, MARIADB, BinlogPosition, PositionRecord
from replog.capture.snapshot import SnapshotPlan, TableSnapshot
from replog.errors import LogIdentityError
from replog.log import ReplicationLog


def test_a_plan_is_read_back_by_its_log_and_refused_by_another(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    plan = SnapshotPlan("s1", log.log_id, tables={"public.t": 7})
    plan.queue.append(TableSnapshot("public.t", 7, "initial", estimate=3))
    plan.save(log.storage)
    found = SnapshotPlan.load(log.storage, "s1", log.log_id)
    assert found is not None and found.tables == {"public.t": 7}
    assert [owed.table for owed in found.queue] == ["public.t"]
    assert SnapshotPlan.load(log.storage, "other", log.log_id) is None
    with pytest.raises(LogIdentityError, match=r"belongs to log .*stale capture record"):
        SnapshotPlan.load(log.storage, "s1", "another-log")


def test_a_position_record_is_read_back_by_its_log_and_refused_by_another(
    tmp_path: Path,
) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    first = BinlogPosition(MARIADB, FILE, "binlog.000001", 400, server_id=1)
    second = BinlogPosition(MARIADB, FILE, "binlog.000001", 900, server_id=1)
    record = PositionRecord("m", log.log_id, [])
    record.write(log.storage, first, logged=0)
    record.write(log.storage, second, logged=first.version)
    found = PositionRecord.load(log.storage, "m", log.log_id)
    assert found is not None
    assert found.at(second.version) == second and found.at(first.version) == first
    assert PositionRecord.load(log.storage, "n", log.log_id) is None
    with pytest.raises(LogIdentityError, match=r"belongs to log .*stale capture record"):
        PositionRecord.load(log.storage, "m", "another-log")


def test_a_position_record_keeps_the_logs_position_through_commits_never_made(
    tmp_path: Path,
) -> None:
    """Killed between writing its record and committing, twice in a row: the record
    still names the position the log holds (it once kept only the newest before the one
    being committed, and the third run could not resume: "no record of where that is in
    the binlog", seen in test_capture_mysql_kill)."""
    log = ReplicationLog.create(str(tmp_path / "log"), 1)
    held, lost, again = (
        BinlogPosition(MARIADB, FILE, "binlog.000001", pos, server_id=1) for pos in (400, 900, 1300)
    )
    record = PositionRecord("m", log.log_id, [])
    record.write(log.storage, held, logged=0)  # committed: the log holds 400
    record.write(log.storage, lost, logged=held.version)  # killed before its commit
    resumed = PositionRecord.load(log.storage, "m", log.log_id)
    assert resumed is not None and resumed.at(held.version) == held
    resumed.write(log.storage, again, logged=held.version)  # killed before its commit too
    found = PositionRecord.load(log.storage, "m", log.log_id)
    assert found is not None and found.at(held.version) == held
    assert found.at(again.version) == again

"""The batch-write protocol (replog.checkpoints.batches): a lease for the whole job, tasks
that renew it, one commit, an abort that never deletes what a commit may name."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from support.logcheck import check_log
from support.logs import log_rows

from replog.checkpoints.batches import BatchCommitter
from replog.core import leases
from replog.errors import CommitOutcomeUnknownError
from replog.format.commits import COMMITS_DIR
from replog.format.leases import STAGING
from replog.log import ReplicationLog
from replog.storage import RetryPolicy, Storage
from replog.storage.backends import Durability
from replog.timeutil import use_clock

HOUR_S = 3600


def test_a_lease_renewed_by_tasks_holds_at_the_commit(tmp_path: Path) -> None:
    """Tasks of a long job renewed the lease; marking it committing must keep the renewed
    expiry, or a job committing after the first expiry is refused every time."""
    started = time.time()
    clock = [started]
    with use_clock(lambda: clock[0]):
        log = ReplicationLog.create(str(tmp_path / "log"), 2)
        committer = BatchCommitter(log)
        write = committer.begin()
        clock[0] = started + 13 * HOUR_S  # a task starting 13 h in renews the lease
        renewed = leases.renew(log.storage, write.lease)
        assert renewed is not None and renewed.expires_ms > write.lease.expires_ms
        staged = log.stage(log_rows(5))
        clock[0] = started + 23.9 * HOUR_S  # the driver's copy is about to run out
        assert committer.commit(write, staged) is not None
    assert len(check_log(log)) == 5


def test_an_abort_while_the_commit_may_land_keeps_the_files(tmp_path: Path) -> None:
    """The commit was sent and never answered, and a late task's renewal wrote the lease
    back as "staging" over "committing": abort must still keep the staged files, since
    the commit may land later and name them."""
    url = str(tmp_path / "log")
    created = ReplicationLog.create(url, 2)

    class Unanswered(Storage):
        held: list[tuple[str, bytes]] = []
        silent = True  # while the commit is being sent

        def _create_once(self, path: str, data: bytes, durability: Durability) -> None:
            if f"/{COMMITS_DIR}/" in path:
                self.held.append((path, data))  # sent, not answered, lands later
                raise TimeoutError("no answer")
            super()._create_once(path, data, durability)

        def _read_once(self, path: str) -> bytes:
            if self.silent and any(path == held for held, _ in self.held):
                raise TimeoutError("no answer")
            return super()._read_once(path)

    storage = Unanswered(url, retry=RetryPolicy(attempts=2, first_delay_s=0.001))
    log = ReplicationLog(storage, created.descriptor, auto_compact=False)
    committer = BatchCommitter(log)
    write = committer.begin()
    staged = log.stage(log_rows(10))
    with pytest.raises(CommitOutcomeUnknownError):
        committer.commit(write, staged)
    Unanswered.silent = False
    late_renewal = dataclasses.replace(write.lease, state=STAGING)  # read before the mark
    log.storage.write(late_renewal.relative, late_renewal.to_bytes())
    committer.abort(write, staged)
    assert all(log.storage.exists(segment.path) for segment in staged)
    path, data = Unanswered.held[0]
    Storage(url).backend.create(path, data, Durability.SYNC)  # the put lands after all
    assert len(check_log(ReplicationLog.open(url))) == 10

"""Batch writes into a log (``df.write``): one atomic append of what every task staged.

The protocol (pure; the Spark adapter passes Spark's calls through):

1. :meth:`BatchCommitter.begin`, when the job is planned: take a staging lease (however
   long the tasks run, ``recover`` keeps their files) and note where staging began. The
   returned :class:`BatchWrite` travels, pickled, to the tasks and the committer.
2. Tasks stage their rows (they name no commit yet); each renews the lease if it runs
   low (:func:`replog.core.leases.renew`).
3. :meth:`BatchCommitter.commit`: refuse if the lease was lost or ran out (``recover``
   may have taken the files: nothing is committed, run the job again); mark it
   ``committing``; commit every staged file in one append, exactly once per transaction
   when the write has one; release the lease.
4. :meth:`BatchCommitter.abort`: delete the staged files, unless a commit names them or
   the commit may still land (the lease says ``committing``): then they stay for
   ``recover``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from replog.core import leases, staging
from replog.format.commits import CommitRecord, Transaction
from replog.format.gc import StagingStart
from replog.format.leases import COMMITTING, Lease
from replog.format.segments import StagedSegment
from replog.log import ReplicationLog
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)


@dataclass
class BatchWrite:
    """A planned batch write: its staging lease, where it began staging, and its
    transaction (if it is idempotent). ``in_doubt``: its commit was sent and may land
    (abort must then keep its files, whatever the lease says: a task renewing the lease
    late may have written "staging" over "committing")."""

    lease: Lease
    since: StagingStart
    transaction: Transaction | None = None
    in_doubt: bool = False


class BatchCommitter:
    """Runs the batch-write protocol for one log (driver side)."""

    def __init__(self, log: ReplicationLog) -> None:
        self.log = log

    def begin(self, transaction: Transaction | None = None) -> BatchWrite:
        """Step 1: the lease, then the staging start (before any task stages)."""
        lease = leases.acquire(self.log.storage, f"batch write into {self.log.url}")
        return BatchWrite(lease, StagingStart(self.log.refresh().version, now_ms()), transaction)

    def commit(self, write: BatchWrite, staged: Sequence[StagedSegment]) -> CommitRecord | None:
        """Step 3: the one append; None when the transaction was already in the log."""
        storage = self.log.storage
        held = leases.check_held(storage, write.lease, "this write")
        leases.mark(storage, write.lease, COMMITTING, current=held)
        transaction = write.transaction
        writer = transaction.writer() if transaction is not None else None
        attempt: staging.CommitAttempt | None = None
        try:
            with staging.committing(storage, staged) as attempt:
                write.in_doubt = True
                record = self.log.commit_staged(
                    staged, writer=writer, attempt=attempt, since=write.since, lease=write.lease
                )
        except BaseException:
            if attempt is not None and attempt.safe_to_discard:
                write.in_doubt = False
                leases.release_quietly(storage, write.lease)
            raise
        write.in_doubt = False
        if record is None:
            assert transaction is not None
            self.log.discard_staged(staged)
            logger.warning(
                "%s: transaction %s version %d is already in the log; this write was skipped",
                self.log.url,
                transaction.app_id,
                transaction.version,
            )
        else:
            self.log.maintain()
        leases.release_quietly(storage, write.lease)
        return record

    def abort(self, write: BatchWrite, staged: Sequence[StagedSegment]) -> None:
        """Step 4."""
        paths = [segment.path for segment in staged]
        if paths and self.log.added_since(write.since.version, paths):
            logger.warning("%s: abort ignored: this write's commit is in the log", self.log.url)
            return
        current = leases.read(self.log.storage, write.lease)
        committing = current is not None and current.state == COMMITTING
        if (write.in_doubt or committing) and staged:
            logger.warning(
                "%s: write aborted while its commit may still land; its %d staged files are "
                "kept ('replog recover' deletes them if no commit names them)",
                self.log.url,
                len(staged),
            )
            return
        self.log.discard_staged(staged)
        leases.release(self.log.storage, write.lease)

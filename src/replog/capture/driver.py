"""What every capture's loop shares, whatever it reads (PostgreSQL's slot in
:mod:`replog.capture.postgres`, MySQL's binlog in :mod:`replog.capture.mysql.capture`):
the run record around the loop, the idempotent commit of a batch with its schemas
registered first, the progress a batch adds and the snapshot queue's progress, the staging
leases of dead runs, and the snapshot plan saved when it changed.

A capture subclasses :class:`CaptureDriver` and gives its loop (``_run``), how it names
itself, and how far behind the source it is. This module never imports pyspark.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from replog.capture.batch import Batch
from replog.capture.progress import CaptureProgress
from replog.capture.running import RunRecord
from replog.capture.snapshot import SnapshotPlan
from replog.core import leases
from replog.errors import CaptureError, TransactionOrderError
from replog.format.commits import Transaction
from replog.log import ReplicationLog
from replog.schemas import registry
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[CaptureProgress], None]

_Driver = TypeVar("_Driver", bound="CaptureDriver")


class SchemaMaker(Protocol):
    """An event maker: the schemas its events were given, by digest."""

    schemas: dict[str, tuple[str, dict[str, Any]]]


class CaptureDriver:
    """One capture of a source into one log: the parts of its loop that do not depend on
    the source (see the module docstring). ``stop`` ends a following capture after the
    commit in progress."""

    run_record: RunRecord
    events: SchemaMaker
    plan: SnapshotPlan | None
    identity: str
    """How errors name this capture (``capture of slot 's1'``)."""
    reads: str
    """What it reads, for errors (``the slot``)."""
    one_per: str
    """What two captures must not share (``slot``)."""

    def __init__(
        self,
        log: ReplicationLog,
        app_id: str,
        *,
        stop: threading.Event | None,
        progress: ProgressCallback | None,
    ) -> None:
        self.log = log
        self.app_id = app_id
        self.stop = stop or threading.Event()
        self.on_progress = progress
        self.progress = CaptureProgress()
        self.plan = None
        self._plan_changed = False
        self._snapshotted = False
        """A snapshot was owed during this run (for SnapshotCompleted)."""
        self._logged = 0
        """The position the log holds as far as this capture knows (0: none): each commit
        must follow it, so a second capture of the source cannot commit over this one's."""
        self._registered: set[str] = set()

    # -- what a capture gives --------------------------------------------------------------

    @property
    def _lease_owner(self) -> str:
        """The owner of its staging leases (the same for every run of this capture)."""
        raise NotImplementedError

    def _run(self) -> None:
        """The loop: snapshot what is owed while streaming."""
        raise NotImplementedError

    def _lag_bytes(self) -> int | None:
        """How far behind the source's position capture is (None: not known now)."""
        raise NotImplementedError

    def _table_ids(self) -> dict[str, int]:
        """The captured tables as the plan keeps them."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Driver) -> _Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> CaptureProgress:
        """Snapshot what is owed while streaming, until caught up with nothing owed (or,
        following, until stopped). How it ended is written to the log's run record."""
        try:
            self._run()
        except BaseException as exc:
            self.progress.errors += 1
            self.run_record.stopped(self.progress.position, exc)
            raise
        self.run_record.stopped(self.progress.position)
        return self.progress

    def _release_dead_leases(self) -> None:
        """Staging leases of earlier runs of this capture: their runs are dead (one capture
        per source; a second one is refused at its commit), so their staged files, never
        committed, are ``recover``'s to collect in minutes, not in 24 hours. Not at once: a
        run that froze (and lost its connection) may be between its commit's lease check
        and its put (:func:`leases.wind_down`)."""
        found = leases.leases(self.log.storage)
        for lease in found.readable:
            if lease.owner == self._lease_owner:
                logger.info("winding down staging lease %s of an earlier run", lease.lease_id)
                try:
                    leases.wind_down(self.log.storage, lease)
                except Exception as exc:  # it then expires on its own, in a day
                    logger.warning("could not wind down staging lease %s: %s",
                                   lease.lease_id, exc)  # fmt: skip

    # -- progress ----------------------------------------------------------------------------

    def _report(self, *, idle: bool = False) -> None:
        """Bring the progress up to date and hand it to the callback (after each batch:
        each snapshot chunk, each commit, each empty poll)."""
        progress = self.progress
        lag = self._lag_bytes()
        if lag is not None:
            progress.lag_bytes = lag
        if idle:
            progress.lag_ms = 0  # caught up: nothing committed at the source is unread
        queue = self.plan.queue if self.plan is not None else []
        progress.snapshot_table = queue[0].table if queue else None
        progress.snapshot_tables_left = len(queue)
        progress.snapshot_running = bool(queue)
        progress.snapshot_completed = self._snapshotted and not queue
        progress.snapshot_rows_total = progress.snapshot_rows + sum(
            max(owed.estimate - owed.rows, 0) for owed in queue
        )
        if self.on_progress is not None:
            self.on_progress(progress)

    def _counted(
        self, batch: Batch, *, snapshot_rows: int, captured: int, last_commit_ms: int | None
    ) -> None:
        """Add a batch read to the progress: its changes (not its snapshot rows), its
        transactions that carried changes, how far behind the source's commits it was."""
        progress = self.progress
        progress.rows += batch.events - snapshot_rows
        progress.count(batch.counts)
        progress.transactions += captured
        if last_commit_ms is not None:
            progress.last_commit_ms = last_commit_ms
            progress.lag_ms = max(now_ms() - last_commit_ms, 0)

    def _never_again(self, snapshot: str, reason: str, qualified: str) -> bool:
        """Whether snapshots are off (``snapshot`` is ``--snapshot``): then a table whose
        rows are owed again (``reason``) is not snapshotted, with a warning."""
        if snapshot == "initial":
            return False
        logger.warning("%s: %s is not snapshotted again (--snapshot never)", reason, qualified)
        return True

    def _snapshot_owed(self) -> bool:
        return self.plan is not None and self.plan.current is not None

    def _save_plan(self) -> None:
        if self.plan is not None and self._plan_changed:
            self.plan.tables = self._table_ids()
            self.plan.save(self.log.storage)
            self._plan_changed = False

    # -- committing --------------------------------------------------------------------------

    def _commit_batch(self, batch: Batch, version: int) -> bool:
        """One atomic commit of ``batch`` recording ``version`` as the capture's position
        (also with no events: transactions of tables not captured move it on), its schemas
        registered first. Whether it landed (False: the log holds that position already,
        or a later one)."""
        transaction = Transaction(self.app_id, version, follows=self._logged)
        self._register()
        try:
            record = batch.commit(transaction)
        except TransactionOrderError as exc:
            raise CaptureError(
                f"another {self.identity} committed to {self.log.url} while this one read "
                f"{self.reads} ({exc}); this capture stops without committing (the changes "
                f"it read would be doubled): run one capture per {self.one_per}"
            ) from exc
        if record is None:
            self._logged = self.log.transaction_version(self.app_id) or 0
            return False
        self.progress.commits += 1
        self._logged = version
        return True

    def _register(self) -> None:
        """Store (put-if-absent) each schema an event was given that this capture has not
        stored yet: before the commit, so a reader that sees an event finds its schema."""
        for digest, (collection, schema) in list(self.events.schemas.items()):
            if digest not in self._registered:
                registry.register(self.log.storage, collection, schema, digest)
                self._registered.add(digest)

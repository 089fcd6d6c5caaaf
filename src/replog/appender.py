"""Group commit: appends from many threads of one process batched into one commit.

A log takes commits one after another (each is a put-if-absent of the next version), so
a process whose threads each append a few events spends its time in commit round trips.
A :class:`GroupAppender` collects what its callers submit for up to ``linger_ms`` (or
until ``max_events`` wait), appends it as one commit from one sender thread, and tells
each caller its own outcome through a future, as Kafka's producer batches records.

Each caller's events are validated when submitted (a bad event fails only its caller,
before anything is queued). An append with a transaction (idempotent) is committed on
its own; appends are committed in submission order (plain appends submitted between
two transactional ones share a commit). A failed commit fails the futures of every caller in it:
nothing of theirs was committed, unless the error is ``CommitOutcomeUnknownError``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pyarrow as pa

from replog.errors import InvalidOptionError
from replog.format.commits import CommitRecord, Transaction
from replog.format.events import events_from_records, events_from_table
from replog.log import ReplicationLog

logger = logging.getLogger(__name__)

DEFAULT_LINGER_MS = 5.0
DEFAULT_MAX_EVENTS = 100_000


@dataclass
class _Pending:
    rows: pa.Table
    transaction: Transaction | None
    future: Future[CommitRecord | None] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


class GroupAppender:
    """Thread-safe appends to one log, committed in groups by one sender thread.

    Example:
        >>> with GroupAppender(replog.open_log(url), linger_ms=5) as appender:  # doctest: +SKIP
        ...     record = appender.append([{"key": "o/1", "data": {"total": 9.5}}])
    """

    def __init__(
        self,
        log: ReplicationLog,
        *,
        linger_ms: float = DEFAULT_LINGER_MS,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        if linger_ms < 0 or max_events < 1:
            raise InvalidOptionError(
                f"linger_ms must be >= 0 and max_events >= 1, got {linger_ms} and {max_events}"
            )
        self.log = log
        self.linger_s = linger_ms / 1000
        self.max_events = max_events
        self.commits = 0
        """Commits made so far (for reports: appends / commits is the grouping)."""
        self._queue: list[_Pending] = []
        self._queued_events = 0
        self._closed = False
        self._changed = threading.Condition()
        self._sender: threading.Thread | None = None

    # -- callers ---------------------------------------------------------------------------

    def submit(
        self,
        events: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
        *,
        transaction: Transaction | None = None,
    ) -> Future[CommitRecord | None]:
        """Queue ``events`` for the next group; the future holds the commit that carries
        them (None if there was nothing to append or the transaction was already in).

        Raises:
            InvalidEventError: an event is malformed (nothing was queued).
            InvalidOptionError: the appender is closed.
        """
        if isinstance(events, pa.Table | pa.RecordBatch):
            rows = events_from_table(events)
        else:
            rows = events_from_records(events)
        pending = _Pending(rows, transaction)
        if rows.num_rows == 0:
            pending.future.set_result(None)
            return pending.future
        with self._changed:
            if self._closed:
                raise InvalidOptionError(f"the appender of {self.log.url} is closed")
            self._queue.append(pending)
            self._queued_events += rows.num_rows
            if self._sender is None:
                try:
                    self._start_sender()
                except RuntimeError:  # no thread to be had: nothing was queued
                    self._queue.remove(pending)
                    self._queued_events -= rows.num_rows
                    raise
            self._changed.notify_all()
        return pending.future

    def _start_sender(self) -> None:
        """Start the sender thread (the caller holds the lock)."""
        sender = threading.Thread(
            target=self._run, name=f"replog-appender-{self.log.url}", daemon=True
        )
        self._sender = sender
        try:
            sender.start()
        except BaseException:
            self._sender = None
            raise

    def append(
        self,
        events: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
        *,
        transaction: Transaction | None = None,
    ) -> CommitRecord | None:
        """:meth:`submit` and wait for the outcome (re-raising the commit's error)."""
        return self.submit(events, transaction=transaction).result()

    def close(self) -> None:
        """Commit what is queued, then stop the sender (waits for it)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        while True:
            with self._changed:
                sender = self._sender
            if sender is None or sender is threading.current_thread():
                return
            sender.join()
            with self._changed:
                if self._sender is sender:  # it ended by draining the queue
                    return

    def __enter__(self) -> GroupAppender:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- the sender ------------------------------------------------------------------------

    def _next_group(self) -> list[_Pending] | None:
        """Wait for work, linger for more, and take a group (None: closed and drained)."""
        with self._changed:
            while not self._queue and not self._closed:
                self._changed.wait()
            if not self._queue:
                return None
            deadline = self._queue[0].arrived + self.linger_s
            while not self._closed and self._queued_events < self.max_events:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            group: list[_Pending] = []
            events = 0
            while self._queue and (
                not group or events + self._queue[0].rows.num_rows <= self.max_events
            ):
                pending = self._queue.pop(0)
                self._queued_events -= pending.rows.num_rows
                # From here on its caller cannot cancel it (it will be sent); one it
                # cancelled while queued is not sent (nor resolved: that would raise).
                if pending.future.set_running_or_notify_cancel():
                    group.append(pending)
                    events += pending.rows.num_rows
            return group

    def _run(self) -> None:
        """The sender's loop. Should it end by an error (none is expected: commits' errors
        go to their callers), a new sender takes over what is queued, so no caller waits
        forever."""
        try:
            self._send()
        except BaseException:
            with self._changed:
                self._sender = None
                if self._queue:
                    try:
                        self._start_sender()
                    except BaseException as exc:
                        self._fail_queued(exc)
            raise

    def _fail_queued(self, exc: BaseException) -> None:
        """Fail every queued caller with ``exc`` (nothing of theirs was sent; the caller
        holds the lock)."""
        for pending in self._queue:
            if pending.future.set_running_or_notify_cancel():  # else its caller cancelled it
                pending.future.set_exception(exc)
        self._queue.clear()
        self._queued_events = 0

    def _send(self) -> None:
        while (group := self._next_group()) is not None:
            plain: list[_Pending] = []
            for pending in group:  # in submission order: a key's events keep theirs
                if pending.transaction is None:
                    plain.append(pending)
                    continue
                if plain:
                    self._commit(plain, None)
                    plain = []
                self._commit([pending], pending.transaction)
            if plain:
                self._commit(plain, None)

    def _commit(self, group: list[_Pending], transaction: Transaction | None) -> None:
        try:
            rows = pa.concat_tables([pending.rows for pending in group])
            record = self.log.append(rows, transaction=transaction)
        except BaseException as exc:  # every caller in the group hears of it
            # ... and only they: the sender goes on with the next group (a BaseException
            # here comes from code that raised it, never from a signal: this is not the
            # main thread).
            for pending in group:
                pending.future.set_exception(exc)
            return
        self.commits += 1
        for pending in group:
            pending.future.set_result(record)

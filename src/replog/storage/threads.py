"""Work in threads that still gets done when no thread can be started.

Once a program's main thread has returned, Python refuses new work in thread pools
("cannot schedule new futures after interpreter shutdown") while the program's other
(non-daemon) threads still run, and may still append to a log. A write must not fail
then, and above all an append whose commit landed must not be reported failed because
some optional work after it could not be scheduled. :func:`run_all` and :func:`submit`
run the calls in the calling thread instead when a pool refuses them.

A pool can also refuse *after* queueing a call: ``submit`` queues the work item, then
fails to start a thread ("can't start new thread"). A thread the pool already has may
still take the item. Each call is therefore a :class:`_Task` that runs once, whichever
thread claims it first; its own future carries the result.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class _Task(Generic[T]):
    """A call run at most once, in a copy of its creator's context (its clocks:
    :mod:`replog.timeutil`), whichever thread runs it first; its future holds the result
    or the exception."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._call = call
        self._context = contextvars.copy_context()
        self._claim = threading.Lock()
        self.future: Future[T] = Future()

    def skip(self) -> bool:
        """Make sure no thread runs the call; False if one has it already."""
        if not self._claim.acquire(blocking=False):
            return False
        self._cancel()
        return True

    def _cancel(self) -> None:
        """Cancel the pending future and tell its waiters (``wait`` counts a cancelled
        future done only once notified, as an executor does)."""
        self.future.cancel()
        self.future.set_running_or_notify_cancel()

    def dropped(self, queued: Future[None]) -> None:
        """The pool's own future for this task ended: if the pool cancelled it
        (``shutdown(cancel_futures=True)``) or broke before any thread ran the call,
        this task's future ends the same way rather than waiting forever."""
        if not queued.cancelled() and queued.exception() is None:
            return
        if not self._claim.acquire(blocking=False):
            return  # a thread ran (or runs) the call: its future is resolved there
        if queued.cancelled():
            self._cancel()
        else:
            self.future.set_exception(queued.exception())

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # another thread has it
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self._context.run(self._call))
        except BaseException as exc:  # the caller reads it from the future, as from a pool
            self.future.set_exception(exc)


def _queue(pool: ThreadPoolExecutor, task: _Task[T]) -> bool:
    """``task`` handed to ``pool``; False if the pool refused it (it may still have
    queued it: ``task`` runs once either way)."""
    try:
        queued = pool.submit(task.run)
    except RuntimeError as exc:
        logger.debug("a thread pool refused work: %s", exc)
        return False
    queued.add_done_callback(task.dropped)
    return True


def run_all(calls: Sequence[Callable[[], T]], *, threads: int) -> list[Future[T]]:
    """Run ``calls`` in up to ``threads`` threads and wait for all of them; their futures,
    in order. If no thread can be started (the interpreter is shutting down, or the
    system refuses a thread), every call not yet started runs in this thread instead.
    Each call runs in a copy of the caller's context."""
    tasks = [_Task(call) for call in calls]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(calls)))) as pool:
        for index, task in enumerate(tasks):
            if not _queue(pool, task):  # no new threads: do the rest here
                for rest in tasks[index:]:
                    rest.run()
                break
    return [task.future for task in tasks]


def submit(pool: ThreadPoolExecutor, call: Callable[[], T]) -> Future[T]:
    """``call`` submitted to ``pool`` in a copy of the caller's context, or run in this
    thread if the pool takes no more work: for work that must be done."""
    task = _Task(call)
    if not _queue(pool, task):
        task.run()
    return task.future


def start(pool: ThreadPoolExecutor, call: Callable[[], T]) -> Future[T] | None:
    """``call`` submitted to ``pool`` in a copy of the caller's context; None if the pool
    takes no more work (the interpreter is shutting down): for optional background work,
    which is then skipped (unless a thread the pool already had took it at once: then its
    future)."""
    task = _Task(call)
    if _queue(pool, task) or not task.skip():
        return task.future
    return None

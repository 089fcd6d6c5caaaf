"""Work in threads that still gets done when no thread can be started.

Once a program's main thread has returned, Python refuses new work in thread pools
("cannot schedule new futures after interpreter shutdown") while the program's other
(non-daemon) threads still run, and may still append to a log. A write must not fail
then, and above all an append whose commit landed must not be reported failed because
some optional work after it could not be scheduled. :func:`run_all` runs the calls in
the calling thread instead when a pool refuses them.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


def _done(call: Callable[[], T]) -> Future[T]:
    """``call`` run here, as a finished future (its result or its exception)."""
    future: Future[T] = Future()
    try:
        future.set_result(call())
    except BaseException as exc:  # the caller reads it from the future, as from a pool
        future.set_exception(exc)
    return future


def run_all(calls: Sequence[Callable[[], T]], *, threads: int) -> list[Future[T]]:
    """Run ``calls`` in up to ``threads`` threads and wait for all of them; their futures,
    in order. If no thread can be started (the interpreter is shutting down, or the
    system refuses a thread), every call not yet started runs in this thread instead.
    Each call runs in a copy of the caller's context (its clocks: :mod:`replog.timeutil`)."""
    futures: list[Future[T]] = []
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(calls)))) as pool:
        for index, call in enumerate(calls):
            try:
                futures.append(pool.submit(contextvars.copy_context().run, call))
            except RuntimeError as exc:  # no new threads: do the rest here
                logger.debug("running %d calls in this thread: %s", len(calls) - index, exc)
                futures.extend(_done(rest) for rest in calls[index:])
                break
    return futures


def submit(pool: ThreadPoolExecutor, call: Callable[[], T]) -> Future[T]:
    """``call`` submitted to ``pool`` in a copy of the caller's context, or run in this
    thread (a finished future) if the pool takes no more work: for work that must be
    done, as :func:`run_all`'s."""
    try:
        return pool.submit(contextvars.copy_context().run, call)
    except RuntimeError as exc:
        logger.debug("running a call in this thread: %s", exc)
        return _done(call)


def start(pool: ThreadPoolExecutor, call: Callable[[], T]) -> Future[T] | None:
    """``call`` submitted to ``pool``; None if the pool takes no more work (the
    interpreter is shutting down): for optional background work, which is then skipped.
    It runs in a copy of the caller's context."""
    try:
        return pool.submit(contextvars.copy_context().run, call)
    except RuntimeError as exc:
        logger.debug("background work skipped: %s", exc)
        return None

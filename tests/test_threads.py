"""Threads misbehaving (issue 32, hole 2): a commit that landed is never reported failed,
and no caller of a GroupAppender waits forever.

Once a program's main thread has returned, Python refuses new work in thread pools while
its other threads still run; those threads' appends must work, and above all an append
whose commit landed must not be told it failed (its caller would append it again).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from replog.appender import GroupAppender
from replog.log import ReplicationLog

AFTER_MAIN_RETURNED = textwrap.dedent(
    """
    import json, sys, threading, time
    from replog.appender import GroupAppender
    from replog.log import ReplicationLog

    url, mode = sys.argv[1], sys.argv[2]
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    log = ReplicationLog.create(url, 2, storage_options=options)
    for n in range(7):  # seven small shared files: the 8th commit's writer merges them
        log.append([{"key": f"k{n}-{j}", "data": {"n": n}} for j in range(4)])
    appender = GroupAppender(log, linger_ms=1) if mode == "group" else None
    main = threading.main_thread()
    ReplicationLog.open(url, storage_options=options).refresh()  # imports done before
    printing = threading.Lock()

    def say(outcome):
        with printing:
            print(json.dumps(outcome), flush=True)

    def producer(name):
        main.join()  # the main thread has returned: the interpreter is shutting down
        events = [{"event_id": f"{name}-{j}", "key": f"{name}-{j}", "data": {}} for j in range(5)]
        try:
            if appender is None:  # a log object is not thread-safe: one each
                record = ReplicationLog.open(url, storage_options=options).append(events)
            else:
                record = appender.append(events)
            say({"ok": record.version})
        except BaseException as exc:
            say({"failed": f"{type(exc).__name__}: {exc}"})

    for name in ("p1", "p2"):
        threading.Thread(target=producer, args=(name,)).start()
    """
)


def run_after_main(tmp_path: Path, url: str, mode: str, options: dict[str, object]) -> list[dict]:
    script = tmp_path / "after_main.py"
    script.write_text(AFTER_MAIN_RETURNED)
    done = subprocess.run(
        [sys.executable, str(script), url, mode, json.dumps(options)],
        capture_output=True,
        text=True,
        env={**os.environ},
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("mode", ["log", "group"])
def test_appends_after_the_main_thread_returned_are_not_told_they_failed(
    tmp_path: Path, mode: str
) -> None:
    """The 8th commit's writer submits a merge to its background pool, which refuses it
    at shutdown: the append (and every caller of a GroupAppender) was told FAILED with
    its 5 events in the log, so a retry doubled them."""
    url = str(tmp_path / "log")
    outcomes = run_after_main(tmp_path, url, mode, {})
    assert outcomes and all("ok" in outcome for outcome in outcomes), outcomes
    ids = ReplicationLog.open(url).read_all().column("event_id").to_pylist()
    assert sorted(i for i in ids if i[:2] in ("p1", "p2")) == sorted(
        f"{p}-{j}" for p in ("p1", "p2") for j in range(5)
    )


def test_appends_after_the_main_thread_returned_work_on_s3(tmp_path: Path, s3: Any) -> None:
    """On remote storage every read and write goes through thread pools: they run in the
    caller's thread when the pools refuse work."""
    outcomes = run_after_main(tmp_path, s3.url("after-main"), "log", s3.storage_options)
    assert outcomes and all("ok" in outcome for outcome in outcomes), outcomes


class Interrupted(BaseException):
    """What code under a commit may raise that is not an ``Exception`` (``SystemExit``
    from a library, a test's injection)."""


class FailsOnce(ReplicationLog):
    failed = False

    def append(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not type(self).failed:
            type(self).failed = True
            raise Interrupted("injected")
        return super().append(*args, **kwargs)


def test_a_base_exception_in_the_sender_fails_its_callers_and_no_later_one(
    tmp_path: Path,
) -> None:
    """The sender re-raised a BaseException and died, leaving itself registered: every
    later submit was queued for a thread that no longer ran (its caller waited forever;
    here ``close`` returns at once and the future is never resolved)."""
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    log = FailsOnce.open(url)
    appender = GroupAppender(log, linger_ms=0)
    first = appender.submit([{"key": "a", "data": {}}])
    with pytest.raises(Interrupted):
        first.result()
    later = appender.submit([{"key": "b", "data": {}}])
    appender.close()
    assert later.done()
    record = later.result()
    assert record is not None and record.version == 1


def one_thread_per_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's second thread fails to start ("can't start new thread"), after
    ``ThreadPoolExecutor.submit`` has queued the work item, as the system does."""
    from concurrent.futures import ThreadPoolExecutor

    adjust = ThreadPoolExecutor._adjust_thread_count

    def one_thread_only(self: ThreadPoolExecutor) -> None:
        if self._threads:
            raise RuntimeError("can't start new thread")
        adjust(self)

    monkeypatch.setattr(ThreadPoolExecutor, "_adjust_thread_count", one_thread_only)


def test_a_call_queued_before_its_thread_failed_to_start_runs_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ThreadPoolExecutor.submit`` queues the work item, then starts a thread: when the
    start fails ("can't start new thread") a thread the pool already has may still take
    the item. run_all and submit ran it in the caller's thread as well: twice."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from replog.storage import threads

    one_thread_per_pool(monkeypatch)
    runs: list[int] = []
    lock = threading.Lock()

    def call(n: int) -> int:
        time.sleep(0.01)  # the pool's one thread is busy while the next is refused
        with lock:
            runs.append(n)
        return n * n

    futures = threads.run_all([functools.partial(call, n) for n in range(6)], threads=4)
    assert [f.result() for f in futures] == [n * n for n in range(6)]
    assert sorted(runs) == list(range(6))
    runs.clear()
    with ThreadPoolExecutor(max_workers=3) as pool:
        submitted = [threads.submit(pool, functools.partial(call, n)) for n in range(4)]
    assert [f.result() for f in submitted] == [0, 1, 4, 9]
    assert sorted(runs) == [0, 1, 2, 3]


def test_background_work_a_pool_refused_is_skipped_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start`` said "skipped" (None) while the refused item stayed queued, and a thread
    the pool already had ran it later: a second merge beside the one the caller started
    next. Now a refused call never runs, or ``start`` returns the future of the thread
    that took it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from replog.storage import threads

    one_thread_per_pool(monkeypatch)
    gate = threading.Event()
    ran: list[str] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = threads.start(pool, lambda: gate.wait(5) and ran.append("first"))
        skipped = threads.start(pool, lambda: ran.append("skipped"))
        gate.set()
    assert first is not None and first.result() is None
    assert skipped is None
    assert ran == ["first"]

"""Adversarial tests of storage.threads' _Task wrapping and of files.write_in_turn /
write_files' failure paths."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from replog.core import files
from replog.format.events import events_from_records
from replog.format.segments import Part, given
from replog.log import ReplicationLog
from replog.storage import Storage, threads


def events(count: int, keys: int = 97) -> pa.Table:
    return events_from_records({"key": f"k{n % keys}", "data": {"n": n}} for n in range(count))


def left_files(root: Path) -> list[Path]:
    return [p for p in (root / "shards").rglob("*") if p.is_file()]


# -- threads: a work item the pool drops leaves the _Task's future pending forever ----------


def test_a_submitted_call_the_pool_cancels_still_resolves_its_future() -> None:
    """``submit`` used to return the pool's own future: ``shutdown(cancel_futures=True)``
    cancelled it. Now it returns the _Task's future and throws the pool's away; the pool
    cancels its work item, nothing ever runs ``task.run``, and the returned future stays
    PENDING for good: whoever calls ``result()`` on it waits forever."""
    gate = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    busy = threads.submit(pool, lambda: gate.wait(5))
    queued = threads.submit(pool, lambda: "ran")
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    pool.shutdown(wait=True)
    assert busy.done()
    done, _ = wait([queued], timeout=2)
    assert queued in done, f"future left {queued._state} after the pool dropped its work"  # type: ignore[attr-defined]


def test_background_work_the_pool_cancels_still_resolves_its_future() -> None:
    """Same for ``start`` (background merge / expiry): a caller that waits for its future
    (``LogMaintenance.flush`` waits for ``_merging`` / ``_expiry``) would hang."""
    gate = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    busy = threads.start(pool, lambda: gate.wait(5))
    queued = threads.start(pool, lambda: "ran")
    assert busy is not None and queued is not None
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    pool.shutdown(wait=True)
    done, _ = wait([queued], timeout=2)
    assert queued in done, f"future left {queued._state} after the pool dropped its work"  # type: ignore[attr-defined]


def test_a_call_given_to_a_broken_pool_still_resolves_its_future() -> None:
    """A pool whose thread initializer failed is broken: it fails every queued work item
    with BrokenThreadPool (a plain ``pool.submit`` future carries that). The _Task's
    future is never told and stays PENDING."""

    def broken() -> None:
        raise ValueError("initializer failed")

    pool = ThreadPoolExecutor(max_workers=1, initializer=broken)
    try:
        future = threads.submit(pool, lambda: "ran")
    except RuntimeError:  # refused outright would be fine too (then it ran here)
        return
    done, _ = wait([future], timeout=2)
    pool.shutdown(wait=True)
    assert future in done, f"future left {future._state} by a broken pool"  # type: ignore[attr-defined]


# -- files: a failing directory sync leaves write_files' files behind ------------------------


def failing_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    def sync(self: Storage, relatives: list[str]) -> None:
        raise OSError("injected fsync EIO")

    monkeypatch.setattr(Storage, "sync", sync)


def test_a_small_write_whose_sync_fails_leaves_none_of_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_in_turn deletes every file of the call when a directory sync fails; the
    small-write path (one shared file, ``write_files``) calls ``storage.sync`` outside its
    cleanup, so the error goes up and the file stays on storage, named by nothing."""
    log = ReplicationLog.create(str(tmp_path / "log"), 8)
    failing_sync(monkeypatch)
    with pytest.raises(OSError, match="fsync EIO"):
        files.stage(log.storage, log.shards, events(50))
    assert left_files(tmp_path / "log") == []


def test_files_written_in_parallel_whose_sync_fails_are_all_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through ``write_files``' run_all branch (merges write this way)."""
    log = ReplicationLog.create(str(tmp_path / "log"), 8)
    table = events(40)
    plans: list[Any] = [
        ([Part(0, 0, 20)], functools.partial(given, table.slice(0, 20))),
        ([Part(1, 0, 20)], functools.partial(given, table.slice(20, 20))),
    ]
    failing_sync(monkeypatch)
    with pytest.raises(OSError, match="fsync EIO"):
        files.write_files(log.storage, plans)
    assert left_files(tmp_path / "log") == []

"""``replog recover`` in a thread, held at the moment it lists ``shards/`` (its gc mark is
committed by then), for tests that interleave writers with a collection."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from replog.format.commits import COMMITS_DIR
from replog.format.gc import StagingStart
from replog.format.segments import SHARDS_DIR, StagedSegment
from replog.log import ReplicationLog
from replog.ops import recovery
from replog.timeutil import Clock, use_clock
from support.logcheck import check_intact


class HeldRecover:
    """Starts ``recovery.recover(log, **options)`` in a thread that waits, when it first
    lists ``shards/``, until :meth:`resume`. :meth:`join` re-raises its error.

    ``clock``: the collector's clock (a thread does not inherit the caller's
    :func:`~replog.timeutil.use_clock`); the real one by default."""

    def __init__(
        self,
        log: ReplicationLog,
        monkeypatch: pytest.MonkeyPatch,
        *,
        clock: Clock | None = None,
        **options: Any,
    ) -> None:
        self.listing = threading.Event()
        self._resume = threading.Event()
        self._errors: list[BaseException] = []
        self.report: recovery.RecoveryReport | None = None
        real_list = log.storage._list_once

        def held_list(path: str) -> list[str]:
            if path.rstrip("/").endswith("/" + SHARDS_DIR) and not self.listing.is_set():
                self.listing.set()
                if not self._resume.wait(30):
                    raise TimeoutError("the test never resumed the held recover")
            return real_list(path)

        monkeypatch.setattr(log.storage, "_list_once", held_list)

        def run() -> None:
            try:
                if clock is None:
                    self.report = recovery.recover(log, **options)
                else:
                    with use_clock(clock):
                        self.report = recovery.recover(log, **options)
            except BaseException as exc:
                self._errors.append(exc)

        self._thread = threading.Thread(target=run)
        self._thread.start()
        if not self.listing.wait(30):
            self._resume.set()
            self.join()
            raise TimeoutError("recover never reached its listing")

    @property
    def resumed(self) -> bool:
        return self._resume.is_set()

    def resume(self) -> None:
        self._resume.set()

    def join(self) -> recovery.RecoveryReport:
        """Let it finish; its report, or its error raised here."""
        self._resume.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the held recover did not finish"
        if self._errors:
            raise self._errors[0]
        assert self.report is not None
        return self.report


def commit_during_recover(
    writer: ReplicationLog,
    staged: Sequence[StagedSegment],
    since: StagingStart,
    monkeypatch: pytest.MonkeyPatch,
    **options: Any,
) -> recovery.RecoveryReport:
    """Commit ``staged`` while a recover that began after them holds at its listing (its
    gc mark committed); the recover lists and deletes right before the writer's log
    commit is put. The recover always finishes; its report is returned, or the writer's
    error raised."""
    held = HeldRecover(ReplicationLog.open(writer.url), monkeypatch, **options)
    real_put = writer.storage.put_if_absent

    def put(relative: str, data: bytes, **kw: Any) -> None:
        if relative.startswith(COMMITS_DIR) and not held.resumed:
            held.join()  # the writer made its checks; the collection deletes now
        real_put(relative, data, **kw)

    monkeypatch.setattr(writer.storage, "put_if_absent", put)
    try:
        writer.commit_staged(staged, since=since)
    finally:
        report = held.join()
    return report


def commit_after_recover(
    writer: ReplicationLog,
    staged: Sequence[StagedSegment],
    since: StagingStart,
    report: recovery.RecoveryReport,
) -> None:
    """The collection of ``report`` must have taken none of ``staged``: the writer's
    commit of them, after it, lands, and every file it names exists."""
    deleted = set(report.garbage) & {segment.path for segment in staged}
    assert not deleted, f"recover deleted {sorted(deleted)}, staged after its mark"
    record = writer.commit_staged(staged, since=since)
    assert record is not None and len(record.add) == len(staged)
    missing = [segment.path for segment in staged if not writer.storage.exists(segment.path)]
    assert not missing, f"the commit names deleted files {missing}"
    check_intact(writer.url)

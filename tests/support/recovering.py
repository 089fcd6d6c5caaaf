"""``replog recover`` in a thread, held at the moment it lists ``shards/`` (its gc mark is
committed by then), for tests that interleave writers with a collection."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from replog.format.segments import SHARDS_DIR
from replog.log import ReplicationLog
from replog.ops import recovery


class HeldRecover:
    """Starts ``recovery.recover(log, **options)`` in a thread that waits, when it first
    lists ``shards/``, until :meth:`resume`. :meth:`join` re-raises its error."""

    def __init__(
        self, log: ReplicationLog, monkeypatch: pytest.MonkeyPatch, **options: Any
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

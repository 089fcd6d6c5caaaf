"""A capture's record of itself in the log: who runs it, since when, how far it got, and
how it last ended (``_replog/captures/<slot>.run.json``; FORMAT.md "Capture plans").

DESIGN: a running capture rewrites its record every few seconds (its heartbeat) and on
every state change; ``replog status`` reads it to say whether the capture is running (a
beat within :data:`STALE_MS`), stopped (and why: the last error), or gone silent (killed:
no stop was written). A second capture of the slot into the same log is refused while a
record beats that another process wrote; the source's advisory lock
(:meth:`~replog.capture.source.PostgresSource.lock_slot`) refuses one into any log.
This module never imports psycopg.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict, dataclass, replace
from typing import Any

from replog.errors import CaptureRunningError
from replog.format.sealed import seal, unseal
from replog.storage import Storage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

RUN_VERSION = 1
BEAT_MS = 5_000
"""How often a running capture rewrites its record (at most)."""
STALE_MS = 60_000
"""A record not rewritten for this long is of a capture that is gone (killed)."""


def run_path(slot: str) -> str:
    return f"_replog/captures/{slot}.run.json"


@dataclass(frozen=True)
class CaptureRun:
    """One capture run of a slot, as it last wrote itself down."""

    slot: str
    log_id: str
    host: str
    pid: int
    started_ms: int
    beat_ms: int
    """When it last wrote this record (its clock)."""
    position: int = 0
    """The slot position the log held then."""
    stopped_ms: int | None = None
    """When it stopped (None: it did not say: running, or killed)."""
    error: str | None = None
    """The error it stopped on (None: a clean stop)."""

    def state(self, at_ms: int) -> str:
        """``running``, ``stopped``, ``failed`` or ``gone`` (no beat for :data:`STALE_MS`:
        killed, or its machine died)."""
        if self.stopped_ms is not None:
            return "failed" if self.error else "stopped"
        return "running" if at_ms - self.beat_ms < STALE_MS else "gone"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read(storage: Storage, slot: str) -> CaptureRun | None:
    """The record of the slot's last capture run (None: none was written)."""
    path = run_path(slot)
    data = storage.read_optional(path)
    if data is None:
        return None
    body = unseal(data, storage.path(path), max_version=RUN_VERSION)
    body.pop("format_version", None)
    return CaptureRun(**body)


class RunRecord:
    """This process's run of the slot's capture, written to the log as it goes."""

    def __init__(self, storage: Storage, slot: str, log_id: str) -> None:
        self.storage = storage
        now = now_ms()
        self.run = CaptureRun(slot, log_id, socket.gethostname(), os.getpid(), now, now)
        self._written_ms = 0

    def claim(self) -> None:
        """Write the record, unless another live process of this machine runs the log's
        capture of the slot: then :class:`CaptureRunningError` naming it. (A record of
        another machine is taken over: the source's advisory lock, which the caller holds,
        says no capture of the slot is connected; a killed capture is restarted at once.)"""
        found = read(self.storage, self.run.slot)
        now = now_ms()
        if (
            found is not None
            and found.state(now) == "running"
            and found.host == self.run.host
            and found.pid != self.run.pid
            and _alive(found.pid)
        ):
            raise CaptureRunningError(
                f"the log's capture of slot {self.run.slot!r} is running on {found.host} "
                f"(process {found.pid}, last seen {(now - found.beat_ms) / 1000:.0f} s ago): "
                f"one capture per slot. Stop it first"
            )
        self._write(self.run)

    def beat(self, position: int, *, force: bool = False) -> None:
        """Show that the run is alive and how far it got (written at most every
        :data:`BEAT_MS` unless ``force``)."""
        now = now_ms()
        if not force and now - self._written_ms < BEAT_MS:
            return
        self._write(replace(self.run, beat_ms=now, position=position))

    def stopped(self, position: int, error: BaseException | None = None) -> None:
        """Write how the run ended (never raises: the run is ending anyway)."""
        now = now_ms()
        text = None if error is None else f"{type(error).__name__}: {error}"[:2000]
        try:
            self._write(
                replace(self.run, beat_ms=now, position=position, stopped_ms=now, error=text)
            )
        except Exception as exc:
            logger.warning("could not write how capture of slot %s ended: %s", self.run.slot, exc)

    def _write(self, run: CaptureRun) -> None:
        self.run = run
        self._written_ms = run.beat_ms
        document = {"format_version": RUN_VERSION, **asdict(run)}
        self.storage.write(run_path(run.slot), seal(document))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def describe(run: CaptureRun, at_ms: int) -> dict[str, Any]:
    """The record with its state, as status reports give it."""
    return {**run.to_json(), "state": run.state(at_ms)}


__all__ = ["BEAT_MS", "STALE_MS", "CaptureRun", "RunRecord", "describe", "read", "run_path"]

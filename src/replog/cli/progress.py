"""What a long ``replog`` command shows while it works, on stderr.

On a terminal: a live display drawn by ``rich`` (a bar with done/total, rate and time
left; a status line for work of unknown size). Elsewhere (a log file, a pipe): a plain
line at most every :data:`PLAIN_EVERY_S` seconds and one when the work ends. Under
``--json``: nothing (stdout carries the one document; stderr stays quiet for scripts).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import IO

from rich.console import Console, RenderableType
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from replog.capture.progress import CaptureProgress
from replog.cli.results import age

PLAIN_EVERY_S = float(os.environ.get("REPLOG_PROGRESS_EVERY_S", "1"))
"""Plain progress lines come at most this often while the work moves (seconds;
``REPLOG_PROGRESS_EVERY_S`` sets it: a log collector may want fewer, a test every one)."""
IDLE_EVERY_S = 60.0
"""...and at least this often while a following capture waits for changes."""
FLUSH_EVERY_S = 0.1
"""A terminal display takes counts at most this often (counting a line of an 8 GiB
file through rich would cost more than parsing it)."""

BYTES = "B"


def _amount(value: float, unit: str) -> str:
    return decimal(int(value)) if unit == BYTES else f"{int(value):,} {unit}".rstrip()


def _seconds(value: float) -> str:
    value = max(value, 0.0)
    if value >= 3600:
        return f"{value / 3600:.1f}h"
    if value >= 60:
        return f"{value / 60:.1f}m"
    return f"{value:.0f}s"


class Work:
    """One piece of work being shown: counts go in with :meth:`advance` or :meth:`update`
    (from any thread), :meth:`done` ends it."""

    def __init__(self, description: str, total: float | None, unit: str) -> None:
        self.description, self.total, self.unit = description, total, unit
        self.completed = 0.0
        self.detail = ""
        self.moves = 0
        """Changes counted so far (work that never moved ends without a word)."""
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def advance(self, amount: float) -> None:
        with self._lock:
            self.completed += amount
            self.moves += 1
            self._moved()

    def update(
        self,
        *,
        completed: float | None = None,
        total: float | None = None,
        detail: str | None = None,
        description: str | None = None,
    ) -> None:
        with self._lock:
            if completed is not None:
                self.completed = completed
            if total is not None:
                self.total = total
            if detail is not None:
                self.detail = detail
            if description is not None:
                self.description = description
            self.moves += 1
            self._moved()

    def done(self, summary: str | None = None) -> None:
        """The work ended: ``summary`` replaces the progress if given; otherwise the
        final state stays (plain: a last line), unless the work never moved."""

    def _moved(self) -> None:
        """Called under the lock after each change."""

    def line(self) -> str:
        """The state as one plain line."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.completed / elapsed
        if self.total:
            share = min(self.completed / self.total, 1.0)
            if self.unit == BYTES:
                amount = f"{decimal(int(self.completed))} of {decimal(int(self.total))}"
            else:
                amount = f"{int(self.completed):,} of {int(self.total):,} {self.unit}".rstrip()
            text = f"{self.description}: {amount} ({share:.0%})"
        else:
            text = f"{self.description}: {_amount(self.completed, self.unit)}"
        if self.completed:
            speed = f"{decimal(int(rate))}/s" if self.unit == BYTES else f"{rate:,.0f}/s"
            text += f", {speed}"
            if self.total and self.total > self.completed:
                text += f", about {_seconds((self.total - self.completed) / rate)} left"
        return text + (f"; {self.detail}" if self.detail else "")


class _PlainWork(Work):
    def __init__(self, display: PlainDisplay, description: str, total: float | None, unit: str):
        super().__init__(description, total, unit)
        self.display = display
        self.shown = time.monotonic()
        self.lines = 0

    def _moved(self) -> None:
        now = time.monotonic()
        if now - self.shown >= self.display.every_s:
            self.shown = now
            self.lines += 1
            self.display.note(self.line())

    def done(self, summary: str | None = None) -> None:
        """A last line, unless the work was quick (under a line's interval, no line yet):
        a log gets no progress of work that needed none."""
        quick = not self.lines and time.monotonic() - self.started < self.display.every_s
        if (summary or self.moves) and not quick:
            self.display.note(summary or self.line())


class _RichWork(Work):
    def __init__(self, display: RichDisplay, description: str, total: float | None, unit: str):
        super().__init__(description, total, unit)
        self.display = display
        self.flushed = 0.0
        self.task: TaskID = display.progress.add_task(
            description, total=total, unit=unit, detail=""
        )

    def _moved(self) -> None:
        now = time.monotonic()
        if now - self.flushed >= FLUSH_EVERY_S:
            self.flushed = now
            self._flush()

    def _flush(self) -> None:
        self.display.progress.update(
            self.task,
            completed=self.completed,
            total=self.total,
            description=self.description,
            detail=self.detail,
        )

    def done(self, summary: str | None = None) -> None:
        with self._lock:
            self._flush()
        self.display.progress.stop_task(self.task)
        if summary or not self.moves:
            self.display.progress.remove_task(self.task)
        if summary:
            self.display.note(summary)


class _Bar(ProgressColumn):
    """A bar for work of known size; none for a status line."""

    def __init__(self) -> None:
        super().__init__()
        self._bar = BarColumn()

    def render(self, task: Task) -> RenderableType:
        return self._bar.render(task) if task.total is not None else Text("")


class _Speed(ProgressColumn):
    """Bytes or items per second."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = TransferSpeedColumn()

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None:
            return Text("")
        if task.fields.get("unit") == BYTES:
            return self._bytes.render(task)
        return Text(f"{speed:,.0f}/s", style="progress.data.speed")


class _Remaining(TimeRemainingColumn):
    """Time left, for work of known size."""

    def render(self, task: Task) -> Text:
        return super().render(task) if task.total is not None else Text("")


class _Amount(ProgressColumn):
    """``done/total unit``: bytes as sizes, other units as counts."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = DownloadColumn()

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == BYTES:
            return self._bytes.render(task)
        if task.total is None:
            return Text("")
        return Text(
            f"{int(task.completed):,}/{int(task.total):,} {task.fields.get('unit', '')}",
            style="progress.download",
        )


class Display:
    """Shows nothing (``--json``); the base of the two that show something."""

    def work(self, description: str, total: float | None = None, unit: str = "") -> Work:
        return Work(description, total, unit)

    def note(self, text: str) -> None:
        """A line for the operator (a stop being finished, a summary), on stderr."""
        print(f"replog: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the display (a terminal display stops drawing)."""

    def __enter__(self) -> Display:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class PlainDisplay(Display):
    """Plain lines on a stream that is not a terminal."""

    def __init__(self, stream: IO[str] | None = None, every_s: float = PLAIN_EVERY_S) -> None:
        self.stream = stream or sys.stderr
        self.every_s = every_s

    def work(self, description: str, total: float | None = None, unit: str = "") -> Work:
        return _PlainWork(self, description, total, unit)

    def note(self, text: str) -> None:
        print(f"replog: {text}", file=self.stream, flush=True)


class RichDisplay(Display):
    """A live display on a terminal."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.console = Console(file=stream or sys.stderr, stderr=stream is None)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            _Bar(),
            TaskProgressColumn(),
            _Amount(),
            _Speed(),
            TimeElapsedColumn(),
            _Remaining(),
            TextColumn("{task.fields[detail]}"),
            console=self.console,
            refresh_per_second=4,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.progress.start()

    def work(self, description: str, total: float | None = None, unit: str = "") -> Work:
        return _RichWork(self, description, total, unit)

    def note(self, text: str) -> None:
        self.progress.console.print(f"replog: {text}", markup=False, highlight=False)

    def close(self) -> None:
        self.progress.stop()


def display_for(json_output: bool, stream: IO[str] | None = None) -> Display:
    """The display a command shows its progress on: none under ``--json``, a live one on
    a terminal, plain lines elsewhere."""
    stream = stream or sys.stderr
    if json_output:
        return Display()
    if stream.isatty():
        return RichDisplay(stream)
    return PlainDisplay(stream)


class CaptureDisplay:
    """Shows a capture's :class:`CaptureProgress` (its ``progress=`` callback): the
    snapshot as rows done of the estimate, then the stream as a status line; plain,
    the line the docs promise every second while it moves (once a minute when idle)."""

    def __init__(self, display: Display, log_name: str = "WAL") -> None:
        self.display = display
        self.log_name = log_name
        """What the source's log is called in the status line (MySQL: binlog)."""
        self.latest = CaptureProgress()
        self.snapshot: Work | None = None
        self.stream: Work | None = None
        self._shown: tuple[int, ...] = ()
        self._last_line = 0.0

    def __call__(self, progress: CaptureProgress) -> None:
        self.latest = progress
        if progress.snapshot_running:
            if self.snapshot is None:
                self.snapshot = self.display.work("snapshot", progress.snapshot_rows_total, "rows")
            self.snapshot.update(
                completed=progress.snapshot_rows,
                total=progress.snapshot_rows_total,
                description=f"snapshot {progress.snapshot_table or ''}".rstrip(),
            )
            return
        if self.snapshot is not None:
            self.snapshot.update(completed=progress.snapshot_rows)
            self.snapshot.done(f"snapshot: {progress.snapshot_rows:,} rows committed")
            self.snapshot = None
        if isinstance(self.display, PlainDisplay):
            self._plain(progress)
            return
        if isinstance(self.display, RichDisplay):
            if self.stream is None:
                self.stream = self.display.work("capturing", None, "changes")
            self.stream.update(completed=progress.rows, detail=status_line(progress, self.log_name))

    def _plain(self, progress: CaptureProgress) -> None:
        key = (progress.rows, progress.commits, progress.transactions, progress.lag_bytes)
        now = time.monotonic()
        moved = key != self._shown
        if now - self._last_line >= (PLAIN_EVERY_S if moved else IDLE_EVERY_S):
            self._shown, self._last_line = key, now
            self.display.note("capture: " + status_line(progress, self.log_name))

    def stopping(self) -> None:
        """Say, at once, what a stop asked for now waits for."""
        progress = self.latest
        if progress.snapshot_running:
            estimate = (
                f" of about {progress.snapshot_rows_total:,}"
                if progress.snapshot_rows_total
                else ""
            )
            what = (
                f"the snapshot chunk in progress ({progress.snapshot_table or 'a table'}: "
                f"{progress.snapshot_rows:,}{estimate} rows so far)"
            )
        else:
            what = "the commit in progress"
        self.display.note(
            f"stopping: finishing {what}, then exiting (Ctrl-C again stops at once; the "
            f"next run resumes from what the log holds)"
        )

    def close(self) -> None:
        if self.stream is not None:
            self.stream.done()
            self.stream = None


def status_line(progress: CaptureProgress, log_name: str = "WAL") -> str:
    """The state of a capture in one line (``log_name``: the source's log, WAL or binlog)."""
    lag_time = "" if progress.lag_ms is None else f" and {progress.lag_ms / 1000:.1f}s"
    return (
        f"{progress.rows:,} changes ({progress.snapshot_rows:,} in the snapshot), "
        f"{progress.transactions:,} transactions, {progress.commits:,} commits, "
        f"lag {decimal(progress.lag_bytes)} of {log_name}{lag_time}, "
        f"last source commit {age(progress.last_commit_ms)}"
    )

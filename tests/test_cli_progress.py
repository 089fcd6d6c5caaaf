"""What long commands show while they work: a live display on a terminal (a real
pseudo-terminal here), plain lines elsewhere, nothing under ``--json``; and what Ctrl-C
says and leaves."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import signal
import struct
import subprocess
import termios
from pathlib import Path
from typing import IO

import pytest
from support.cli import REPLOG, replog
from support.logs import filled_log

from replog.capture.progress import CaptureProgress
from replog.cli import progress as shown
from replog.cli.commands import PROGRESS_MIN_BYTES

TERMINAL_ENV = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160"}
TERMINAL_ENV.pop("NO_COLOR", None)


def on_terminal(*args: str) -> tuple[int, str, str]:
    """``replog ARGS`` with stderr on a pseudo-terminal (stdout piped): the exit status,
    stdout, and everything drawn on the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen(
        [REPLOG, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=TERMINAL_ENV,
    )
    os.close(slave)
    drawn = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert process.stdout is not None
    stdout = process.stdout.read().decode()
    return process.wait(), stdout, drawn.decode(errors="replace")


def piped(*args: str) -> subprocess.CompletedProcess[str]:
    """``replog ARGS`` with stderr not a terminal; a plain line for every step (whatever
    the machine's speed, so the lines do not depend on timing)."""
    env = {**os.environ, "REPLOG_PROGRESS_EVERY_S": "0"}
    return subprocess.run([REPLOG, *args], capture_output=True, text=True, check=False, env=env)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JSON lines file just over the size ``append`` shows progress for."""
    path = tmp_path_factory.mktemp("big") / "events.jsonl"
    line = '{"key": "k%d", "data": {"n": %d, "pad": "' + "x" * 200 + '"}}\n'
    count = PROGRESS_MIN_BYTES // len(line % (0, 0)) + 10
    path.write_text("".join(line % (i, i) for i in range(count)))
    return path


@pytest.mark.slow
def test_append_of_a_large_file_draws_a_live_display_on_a_terminal(
    tmp_path: Path, big_file: Path
) -> None:
    url = str(tmp_path / "log")
    assert replog("create", url, "--shards", "2").returncode == 0
    code, stdout, drawn = on_terminal("append", url, str(big_file))
    assert code == 0, drawn
    assert "appended" in stdout and "\x1b[" not in stdout  # the result: plain, on stdout
    assert "\x1b[" in drawn  # drawn by rich: cursor moves and colours
    assert f"reading {big_file}" in drawn and "MB" in drawn
    assert "read " in drawn and " lines of " in drawn  # the summary that replaces the bar


@pytest.mark.slow
def test_append_progress_is_plain_lines_off_a_terminal_and_absent_under_json(
    tmp_path: Path, big_file: Path
) -> None:
    url = str(tmp_path / "log")
    assert replog("create", url, "--shards", "2").returncode == 0
    plain = piped("append", url, str(big_file))
    assert plain.returncode == 0, plain.stderr
    assert "\x1b[" not in plain.stderr
    lines = plain.stderr.splitlines()
    assert lines and all(line.startswith("replog: ") for line in lines), lines
    assert lines[-1].startswith("replog: read ") and lines[-1].endswith(f" lines of {big_file}")
    quiet = piped("append", url, str(big_file), "--json")
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert json.loads(quiet.stdout)["events"] == json.loads(quiet.stdout)["lines"]


@pytest.mark.slow
def test_compact_verify_and_recover_show_progress_on_a_terminal(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    filled_log(url, commits=60, per_commit=5, shards=2, auto_compact=False)
    code, stdout, drawn = on_terminal("compact", url)
    assert code == 0, drawn
    assert "compacting" in drawn and "300/300 events" in drawn and "\x1b[" in drawn
    code, stdout, drawn = on_terminal("verify", url)
    assert code == 0 and stdout.startswith("ok:"), drawn
    assert "checked 2 segment files" in drawn
    code, stdout, drawn = on_terminal("recover", url, "--grace", "0")
    assert code == 0, drawn
    assert "deleting garbage files" in drawn and "60/60 files" in drawn


def test_plain_work_lines_say_done_of_total_rate_and_time_left() -> None:
    stream = io.StringIO()
    display = shown.PlainDisplay(stream, every_s=0)
    work = display.work("compacting", 400, "events")
    work.started -= 2  # two seconds in
    work.update(completed=100)
    assert "compacting: 100 of 400 events (25%), 50/s, about 6s left" in stream.getvalue()
    work.done("compacted")
    assert stream.getvalue().endswith("replog: compacted\n")
    idle = display.work("nothing", None, "files")
    idle.done()  # never moved: no word
    assert "nothing" not in stream.getvalue()
    quiet = io.StringIO()
    quick = shown.PlainDisplay(quiet, every_s=60).work("verifying", 3, "files")
    quick.update(completed=3)
    quick.done("checked 3 files")  # work quicker than a line's interval: no line at all
    assert quiet.getvalue() == ""


def _terminal_display(monkeypatch: pytest.MonkeyPatch) -> tuple[shown.RichDisplay, int, IO[str]]:
    """A live display drawing on a pseudo-terminal 160 columns wide (rich sizes it from
    the process's own terminal, so through COLUMNS here), and its reading end."""
    master, slave = pty.openpty()
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    for name, value in TERMINAL_ENV.items():
        monkeypatch.setenv(name, value)
    return shown.RichDisplay(stream), master, stream


def _read_all(master: int) -> str:
    drawn = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    return drawn.decode(errors="replace")


def test_capture_display_shows_the_snapshot_against_its_estimate_then_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From :class:`CaptureProgress` fields alone, as the capture fills them."""
    display, master, stream = _terminal_display(monkeypatch)
    capture = shown.CaptureDisplay(display)
    state = CaptureProgress(
        snapshot_running=True,
        snapshot_table="public.orders",
        snapshot_rows=120_000,
        snapshot_rows_total=300_000,
    )
    capture(state)
    display.progress.refresh()  # draw now, not when rich's refresh thread next looks
    capture.stopping()
    state.snapshot_running, state.snapshot_completed = False, True
    state.snapshot_rows = 300_000
    state.rows, state.transactions, state.commits, state.lag_bytes = 12, 3, 2, 4096
    state.lag_ms = 1500
    capture(state)
    capture.close()
    display.close()
    stream.close()
    drawn = _read_all(master)
    os.close(master)
    assert "snapshot public.orders" in drawn
    assert "120,000/300,000 rows" in drawn and "40%" in drawn
    assert (
        "stopping: finishing the snapshot chunk in progress (public.orders: 120,000 of about "
        "300,000 rows so far)" in drawn
    )
    assert "snapshot: 300,000 rows committed" in drawn
    assert "12 changes" in drawn and "lag 4.1 kB of WAL and 1.5s" in drawn


def test_plain_capture_lines_come_when_it_moves_and_once_a_minute_idle() -> None:
    stream = io.StringIO()
    capture = shown.CaptureDisplay(shown.PlainDisplay(stream))
    state = CaptureProgress(rows=1, commits=1)
    capture(state)
    capture(state)  # nothing moved: no second line
    assert stream.getvalue().count("\n") == 1
    assert stream.getvalue().startswith("replog: capture: 1 changes (0 in the snapshot)")
    capture._last_line -= shown.PLAIN_EVERY_S
    capture(state)  # still nothing moved
    assert stream.getvalue().count("\n") == 1
    capture._last_line -= shown.IDLE_EVERY_S
    capture(state)
    assert stream.getvalue().count("\n") == 2


@pytest.mark.slow
def test_ctrl_c_ends_tail_follow_cleanly(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    filled_log(url, commits=1, per_commit=3, shards=1)
    process = subprocess.Popen(
        [REPLOG, "tail", url, "--follow", "--interval", "50ms"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for _ in range(3):
        assert json.loads(process.stdout.readline())["shard"] == 0
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate()
    assert process.returncode == 0, stderr
    assert "interrupted" not in stderr and "Traceback" not in stderr


def test_an_interrupted_compact_says_what_recover_collects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    filled_log(url, commits=4, per_commit=5, shards=2, auto_compact=False)
    from replog.ops import compaction

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(compaction, "compact", interrupted)
    result = replog("compact", url)
    assert result.returncode == 130
    assert "replog: interrupted: nothing was committed" in result.stderr
    assert "'replog recover URL' deletes them" in result.stderr
    as_json = replog("compact", url, "--json")
    document = json.loads(as_json.stdout)
    assert document["exit_code"] == 130 and document["type"] == "KeyboardInterrupt"

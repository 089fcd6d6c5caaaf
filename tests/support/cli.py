"""Running the ``replog`` command: in-process (most tests) or as a user would (smoke tests)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from replog.cli import main

REPLOG = str(Path(sys.executable).with_name("replog"))


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def replog(*args: str, stdin: str | None = None) -> Result:
    """``replog ARGS`` run in this process through :func:`replog.cli.main`."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin or "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse errors and --version
                code = int(exit_.code or 0)
    finally:
        sys.stdin = saved
    return Result(code, out.getvalue(), err.getvalue())


def replog_process(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The installed ``replog`` console script in a child process (slow: smoke tests only)."""
    return subprocess.run(
        [REPLOG, *args],
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )

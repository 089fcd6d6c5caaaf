"""Run the installed ``replog`` console script as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPLOG = str(Path(sys.executable).with_name("replog"))


def replog(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REPLOG, *args],
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )

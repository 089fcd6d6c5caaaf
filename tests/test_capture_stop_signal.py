"""A capture stopped by SIGTERM (or Ctrl-C) stops, whatever its main thread is doing when
the signal lands (``replog capture postgres|mysql`` share :func:`run_capture`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    from replog.cli.capturing import run_capture
    from replog.cli.metrics import CaptureMetrics
    from replog.cli.output import JsonOutput

    rounds = int(sys.argv[1])
    out = JsonOutput(open(os.devnull, "w"))
    for _ in range(rounds):
        def work(stop, progress):
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGTERM)).start()
            waits = 0
            while not stop.wait(0):  # the event's lock taken and let go, over and over
                waits += 1
            return waits
        run_capture(out, CaptureMetrics("slot", "/nowhere/log"), None, work)
    print("stopped", rounds)
    """
)
HANG_S = 120
"""Far beyond what 300 stops take (under a second each); only a hung stop reaches it."""


def test_a_stop_signal_stops_a_capture_whatever_its_main_thread_holds() -> None:
    """The handler set the stop event itself, in the main thread, which the signal may
    interrupt inside ``stop.wait()`` holding the event's lock: ``set()`` then waited for
    that lock for ever (a followed capture SIGTERMed by pgbench_follow hung for minutes,
    py-spy showing the handler inside ``Event.wait``). Each round here stops a capture
    whose main thread takes that lock as often as it can."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "300"],
        check=False,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stopped", "300"]

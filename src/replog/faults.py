"""Fault injection for crash tests: die at a named step of the sink protocol.

Set ``REPLOG_FAULT=<step>`` or ``<step>@<epoch>`` (for example ``after_pending@1``).
At that step the process group is killed with SIGKILL: the Spark driver, its JVM and
its Python workers die at once, as in a machine failure. ``REPLOG_FAULT_ACTION=raise``
raises :class:`InjectedCrash` instead (a task or commit failure Spark can see).
Unset in production: :func:`fault_point` is then a dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import signal

from replog.errors import InjectedCrash

logger = logging.getLogger(__name__)

STEPS = ("staged", "after_pending", "after_log_commit", "after_committed", "write_task")


def fault_point(step: str, epoch: int | None = None) -> None:
    spec = os.environ.get("REPLOG_FAULT")
    if not spec:
        return
    name, _, at_epoch = spec.partition("@")
    if name != step or (at_epoch and epoch is not None and int(at_epoch) != epoch):
        return
    if os.environ.get("REPLOG_FAULT_ACTION", "kill") == "raise":
        raise InjectedCrash(f"injected fault at {step} (epoch {epoch})")
    logger.error("injected fault: killing process group at %s (epoch %s)", step, epoch)
    os.killpg(os.getpgrp(), signal.SIGKILL)

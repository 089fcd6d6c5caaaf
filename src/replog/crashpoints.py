"""Crash points for crash tests: die at a named step of the sink protocol (or of
``apply_changes``, capture).

Set ``REPLOG_FAULT=<step>`` or ``<step>@<epoch>`` (for example ``after_pending@1``).
At that step the process group named by ``REPLOG_FAULT_PGID`` (default: the caller's)
is killed with SIGKILL. Spark starts its Python workers in process groups of their
own, so a driver app sets ``REPLOG_FAULT_PGID`` to its own group before starting
Spark: then the driver, its JVM and every Python worker die at once, as in a machine
failure. ``REPLOG_FAULT_ACTION=raise``
raises :class:`InjectedFaultError` instead (a task or commit failure Spark can see).
Unset in production: :func:`crash_point` is then a dictionary lookup. (Storage faults
are injected by :mod:`replog.storage.faults`.)
"""

from __future__ import annotations

import logging
import os
import signal

from replog.errors import InjectedFaultError, InvalidOptionError

logger = logging.getLogger(__name__)

STEPS = (
    "staged",
    "after_pending",
    "after_log_commit",
    "after_committed",
    "write_task",
    "capture_committed",
    "capture_staged",
    "capture_noted",
    "apply_before_delta",
    "apply_deletion_vectors",
    "apply_after_delta",
)
"""``apply_before_delta``/``apply_after_delta``: in ``apply_changes``, with the micro-batch
id as epoch, just before its Delta commit and just after it (before Spark's commit log);
``apply_deletion_vectors``: a merge-on-read batch's files (rows, deletion vectors) are
written, its commit is not; ``capture_noted``: a MySQL capture wrote its position record
(and plan) for a commit it has not made yet."""


def crash_point(step: str, epoch: int | None = None) -> None:
    spec = os.environ.get("REPLOG_FAULT")
    if not spec:
        return
    name, _, at_epoch = spec.partition("@")
    if name not in STEPS:
        raise InvalidOptionError(
            f"REPLOG_FAULT={spec!r}: unknown step {name!r}; steps: {', '.join(STEPS)}"
        )
    if name != step or (at_epoch and epoch is not None and int(at_epoch) != epoch):
        return
    if os.environ.get("REPLOG_FAULT_ACTION", "kill") == "raise":
        raise InjectedFaultError(f"injected fault at {step} (epoch {epoch})")
    logger.error("injected fault: killing process group at %s (epoch %s)", step, epoch)
    os.killpg(int(os.environ.get("REPLOG_FAULT_PGID", os.getpgrp())), signal.SIGKILL)
    # A Spark Python worker is not in the driver's group: without this it would carry on
    # and finish the protocol step by step after its driver died.
    os.kill(os.getpid(), signal.SIGKILL)

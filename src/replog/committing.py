"""Committing to a log: one record put as the next version, whatever else happens.

DESIGN: this module owns the put of a commit, every kind alike (appends, merges,
truncations, gc marks):

* a commit is one put-if-absent of the next version; a lost race is retried on the new
  state, after a short random wait;
* a commit that landed in a slot retention emptied (a writer stalled past the retention
  between reading the state and its put) is found and taken back, and built again;
* a commit whose check failed is reported as of unknown outcome, never as failed.

What a commit holds is its caller's ``build``; what runs after it lands (checkpoints,
expiry) is ``after_commit``. Staged files and their guards are :mod:`replog.writing`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable

from replog.core import history
from replog.core.staging import CommitAttempt
from replog.errors import (
    CommitConflictError,
    CommitOutcomeUnknownError,
    LogNotFoundError,
    LogRecreatedError,
    ReplogError,
    StorageError,
)
from replog.format.commits import CommitRecord, commit_path
from replog.format.state import LogState
from replog.reading import LogReader
from replog.timeutil import monotonic_s, now_ms

logger = logging.getLogger(__name__)

MAX_COMMIT_ATTEMPTS = 200
RACE_BACKOFF_MAX_S = 0.02
"""A writer that lost a commit race waits at most this long (at random) before it reads
the winner's commit and tries the next version: the chain of versions is the log's
throughput, and a long back-off leaves it idle."""


def commit(
    log: LogReader,
    build: Callable[[LogState], CommitRecord | None],
    *,
    attempt: CommitAttempt | None = None,
    refreshed: bool = False,
    after_commit: Callable[[LogState], None] | None = None,
) -> CommitRecord | None:
    """Commit ``build(state)`` (a record for ``state.version + 1``), retrying lost races.

    ``build`` sees the refreshed state on every attempt and may return None to commit
    nothing. ``refreshed`` says the caller has just refreshed the state: the first attempt
    builds on it without reading again. That is safe because the put is create-if-absent:
    a commit that landed since takes the version, and the retry builds on a refreshed
    state. ``after_commit`` is called with the state the commit made (it must not raise:
    the commit has landed).
    """
    attempt = attempt if attempt is not None else CommitAttempt()
    for tries in range(MAX_COMMIT_ATTEMPTS):
        state = log.state() if refreshed and tries == 0 else log.refresh(verify_within=0)
        record = build(state)
        if record is None:
            return None
        if record.log_id != log.descriptor.log_id:
            record = dataclasses.replace(record, log_id=log.descriptor.log_id)
        attempt.in_doubt = True
        putting = monotonic_s()  # no one writes the version after it before it lands
        try:
            log.storage.put_if_absent(commit_path(record.version), record.to_bytes())
        except FileExistsError:
            attempt.in_doubt = False  # read back: another writer's record is there
            logger.debug("lost the race for version %d; retrying", record.version)
            time.sleep(random.uniform(0, min(RACE_BACKOFF_MAX_S, 0.001 * 2**tries)))
            continue
        if not _landed_on_history(log, state, record, putting):
            attempt.in_doubt = False
            continue
        attempt.landed, attempt.in_doubt = record, False
        state.apply(record)
        state.verified = (record.version, monotonic_s())  # its own commit: its log
        state.head_seen = putting
        if after_commit is not None:
            after_commit(state)
        return record
    raise CommitConflictError(f"{log.url}: gave up after {MAX_COMMIT_ATTEMPTS} lost commit races")


def _landed_on_history(
    log: LogReader, state: LogState, record: CommitRecord, putting: float
) -> bool:
    """Whether ``record``, just put at ``state.version + 1``, follows the log's history
    rather than filling a slot retention emptied (the writer stalled between finding
    the slot free and its put, while others committed past it and expiry deleted it).

    Expiry deletes a commit only once a header at or after it is older than the
    retention: by storage time, or by its writers' clocks, which may disagree by the
    clock skew (10 minutes). So the slot cannot have been emptied if less than the
    retention less the skew passed, on this process's monotonic clock, since the
    slot was known to be unwritten (:attr:`LogState.head_seen`): no clock of another
    machine enters this. (As a second line, the slot counts as possibly emptied also
    when commit ``state.version`` is that old by this writer's wall clock: a machine
    paused under a monotonic clock that stopped.) Otherwise (or if that time is
    unknown) commit ``state.version`` is read again: retention deletes commits oldest
    first, so if it is the one the state applied, the slot was never written. A
    misplaced commit is deleted and False returned (the caller commits again on a fresh
    state); if the log was re-created, it is deleted and the error raised.
    """
    seen = state.head_seen
    window_ms = log.descriptor.surely_kept_ms
    recent = seen is not None and (monotonic_s() - seen) * 1000 < window_ms
    # The wall clock too (its error is covered above): a monotonic clock may not count
    # time the machine spent paused.
    if recent and state.version > 0 and state.timestamp_ms > now_ms() - window_ms:
        return True
    try:
        base = None
        if state.version:
            base = log.storage.read_optional(commit_path(state.version))
        history.check_base(log.storage, state, base)
    except history.BaseMissing:
        # Gone since the put, or before it? A commit that landed on the history and
        # whose base expired after it must be neither taken back nor made again.
        first = _landed_first(log, record, putting)
        if first:
            logger.info(
                "%s: commit %d landed on the log's history; its base %d expired since",
                log.url,
                record.version,
                state.version,
            )
            return True
        if first is None:
            log.forget()
            raise CommitOutcomeUnknownError(
                f"{log.url}: commit {record.version} landed, and its base (commit "
                f"{state.version}) is gone: retention deleted it, before or after the "
                f"put, which cannot be told; the commit was kept ('replog read' tells "
                f"whether its events are in the log)"
            ) from None
        logger.warning(
            "%s: commit %d landed in a range retention deleted (this writer's state was "
            "older than the retention); deleting it and committing again",
            log.url,
            record.version,
        )
        _take_back(log, record)
        return False
    except (LogRecreatedError, LogNotFoundError):
        _take_back(log, record)
        raise
    except (StorageError, OSError) as exc:
        log.forget()
        raise CommitOutcomeUnknownError(
            f"{log.url}: commit {record.version} landed, but checking that it follows "
            f"the log's history failed: {exc}"
        ) from exc
    return True


def _landed_first(log: LogReader, record: CommitRecord, putting: float) -> bool | None:
    """:func:`history.landed_first`. If the record went too: expired, which needs a
    header built on it to age for the retention (by storage time and by clocks within
    the skew), or deleted by an expiry that ran from an older version (so it filled an
    emptied slot). Less than the retention less the skew after ``putting`` (this
    process's monotonic clock) it cannot have expired; later, it landed first if its
    files are live in the log as it is now (no other writer's state can name them).
    A storage failure makes it unknown (None)."""
    try:
        first = history.landed_first(log.storage, record, log.descriptor.snapshot_interval)
        if first is None:
            window_ms = log.descriptor.surely_kept_ms
            if (monotonic_s() - putting) * 1000 < window_ms:
                return False
            fresh = history.load_state(log.storage, log.descriptor)
            if record.add and all(fresh.is_live(segment) for segment in record.add):
                return True
        return first
    except (ReplogError, OSError) as exc:
        logger.warning(
            "%s: could not tell where commit %d landed: %s", log.url, record.version, exc
        )
        return None


def _take_back(log: LogReader, record: CommitRecord) -> None:
    """Delete ``record``'s commit, put where it does not belong (nothing reads it: it
    is below every header of the log there), and forget the state."""
    log.forget()
    try:
        log.storage.delete(commit_path(record.version))
    except (StorageError, OSError) as exc:
        raise CommitOutcomeUnknownError(
            f"{log.url}: commit {record.version} landed where it does not belong and "
            f"could not be deleted: {exc}"
        ) from exc

"""Staging leases on storage: taking, marking, reading and releasing them, and listing
them for ``recover`` (the layout is :mod:`replog.format.leases`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from replog.errors import CorruptionError, StagingCollectedError
from replog.format.gc import CLOCK_SKEW_MS
from replog.format.leases import (
    COMPACTION_PREFIX,
    COMPACTION_YIELD_MS,
    DEFAULT_LEASE_MS,
    LEASES_DIR,
    STAGING,
    Lease,
    UnreadableLease,
)
from replog.storage import Storage
from replog.storage.backends import is_temporary
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

HEARTBEAT_MS = 10 * 60_000
"""A running compaction rewrites its lease at most this often (:class:`Heartbeat`)."""


def acquire(
    storage: Storage, owner: str, duration_ms: int = DEFAULT_LEASE_MS, *, compaction: bool = False
) -> Lease:
    """Write a new lease for ``owner`` (a description for operators). ``compaction``: the
    lease of an operator's compaction, which writers' automatic merges yield to
    (:func:`compaction_running`)."""
    acquired = now_ms()
    prefix = COMPACTION_PREFIX if compaction else ""
    lease = Lease(prefix + uuid.uuid4().hex, owner, acquired, acquired + duration_ms)
    storage.put_if_absent(lease.relative, lease.to_bytes())
    return lease


def compaction_running(storage: Storage) -> bool:
    """Whether an operator's compaction holds a lease: one whose id begins with
    :data:`COMPACTION_PREFIX`, live, and taken less than :data:`COMPACTION_YIELD_MS` ago
    or, for a compaction that runs longer, whose file was written that recently (storage
    time: a running compaction rewrites it, :class:`Heartbeat`). One that died without
    releasing it holds merges back for that long at most. Lists the leases and reads only
    compactions' (usually none)."""
    now = now_ms()
    for relative, data in _lease_files(storage, COMPACTION_PREFIX):
        try:
            lease = Lease.from_bytes(data, storage.path(relative))
        except CorruptionError:
            continue  # recover reports it; merges need not wait for it
        # A lease from further in the future than the clock skew is a clock gone wrong:
        # not waited for.
        if not lease.live(now) or now - lease.acquired_ms < -CLOCK_SKEW_MS:
            continue
        if now - lease.acquired_ms < COMPACTION_YIELD_MS:
            return True
        try:
            beat = storage.modified_ms(relative)
        except FileNotFoundError:  # released meanwhile
            continue
        if beat is not None and -CLOCK_SKEW_MS <= now - beat < COMPACTION_YIELD_MS:
            return True
    return False


class Heartbeat:
    """Shows that the compaction holding ``lease`` is still running: called as it makes
    progress, it rewrites the lease file (the same bytes: only its storage time moves) at
    most every :data:`HEARTBEAT_MS` by the holder's clock, so writers' merges keep
    yielding to a compaction that runs longer than :data:`COMPACTION_YIELD_MS`
    (:func:`compaction_running`). Thread-safe; :meth:`stop` before the lease is released
    (a beat after it would write it again)."""

    def __init__(self, storage: Storage, lease: Lease) -> None:
        self.storage, self.lease = storage, lease
        self._last = now_ms()
        self._lock = threading.Lock()
        self._stopped = False

    def __call__(self, *_: object) -> None:
        now = now_ms()
        with self._lock:
            if self._stopped or now - self._last < HEARTBEAT_MS:
                return
            self._last = now
            try:
                current = read(self.storage, self.lease)
                if current is not None:
                    self.storage.write(current.relative, current.to_bytes())
            except Exception as exc:  # merges may stop yielding: the compaction may conflict
                logger.warning("could not renew compaction lease %s: %s",
                               self.storage.path(self.lease.relative), exc)  # fmt: skip

    def stop(self) -> None:
        with self._lock:
            self._stopped = True


def mark(storage: Storage, lease: Lease, state: str, current: Lease | None = None) -> Lease:
    """Record that ``lease``'s writer moved to ``state``, keeping the latest expiry its
    tasks renewed it to (the driver's copy of the lease may be older; ``current``: the
    lease as just read, if the caller has it)."""
    current = current or read(storage, lease) or lease
    marked = dataclasses.replace(
        current, state=state, expires_ms=max(current.expires_ms, lease.expires_ms)
    )
    storage.write(marked.relative, marked.to_bytes())
    return marked


def read(storage: Storage, lease: Lease) -> Lease | None:
    """``lease`` as now on storage, or None if it was released (:class:`CorruptionError`
    if it was damaged)."""
    data = storage.read_optional(lease.relative)
    return None if data is None else Lease.from_bytes(data, storage.path(lease.relative))


def check_held(storage: Storage, lease: Lease, what: str) -> Lease:
    """``lease`` as on storage; :class:`StagingCollectedError` (refusing to commit
    ``what``) if it is gone, damaged or ran out (less the clock skew): ``recover``
    honours only live leases, so it may have taken the staged files, or be taking them."""
    try:
        current = read(storage, lease)
    except CorruptionError as exc:
        problem = f"is damaged ({exc})"
    else:
        if current is not None and now_ms() < current.expires_ms - CLOCK_SKEW_MS:
            return current
        problem = "is gone" if current is None else "ran out"
    raise StagingCollectedError(
        f"{storage.url}: the staging lease of {what} ({storage.path(lease.relative)}) "
        f"{problem}: 'replog recover' may have deleted its staged files; nothing was "
        f"committed, run it again"
    )


def renew(storage: Storage, lease: Lease, duration_ms: int = DEFAULT_LEASE_MS) -> Lease | None:
    """Extend ``lease`` to ``duration_ms`` from now if less than half of that is left
    (a long write's tasks call this as they start); None if it is gone (then the write
    will be refused at its commit). Reads it once; writes it only when extended."""
    current = read(storage, lease)
    now = now_ms()
    if current is None or current.state != STAGING or current.expires_ms - now >= duration_ms // 2:
        return current  # a lease marked committing is the driver's to write from now on
    renewed = dataclasses.replace(current, expires_ms=now + duration_ms)
    storage.write(renewed.relative, renewed.to_bytes())
    return renewed


def wind_down(storage: Storage, lease: Lease) -> None:
    """Make ``lease``, of a writer believed dead, expire within the clock skew instead of
    releasing it: should its writer live after all, it is refused at its next check
    (:func:`check_held`: within the skew of expiry), and if it passed that check just
    before, ``recover`` keeps honouring the lease for the skew that check allows for,
    rather than taking its files between the check and the put. Its files are then
    collected in minutes, not a day."""
    current = read(storage, lease)
    expires = now_ms() + CLOCK_SKEW_MS
    if current is None or current.expires_ms <= expires:
        return
    winding = dataclasses.replace(current, expires_ms=expires)
    storage.write(winding.relative, winding.to_bytes())


def release(storage: Storage, lease: Lease) -> None:
    storage.delete(lease.relative)


def release_quietly(storage: Storage, lease: Lease) -> None:
    """Release ``lease``, only warning if that fails (it then expires on its own)."""
    try:
        release(storage, lease)
    except Exception as exc:
        logger.warning("could not release staging lease %s: %s", storage.path(lease.relative), exc)


@contextmanager
def holding(storage: Storage, owner: str, *, compaction: bool = False) -> Iterator[Lease]:
    """A lease held for the block (released on the way out, whatever happens)."""
    lease = acquire(storage, owner, compaction=compaction)
    try:
        yield lease
    finally:
        release_quietly(storage, lease)


@contextmanager
def compacting(storage: Storage, owner: str) -> Iterator[tuple[Lease, Heartbeat]]:
    """A compaction's lease and its :class:`Heartbeat` for the block: writers' merges
    yield to it however long it runs. The beat stops before the lease is released."""
    with holding(storage, owner, compaction=True) as lease:
        beat = Heartbeat(storage, lease)
        try:
            yield lease, beat
        finally:
            beat.stop()


@dataclass
class FoundLeases:
    """Every lease file on storage: the leases, and the files that cannot be read as one."""

    readable: list[Lease] = field(default_factory=list)
    unreadable: list[UnreadableLease] = field(default_factory=list)


def _lease_files(storage: Storage, prefix: str = "") -> Iterator[tuple[str, bytes]]:
    """The path and bytes of each lease file named ``prefix...`` (a temporary one, a
    lease being written, is read once it has its name; one released meanwhile is not)."""
    for name in storage.listdir(LEASES_DIR):
        if name.startswith(prefix) and not is_temporary(name):
            relative = f"{LEASES_DIR}/{name}"
            data = storage.read_optional(relative)
            if data is not None:
                yield relative, data


def leases(storage: Storage) -> FoundLeases:
    """Every lease on storage, expired and unreadable ones included (lists the directory:
    for ``recover``, ``status`` and ``verify``). An unreadable one is warned about, naming
    its file, and returned as such: it may still guard a writer's files."""
    found = FoundLeases()
    for relative, data in _lease_files(storage):
        try:
            found.readable.append(Lease.from_bytes(data, storage.path(relative)))
        except CorruptionError as exc:
            logger.warning(
                "%s: it protects every staged file until it is repaired or removed, or "
                "until it is %d h old",
                exc,
                DEFAULT_LEASE_MS // 3_600_000,
            )
            found.unreadable.append(
                UnreadableLease(
                    relative, str(exc).removeprefix(f"{exc.path}: "), storage.modified_ms(relative)
                )
            )
    return found

"""Staging leases on storage: taking, marking, reading and releasing them, and listing
them for ``recover`` (the layout is :mod:`replog.format.leases`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

from replog.format.leases import DEFAULT_LEASE_MS, LEASES_DIR, Lease
from replog.storage import Storage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)


def acquire(storage: Storage, owner: str, duration_ms: int = DEFAULT_LEASE_MS) -> Lease:
    """Write a new lease for ``owner`` (a description for operators)."""
    acquired = now_ms()
    lease = Lease(uuid.uuid4().hex, owner, acquired, acquired + duration_ms)
    storage.put_if_absent(lease.relative, json.dumps(asdict(lease)).encode())
    return lease


def mark(storage: Storage, lease: Lease, state: str) -> Lease:
    """Record that ``lease``'s writer moved to ``state``."""
    marked = dataclasses.replace(lease, state=state)
    storage.write(marked.relative, json.dumps(asdict(marked)).encode())
    return marked


def read(storage: Storage, lease: Lease) -> Lease | None:
    """``lease`` as now on storage, or None if it was released."""
    data = storage.read_optional(lease.relative)
    return None if data is None else Lease(**json.loads(data))


def renew(storage: Storage, lease: Lease, duration_ms: int = DEFAULT_LEASE_MS) -> Lease | None:
    """Extend ``lease`` to ``duration_ms`` from now if less than half of that is left
    (a long write's tasks call this as they start); None if it is gone (then the write
    will be refused at its commit). Reads it once; writes it only when extended."""
    current = read(storage, lease)
    now = now_ms()
    if current is None or current.expires_ms - now >= duration_ms // 2:
        return current
    renewed = dataclasses.replace(current, expires_ms=now + duration_ms)
    storage.write(renewed.relative, json.dumps(asdict(renewed)).encode())
    return renewed


def release(storage: Storage, lease: Lease) -> None:
    storage.delete(lease.relative)


def release_quietly(storage: Storage, lease: Lease) -> None:
    """Release ``lease``, only warning if that fails (it then expires on its own)."""
    try:
        release(storage, lease)
    except Exception as exc:
        logger.warning("could not release staging lease %s: %s", storage.path(lease.relative), exc)


@contextmanager
def holding(storage: Storage, owner: str) -> Iterator[Lease]:
    """A lease held for the block (released on the way out, whatever happens)."""
    lease = acquire(storage, owner)
    try:
        yield lease
    finally:
        release_quietly(storage, lease)


def leases(storage: Storage) -> list[Lease]:
    """Every lease on storage, expired ones included (lists the directory: for recover)."""
    found = []
    for name in storage.listdir(LEASES_DIR):
        data = storage.read_optional(f"{LEASES_DIR}/{name}")
        if data is None:
            continue
        try:
            found.append(Lease(**json.loads(data)))
        except (ValueError, TypeError) as exc:
            logger.warning(
                "ignoring unreadable lease %s: %s", storage.path(f"{LEASES_DIR}/{name}"), exc
            )
    return found

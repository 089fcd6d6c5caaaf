"""Staging leases on storage: taking, marking, reading and releasing them, and listing
them for ``recover`` (the layout is :mod:`replog.format.leases`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
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


def release(storage: Storage, lease: Lease) -> None:
    storage.delete(lease.relative)


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

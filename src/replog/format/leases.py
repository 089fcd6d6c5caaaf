"""Staging leases: a long-running writer's claim that its staged files are still wanted.

Garbage collection (``replog recover``) deletes segment files no commit references once
they are older than a grace period. A batch job or a compaction can stage files for longer
than that; before it stages anything it writes a lease, ``_replog/leases/<id>.json``, and
recover leaves alone every file written after the oldest live lease was acquired. A lease
is released when its writer commits or gives up; one whose writer died expires at
``expires_ms`` and is then ignored (and removed by recover).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from dataclasses import asdict, dataclass

from replog.format.commits import META_DIR
from replog.storage import Storage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

LEASES_DIR = f"{META_DIR}/leases"
DEFAULT_LEASE_MS = 24 * 3_600_000
"""How long a lease protects its files if its writer never releases it (it died)."""


STAGING, COMMITTING = "staging", "committing"
"""A lease's states: its writer is staging files, or its commit has been sent (and may
land even if the writer dies: its files must then wait for recover's usual rules)."""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    owner: str
    acquired_ms: int
    expires_ms: int
    state: str = STAGING

    @property
    def relative(self) -> str:
        return f"{LEASES_DIR}/{self.lease_id}.json"

    def live(self, at_ms: int) -> bool:
        return at_ms < self.expires_ms


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

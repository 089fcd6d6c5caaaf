"""Staging leases: a long-running writer's claim that its staged files are still wanted
(the layout; taking, renewing and releasing them is :mod:`replog.core.leases`).

Garbage collection (``replog recover``) deletes segment files no commit references once
they are older than a grace period. A batch job or a compaction can stage files for longer
than that; before it stages anything it writes a lease, ``_replog/leases/<id>.json``, and
recover leaves alone every file written after the oldest live lease was acquired. A lease
is released when its writer commits or gives up; one whose writer died expires at
``expires_ms`` and is then ignored (and removed by recover).
"""

from __future__ import annotations

from dataclasses import dataclass

from replog.format.commits import META_DIR

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

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

import json
from dataclasses import asdict, dataclass

from replog.errors import CorruptionError
from replog.format.commits import META_DIR

LEASES_DIR = f"{META_DIR}/leases"
DEFAULT_LEASE_MS = 24 * 3_600_000
"""How long a lease protects its files if its writer never releases it (it died)."""


COMPACTION_PREFIX = "compaction-"
"""The ids of operators' compactions' leases begin with this: writers' automatic merges
yield to them (FORMAT.md, "Automatic merges")."""
COMPACTION_YIELD_MS = 3_600_000
"""Automatic merges yield to a compaction's lease for at most this long after it was taken
(a compaction that died without releasing it holds them back no longer)."""


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

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Lease:
        """A lease as written; :class:`CorruptionError` (naming ``where`` and the member)
        for anything else, so a damaged lease is never half-understood."""
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise CorruptionError(where, f"lease is not JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise CorruptionError(where, "lease is not a JSON object")
        for name, kind in (("lease_id", str), ("owner", str), ("acquired_ms", int),
                           ("expires_ms", int)):  # fmt: skip
            value = document.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CorruptionError(
                    where, f"lease member {name!r} must be {kind.__name__}, got {value!r:.40}"
                )
        state = document.get("state", STAGING)
        if state not in (STAGING, COMMITTING):
            raise CorruptionError(where, f"lease state {state!r:.40} is not staging/committing")
        return cls(
            document["lease_id"],
            document["owner"],
            document["acquired_ms"],
            document["expires_ms"],
            state,
        )


@dataclass(frozen=True)
class UnreadableLease:
    """A lease file that cannot be understood. It may still belong to a live writer, so
    it protects every staged file (as a lease acquired at the beginning of time would)
    until its file is :data:`DEFAULT_LEASE_MS` old (``modified_ms``: never, when storage
    gives no modification times)."""

    relative: str
    reason: str
    modified_ms: int | None

    def live(self, at_ms: int) -> bool:
        return self.modified_ms is None or at_ms < self.modified_ms + DEFAULT_LEASE_MS

"""What a new log may be created with: each limit stated once.

Every way to create a log checks its settings here: :meth:`ReplicationLog.create` (and
``replog.create_log``), ``replog create`` and the ``replog-sink`` when it creates its
target. A check names the option as its caller spells it (``retention_ms``,
``--retention``, ``option 'shards'``). OPERATIONS.md ("Creating a log") states the
same limits once for users.
"""

from __future__ import annotations

from replog.errors import InvalidOptionError
from replog.format.gc import CLOCK_SKEW_MS, DEFAULT_GRACE_MS

MAX_SHARDS = 4096

MIN_RETENTION_MS = CLOCK_SKEW_MS
"""No retention below the clock skew writers allow: expiry judges ages by clocks that
may disagree by that much, so a shorter retention would let a writer whose clock runs
ahead delete commits readers are opening (they give up after three such races) and
files a planned read needs. Logs created with less by replog 0.5 and earlier keep it."""

ADVISED_RETENTION_MS = DEFAULT_GRACE_MS + CLOCK_SKEW_MS
"""Below this, files a merge replaced may go before ``replog recover``'s default grace:
creating such a log warns."""


def _minutes(ms: int) -> str:
    return f"{ms // 60_000}m" if ms % 60_000 == 0 else f"{ms} ms"


def check_shards(value: object, name: str = "shards") -> int:
    """``value`` if it is a shard count a log may have, else :class:`InvalidOptionError`
    naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SHARDS:
        raise InvalidOptionError(
            f"{name} must be an integer from 1 to {MAX_SHARDS}, got {value!r}"
        )
    return value


def check_snapshot_interval(value: object, name: str = "snapshot_interval") -> int:
    """``value`` if it is a snapshot interval (commits between segment tables, >= 1)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidOptionError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_retention(value: object, name: str = "retention_ms", given: str | None = None) -> int:
    """``value`` (ms) if a new log may have it as its retention, else
    :class:`InvalidOptionError` naming ``name`` and the value as ``given`` (default: in
    ms)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be an integer (milliseconds), got {value!r}")
    if value < MIN_RETENTION_MS:
        shown = given if given is not None else f"{value} ms"
        raise InvalidOptionError(
            f"{name} {shown}: at least {_minutes(MIN_RETENTION_MS)} (the clock skew writers "
            f"allow: no age is judged more finely); keep it at least recover's grace plus "
            f"{_minutes(CLOCK_SKEW_MS)} (default {_minutes(ADVISED_RETENTION_MS)})"
        )
    return value


def retention_advice(value_ms: int) -> str | None:
    """A warning for a retention shorter than :data:`ADVISED_RETENTION_MS` (None: none)."""
    if value_ms >= ADVISED_RETENTION_MS:
        return None
    return (
        f"a retention of {_minutes(value_ms)} is below recover's default grace "
        f"({_minutes(DEFAULT_GRACE_MS)}) plus {_minutes(CLOCK_SKEW_MS)}: run 'replog recover' "
        f"with --grace {_minutes(value_ms - CLOCK_SKEW_MS)} or less on this log"
    )

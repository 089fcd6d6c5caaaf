"""Times given by users: durations (``15m``) and instants in milliseconds since the epoch."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from replog.errors import InvalidOptionError

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?$")
_DURATION_UNITS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

SECONDS_BELOW = 100_000_000_000
"""Epoch milliseconds below this (1973-03-03) are taken for seconds given by mistake."""
MICROSECONDS_ABOVE = 100_000_000_000_000
"""Epoch milliseconds above this (year 5138) are taken for micro- or nanoseconds."""


def duration_ms(text: str, option: str) -> int:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"7d"``, ``"250ms"`` or ``"0"`` in milliseconds."""
    match = _DURATION.match(text.strip().lower())
    if match is None or (match.group(2) is None and float(match.group(1)) != 0):
        raise InvalidOptionError(
            f"{option}: {text!r} is not a duration; use a number with ms, s, m, h or d, e.g. 1h"
        )
    return int(float(match.group(1)) * _DURATION_UNITS[match.group(2) or "ms"])


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")


def check_epoch_ms(raw: str | int, option: str) -> int:
    """An instant given as milliseconds since the epoch (Kafka's and Delta's unit).

    Refuses, with a hint, a value that is plainly in seconds or microseconds: read as
    milliseconds, 1700000000 is in January 1970.
    """
    try:
        value = int(str(raw).strip())
    except ValueError as exc:
        raise InvalidOptionError(
            f"{option}: {raw!r} is not milliseconds since the epoch (an integer, e.g. "
            f"1735689600000 for 2025-01-01T00:00:00Z)"
        ) from exc
    if value < 0:
        raise InvalidOptionError(f"{option}: {value} is before 1970")
    if value < SECONDS_BELOW:
        raise InvalidOptionError(
            f"{option}: {value} read as milliseconds is {iso(value)}; it looks like seconds - "
            f"pass milliseconds: {value * 1000}"
        )
    if value > MICROSECONDS_ABOVE:
        raise InvalidOptionError(
            f"{option}: {value} read as milliseconds is far in the future; it looks like "
            f"microseconds or nanoseconds - pass milliseconds"
        )
    return value

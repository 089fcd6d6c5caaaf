"""Time: the one clock replog reads, and times given by users (durations such as ``15m``,
instants in milliseconds since the epoch).

Every part of replog asks :func:`now_ms` / :func:`now_utc` for the time. Tests (and a
process that must act as if its clock ran elsewhere) replace the clock for the code they
run with :func:`use_clock`: the replacement holds for the calling context only (a
``ContextVar``), so a collector and a writer in two threads can run on two clocks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone

from replog.errors import InvalidOptionError

Clock = Callable[[], float]
"""Seconds since the Unix epoch, as :func:`time.time` gives them."""


class _ClockVar:
    """The current clock, per context; pickles as a fresh one (``replog.register(spark)``
    pickles replog's modules by value, and a ``ContextVar`` cannot be pickled)."""

    def __init__(self, name: str = "replog_clock", default: Clock = time.time) -> None:
        self.name, self.default = name, default
        self.var: ContextVar[Clock] = ContextVar(name, default=default)

    def __reduce__(self) -> tuple[type[_ClockVar], tuple[str, Clock]]:
        return (_ClockVar, (self.name, self.default))


def _since_boot() -> float:
    """Seconds since boot, suspended time included (Linux's ``CLOCK_BOOTTIME``): a
    process whose machine slept for an hour must see that an hour passed, as
    ``time.monotonic`` (``CLOCK_MONOTONIC``, which stops while suspended) would not."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_CLOCK = _ClockVar()
_MONOTONIC = _ClockVar(
    "replog_monotonic", _since_boot if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic
)


def now_s() -> float:
    """The time, in seconds since the epoch, on the current clock."""
    return _CLOCK.var.get()()


def now_ms() -> int:
    """The time, in milliseconds since the epoch, on the current clock."""
    return int(now_s() * 1000)


def now_utc() -> datetime:
    """The time as an aware UTC datetime, on the current clock."""
    return datetime.fromtimestamp(now_s(), timezone.utc)


def monotonic_s() -> float:
    """Seconds on this machine's monotonic clock, counting time it was suspended where the
    system can (``CLOCK_BOOTTIME``; else :func:`time.monotonic`): for how long something
    took, which no other machine's clock, and no step of the wall clock, can change."""
    return _MONOTONIC.var.get()()


@contextmanager
def use_clock(clock: Clock, monotonic: Clock | None = None) -> Iterator[None]:
    """Run the block (in this context) with ``clock`` as replog's clock, and
    ``monotonic`` (if given) as its monotonic clock (a test that lets time pass)."""
    token = _CLOCK.var.set(clock)
    ticking = _MONOTONIC.var.set(monotonic) if monotonic is not None else None
    try:
        yield
    finally:
        if ticking is not None:
            _MONOTONIC.var.reset(ticking)
        _CLOCK.var.reset(token)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?$")
_DURATION_UNITS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

SECONDS_BELOW = 100_000_000_000
"""Epoch milliseconds below this (1973-03-03) are taken for seconds given by mistake."""
MICROSECONDS_ABOVE = 100_000_000_000_000
"""Epoch milliseconds above this (year 5138) are taken for micro- or nanoseconds."""


_ISO_DURATION = re.compile(
    r"^P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?"
    r"(?:(\d+(?:\.\d+)?)S)?)?$"
)


def duration_ms(text: str, option: str) -> int:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"7d"``, ``"250ms"`` or ``"0"`` in milliseconds; also
    ISO 8601 ``PnDTnHnMnS`` (``P1DT2H``, ``PT15M``), the form Kafka's ``--by-duration``
    takes."""
    stripped = text.strip()
    iso_match = _ISO_DURATION.match(stripped.upper())
    if iso_match is not None and stripped.upper() not in ("P", "PT"):
        days, hours, minutes, seconds = (float(part or 0) for part in iso_match.groups())
        return int(((days * 24 + hours) * 60 + minutes) * 60_000 + seconds * 1000)
    match = _DURATION.match(stripped.lower())
    if match is None or (match.group(2) is None and float(match.group(1)) != 0):
        raise InvalidOptionError(
            f"{option}: {text!r} is not a duration; use a number with ms, s, m, h or d "
            f"(e.g. 1h) or ISO 8601 PnDTnHnMnS (e.g. PT1H)"
        )
    return int(float(match.group(1)) * _DURATION_UNITS[match.group(2) or "ms"])


def iso_instant_ms(text: str, option: str) -> int:
    """An ISO 8601 instant (``2024-03-01T10:00:00Z``, ``2024-03-01T11:00:00+01:00``,
    ``2024-03-01``) in milliseconds since the epoch; a time without an offset is UTC (the
    log's event times are UTC), not the machine's zone."""
    raw = text.strip()
    try:
        parsed = datetime.fromisoformat(raw[:-1] + "+00:00" if raw[-1:] in "zZ" and raw else raw)
    except ValueError as exc:
        raise InvalidOptionError(
            f"{option}: {text!r} is not an ISO 8601 time (e.g. 2024-03-01T10:00:00Z or "
            f"2024-03-01T11:00:00+01:00)"
        ) from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    value = int(parsed.timestamp() * 1000)
    if value < 0:
        raise InvalidOptionError(f"{option}: {text!r} is before 1970")
    return value


def instant_ms(raw: str | int, option: str) -> int:
    """An instant given as milliseconds since the epoch or as ISO 8601 text (anything that
    is not all digits is read as ISO 8601): ``startingTimestamp`` takes both."""
    text = str(raw).strip()
    if text.lstrip("-").isdigit():
        return check_epoch_ms(text, option)
    return iso_instant_ms(text, option)


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
            f"1735689600000) nor ISO 8601 (e.g. 2025-01-01T00:00:00Z)"
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

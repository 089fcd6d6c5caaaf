"""Offsets: ``{shard: last processed sequence}``, their Spark form, and where a read starts.

:func:`resolve` is the one place a starting or ending position given by a user (a
keyword, JSON, or a timestamp) becomes offsets; the source and ``replog consumer set``
share it.

``pyarrow.compute`` is imported where it is used, not with this module: Spark starts a
Python process per streaming query that imports replog to plan it, and planning needs no
compute kernel (the import costs ~30 ms of every query).
"""

from __future__ import annotations

import json

from replog.core.files import read_stored
from replog.errors import InvalidOptionError
from replog.format.segments import row_sequences
from replog.format.state import LogState
from replog.log import ReplicationLog

Offsets = dict[int, int]

VERSION_KEY = "version"
LOG_KEY = "log_id"
CONSUMER_KEY = "consumer"
URL_KEY = "url"


def earliest(state: LogState) -> Offsets:
    """Offsets before the oldest retained event of every shard."""
    return {shard: low - 1 for shard, low in enumerate(state.lows)}


def latest(state: LogState) -> Offsets:
    return dict(enumerate(state.heads))


def meaning(option: str) -> str:
    """What a sequence given to ``option`` means: batch reads take ``startingOffsets``
    exclusive and ``endingOffsets`` inclusive, the reverse of Kafka's; error messages say so
    because that is where a Kafka user finds out."""
    if option == "endingOffsets":
        return "the last sequence to read (inclusive, unlike Kafka's endingOffsets)"
    if option == "startingOffsets":
        return (
            "the last processed sequence (exclusive: the read starts after it, unlike "
            "Kafka's startingOffsets)"
        )
    return "the last processed sequence"


def parse_offsets_json(text: str, shards: int, option: str) -> Offsets:
    """Offsets given by a user as JSON ``{"0": 41, "1": 0}``; missing shards default to 0.

    Every error names ``option`` and the value at fault.
    """
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise InvalidOptionError(
            f"option {option!r}: {text!r} is neither a keyword nor valid JSON ({exc})"
        ) from exc
    if not isinstance(document, dict):
        raise InvalidOptionError(
            f'option {option!r}: expected a JSON object like {{"0": 41}}, got {text!r}'
        )
    offsets = dict.fromkeys(range(shards), 0)
    for key, value in document.items():
        if key in (VERSION_KEY, LOG_KEY, CONSUMER_KEY, URL_KEY):
            continue
        if not str(key).isdigit():
            raise InvalidOptionError(f"option {option!r}: {key!r} is not a shard number")
        shard = int(key)
        if shard >= shards:
            raise InvalidOptionError(
                f"option {option!r}: shard {shard} does not exist (the log has {shards} "
                f"shards: 0..{shards - 1})"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidOptionError(
                f"option {option!r}: shard {shard} has {value!r}; expected {meaning(option)}, "
                f"an integer >= 0"
            )
        offsets[shard] = value
    return offsets


def for_timestamp(log: ReplicationLog, state: LogState, timestamp_ms: int) -> Offsets:
    """Per shard, the offset just before the first event (in sequence order) whose event
    time is at or after ``timestamp_ms``; the head if there is none.

    Segments whose newest event is older are skipped without being read; the first other
    segment is read to find the exact event. Timestamps need not be monotonic in a shard:
    events after that position with earlier times are still delivered, events before it
    with later times are not.
    """
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    offsets: Offsets = {}
    for shard in range(log.shards):
        offsets[shard] = state.heads[shard]
        for segment in state.covering(shard, state.lows[shard], state.heads[shard]):
            if segment.max_timestamp_ms < timestamp_ms:
                continue
            rows = read_stored(log.storage, segment)
            stamps = rows.column("timestamp").cast("int64")
            reached = pc.greater_equal(stamps, timestamp_ms * 1000)
            index = pc.index(reached, True).as_py()
            if index >= 0:
                first = int(row_sequences(rows, segment)[index])  # holed entries skip some
                offsets[shard] = max(first, state.lows[shard]) - 1
                break
    return offsets


def resolve(
    log: ReplicationLog, spec: str, option: str, *, timestamp_ms: int | None = None
) -> Offsets:
    """Offsets for a user's position: ``earliest``, ``latest``, JSON, or (when
    ``timestamp_ms`` is given) the first event at or after that time."""
    state = log.refresh()
    if timestamp_ms is not None:
        return for_timestamp(log, state, timestamp_ms)
    if spec == "earliest":
        return earliest(state)
    if spec == "latest":
        return latest(state)
    offsets = parse_offsets_json(spec, log.shards, option)
    for shard, sequence in offsets.items():
        if sequence > state.heads[shard]:
            raise InvalidOptionError(
                f"option {option!r}: shard {shard} offset {sequence} is beyond its head "
                f"{state.heads[shard]} (offsets are {meaning(option)})"
            )
    return offsets

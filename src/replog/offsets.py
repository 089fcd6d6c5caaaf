"""Consumer offsets: ``{shard: last processed sequence}``, their parsing and their JSON form.

Spark offsets are dicts of JSON primitives: keys ``"0"``, ``"1"``, ... hold the last
processed sequence of each shard; the key ``"version"`` records the log version the
offset was taken at (planning reads only the commits after it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from replog.errors import InvalidOptionError

Offsets = dict[int, int]
VERSION_KEY = "version"


def to_spark(offsets: Mapping[int, int], version: int) -> dict[str, int]:
    document = {str(shard): int(sequence) for shard, sequence in sorted(offsets.items())}
    document[VERSION_KEY] = int(version)
    return document


def from_spark(document: Mapping[str, Any]) -> tuple[Offsets, int]:
    """Offsets and log version from a Spark offset dict (as written by :func:`to_spark`)."""
    offsets = {int(key): int(value) for key, value in document.items() if key.isdigit()}
    return offsets, int(document.get(VERSION_KEY, 0))


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
        if key == VERSION_KEY:
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
                f"option {option!r}: shard {shard} has {value!r}; expected the last processed "
                f"sequence, an integer >= 0"
            )
        offsets[shard] = value
    return offsets

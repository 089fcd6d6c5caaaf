"""Source and sink options, parsed once into frozen dataclasses.

Spark hands options over as a case-insensitive string map; every error names the
option, the value and what is allowed. ``fs.<name>`` options become fsspec storage
options and are never logged (see :func:`replog.storage.redact`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replog.consumers import check_name
from replog.errors import InvalidOptionError
from replog.storage import coerce_option_value

FS_PREFIX = "fs."
DEFAULT_MAX_EVENTS_PER_PARTITION = 500_000
STARTING_KEYWORDS = ("manifest", "earliest", "latest")


def _get(options: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive lookup (Spark lower-cases option names)."""
    for key, value in options.items():
        if key.lower() == name.lower():
            return value
    return None


def _positive_int(options: Mapping[str, str], name: str) -> int | None:
    raw = _get(options, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise InvalidOptionError(f"option {name!r}: {raw!r} is not an integer") from exc
    if value <= 0:
        raise InvalidOptionError(f"option {name!r}: must be a positive integer, got {value}")
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise InvalidOptionError(f"option {name!r}: expected true or false, got {raw!r}")
    return raw.strip().lower() == "true"


def _path(options: Mapping[str, str]) -> str:
    path = _get(options, "path")
    if not path:
        raise InvalidOptionError(
            "option 'path' is required: pass the log URL to .load(url) / .start(url) "
            "or .option('path', url)"
        )
    return path


def storage_options(options: Mapping[str, str]) -> dict[str, Any]:
    """The ``fs.*`` options, prefix removed, values coerced (``"true"`` → True, ``"5"`` → 5)."""
    return {
        key[len(FS_PREFIX) :]: coerce_option_value(value)
        for key, value in options.items()
        if key.lower().startswith(FS_PREFIX)
    }


@dataclass(frozen=True)
class SourceOptions:
    path: str
    consumer: str = "default"
    starting_offsets: str = "manifest"
    ending_offsets: str = "latest"
    max_events_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    max_events_per_partition: int = DEFAULT_MAX_EVENTS_PER_PARTITION
    fail_on_data_loss: bool = True
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool = True) -> SourceOptions:
        """Streaming queries start from the consumer's manifest by default; batch reads
        (``spark.read``) from the earliest event, like Kafka's batch reads."""
        default_start = "manifest" if streaming else "earliest"
        starting = (_get(options, "startingOffsets") or default_start).strip()
        if starting.lower() in STARTING_KEYWORDS:
            starting = starting.lower()
        elif not starting.startswith("{"):
            raise InvalidOptionError(
                f"option 'startingOffsets': {starting!r} is not allowed; use manifest, "
                f'earliest, latest, or JSON like {{"0": 41, "1": 0}}'
            )
        ending = (_get(options, "endingOffsets") or "latest").strip()
        if ending.lower() == "latest":
            ending = "latest"
        elif not ending.startswith("{"):
            raise InvalidOptionError(
                f"option 'endingOffsets': {ending!r} is not allowed; use latest or JSON"
            )
        return cls(
            path=_path(options),
            consumer=check_name(_get(options, "consumer") or "default", "consumer"),
            starting_offsets=starting,
            ending_offsets=ending,
            max_events_per_trigger=_positive_int(options, "maxEventsPerTrigger"),
            max_bytes_per_trigger=_positive_int(options, "maxBytesPerTrigger"),
            max_events_per_partition=_positive_int(options, "maxEventsPerPartition")
            or DEFAULT_MAX_EVENTS_PER_PARTITION,
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            storage_options=storage_options(options),
        )


def sink_id_from_checkpoint(location: str) -> str:
    """A stable, valid sink id for a checkpoint location: its last part plus a short hash."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", location.rstrip("/").rsplit("/", 1)[-1]).strip("-.")
    digest = hashlib.sha256(location.rstrip("/").encode("utf-8")).hexdigest()[:10]
    return f"{(tail or 'chk')[:80]}-{digest}"


@dataclass(frozen=True)
class SinkOptions:
    path: str
    sink_id: str
    shards: int = 8
    collection: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SinkOptions:
        sink_id = _get(options, "sinkId")
        if sink_id is None:
            checkpoint = _get(options, "checkpointLocation")
            if checkpoint:
                sink_id = sink_id_from_checkpoint(checkpoint)
            elif streaming:
                raise InvalidOptionError(
                    "option 'sinkId' is required: name this writer with .option('sinkId', ...) "
                    "or set .option('checkpointLocation', ...) to derive it"
                )
            else:
                sink_id = "batch"
        shards = _positive_int(options, "shards") or 8
        if shards > 4096:
            raise InvalidOptionError(f"option 'shards': at most 4096, got {shards}")
        return cls(
            path=_path(options),
            sink_id=check_name(sink_id, "sinkId"),
            shards=shards,
            collection=_get(options, "collection"),
            storage_options=storage_options(options),
        )

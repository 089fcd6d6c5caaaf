"""Source and sink options, parsed once into frozen dataclasses.

Spark hands options over as a case-insensitive string map. Every option is known by name:
an unknown one is refused (with a hint when it is a Kafka or Delta habit, or a typo), and
every error names the option, the value and what is allowed. ``fs.<name>`` options become
fsspec storage options and are never logged (:func:`replog.storage.redact`).

Locations are made absolute on the driver, as Spark's file sources qualify theirs, so
executors (in other working directories) and later restarts see the same log; checkpoint
locations are normalised before an id is derived from them.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from replog.errors import InvalidOptionError, ReplogError
from replog.format.commits import DEFAULT_SHARDS, Transaction
from replog.format.limits import check_shards
from replog.names import check_name
from replog.storage import coerce_option_value
from replog.timeutil import duration_ms, instant_ms

FS_PREFIX = "fs."
DEFAULT_MAX_EVENTS_PER_PARTITION = 500_000
DEFAULT_MAX_TRIGGER_DELAY = "15m"
STARTING_KEYWORDS = ("manifest", "earliest", "latest")

SOURCE_OPTIONS = (
    "path",
    "consumer",
    "startingOffsets",
    "startingTimestamp",
    "endingOffsets",
    "maxEventsPerTrigger",
    "maxBytesPerTrigger",
    "maxEventsPerPartition",
    "minEventsPerTrigger",
    "maxTriggerDelay",
    "failOnDataLoss",
    "view",
    "asOfLsn",
    "asOfTimestamp",
)
VIEWS = ("latest",)
"""Batch reads' ``view``: ``latest`` is one row per (collection, key), deletes dropped."""
SINK_OPTIONS = (
    "path",
    "sinkId",
    "shards",
    "collection",
    "txnAppId",
    "txnVersion",
    "checkpointLocation",
)

HINTS = {
    "maxoffsetspertrigger": "maxOffsetsPerTrigger is Kafka's name; replog's is maxEventsPerTrigger",
    "minoffsetspertrigger": "minOffsetsPerTrigger is Kafka's name; replog's is minEventsPerTrigger",
    "maxfilespertrigger": "replog limits micro-batches by events: maxEventsPerTrigger",
    "startingoffsetsbytimestamp": (
        "startingOffsetsByTimestamp is Kafka's; replog takes one time for every shard: "
        "startingTimestamp (ms since the epoch)"
    ),
    "startingversion": (
        "startingVersion is Delta's; replog starts at startingOffsets or startingTimestamp"
    ),
    "endingtimestamp": "replog batch reads end at endingOffsets",
    "subscribe": "replog reads the log given as the path: .load(url)",
    "subscribepattern": "replog reads the log given as the path: .load(url)",
    "kafka.bootstrap.servers": "replog reads the log given as the path: .load(url)",
    "kafka.group.id": "kafka.group.id is Kafka's; replog names a reader with consumer",
    "groupidprefix": "groupIdPrefix is Kafka's; replog names a reader with consumer",
    "readchangefeed": "readChangeFeed is Delta's; a replog log is always a change feed",
    "ignorechanges": "ignoreChanges is Delta's; replog logs are append-only",
    "skipchangecommits": "skipChangeCommits is Delta's; replog logs are append-only",
    "topic": "topic is Kafka's; replog writes to the log given as the path: .start(url)",
    "mergeschema": "mergeSchema is Delta's; replog's columns are fixed (see the README)",
    "overwriteschema": "overwriteSchema is Delta's; replog's columns are fixed",
    "replacewhere": "replaceWhere is Delta's; replog logs are append-only",
    "txnappid": "txnAppId and txnVersion are for batch writes (df.write)",
    "txnversion": "txnAppId and txnVersion are for batch writes (df.write)",
    "checkpointlocation": "set checkpointLocation on writeStream, not on readStream",
    "queryname": "set the query name with writeStream.queryName(...)",
}

SPELLINGS = {
    name.lower(): name
    for name in (
        *SOURCE_OPTIONS,
        *SINK_OPTIONS,
        "maxOffsetsPerTrigger",
        "minOffsetsPerTrigger",
        "maxFilesPerTrigger",
        "startingOffsetsByTimestamp",
        "startingVersion",
        "endingTimestamp",
        "subscribe",
        "subscribePattern",
        "kafka.bootstrap.servers",
        "kafka.group.id",
        "groupIdPrefix",
        "readChangeFeed",
        "ignoreChanges",
        "skipChangeCommits",
        "topic",
        "mergeSchema",
        "overwriteSchema",
        "replaceWhere",
        "queryName",
    )
}
"""Option names as users write them: Spark hands a Python data source its options
lower-cased, and an error should name the option as it was written."""

_Method = TypeVar("_Method", bound=Callable[..., Any])


def plain_errors(method: _Method) -> _Method:
    """``method`` re-raising a replog error with its traceback cut to this frame.

    Spark shows a Python data source's error as the Python traceback followed by the
    message; replog's messages say what is wrong in one line, which came after 10 to 24
    lines of replog's frames. Cut, it is the line after two (the frame's file and this
    ``raise``)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ReplogError as error:
            raise error.with_traceback(None) from None

    return cast(_Method, wrapper)


def _get(options: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive lookup (Spark lower-cases option names)."""
    for key, value in options.items():
        if key.lower() == name.lower():
            return value
    return None


def check_known(options: Mapping[str, str], known: Iterable[str], what: str) -> None:
    """Refuse every option that is not in ``known`` (nor ``fs.*``), naming it."""
    allowed = {name.lower(): name for name in known}
    for key in options:
        lowered = key.lower()
        if lowered in allowed or lowered.startswith(FS_PREFIX) or lowered.startswith("__"):
            continue
        hint = HINTS.get(lowered)
        if hint is None:
            close = difflib.get_close_matches(lowered, list(allowed), n=1, cutoff=0.75)
            hint = f"did you mean {allowed[close[0]]}?" if close else ""
        listed = ", ".join(sorted(allowed.values()))
        shown = SPELLINGS.get(lowered, key)
        raise InvalidOptionError(
            f"{what}: unknown option {shown!r}{'; ' + hint if hint else ''} "
            f"(options: {listed}, and fs.<name> for storage)"
        )


def _int(options: Mapping[str, str], name: str) -> int | None:
    raw = _get(options, name)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError as exc:
        raise InvalidOptionError(f"option {name!r}: {raw!r} is not an integer") from exc


def _positive_int(options: Mapping[str, str], name: str, *, zero: bool = False) -> int | None:
    value = _int(options, name)
    if value is None:
        return None
    if value < 0 or (value == 0 and not zero):
        kind = "an integer >= 0" if zero else "a positive integer"
        raise InvalidOptionError(f"option {name!r}: must be {kind}, got {value}")
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise InvalidOptionError(f"option {name!r}: expected true or false, got {raw!r}")
    return raw.strip().lower() == "true"


def is_bare_path(location: str) -> bool:
    """Whether ``location`` is a path without a scheme (a local path, maybe relative)."""
    return "://" not in location and not location.startswith("file:")


def absolute_location(location: str) -> str:
    """``location`` with a local path made absolute (a ``file:`` URL becomes a path)."""
    location = location.strip()
    if location.startswith("file:"):
        parts = urlsplit(location)
        if parts.netloc not in ("", "localhost"):
            raise InvalidOptionError(f"{location!r}: a file: URL names no other host")
        return os.path.normpath(parts.path or "/")
    if is_bare_path(location):
        return os.path.normpath(os.path.abspath(os.path.expanduser(location)))
    return location


_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "gs": "gcs", "abfss": "abfs"}


def normalize_location(location: str) -> str:
    """One spelling per place: ``/x``, ``file:/x``, ``file:///x`` and ``x/`` relative to
    the working directory agree, as do ``s3a://b/x/`` and ``s3://b/x``."""
    location = absolute_location(location)
    if "://" not in location:
        return location
    parts = urlsplit(location)
    scheme = _SCHEME_ALIASES.get(parts.scheme.lower(), parts.scheme.lower())
    path = re.sub(r"/+", "/", parts.path).rstrip("/")
    return f"{scheme}://{parts.netloc}{path}"


def id_from_location(location: str, prefix: str = "") -> str:
    """A stable, valid name for a checkpoint location: its last part plus a short hash of
    its normalised form."""
    normalized = normalize_location(location)
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", normalized.rsplit("/", 1)[-1]).strip("-.")
    digest = hashlib.sha256(normalized.encode("utf-8")).hexdigest()[:10]
    return f"{prefix}{(tail or 'chk')[:80]}-{digest}"


def _path(options: Mapping[str, str]) -> str:
    path = _get(options, "path")
    if not path or not path.strip():
        raise InvalidOptionError(
            "option 'path' is required: pass the log URL to .load(url) / .start(url) "
            "or .option('path', url)"
        )
    return absolute_location(path)


def storage_options(options: Mapping[str, str]) -> dict[str, Any]:
    """The ``fs.*`` options, prefix removed, values coerced (``"true"`` → True, ``"5"`` → 5;
    secrets are passed as given)."""
    return {
        key[len(FS_PREFIX) :]: coerce_option_value(key[len(FS_PREFIX) :], value)
        for key, value in options.items()
        if key.lower().startswith(FS_PREFIX)
    }


def _starting_offsets(options: Mapping[str, str], streaming: bool) -> str:
    default = "manifest" if streaming else "earliest"
    starting = (_get(options, "startingOffsets") or default).strip()
    if starting.lower() in STARTING_KEYWORDS:
        return starting.lower()
    if not starting.startswith("{"):
        raise InvalidOptionError(
            f"option 'startingOffsets': {starting!r} is not allowed; use manifest, "
            f'earliest, latest, or JSON like {{"0": 41, "1": 0}} (per shard the last '
            f"processed sequence: the read starts after it - exclusive, unlike Kafka)"
        )
    return starting


def _starting_timestamp(options: Mapping[str, str]) -> int | None:
    raw = _get(options, "startingTimestamp")
    if raw is None:
        return None
    if _get(options, "startingOffsets") is not None:
        raise InvalidOptionError(
            "options 'startingOffsets' and 'startingTimestamp' are both set; set one"
        )
    return instant_ms(raw, "startingTimestamp")


def _ending_offsets(options: Mapping[str, str], streaming: bool) -> str:
    given = _get(options, "endingOffsets")
    if streaming and given is not None:
        raise InvalidOptionError("option 'endingOffsets' is for batch reads (spark.read)")
    ending = (given or "latest").strip()
    if ending.lower() == "latest":
        return "latest"
    if not ending.startswith("{"):
        raise InvalidOptionError(
            f"option 'endingOffsets': {ending!r} is not allowed; use latest or JSON like "
            f'{{"0": 99}} (per shard the last sequence to read - inclusive, unlike Kafka)'
        )
    return ending


def _view(options: Mapping[str, str], streaming: bool) -> str | None:
    raw = _get(options, "view")
    if raw is None:
        return None
    view = raw.strip().lower()
    if view not in VIEWS:
        raise InvalidOptionError(f"option 'view': {raw!r} is not allowed; use {', '.join(VIEWS)}")
    if streaming:
        raise InvalidOptionError(
            "option 'view' is for batch reads (spark.read); a stream of the latest rows is "
            "replog.spark.functions.apply_changes into a table"
        )
    return view


def _as_of(options: Mapping[str, str], view: str | None) -> tuple[int | None, int | None]:
    """``asOfLsn`` (``0/3A5F1C8``) or ``asOfTimestamp`` (ms or ISO 8601; UTC without a
    zone): ``view=latest`` as the source had it then (position, time in ms)."""
    lsn, stamp = _get(options, "asOfLsn"), _get(options, "asOfTimestamp")
    if lsn is None and stamp is None:
        return None, None
    if lsn is not None and stamp is not None:
        raise InvalidOptionError("options 'asOfLsn' and 'asOfTimestamp': give one of them")
    if view != "latest":
        name = "asOfLsn" if lsn is not None else "asOfTimestamp"
        raise InvalidOptionError(
            f"option {name!r} reads the latest rows as of a point: set option 'view' to "
            f"'latest' too"
        )
    if lsn is not None:
        # imported here: pyarrow.compute costs every query's planning process ~30 ms
        from replog.tables.coverage import lsn_to_int  # noqa: PLC0415

        return lsn_to_int(lsn, "option 'asOfLsn'"), None
    assert stamp is not None
    return None, instant_ms(stamp, "option 'asOfTimestamp'")


def _consumer(options: Mapping[str, str], starting: str) -> str | None:
    consumer = _get(options, "consumer")
    if consumer is not None:
        return check_name(consumer, "consumer")
    if starting == "manifest" and _get(options, "startingOffsets") is not None:
        raise InvalidOptionError(
            "option 'startingOffsets': 'manifest' resumes a named consumer; set option "
            "'consumer' too"
        )
    return None


@dataclass(frozen=True)
class SourceOptions:
    path: str
    consumer: str | None = None
    starting_offsets: str = "manifest"
    starting_timestamp_ms: int | None = None
    ending_offsets: str = "latest"
    max_events_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    max_events_per_partition: int = DEFAULT_MAX_EVENTS_PER_PARTITION
    min_events_per_trigger: int | None = None
    max_trigger_delay_ms: int = 15 * 60_000
    fail_on_data_loss: bool = True
    view: str | None = None
    as_of_position: int | None = None
    """``asOfLsn``: ``view=latest`` as of this source position."""
    as_of_ms: int | None = None
    """``asOfTimestamp``: ``view=latest`` as of this time."""
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool = True) -> SourceOptions:
        """Streaming queries start from the consumer's position by default; batch reads
        (``spark.read``) from the earliest event, like Kafka's batch reads."""
        check_known(options, SOURCE_OPTIONS, "replog source")
        starting = _starting_offsets(options, streaming)
        timestamp = _starting_timestamp(options)
        ending = _ending_offsets(options, streaming)
        consumer = _consumer(options, starting)
        min_events = _positive_int(options, "minEventsPerTrigger")
        raw_delay = _get(options, "maxTriggerDelay")
        if raw_delay is not None and min_events is None:
            raise InvalidOptionError("option 'maxTriggerDelay' needs 'minEventsPerTrigger'")
        view = _view(options, streaming)
        as_of_position, as_of_ms = _as_of(options, view)
        return cls(
            path=_path(options),
            consumer=consumer,
            starting_offsets=starting,
            starting_timestamp_ms=timestamp,
            ending_offsets=ending,
            max_events_per_trigger=_positive_int(options, "maxEventsPerTrigger"),
            max_bytes_per_trigger=_positive_int(options, "maxBytesPerTrigger"),
            max_events_per_partition=_positive_int(options, "maxEventsPerPartition")
            or DEFAULT_MAX_EVENTS_PER_PARTITION,
            min_events_per_trigger=min_events,
            max_trigger_delay_ms=duration_ms(
                raw_delay or DEFAULT_MAX_TRIGGER_DELAY, "option 'maxTriggerDelay'"
            ),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            view=view,
            as_of_position=as_of_position,
            as_of_ms=as_of_ms,
            storage_options=storage_options(options),
        )


@dataclass(frozen=True)
class SinkOptions:
    path: str
    sink_id: str | None
    checkpoint: str | None = None
    shards: int = DEFAULT_SHARDS
    collection: str | None = None
    transaction: Transaction | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SinkOptions:
        check_known(options, SINK_OPTIONS, "replog-sink")
        checkpoint = _get(options, "checkpointLocation")
        checkpoint = absolute_location(checkpoint) if checkpoint else None
        sink_id = _get(options, "sinkId")
        app_id, version = _get(options, "txnAppId"), _positive_int(options, "txnVersion", zero=True)
        transaction = None
        if streaming:
            if app_id is not None or version is not None:
                raise InvalidOptionError(
                    "options 'txnAppId'/'txnVersion' are for batch writes (df.write); a streaming "
                    "sink is exactly-once per checkpoint and sinkId already"
                )
            if sink_id is None:
                if checkpoint is None:
                    raise InvalidOptionError(
                        "option 'sinkId' is required: name this writer with "
                        ".option('sinkId', ...) or set .option('checkpointLocation', ...) to "
                        "derive it"
                    )
                sink_id = id_from_location(checkpoint)
            check_name(sink_id, "sinkId")
        else:
            if sink_id is not None:
                raise InvalidOptionError(
                    "option 'sinkId' names a streaming writer; to make a batch write "
                    "idempotent, set 'txnAppId' and 'txnVersion' (Delta's contract)"
                )
            if (app_id is None) != (version is None):
                raise InvalidOptionError("options 'txnAppId' and 'txnVersion' go together")
            if app_id is not None and version is not None:
                transaction = Transaction(check_name(app_id, "txnAppId"), version)
        shards = _int(options, "shards")
        shards = check_shards(DEFAULT_SHARDS if shards is None else shards, "option 'shards'")
        return cls(
            path=_path(options),
            sink_id=sink_id,
            checkpoint=checkpoint,
            shards=shards,
            collection=_get(options, "collection"),
            transaction=transaction,
            storage_options=storage_options(options),
        )

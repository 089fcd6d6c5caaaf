"""Debezium change events in and out of replog's change event (docs/CDC.md).

In: one Debezium change-event *value* (with or without the ``{"schema", "payload"}``
wrapper) becomes one replog event:

* ``op`` c (create) and r (snapshot read) → insert, u → update, d → delete; t (truncate)
  and m (message) carry no row and are skipped, as are tombstones (null values);
* ``data`` = ``after``, or ``before`` for a delete; ``before`` = ``before``; both as the
  exact JSON text of the envelope (numbers, key order and escapes unchanged);
* ``collection`` = ``<schema>.<table>`` where the connector names a schema (PostgreSQL,
  SQL Server, Oracle), else ``<db>.<table>`` (MySQL), or ``<db>.<collection>`` (MongoDB);
* ``key`` = the key fields of the row as a compact JSON object, e.g. ``{"id":1001}``
  (Debezium's own message-key form), so every event of one row shares one key; MongoDB's
  ``{"_id":...}`` holds the id in one canonical form whatever the connector wrote (the
  document's v1 strict ``_id``, the message key's relaxed ``id``);
* ``timestamp`` = ``source.ts_ms`` when non-zero, else the envelope's ``ts_ms``;
* ``event_id`` = a UUID derived from the source position, the operation and the key, so
  a change redelivered by Debezium keeps its id and two snapshot rows never share one;
* ``metadata`` = ``{"op", "ts_ms", "ts_us", "ts_ns", "source", "transaction"}`` (exact
  text), ``"schema"``: the digest of the value's schema, ``"replog_filled"``: the fields
  replog filled in (a ``timestamp`` the event did not carry), ``"members"``/``"order"``:
  other envelope members and the input's member order, so the envelope comes back as it
  came (:func:`original_envelope`);
* transaction BEGIN/END records are :class:`Marker` records; ExtractNewRecordState rows
  (with ``__op``, ``__deleted``, ... or the row alone) are understood; a Kafka record line
  ``{"key", "value"}`` gives a delete without ``before`` its key, and a MongoDB update
  without ``after`` (``capture.mode=change_streams``) the document it builds;
* :func:`position_of` orders events by the connector's source position (ingestion skips
  redeliveries with it).

Out: :func:`original_envelope` rebuilds the Debezium value an event was appended from;
:func:`envelope` builds one for an event that did not come from Debezium (both used by
:func:`replog.spark.functions.to_debezium`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from replog.errors import InvalidEventError
from replog.format import jsontext
from replog.format.jsontext import Member, RawJSON
from replog.names import is_valid_name
from replog.schemas import connect
from replog.timeutil import now_ms

OPERATIONS = {"c": "insert", "r": "insert", "u": "update", "d": "delete"}
"""Debezium's row operations (``t``, a truncate, is a table's: :data:`TRUNCATE_OP`)."""
TRUNCATE_OP = "t"
SKIPPED = {"t": "truncate event (op t)", "m": "message event (op m)"}


@dataclass(frozen=True)
class Skipped:
    """A Debezium record that carries no change event (a tombstone, a truncate or message
    event): ``reason`` says which, for the count an append reports."""

    reason: str


@dataclass(frozen=True)
class Marker:
    """A transaction metadata record (``status`` BEGIN or END, ``id``, END's
    ``event_count``): no event, but it brackets a source transaction."""

    status: str
    id: str
    event_count: int | None


@dataclass(frozen=True)
class Position:
    """A connector's source position: ``version`` orders the events of ``app_id`` (the
    idempotent transaction it is recorded as, ``debezium.<source.name>``)."""

    app_id: str
    version: int
    snapshot: bool
    """A snapshot read: every row of a snapshot shares its position."""
    text: str


@dataclass
class Change:
    """A Debezium change as a replog event record, with its schema and source position."""

    record: dict[str, Any]
    schema: dict[str, Any] | None
    digest: str | None
    position: Position | None
    transaction_id: str | None
    pinned: bool = True
    """Whether the source fields name this change alone (a redelivery has its event id, no
    other change does): False for a flattened row that carries no source position, whose
    ``__`` fields (``__op``, ``__table``, ...) two changes of one row can share."""


OPS_OUT = {"insert": "c", "update": "u", "delete": "d", "bulk": "c"}
EVENT_ID_NAMESPACE = uuid.UUID("6f1f2a52-8d2c-4f6e-9a57-3f2b1a0c9d41")


def _object(member: Member | None, what: str) -> dict[str, Member] | None:
    """The members of a JSON object given as a member (or as a JSON string holding one,
    as MongoDB connectors send documents)."""
    if member is None or member.value is None:
        return None
    text = member.value if isinstance(member.value, str) else member.text
    try:
        return jsontext.parse_object(text)
    except ValueError as exc:
        raise InvalidEventError(f"{what!r} is not a JSON object: {exc}") from exc


def _wrapped(members: dict[str, Member]) -> bool:
    """Whether a value is a ``{"schema", "payload"}`` wrapper (JsonConverter with schemas)."""
    return "payload" in members and set(members) <= {"schema", "payload"}


def _unwrap(members: dict[str, Member]) -> dict[str, Member] | None:
    """The envelope inside a ``{"schema", "payload"}`` wrapper (None for a null payload)."""
    if _wrapped(members):
        return _object(members["payload"], "payload")
    return members


def collection_of(source: Mapping[str, Any]) -> str | None:
    table = source.get("table") or source.get("collection")
    owner = source.get("schema") or source.get("db")
    if table is None:
        return None
    return f"{owner}.{table}" if owner else str(table)


def key_of(row: dict[str, Member], key_fields: Sequence[str], where: str) -> str:
    missing = [name for name in key_fields if name not in row]
    if missing:
        raise InvalidEventError(
            f"key field(s) {missing} are not in the {where} image (its fields: {sorted(row)})"
        )
    return "{" + ",".join(f"{json.dumps(name)}:{row[name].text}" for name in key_fields) + "}"


@dataclass(frozen=True)
class _Schema:
    """A value's Connect schema, parsed once: its digest and the schema it is the digest
    of (floats as floats: a schema is JSON to store, not a payload to keep exactly)."""

    digest: str
    value: dict[str, Any]


@functools.lru_cache(maxsize=256)
def _schema_of(text: str) -> _Schema:
    parsed = json.loads(text)
    return _Schema(connect.digest(parsed), parsed)


_MESSAGE_MEMBERS = {"key", "value", "topic", "partition", "offset", "timestamp", "headers"}


def _message(members: dict[str, Member]) -> tuple[Member | None, Member | None] | None:
    """``(key, value)`` of a Kafka record line (``{"key": ..., "value": ...}``, each a JSON
    value or a string holding one), or None for a bare Debezium value."""
    if "value" in members and set(members) <= _MESSAGE_MEMBERS:
        return members.get("key"), members["value"]
    return None


ENVELOPE_MEMBERS = ("before", "after", "source", "transaction", "op", "ts_ms", "ts_us", "ts_ns")
"""A change-event envelope's members, in the order Debezium >= 2.7 writes them when every one
is there (``transaction`` before ``op``: earlier versions put it last, or leave it out)."""


def _flat(envelope: dict[str, Member]) -> bool:
    """Whether a record is a row flattened by ExtractNewRecordState: any object that is no
    envelope (no ``op``; ``before``/``after`` with ``source`` make a broken envelope, not a
    row), with its ``__`` fields (``__op``, ``__deleted``, ...) or without (the SMT's
    default output: the row alone)."""
    if "op" in envelope:
        return False
    return not ("source" in envelope and ("after" in envelope or "before" in envelope))


_FLAT_TOP = {"op", "deleted", "ts_ms", "ts_us", "ts_ns"}
_JSON_SPACE = " \t\r\n"


def _flat_parts(envelope: dict[str, Member]) -> tuple[str, dict[str, Member], dict[str, Any]]:
    """A flattened row's operation, its envelope-level fields and its source fields, from
    the ``__`` fields ExtractNewRecordState adds (``__source_ts_ms`` is ``source.ts_ms``,
    ``__lsn``/``__table``/... are source fields, ``__op``/``__ts_ms`` the envelope's)."""
    top: dict[str, Member] = {}
    source: dict[str, Any] = {}
    for name, member in envelope.items():
        if not name.startswith("__"):
            continue
        field = name[2:]
        if field.startswith("source_"):
            source[field[len("source_") :]] = member.value
        elif field in _FLAT_TOP:
            top[field] = member
        else:
            source[field] = member.value
    deleted = top.get("deleted")
    if deleted is not None and str(deleted.value).lower() == "true":
        return "d", top, source
    op = top["op"].value if "op" in top else "u"  # no __op: the row as it now is
    if op not in OPERATIONS:
        raise InvalidEventError(f"'__op' is {op!r}: not c, r, u or d")
    return str(op), top, source


@dataclass
class _Opened:
    """A record taken out of its Kafka record and schema wrappers."""

    envelope: dict[str, Member]
    text: str | None
    schema: Member | None
    message_key: dict[str, Member] | None


def _open(members: dict[str, Member], text: str | None) -> _Opened | Skipped:
    message_key: dict[str, Member] | None = None
    message = _message(members)
    if message is not None:
        key_member, value_member = message
        value = _object(value_member, "value")
        if value is None or value_member is None:
            return Skipped("tombstone (null value)")
        text = value_member.value if isinstance(value_member.value, str) else value_member.text
        members = value
        message_key = _object(key_member, "key")
        if message_key is not None and _wrapped(message_key):
            message_key = _unwrap(message_key)
    wrapped = _wrapped(members)
    envelope = _unwrap(members)
    if envelope is None:
        return Skipped("tombstone (null payload)")
    if wrapped:
        payload = members["payload"]
        text = payload.value if isinstance(payload.value, str) else payload.text
    return _Opened(envelope, text, members.get("schema") if wrapped else None, message_key)


@dataclass
class _Image:
    """What one change says: op, row image, envelope-level and source fields."""

    op: str
    op_text: str
    row: dict[str, Member] | None
    where: str
    data: str | None
    before: Member | None
    top: dict[str, Member]
    source: dict[str, Any]
    source_text: Any
    transaction: Member | None
    order: list[str] | None = None
    """The envelope's members in the input's order, when a rebuild in the default order
    (:func:`_default_order`) would not give it back."""
    extra: dict[str, Member] = field(default_factory=dict)
    """Envelope members beyond :data:`ENVELOPE_MEMBERS` (MongoDB's ``updateDescription``)."""
    partial: bool = False
    """A MongoDB update without ``after`` (``capture.mode=change_streams``): ``data`` is
    built from ``updateDescription``."""


def _flat_image(opened: _Opened) -> _Image:
    op, top, source = _flat_parts(opened.envelope)
    # The row is the record's JSON text without the white space around it (a line's
    # newline is no part of the value), so a file and a Kafka value give one ``data``.
    text = opened.text.strip(_JSON_SPACE) if opened.text is not None else None
    data = text if text is not None else _text_of(opened.envelope)
    return _Image(op, json.dumps(op), opened.envelope, "row", data, None, top, source, source, None)


def _default_order(envelope: Mapping[str, Member]) -> list[str]:
    """The members :func:`original_envelope` writes when no order is recorded."""
    times = [n for n in ("ts_ms", "ts_us", "ts_ns") if n in envelope]
    times = [n for n in times if envelope[n].value is not None]
    return ["before", "after", "source", "transaction", "op", *times]


def _envelope_image(envelope: dict[str, Member]) -> _Image | Skipped:
    op_member = envelope.get("op")
    op = op_member.value if op_member else None
    if op in SKIPPED:
        return Skipped(SKIPPED[op])
    if op not in OPERATIONS or op_member is None:
        raise InvalidEventError(
            f"'op' is {op!r}: not a Debezium change event (c, r, u, d; t and m are "
            f"skipped), a transaction BEGIN/END record or an ExtractNewRecordState row"
        )
    top: dict[str, Member] = {
        name: envelope[name] for name in ("ts_ms", "ts_us", "ts_ns") if name in envelope
    }
    before, after = envelope.get("before"), envelope.get("after")
    image, where = (before, "before") if op == "d" else (after, "after")
    source_member = envelope.get("source")
    source = source_member.value if source_member else None
    order = list(envelope)
    return _Image(
        op,
        op_member.text,
        _object(image, where),
        where,
        image.raw if image is not None else None,
        before,
        top,
        source if isinstance(source, dict) else {},
        RawJSON(source_member.text) if source_member else None,
        envelope.get("transaction"),
        order=None if order == _default_order(envelope) else order,
        extra={n: m for n, m in envelope.items() if n not in ENVELOPE_MEMBERS},
    )


def _marker(envelope: dict[str, Member]) -> Marker | None:
    status = envelope.get("status")
    if status is None or status.value not in ("BEGIN", "END") or "id" not in envelope:
        return None
    count = envelope.get("event_count")
    return Marker(
        str(status.value),
        str(envelope["id"].value),
        int(count.value) if count is not None and count.value is not None else None,
    )


# -- MongoDB -----------------------------------------------------------------------------------

MONGODB_ID_FIELDS = (("_id",), ("id",))
"""``--key-fields`` that key MongoDB events on the document id (``_id`` in a document, ``id``
in the connector's message key)."""
_MONGO_NUMBERS = ("$numberInt", "$numberLong", "$numberDouble")


def _mongo_number(text: str) -> RawJSON:
    number = Decimal(text)
    if not number.is_finite():
        raise ArithmeticError(text)
    if number == number.to_integral_value():  # 5, 5.0, {"$numberLong": "5"}: one _id
        return RawJSON(str(int(number)))
    return RawJSON(str(number.normalize()))


def _mongo_canonical(value: Any) -> Any:  # noqa: PLR0911 - one return per BSON form
    """A MongoDB extended-JSON value in one form whatever mode wrote it (the connector
    writes documents in v1 strict mode and key ids in v2 relaxed mode): numbers plain,
    v1 binary as v2, key order kept. Every form of one ``_id`` then gives one key."""
    if isinstance(value, list):
        return [_mongo_canonical(item) for item in value]
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float | Decimal):
        return _mongo_number(str(value))
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        wrapped = _mongo_wrapper(*next(iter(value.items())))
        if wrapped is not None:
            return wrapped
    if set(value) == {"$binary", "$type"} and isinstance(value["$binary"], str):
        return {"$binary": {"base64": value["$binary"], "subType": value["$type"]}}
    return {name: _mongo_canonical(inner) for name, inner in value.items()}


def _mongo_wrapper(name: str, inner: Any) -> Any:  # noqa: PLR0911 - one return per BSON form
    """A one-member extended-JSON wrapper of a number or date in its canonical form (None:
    not one of those)."""
    if name in _MONGO_NUMBERS and isinstance(inner, str):
        try:
            return _mongo_number(inner)
        except ArithmeticError:
            return {name: inner}  # NaN, Infinity: kept as written
    if name == "$date" and isinstance(inner, dict) and "$numberLong" in inner:
        return {"$date": _mongo_number(str(inner["$numberLong"]))}
    if name == "$date" and isinstance(inner, int | Decimal) and not isinstance(inner, bool):
        return {"$date": _mongo_number(str(inner))}
    if name == "$date" and isinstance(inner, str):  # relaxed mode (a message key): ISO 8601
        try:
            moment = datetime.datetime.fromisoformat(inner.replace("Z", "+00:00"))
        except ValueError:
            return None
        epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
        return {"$date": RawJSON(str((moment - epoch) // datetime.timedelta(milliseconds=1)))}
    return None


def _mongo_key(row: dict[str, Member] | None, message_key: dict[str, Member] | None) -> str:
    """A MongoDB event's key, ``{"_id":<the id, canonical>}``, from the document's ``_id`` or
    from the message key's ``id`` (the id as extended-JSON text)."""
    if row is not None and "_id" in row:
        value = row["_id"].value
    elif message_key is not None and "id" in message_key:
        given = message_key["id"].value
        try:
            value = json.loads(given, parse_float=Decimal) if isinstance(given, str) else given
        except ValueError as exc:
            raise InvalidEventError(
                f"message key id {given!r} is not extended JSON: {exc}"
            ) from exc
    else:
        raise InvalidEventError(
            "a MongoDB event without the document's _id: no after/before document and no "
            'message key {"id": ...} (give Kafka record lines {"key": ..., "value": ...})'
        )
    return '{"_id":' + jsontext.encode(_mongo_canonical(value)) + "}"


def _java_double(number: Decimal) -> str:
    """A double as Java's ``Double.toString`` writes it (what the BSON writer's relaxed mode
    gives for a double): ``1004.0``, ``0.5``, ``1.0E20``, ``1.5E-5``."""
    value = float(number)
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    shortest = Decimal(repr(value))  # the shortest digits that read back, as Java 19+ gives
    if 1e-3 <= abs(value) < 1e7:
        text = format(shortest, "f")
        return text if "." in text else text + ".0"
    sign, digits, _ = shortest.as_tuple()
    significant = "".join(map(str, digits)).rstrip("0") or "0"
    mantissa = significant[0] + "." + (significant[1:] or "0")
    return ("-" if sign else "") + f"{mantissa}E{shortest.adjusted()}"


_DATE_MIN_MS, _DATE_MAX_MS = 0, 253402300799999  # 1970 .. 9999: relaxed mode's ISO range


def _relaxed_date(inner: Any) -> str | None:
    millis = inner["$numberLong"] if isinstance(inner, dict) and "$numberLong" in inner else inner
    if isinstance(millis, bool) or not isinstance(millis, int | Decimal | str):
        return None
    try:
        millis = int(millis)
    except ValueError:
        return None
    if not _DATE_MIN_MS <= millis <= _DATE_MAX_MS:
        return '{"$date": {"$numberLong": "' + str(millis) + '"}}'
    moment = datetime.datetime.fromtimestamp(millis // 1000, datetime.timezone.utc)
    fraction = f".{millis % 1000:03d}" if millis % 1000 else ""
    return '{"$date": "' + moment.strftime("%Y-%m-%dT%H:%M:%S") + fraction + 'Z"}'


def _relaxed_wrapper(name: str, inner: Any) -> str | None:
    """A one-member extended-JSON wrapper (a number or date) in relaxed mode; None: not one."""
    if name in ("$numberInt", "$numberLong") and isinstance(inner, str):
        return str(int(inner))
    if name == "$numberDouble" and isinstance(inner, str):
        if inner in ("NaN", "Infinity", "-Infinity"):
            return '{"$numberDouble": "' + inner + '"}'
        return _java_double(Decimal(inner))
    if name == "$date":
        return _relaxed_date(inner)
    return None


def _relaxed(value: Any) -> str:
    """A document id (as parsed from extended JSON, either mode) written as MongoDB's BSON
    writer writes it in relaxed mode with Debezium's settings (indented with no indent and no
    new lines: ``{"a": 1,"b": 2}``): the text Debezium's MongoDB connector puts in the message
    key's ``id`` (``JsonSerialization.getDocumentIdOplog``)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Decimal):  # a JSON number with a fraction or exponent: a double
        return _java_double(value)
    if isinstance(value, list):
        return "[" + ", ".join(_relaxed(item) for item in value) + "]"
    if not isinstance(value, dict):
        raise InvalidEventError(f"a MongoDB id of an unknown form: {value!r}")
    wrapped = _relaxed_wrapper(*next(iter(value.items()))) if len(value) == 1 else None
    if wrapped is not None:
        return wrapped
    if set(value) == {"$binary", "$type"} and isinstance(value["$binary"], str):
        value = {"$binary": {"base64": value["$binary"], "subType": value["$type"]}}
    members = (
        f"{json.dumps(name, ensure_ascii=False)}: {_relaxed(v)}" for name, v in value.items()
    )
    return "{" + ",".join(members) + "}"


def message_key(key: str | None, metadata: str | None, data: str | None) -> str | None:
    """The Kafka message key the event's connector writes: the event's key, except for
    MongoDB, whose key inside the log is the canonical ``{"_id":...}`` but whose connector
    writes ``{"id":"<the id as relaxed extended JSON>"}`` (``{"id":"1004"}``), so that a
    consumer that looks a document up by the key's ``id`` finds it. The id is taken from the
    document when the event holds it (its types exact: an int64, a double), else from the key."""
    if key is None or not key.startswith('{"_id":'):
        return key
    members = _debezium_metadata(metadata)
    if members is None or members["source"].value.get("connector") != "mongodb":
        return key
    document: Any = None
    if data is not None:
        try:
            document = json.loads(data, parse_float=Decimal, parse_int=int)
        except ValueError:
            document = None
    if not isinstance(document, dict) or "_id" not in document:
        document = json.loads(key, parse_float=Decimal)
    return '{"id":' + json.dumps(_relaxed(document["_id"]), ensure_ascii=False) + "}"


def _mongo_partial(image: _Image, key: str) -> str:
    """The document a ``change_streams`` update without ``after`` gives, as Debezium's
    ExtractNewDocumentState builds it: the ``before`` document (a pre-image) or nothing,
    with ``updateDescription.updatedFields`` set, ``removedFields`` taken out, and the
    ``_id`` from the key when it is not there (member texts kept exactly)."""
    members: dict[str, str] = {n: m.text for n, m in (image.row or {}).items()}
    description = image.extra["updateDescription"].value
    if not isinstance(description, dict):
        raise InvalidEventError("'updateDescription' is not an object")
    updated = description.get("updatedFields")
    if updated is not None:
        try:
            members.update({n: m.text for n, m in jsontext.parse_object(str(updated)).items()})
        except ValueError as exc:
            raise InvalidEventError(f"updateDescription.updatedFields: {exc}") from exc
    for name in description.get("removedFields") or ():
        members.pop(str(name), None)
    if "_id" not in members:
        members["_id"] = key[len('{"_id":') : -1]
    texts = (f"{json.dumps(n, ensure_ascii=False)}:{t}" for n, t in members.items())
    return "{" + ",".join(texts) + "}"


def convert(
    members: dict[str, Member],
    key_fields: Sequence[str],
    *,
    text: str | None = None,
    filled_ms: int,
) -> Change | Skipped | Marker:
    """One Debezium record (a value, or a Kafka record ``{"key", "value"}``) as a replog
    event with what ingestion needs to know about it, a transaction marker, or what kind
    of record carries no event. ``text`` is the record's exact JSON text (a flattened
    row's payload); ``filled_ms`` the time of an event that has none (marked)."""
    if not key_fields:
        raise InvalidEventError("Debezium events need key fields (--key-fields id[,col...])")
    opened = _open(members, text)
    if isinstance(opened, Skipped):
        return opened
    marker = _marker(opened.envelope)
    if marker is not None:
        return marker
    flat = _flat(opened.envelope)
    image = _flat_image(opened) if flat else _envelope_image(opened.envelope)
    if isinstance(image, Skipped):
        return image
    key = _key(image, key_fields, opened.message_key, flat)
    ts_member = image.top.get("ts_ms")
    stamp = image.source.get("ts_ms") or (ts_member.value if ts_member else None)
    schema = _schema_of(opened.schema.text) if opened.schema and opened.schema.value else None
    digest = schema.digest if schema is not None else None
    document = _metadata(image, flat=flat, digest=digest, filled=stamp is None)
    identity = json.dumps([image.source, image.op, key], sort_keys=True, default=str)
    transaction = image.transaction.value if image.transaction is not None else None
    position = position_of(image.source)
    return Change(
        record={
            "event_id": str(uuid.uuid5(EVENT_ID_NAMESPACE, identity)),
            "timestamp": int(stamp) if stamp is not None else filled_ms,
            "operation": OPERATIONS[image.op],
            "collection": collection_of(image.source),
            "key": key,
            "data": image.data,
            "before": image.before.raw if image.before else None,
            "metadata": RawJSON(jsontext.encode(document)),
        },
        schema=schema.value if schema is not None else None,
        digest=digest,
        position=position,
        transaction_id=(
            str(transaction["id"])
            if isinstance(transaction, dict) and "id" in transaction
            else None
        ),
        pinned=not flat or position is not None,
    )


def _metadata(image: _Image, *, flat: bool, digest: str | None, filled: bool) -> dict[str, Any]:
    """What ``metadata`` keeps of a change (CDC.md): the envelope's members as their exact
    text, and what replog knows about it."""
    ts_member = image.top.get("ts_ms")
    document: dict[str, Any] = {
        "op": RawJSON(image.op_text),
        "ts_ms": RawJSON(ts_member.text) if ts_member else None,
        **{name: RawJSON(image.top[name].text) for name in ("ts_us", "ts_ns") if name in image.top},
        "source": image.source_text,
        "transaction": RawJSON(image.transaction.text) if image.transaction else None,
    }
    if image.extra:
        document["members"] = {n: RawJSON(m.text) for n, m in image.extra.items()}
    if image.order is not None:
        document["order"] = image.order
    if image.partial:
        document["partial"] = True
    if flat:
        document["flattened"] = True
    if digest is not None:
        document["schema"] = digest
    if filled:
        document["replog_filled"] = ["timestamp"]
    return document


def _mongo(image: _Image, key_fields: Sequence[str], flat: bool) -> bool:
    return (
        not flat
        and image.source.get("connector") == "mongodb"
        and tuple(key_fields) in MONGODB_ID_FIELDS
    )


def _key(
    image: _Image,
    key_fields: Sequence[str],
    message_key: dict[str, Member] | None,
    flat: bool,
) -> str:
    """The event's key; for a change without its row image, the ``data`` it gets too."""
    if _mongo(image, key_fields, flat):
        key = _mongo_key(image.row, message_key)
        if image.row is None and image.op == "u" and "updateDescription" in image.extra:
            image.row = _object(image.before, "before") if image.before else None
            image.data, image.partial = RawJSON(_mongo_partial(image, key)), True
        elif image.row is None:
            if image.op != "d":
                raise InvalidEventError(f"op {image.op!r} without a {image.where!r} document")
            image.data = RawJSON(key)
        return key
    if image.row is None and image.op == "d" and message_key is not None:
        # A delete without its before image: the message key holds the row's key.
        image.row, image.where = message_key, "message key"
        image.data = RawJSON(key_of(image.row, key_fields, image.where))
    if image.row is None:
        raise InvalidEventError(
            f"op {image.op!r} without a {image.where!r} image"
            + (" (and no message key to take the key from)" if image.op == "d" else "")
        )
    where = image.where
    if flat:
        where = "row (a record without 'op' is read as an ExtractNewRecordState row)"
    return key_of(image.row, key_fields, where)


def _text_of(members: dict[str, Member]) -> RawJSON:
    return RawJSON("{" + ",".join(f"{json.dumps(n)}:{m.text}" for n, m in members.items()) + "}")


def debezium_record(
    members: dict[str, Member], key_fields: Sequence[str], *, text: str | None = None
) -> dict[str, Any] | Skipped:
    """One replog event record from one Debezium value, or what kind of record was
    skipped (the Spark path: :func:`replog.spark.functions.from_debezium`)."""
    converted = convert(members, key_fields, text=text, filled_ms=now_ms())
    if isinstance(converted, Marker):
        return Skipped(f"transaction {converted.status} record")
    if isinstance(converted, Skipped):
        return converted
    return converted.record


# -- source positions ------------------------------------------------------------------------


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _part(value: Any, bits: int) -> int | None:
    """One part of a source position: an integer from 0 to 2**bits - 1 (given as a number,
    a whole float or a numeric string), else None. Connectors write sentinels where a
    position is unknown: Debezium 1.6's PostgreSQL snapshot reads carry ``lsn``
    -9223372036854775808 (Long.MIN_VALUE, often through a double as
    -9223372036854776000); such a part orders nothing."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float | Decimal):
        finite = value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)
        if not finite or value != int(value):
            return None
        value = int(value)
    number = _int_or_none(value)
    return number if number is not None and 0 <= number < 1 << bits else None


def position_app_id(*parts: str) -> str:
    """The app id recording a connector's position: ``debezium.<name>[.<replica set>]``.
    A connector name that is not a valid name (Kafka Connect allows more characters than
    replog's names) has each other character replaced and a digest of the whole added,
    so two names never share an app id."""
    app_id = ".".join(("debezium", *parts))
    if is_valid_name(app_id):
        return app_id
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", app_id)[:100]
    digest = hashlib.sha256(app_id.encode()).hexdigest()[:16]
    return f"{cleaned}.{digest}"


def position_of(source: Mapping[str, Any]) -> Position | None:
    """The connector's position of an event, as one integer that orders like Debezium's
    offsets: PostgreSQL ``(commit LSN, lsn)`` (from ``sequence``, else ``lsn`` twice),
    MySQL ``(binlog file number, pos, row)``, MongoDB ``(ts_ms, ord)`` per replica set.

    None for a source without one (no ``name``, another connector), or whose position is
    unusable: a part that is no integer in its range (a sentinel such as a negative LSN).
    Such an event is still appended, without redelivery detection (the append counts it);
    it never makes an input fail."""
    name = source.get("name")
    if not name:
        return None
    parts = [str(name)]
    if source.get("lsn") is not None:
        found = _postgres_position(source)
    elif isinstance(source.get("file"), str) and source["file"] and source.get("pos") is not None:
        found = _mysql_position(source)
    elif source.get("ord") is not None and source.get("ts_ms") is not None:
        found = _mongo_position(source)
        parts += [str(source["rs"])] if source.get("rs") else []
    else:
        found = None
    if found is None:
        return None
    snapshot = str(source.get("snapshot", "false")).lower() not in ("false", "none")
    return Position(position_app_id(*parts), found[0], snapshot, found[1])


def _postgres_position(source: Mapping[str, Any]) -> tuple[int, str] | None:
    lsn = _part(source.get("lsn"), 64)
    if lsn is None:
        return None
    commit = lsn
    sequence = source.get("sequence")
    if isinstance(sequence, str):
        try:
            parsed = json.loads(sequence)
            found = _part(parsed[0], 64) if parsed and parsed[0] is not None else None
            commit = lsn if found is None else found
        except (ValueError, TypeError, IndexError, KeyError):
            commit = lsn
    return (commit << 64) | lsn, f"lsn {lsn}"


def _mysql_position(source: Mapping[str, Any]) -> tuple[int, str] | None:
    binlog = str(source["file"])
    number = _part(binlog.rsplit(".", 1)[-1], 64)
    pos, row = _part(source.get("pos"), 64), _part(source.get("row") or 0, 32)
    if number is None or pos is None or row is None:
        return None
    return (number << 96) | (pos << 32) | row, f"{binlog}:{pos}:{row}"


def _mongo_position(source: Mapping[str, Any]) -> tuple[int, str] | None:
    ord_, ts_ms = _part(source.get("ord"), 32), _part(source.get("ts_ms"), 64)
    if ord_ is None or ts_ms is None:
        return None
    return (ts_ms << 32) | ord_, f"ts_ms {ts_ms} ord {ord_}"


_ENVELOPE_OPS = frozenset(OPERATIONS)


def _debezium_metadata(metadata: str | None) -> dict[str, Member] | None:
    """The members of an event's metadata when they are a Debezium change's (an ``op`` and
    a ``source`` object), else None."""
    if not metadata:
        return None
    try:
        members = jsontext.parse_object(metadata)
    except ValueError:
        return None
    op, source = members.get("op"), members.get("source")
    if op is None or op.value not in _ENVELOPE_OPS or source is None:
        return None
    return members if isinstance(source.value, dict) else None


def original_envelope(
    metadata: str | None, *, operation: str, data: str | None, before: str | None
) -> str | None:
    """The Debezium value an event was appended from, rebuilt from what ingestion kept
    (``metadata``: ``op``, ``ts_ms``/``ts_us``/``ts_ns``, ``source``, ``transaction``, all as
    their exact text; ``data`` and ``before`` as given), or None for an event that did not
    come from Debezium (or ``replog capture``, which writes the same metadata).

    Members come in the input's order when ingestion recorded one (``metadata.order``:
    Debezium before 2.7 wrote ``transaction`` last, or not at all; MongoDB adds
    ``updateDescription``, kept in ``metadata.members``), else in Debezium >= 2.7's order
    (``before, after, source, transaction, op, ts_ms, ts_us, ts_ns``; a ``ts_*`` the
    envelope did not carry is left out). A flattened row (ExtractNewRecordState) is
    ``data`` itself, the row as it was given. MongoDB sends documents as JSON strings: they
    are given back as strings; a MongoDB update that had no ``after`` (``metadata.partial``)
    gets none back.
    """
    members = _debezium_metadata(metadata)
    if members is None:
        return None
    op, source = members["op"], members["source"]
    flattened = members.get("flattened")
    if flattened is not None and flattened.value is True:
        return data
    as_string = source.value.get("connector") == "mongodb"

    def image(text: str | None) -> RawJSON | str | None:
        if text is None:
            return None
        return RawJSON(text) if not as_string and jsontext.is_object_text(text) else text

    partial = members.get("partial")
    values: dict[str, Any] = {
        "before": image(before),
        "after": None
        if operation == "delete" or (partial is not None and partial.value is True)
        else image(data),
        "source": RawJSON(source.text),
        "transaction": RawJSON(members["transaction"].text) if "transaction" in members else None,
        "op": RawJSON(op.text),
    }
    times: dict[str, RawJSON] = {
        n: RawJSON(members[n].text) for n in ("ts_ms", "ts_us", "ts_ns") if n in members
    }
    extra = members.get("members")
    if extra is not None and isinstance(extra.value, dict):
        values.update({n: RawJSON(m.text) for n, m in jsontext.parse_object(extra.text).items()})
    order = members.get("order")
    if order is not None and isinstance(order.value, list):
        values.update(times)
        return jsontext.encode({str(name): values.get(str(name)) for name in order.value})
    document = dict(values)
    document.update({n: t for n, t in times.items() if members[n].value is not None})
    return jsontext.encode(document)


def envelope(
    *,
    operation: str,
    data: str | None,
    before: str | None,
    ts_ms: int,
    source: Mapping[str, Any],
) -> str:
    """A replog-made Debezium change-event value for an event that did not come from
    Debezium (payloads spliced in exactly; a payload that is not JSON text is given as a
    JSON string): ``op`` c for insert and bulk, ``source`` replog's own block."""

    def payload(text: str | None) -> RawJSON | str | None:
        if text is None:
            return None
        return RawJSON(text) if jsontext.is_object_text(text) else text

    after_image, before_image = payload(data), payload(before)
    if operation == "delete":
        after_image, before_image = None, before_image if before is not None else payload(data)
    return jsontext.encode(
        {
            "before": before_image,
            "after": after_image,
            "source": dict(source),
            "transaction": None,
            "op": OPS_OUT[operation],
            "ts_ms": ts_ms,
        }
    )

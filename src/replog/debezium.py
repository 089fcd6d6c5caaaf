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
  (Debezium's own message-key form), so every event of one row shares one key;
* ``timestamp`` = ``source.ts_ms`` when non-zero, else the envelope's ``ts_ms``;
* ``event_id`` = a UUID derived from the source position, the operation and the key, so
  a change redelivered by Debezium keeps its id and two snapshot rows never share one;
* ``metadata`` = ``{"op", "ts_ms", "source", "transaction"}`` (exact text).

Out: :func:`envelope` builds the Debezium value for a replog event (used by
:func:`replog.spark.functions.to_debezium`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replog.errors import InvalidEventError
from replog.format import jsontext
from replog.format.jsontext import Member, RawJSON

OPERATIONS = {"c": "insert", "r": "insert", "u": "update", "d": "delete"}
SKIPPED = {"t": "truncate event (op t)", "m": "message event (op m)"}


@dataclass(frozen=True)
class Skipped:
    """A Debezium record that carries no change event (a tombstone, a truncate or message
    event): ``reason`` says which, for the count an append reports."""

    reason: str


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


def _unwrap(members: dict[str, Member]) -> dict[str, Member] | None:
    """The envelope inside a ``{"schema", "payload"}`` wrapper (None for a null payload)."""
    if "payload" in members and set(members) <= {"schema", "payload"}:
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


def debezium_record(
    members: dict[str, Member], key_fields: Sequence[str]
) -> dict[str, Any] | Skipped:
    """One replog event record from one Debezium value, or what kind of record was
    skipped."""
    if not key_fields:
        raise InvalidEventError("Debezium events need key fields (--key-fields id[,col...])")
    envelope = _unwrap(members)
    if envelope is None:
        return Skipped("tombstone (null payload)")
    op_member = envelope.get("op")
    op = op_member.value if op_member else None
    if op in SKIPPED:
        return Skipped(SKIPPED[op])
    if op not in OPERATIONS:
        raise InvalidEventError(
            f"'op' is {op!r}: not a Debezium change event (c, r, u, d; t and m are skipped)"
        )
    before = envelope.get("before")
    after = envelope.get("after")
    image, where = (before, "before") if op == "d" else (after, "after")
    row = _object(image, where)
    if row is None:
        raise InvalidEventError(f"op {op!r} without a {where!r} image")
    source_member = envelope.get("source")
    source = source_member.value if source_member and isinstance(source_member.value, dict) else {}
    key = key_of(row, key_fields, where)
    ts_member = envelope.get("ts_ms")
    stamp = source.get("ts_ms") or (ts_member.value if ts_member else None)
    identity = json.dumps([source, op, key], sort_keys=True, default=str)
    transaction = envelope.get("transaction")
    metadata = jsontext.encode(
        {
            "op": RawJSON(op_member.text) if op_member else None,
            "ts_ms": RawJSON(ts_member.text) if ts_member else None,
            "source": RawJSON(source_member.text) if source_member else None,
            "transaction": RawJSON(transaction.text) if transaction else None,
        }
    )
    return {
        "event_id": str(uuid.uuid5(EVENT_ID_NAMESPACE, identity)),
        "timestamp": int(stamp) if stamp is not None else None,
        "operation": OPERATIONS[op],
        "collection": collection_of(source),
        "key": key,
        "data": image.raw if image else None,
        "before": before.raw if before else None,
        "metadata": RawJSON(metadata),
    }


def envelope(
    *,
    operation: str,
    data: str | None,
    before: str | None,
    ts_ms: int,
    source: Mapping[str, Any],
) -> str:
    """A Debezium change-event value for one replog event (payloads spliced in exactly;
    a payload that is not JSON text is given as a JSON string)."""

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
            "op": OPS_OUT[operation],
            "ts_ms": ts_ms,
            "source": dict(source),
        }
    )

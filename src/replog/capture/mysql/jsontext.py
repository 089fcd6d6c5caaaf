"""MySQL's binary JSON (MySQL 8's ``JSON`` columns in the binlog) as the text the server
writes for it, and partial JSON updates applied (``binlog_row_value_options =
PARTIAL_JSON``: an update's after image holds only the changes of a JSON column).

MariaDB has no binary JSON (its ``JSON`` is text, captured as written), so this module is
used with MySQL 8 only: its output follows MySQL's ``Json_wrapper::to_string`` (``{"a":
1, "b": [true, null]}``, ``", "`` and ``": "`` separators, keys in the stored order) and is
tested against hand-made values, not against a MySQL server (none runs here).
"""

from __future__ import annotations

import datetime
import json
import re
from decimal import Decimal
from typing import Any

from pymysqlreplication.json_binary import JsonDiffOperation, parse_json
from pymysqlreplication.util.bytes import length_encoded_int

from replog.errors import CaptureError


def binary_json_text(data: bytes) -> str:
    """The text of a binary JSON value (its type byte, then its data)."""
    if not data:
        return "null"
    return to_text(parse_json(data[0], data[1:]))


def to_text(value: Any) -> str:  # noqa: PLR0911, C901 - one return per JSON kind
    """A parsed binary JSON value (mysql-replication's: keys as bytes, opaque values as
    Decimal, dates and times) as MySQL writes it."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value).replace("e+", "e")
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bytes):
        return _string(value.decode("utf-8"))
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dict):
        keys = sorted((_key(k) for k in value), key=_stored_order)
        items = {_key(k): v for k, v in value.items()}
        return "{" + ", ".join(f"{_string(k)}: {to_text(items[k])}" for k in keys) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_text(item) for item in value) + "]"
    if isinstance(value, datetime.datetime):
        return '"' + value.strftime("%Y-%m-%d %H:%M:%S.%f") + '"'
    if isinstance(value, datetime.date | datetime.time | datetime.timedelta):
        return '"' + str(value) + '"'
    raise CaptureError(f"a binary JSON value of type {type(value).__name__} cannot be written")


def _key(key: Any) -> str:
    return key.decode("utf-8") if isinstance(key, bytes) else str(key)


def _stored_order(key: str) -> tuple[int, bytes]:
    """MySQL keeps an object's keys ordered by length, then bytes (and writes them so)."""
    raw = key.encode("utf-8")
    return len(raw), raw


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# -- partial updates -------------------------------------------------------------------------

_STEP = re.compile(r'\.(?:"((?:[^"\\]|\\.)*)"|([A-Za-z_$][\w$]*))|\[(\d+|last)\]')


def _path(text: str) -> list[str | int]:
    """``$.a."b c"[2]`` -> ``["a", "b c", 2]`` (``last`` as -1)."""
    if not text.startswith("$"):
        raise CaptureError(f"partial JSON update path {text!r} does not start at $")
    steps: list[str | int] = []
    at = 1
    while at < len(text):
        found = _STEP.match(text, at)
        if found is None:
            raise CaptureError(f"partial JSON update path {text!r} cannot be read at {at}")
        quoted, bare, index = found.groups()
        if index is not None:
            steps.append(-1 if index == "last" else int(index))
        else:
            steps.append(json.loads(f'"{quoted}"') if quoted is not None else bare)
        at = found.end()
    return steps


def apply_diffs(before: str, diffs: bytes) -> str:
    """The value after a partial JSON update: ``diffs`` (the after image's field: one or
    more operations, each op, path and for all but REMOVE a binary JSON value) applied to
    the ``before`` value's text, written as MySQL writes it."""
    document = json.loads(before)
    at = 0
    while at < len(diffs):
        operation = JsonDiffOperation.by_index(diffs[at])
        at += 1
        length, _, used = length_encoded_int(diffs[at:])
        at += used
        path = _path(diffs[at : at + length].decode("utf-8"))
        at += length
        value: Any = None
        if operation != JsonDiffOperation.Remove:
            length, _, used = length_encoded_int(diffs[at:])
            at += used
            raw = diffs[at : at + length]
            at += length
            value = parse_json(raw[0], raw[1:])
        document = _apply(document, operation, path, value)
    return to_text(document)


def _apply(document: Any, operation: JsonDiffOperation, path: list[str | int], value: Any) -> Any:
    if not path:
        return value if operation != JsonDiffOperation.Remove else None
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if isinstance(parent, dict):
        key = last if isinstance(last, str) else str(last)
        if operation == JsonDiffOperation.Remove:
            parent.pop(key, None)
        else:
            parent[key] = value
    elif isinstance(parent, list) and isinstance(last, int):
        index = len(parent) if last == -1 and operation == JsonDiffOperation.Insert else last
        if operation == JsonDiffOperation.Remove:
            del parent[index]
        elif operation == JsonDiffOperation.Insert:
            parent.insert(index, value)
        else:
            parent[index] = value
    else:
        raise CaptureError(f"partial JSON update at a path that is not in the value: {path}")
    return document

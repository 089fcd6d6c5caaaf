"""Sealed JSON records: a JSON object that carries the SHA-256 of its own canonical form.

The log descriptor, commit records, snapshot headers and checkpoint manifests are sealed,
so a torn or edited record is detected. The canonical form is defined without reference
to any library (FORMAT.md, "Sealed JSON records"), so another implementation computes
the same checksum:

* an object's members are sorted by key, compared by Unicode code point;
* no white space anywhere;
* strings: ``"`` and ``\\`` are escaped as ``\\"`` and ``\\\\``; U+0008, U+0009,
  U+000A, U+000C and U+000D as ``\\b \\t \\n \\f \\r``; every other character outside
  U+0020..U+007E as ``\\uXXXX`` with lower-case hex digits (UTF-16 surrogate pairs above
  U+FFFF);
* arrays: their elements in order, separated by ``,``;
* numbers are integers, written in decimal without a plus sign or leading zeros; sealed
  records hold no fractions or exponents;
* ``true``, ``false``, ``null`` as such.

:func:`canonical_json` produces exactly this (Python's ``json`` with ``sort_keys``,
``ensure_ascii`` and compact separators does, for inputs without floats, which it refuses).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from replog.errors import CorruptionError, UnsupportedFormatError

CHECKSUM_FIELD = "checksum"


def _no_float(text: str) -> float:
    raise TypeError(f"sealed records hold integers only; found {text}")


def _dumps(document: dict[str, Any]) -> bytes:
    """The canonical form of a document known to hold no floats."""
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def canonical_json(document: dict[str, Any]) -> bytes:
    """The canonical form defined above, as ASCII bytes."""
    encoded = _dumps(document)
    json.loads(encoded, parse_float=_no_float)  # a float would seal a non-canonical form
    return encoded


def _body(document: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in document.items() if name != CHECKSUM_FIELD}


def checksum(document: dict[str, Any]) -> str:
    """SHA-256 (lower-case hex) of ``document``'s canonical form without its checksum."""
    return hashlib.sha256(canonical_json(_body(document))).hexdigest()


def seal(document: dict[str, Any]) -> bytes:
    """``document`` with its checksum added, as one line of compact JSON (a small commit's
    record is read by every reader of the log: a third of its size was indentation)."""
    body = _body(document)
    return _dumps({**body, CHECKSUM_FIELD: checksum(body)}) + b"\n"


def unseal(
    data: bytes,
    path: str,
    *,
    version_field: str = "format_version",
    max_version: int,
) -> dict[str, Any]:
    """Parse a sealed record: JSON object, then version, then checksum, in that order.

    The version is checked before the checksum so that a record from a newer replog
    (which might seal differently) is reported as "upgrade", not as corruption.
    """
    try:
        document = json.loads(data, parse_float=_no_float, parse_constant=_no_float)
    except TypeError as exc:  # a float (or NaN) in a record: not something replog sealed
        raise CorruptionError(path, f"not a sealed record: {exc}") from exc
    except ValueError as exc:
        raise CorruptionError(path, f"not valid JSON ({len(data)} bytes): {exc}") from exc
    if not isinstance(document, dict):
        raise CorruptionError(path, "expected a JSON object")
    version = document.get(version_field)
    if isinstance(version, int) and not isinstance(version, bool) and version > max_version:
        raise UnsupportedFormatError(
            f"{path}: written with {version_field} {version}; this replog reads up to "
            f"{max_version} - upgrade pyspark-replog"
        )
    recorded = document.get(CHECKSUM_FIELD)
    body = _body(document)
    actual = hashlib.sha256(_dumps(body)).hexdigest()  # parsed without floats: canonical
    if recorded != actual:
        raise CorruptionError(path, f"checksum mismatch: recorded {recorded}, computed {actual}")
    return body

"""Payload JSON kept exactly: the text a value had in the input, never re-serialised.

CDC payloads are data: a number like ``12345678901234567890.123456789`` must not become
``1.2345678901234567e+19``, ``1e400`` must not become ``Infinity``, and key order and
escapes must not change. Two tools keep them exact:

* :func:`object_members` walks a JSON object and returns each member's value together
  with its exact text (Python's own decoder validates every value; only the outer walk
  is ours), so a JSON line's ``data`` is stored as the bytes it had in the line;
* :func:`encode` writes Python values without losing anything: key order kept,
  :class:`~decimal.Decimal` and integers of any size written exactly, non-finite numbers
  refused.

:class:`RawJSON` marks text that is already JSON and must be stored verbatim.
"""

from __future__ import annotations

import json
import json.decoder
import json.encoder
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any


class RawJSON(str):
    """JSON text to be stored exactly as it is (not a string value to be quoted)."""

    __slots__ = ()


@dataclass(frozen=True)
class Member:
    """One member of a JSON object: its parsed value and its exact text."""

    value: Any
    text: str

    @property
    def raw(self) -> RawJSON | str | None:
        """What to store for a payload given as this member: the text of a JSON value
        verbatim, a JSON string's own characters, nothing for null."""
        if self.value is None:
            return None
        if isinstance(self.value, str):
            return self.value
        return RawJSON(self.text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, index: int) -> int:
    match = _WHITESPACE.match(text, index)
    assert match is not None
    return match.end()


def object_members(text: str, start: int = 0) -> tuple[dict[str, Member], int]:
    """The members of the JSON object at ``text[start:]`` and the index after it.

    Raises ``ValueError`` with the column at fault for anything that is not a valid
    JSON object, including a member name given twice.
    """
    # Built per call, not at import: register() pickles this module by value, and a
    # decoder holds a C scanner that cannot be pickled.
    decoder = json.JSONDecoder(parse_float=Decimal, parse_constant=_refuse_constant)
    index = _skip(text, start)
    if text[index : index + 1] != "{":
        raise ValueError(f"expected a JSON object at column {index + 1}")
    index = _skip(text, index + 1)
    members: dict[str, Member] = {}
    if text[index : index + 1] == "}":
        return members, index + 1
    while True:
        if text[index : index + 1] != '"':
            raise ValueError(f"expected a member name in double quotes at column {index + 1}")
        name, index = _scanstring(text, index + 1)
        index = _skip(text, index)
        if text[index : index + 1] != ":":
            raise ValueError(f"expected ':' after {name!r} at column {index + 1}")
        index = _skip(text, index + 1)
        try:
            value, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            raise ValueError(f"member {name!r}: {exc.msg} at column {exc.pos + 1}") from exc
        if name in members:
            raise ValueError(f"member {name!r} is given twice")
        members[name] = Member(value, text[index:end])
        index = _skip(text, end)
        separator = text[index : index + 1]
        if separator == ",":
            index = _skip(text, index + 1)
        elif separator == "}":
            return members, index + 1
        else:
            raise ValueError(f"expected ',' or '}}' at column {index + 1}")


def parse_object(text: str) -> dict[str, Member]:
    """The members of ``text``, which must be exactly one JSON object."""
    members, end = object_members(text)
    if _skip(text, end) != len(text):
        raise ValueError(f"unexpected text after the JSON object at column {end + 1}")
    return members


def is_object_text(text: str) -> bool:
    """Whether ``text`` is one valid JSON object (``NaN`` and ``Infinity`` are not JSON)."""
    try:
        parsed = json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return isinstance(parsed, dict)


class _NeedsExactPath(Exception):  # noqa: N818 - control flow, never escapes
    pass


def _exact_only(value: Any) -> Any:
    raise _NeedsExactPath


def _encode_exact(value: Any) -> str:
    if isinstance(value, RawJSON):
        return str(value)
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a JSON number")
        return str(value)
    if value is None or isinstance(value, bool | str | float):  # bool before int
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, Mapping):
        members = (
            f"{json.dumps(str(k), ensure_ascii=False)}:{_encode_exact(v)}" for k, v in value.items()
        )
        return "{" + ",".join(members) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_encode_exact(item) for item in value) + "]"
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


_SCALARS = frozenset({str, int, float, bool, type(None), Decimal})


def _holds_raw(value: Any) -> bool:
    """Whether a :class:`RawJSON` is anywhere in ``value`` (the C encoder would quote it).
    Plain members are passed over by their exact type: this runs on every payload."""
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, list | tuple):
        items = value
    else:
        return isinstance(value, RawJSON)
    for item in items:  # noqa: SIM110 (a loop: any() over a generator costs 20% more here)
        if type(item) not in _SCALARS and _holds_raw(item):
            return True
    return False


class _CompactEncoder:
    """The C encoder ``json.dumps(..., separators=(",", ":"), ensure_ascii=False,
    allow_nan=False)`` builds on each call, built once (no circular check: the values are
    events' parts, built by replog): half of what encoding an event's metadata cost.
    Pickled as a new one: replog's modules travel to Spark's workers by value, and a C
    encoder does not pickle."""

    def __init__(self) -> None:
        make = getattr(json.encoder, "c_make_encoder", None)  # absent from typeshed
        # markers (none), default, strings, indent, separators; sort, skip keys, NaN: no
        options = (None, _exact_only, json.encoder.encode_basestring, None, ":", ",")
        self.encode = None if make is None else make(*options, False, False, False)

    def __reduce__(self) -> tuple[type[_CompactEncoder], tuple[()]]:
        return (_CompactEncoder, ())


_C_ENCODER = _CompactEncoder()


def encode(value: Any) -> str:
    """Compact JSON for a Python value, losing nothing (see the module docstring).

    :class:`RawJSON` values are spliced in verbatim, at any depth. Raises ``ValueError``
    for non-finite numbers and ``TypeError`` for other types.
    """
    if _holds_raw(value):  # pure Python: the C encoder cannot splice text in
        return _encode_exact(value)
    try:  # the C encoder, unless a Decimal needs its exact text
        if _C_ENCODER.encode is not None:
            return "".join(_C_ENCODER.encode(value, 0))
        return json.dumps(
            value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_exact_only
        )
    except _NeedsExactPath:
        return _encode_exact(value)

"""Row images as JSON built column by column in Arrow (a snapshot's hot path).

DESIGN: a chunk's rows arrive as columns of each value's output text (COPY ... TO STDOUT
in CSV, parsed by Arrow's reader in C++). Each column becomes ``"name":value`` for every
row at once with Arrow's string kernels: numbers as their text, booleans as
``true``/``false``, text types escaped as :func:`json.encoder.encode_basestring` escapes
them (the capture's stream path: one text per value whichever path carried it); every
other type goes value by value through the same Python function the stream uses. Only
what Python must do per row stays in Python: types without a vector form, and the event
ids (SHA-1, as :func:`replog.capture.events.event_id`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Fragment = Callable[[str], str]

SAME = frozenset({20, 21, 23, 26})
"""int8, int2, int4, oid: their text is their JSON."""
NUMERIC = 1700
BOOLEAN = 16
QUOTED = frozenset({18, 19, 25, 114, 1042, 1043, 2950, 3802})
"""Types whose text becomes a JSON string as it is ("char", name, text, json, character(n),
character varying, uuid, jsonb)."""

_ESCAPES = (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"),
            ("\b", "\\b"), ("\f", "\\f"))  # fmt: skip
_OTHER_CONTROL = "[\\x00-\\x07\\x0b\\x0e-\\x1f]"
"""Control characters ``encode_basestring`` writes as ``\\u00XX`` (rare in text)."""
_TO_ESCAPE = '[\\\\"\\x00-\\x1f]'
"""A character some JSON escape stands for (most texts have none)."""
_quoted: Callable[[str], str] = json.encoder.encode_basestring
_HEX = np.frombuffer(b"".join(b"%02x" % byte for byte in range(256)), np.uint16)
"""Each byte's two lowercase hex digits, as ASCII (one 16-bit item per byte value)."""
_UUID_GROUPS = ((0, 8), (9, 13), (14, 18), (19, 23), (24, 36))
"""A UUID's groups of hex digits, as slices of its 36 characters (dashes between)."""


def json_strings(texts: pa.Array) -> pa.Array:
    """Each text as a JSON string (nulls stay null), as ``encode_basestring`` writes it."""
    if not pc.any(pc.match_substring_regex(texts, _TO_ESCAPE)).as_py():  # the usual case
        return pc.binary_join_element_wise('"', texts, '"', "")
    escaped = texts
    for raw, escape in _ESCAPES:
        if pc.any(pc.match_substring(escaped, raw)).as_py():
            escaped = pc.replace_substring(escaped, raw, escape)
    quoted = pc.binary_join_element_wise('"', escaped, '"', "")
    odd = pc.match_substring_regex(texts, _OTHER_CONTROL)
    if not pc.any(odd).as_py():
        return quoted
    values = quoted.to_pylist()
    for index in pc.indices_nonzero(odd).to_pylist():
        values[index] = _quoted(texts[index].as_py())
    return pa.array(values, pa.string())


def json_values(texts: pa.Array, type_oid: int, fragment: Fragment) -> pa.Array:
    """Each value's JSON (nulls stay null) from its output text: :data:`SAME`, numeric
    (``NaN`` and the infinities as strings), boolean and :data:`QUOTED` types column-wise,
    any other through ``fragment`` value by value."""
    if type_oid in SAME:
        return texts
    if type_oid == NUMERIC:
        number = pc.fill_null(pc.match_substring_regex(texts, "[0-9]$"), True)
        if pc.all(number).as_py():
            return texts
        return pc.if_else(number, texts, json_strings(texts))
    if type_oid == BOOLEAN:
        return pc.if_else(pc.equal(texts, "t"), "true", "false")
    if type_oid in QUOTED:
        return json_strings(texts)
    return pa.array(
        [None if text is None else fragment(text) for text in texts.to_pylist()], pa.string()
    )


def json_objects(members: Sequence[tuple[str, pa.Array]]) -> pa.Array:
    """``{"name":value,...}`` of each row, from each member's ``"name":`` and its values'
    JSON (a null value is ``null``)."""
    parts = [
        pc.binary_join_element_wise(name, pc.fill_null(values, "null"), "")
        for name, values in members
    ]
    body = pc.binary_join_element_wise(*parts, ",") if parts else None
    if body is None:
        return pa.array([], pa.string())
    return pc.binary_join_element_wise("{", body, "}", "")


def event_ids(namespace: bytes, prefix: str, names: pa.Array) -> pa.Array:
    """The UUID (version 5) of ``prefix + name`` for each name: what
    :func:`replog.capture.events.event_id` gives each, the prefix hashed once and the
    digests formatted as text all at once (per row, only the SHA-1 is Python's)."""
    base = hashlib.sha1(namespace + prefix.encode(), usedforsecurity=False)
    digests = bytearray()
    for name in pc.cast(names, pa.binary()).to_pylist():
        digest = base.copy()
        digest.update(name)
        digests += digest.digest()
    count = len(names)
    raw = np.frombuffer(bytes(digests), np.uint8).reshape(count, 20)[:, :16].copy()
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x50
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80
    digits = _HEX[raw].view(np.uint8)  # (count, 32)
    text = np.full((count, 36), ord("-"), np.uint8)
    done = 0
    for start, end in _UUID_GROUPS:
        text[:, start:end] = digits[:, done : done + end - start]
        done += end - start
    offsets = np.arange(0, 36 * (count + 1), 36, dtype=np.int32)
    return pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(text))

"""Capture's event making in isolation (no server): ids, keys."""

from __future__ import annotations

import uuid

import pytest

from replog.capture.events import EVENT_ID_NAMESPACE, event_id, key_value
from replog.format.jsontext import RawJSON


@pytest.mark.parametrize("identity", ["a", "cap:123:1", "x" * 300, "zoë:snapshot:1:{}"])
def test_event_ids_are_the_uuid5_of_their_identity(identity: str) -> None:
    """Written without the uuid module (per row it cost a third of a snapshot's time),
    the ids stay those earlier captures gave: a re-capture keeps them."""
    assert event_id(identity) == str(uuid.uuid5(EVENT_ID_NAMESPACE, identity))


@pytest.mark.parametrize(
    ("text", "key"),
    [("1", "1"), ("1.00", "1"), ("2.50", "2.5"), ("-0.000", "0"), ("100", "100"), ("1E+2", "100")],
)
def test_numbers_in_keys_are_written_in_their_shortest_exact_form(text: str, key: str) -> None:
    assert key_value(RawJSON(text)) == key


def test_column_wise_json_and_ids_are_the_per_value_ones() -> None:
    """A snapshot chunk's JSON and event ids are made column-wise: each must be the text
    the per-value path (the stream's) writes, for every awkward character."""
    import json

    import pyarrow as pa

    from replog.capture.jsoncolumns import event_ids, json_strings

    texts = ['a"b', "back\\slash", "new\nline\r\t", "\b\f", "\x01\x1f\x7f", "é 🎉 \u2028", "", None]
    expected = [None if t is None else json.encoder.encode_basestring(t) for t in texts]
    assert json_strings(pa.array(texts, pa.string())).to_pylist() == expected
    plain = ["é 🎉 \u2028", "", None, "a b"]  # nothing to escape: the column-wise fast path
    assert json_strings(pa.array(plain, pa.string())).to_pylist() == [
        None if t is None else json.encoder.encode_basestring(t) for t in plain
    ]
    keys = ['{"id":1}', '{"id":"x"}', '{"a":1,"b":null}', '{"id":"zoë 🎉"}']
    assert event_ids(
        EVENT_ID_NAMESPACE.bytes, "s:snapshot:9:public.t:", pa.array(keys)
    ).to_pylist() == [event_id("s:snapshot:9:public.t:" + key) for key in keys]

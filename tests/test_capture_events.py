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

"""apply_changes' concurrent table commits and driver-side split, attacked: faults in a
table's thread, replays, empty and driver-split batches, two collections sent to one table."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from test_apply_routing import event, routed_batch, shop_log, state

import replog.spark.apply as apply_module
from replog.errors import InjectedFaultError, InvalidOptionError
from replog.spark.functions import apply_changes
from replog.tables.delta import open_table

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("step", ["apply_before_delta", "apply_after_delta"])
def test_a_fault_in_a_table_thread_then_a_replay(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    log, digests = shop_log(tmp_path)
    o, s = digests["shop.orders"], digests["shop.stock"]
    frame = routed_batch(spark, [
        event("shop.orders", {"id": 1}, "insert", {"id": 1, "total": 1}, schema=o),
        event("shop.stock", {"sku": "a"}, "insert", {"sku": "a", "count": 1}, schema=s),
        event("shop.orders", {"id": 1}, "update", {"id": 1, "total": 2}, schema=o),
    ], first=0)  # fmt: skip
    tables = {name: str(tmp_path / name) for name in ("shop.orders", "shop.stock")}
    apply = apply_changes(tables, app_id="r", log=log.url)
    monkeypatch.setenv("REPLOG_FAULT", f"{step}@0")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    with pytest.raises(InjectedFaultError):
        apply(frame, 0)
    monkeypatch.delenv("REPLOG_FAULT")
    apply(frame, 0)
    apply(frame, 0)
    assert state(tables["shop.orders"]) == {(1,): {"id": 1, "total": Decimal(2)}}
    assert state(tables["shop.stock"]) == {("a",): {"sku": "a", "count": 1}}
    for target in tables.values():
        table = open_table(target, None)
        assert table is not None and table.transaction_version("r") == 0


def test_empty_then_local_batches(spark: Any, tmp_path: Path) -> None:
    """An empty micro-batch, then an empty one split on the driver, then rows on the
    driver: the same tables as through the tasks."""
    log, digests = shop_log(tmp_path)
    o, s = digests["shop.orders"], digests["shop.stock"]
    rows = [
        event("shop.orders", {"id": 1}, "insert", {"id": 1, "total": 1}, schema=o),
        event("shop.stock", {"sku": "a"}, "insert", {"sku": "a", "count": 1}, schema=s),
    ]
    frame = routed_batch(spark, rows, first=0)
    empty = frame.limit(0)
    found = {}
    for how in ("local", "tasks"):
        if how == "tasks":
            apply_module.LOCAL_EVENTS, saved = -1, apply_module.LOCAL_EVENTS
        try:
            tables = {n: str(tmp_path / how / n) for n in ("shop.orders", "shop.stock")}
            apply = apply_changes(tables, app_id="r", log=log.url)
            apply(empty, 0)
            apply(empty, 1)
            apply(frame, 2)
            found[how] = (state(tables["shop.orders"]), state(tables["shop.stock"]))
            for target in tables.values():
                schema = open_table(target, None).schema().to_arrow()  # type: ignore[union-attr]
                found[how + "-types"] = str(schema)
        finally:
            if how == "tasks":
                apply_module.LOCAL_EVENTS = saved
    assert found["local"] == found["tasks"]
    assert found["local-types"] == found["tasks-types"]
    assert found["local"][0] == {(1,): {"id": 1, "total": Decimal(1)}}


def test_two_collections_mapped_to_one_table_are_refused(tmp_path: Path) -> None:
    """A mapping that routes two collections to one path is refused when apply_changes is
    called: each table's commit carries the batch id, so one collection's commit would be
    taken for a replay of the other's and its rows lost (as they were, silently)."""
    log, _ = shop_log(tmp_path)
    target = str(tmp_path / "orders")
    with pytest.raises(InvalidOptionError, match=r"shop.orders', 'shop.stock'\] to one table"):
        apply_changes({"shop.orders": target, "shop.stock": target + "/"}, app_id="r",
                      log=log.url)  # fmt: skip
    assert open_table(target, None) is None

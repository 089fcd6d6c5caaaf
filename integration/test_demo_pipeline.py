"""``make demo``'s pipeline end to end (examples/demo.py, small sizes): PostgreSQL ->
capture -> Spark masks e-mails -> replog-sink -> apply_changes -> Delta, which must equal
the PostgreSQL table row by row. Plus the check itself: it sees every kind of difference."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import demo
import pytest


@pytest.mark.slow
@pytest.mark.spark
def test_delta_table_equals_the_postgres_table(pg_dsn: str, spark, tmp_path: Path) -> None:
    outcome = demo.pipeline(pg_dsn, tmp_path / "demo", orders=150, transactions=300, spark=spark)
    assert outcome.comparison.rows > 150
    assert (outcome.comparison.missing, outcome.comparison.extra) == ([], [])
    assert outcome.comparison.changed == []
    assert outcome.leaked == 0
    assert outcome.ok


def test_the_check_sees_each_difference() -> None:
    row = (1, "Customer 1", demo.sha256("a@example.com"), Decimal("1.50"), "new", None)
    expected = {1: row, 2: (2, *row[1:])}
    assert demo.compare(expected, dict(expected)).equal
    assert demo.compare(expected, {1: row}).missing == [2]
    assert demo.compare(expected, {**expected, 3: row}).extra == [3]
    for column, value in ((3, Decimal("1.5")), (5, ""), (2, "a@example.com"), (3, None)):
        changed = list(row)
        changed[column] = value
        result = demo.compare(expected, {**expected, 1: tuple(changed)})
        assert [(key, want, got) for key, _, want, got in result.changed] == [
            (1, row[column], value)
        ], column

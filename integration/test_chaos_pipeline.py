"""The whole pipeline under chaos, short: a PostgreSQL workload, capture (storage faults,
SIGKILLs, crash points) into log A, a Spark replication A -> B and apply_changes B -> Delta
(each killed at random and at its crash points), compact/recover on timers, all on one
moto S3 endpoint; then each Delta table equals its PostgreSQL table row by row.
``benchmarks/chaos_pipeline.py --seconds 600`` is the long run (figures in
docs/RELIABILITY.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from chaos_pipeline import SHORT_MIX, failures, run_pipeline_chaos

pytestmark = pytest.mark.slow


def test_a_short_pipeline_chaos_run_ends_equal_row_by_row(pg_dsn: str, tmp_path: Path) -> None:
    report = run_pipeline_chaos(100, tmp_path, seed=11, mix=SHORT_MIX, dsn=pg_dsn, rate=10)
    assert report["transactions"] > 0
    assert report["A"]["events"] > report["A"]["snapshot_events"] > 0
    for stage in ("capture", "replication", "apply"):  # each killed at a crash point
        fired = any(k.startswith(f"{stage}: crash point") for k in report["kills"])
        assert fired, (stage, report["kills"], report.get("chaos_seconds"))
    assert report["capture_storage_faults"] > 0
    assert report["rows_compared"] > 0
    assert report["rows_unequal"] == 0, report["delta"]
    assert failures(report) == [], report
    assert report["verify A"] == "ok" and report["verify B"] == "ok"

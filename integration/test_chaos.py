"""The chaos run, short: appenders with storage faults and kills, two Spark replications
killed at random and at sink protocol steps, compact/recover/truncate on timers, all on
one moto S3 endpoint; then every acknowledged event is in each replica exactly once.
``benchmarks/chaos.py --seconds 600`` is the long run (figures in RELIABILITY.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from chaos import SHORT_MIX, run_chaos

pytestmark = pytest.mark.slow


def test_a_short_chaos_run_loses_and_doubles_nothing(tmp_path: Path) -> None:
    report = run_chaos(seconds=75, workdir=tmp_path, seed=7, mix=SHORT_MIX)
    assert report["acknowledged_events"] > 0
    assert sum(report["kills"].values()) > 0  # something was killed
    for replica in ("B1", "B2"):
        assert report[replica]["lost"] == 0, report
        assert report[replica]["doubled"] == 0, report
        assert report[replica]["unknown"] == 0, report  # no event no appender tried
        assert report[replica]["out_of_order_keys"] == 0, report
    for log in ("A", "B1", "B2"):
        assert report[f"verify {log}"] == "ok", report

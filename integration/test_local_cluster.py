"""Replication on local-cluster[2,1,1024]: executors are separate JVMs and Python workers."""

from pathlib import Path

import pytest
from support.replication import assert_exact_replica, batches, fill_source, run_app

from replog.log import ReplicationLog

pytestmark = pytest.mark.slow


def test_replication_on_local_cluster(tmp_path: Path) -> None:
    source = ReplicationLog.create(str(tmp_path / "A"), 4)
    fill_source(source, commits=4, per_commit=100)
    result = run_app(
        "replicate.py",
        source.url,
        str(tmp_path / "B"),
        str(tmp_path / "chk"),
        "--master",
        "local-cluster[2,1,1024]",
        "--max-events",
        "250",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert batches(result) == [250, 150]
    assert_exact_replica(source, ReplicationLog.open(str(tmp_path / "B")))


def test_relative_paths_on_local_cluster(tmp_path: Path) -> None:
    """Executors run in other working directories: relative locations are made absolute
    on the driver, so they find the same log."""
    source = ReplicationLog.create(str(tmp_path / "sub" / "A"), 2)
    fill_source(source, commits=2, per_commit=50)
    result = run_app(
        "replicate.py",
        "sub/A",
        "sub/B",
        "chk",
        "--master",
        "local-cluster[2,1,1024]",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert_exact_replica(source, ReplicationLog.open(str(tmp_path / "sub" / "B")))

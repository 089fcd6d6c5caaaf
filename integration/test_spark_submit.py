"""The two spark-submit recipes, run for real with the built wheel on
local-cluster[2,1,1024] (executors are separate JVMs with their own Python workers).

The "cluster's Python" is a fresh virtualenv that sees pyspark, pyarrow, fsspec and numpy
from the test environment but not replog: recipe (a) installs the wheel into it; recipe
(b) leaves it out and ships the wheel with ``--py-files``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from support.logcheck import check_log
from support.replication import key_histories

from replog.log import ReplicationLog

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
APP = ROOT / "examples" / "replicate_masked.py"
SPARK_SUBMIT = Path(sys.executable).with_name("spark-submit")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    [built] = out.glob("pyspark_replog-*.whl")
    return built


def cluster_python(root: Path, wheel: Path | None) -> Path:
    """A virtualenv with replog's dependencies visible and, if given, the wheel installed."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A plain path entry: the test environment's own .pth files (replog's editable
    # install among them) are not processed, so replog is not importable from there.
    Path(site, "cluster_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if wheel is not None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "--quiet",
                "--no-deps",
                str(wheel),
            ],
            check=True,
        )
    probe = subprocess.run(
        [str(python), "-c", "import replog; print(replog.__file__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (probe.returncode == 0) == (wheel is not None), probe.stderr
    return python


def make_source(url: str) -> ReplicationLog:
    log = ReplicationLog.create(url, 4)
    for commit in range(3):
        log.append(
            [
                {
                    "event_id": f"c{commit}-{i:03d}",
                    "key": f"customer-{i % 17}",
                    "collection": "customers",
                    "operation": "update",
                    "data": {"n": commit * 1000 + i, "email": f"user{i}@example.com"},
                }
                for i in range(120)
            ]
        )
    return log


def submit(python: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYSPARK_PYTHON=str(python), PYSPARK_DRIVER_PYTHON=str(python))
    result = subprocess.run(
        [
            str(SPARK_SUBMIT),
            "--master",
            "local-cluster[2,1,1024]",
            "--conf",
            "spark.ui.enabled=false",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=900,
        check=False,
    )
    noise = (" INFO ", " WARN Master", "ERROR Worker", "\tat ", "IllegalStateException")
    assert result.returncode == 0, (
        result.stdout[-3000:]
        + "\n".join(
            line for line in result.stderr.splitlines() if not any(n in line for n in noise)
        )[-6000:]
    )
    [line] = [out for out in result.stdout.splitlines() if out.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def check_masked_replica(source: ReplicationLog, target_url: str) -> None:
    source_rows = check_log(source)
    target_rows = check_log(ReplicationLog.open(target_url))
    assert sorted(r["event_id"] for r in target_rows) == sorted(r["event_id"] for r in source_rows)
    assert key_histories(target_rows) == key_histories(source_rows)
    for row in target_rows:
        document = json.loads(row["data"])
        assert document["email"] == "***" and "@" not in row["data"].decode()


def test_recipe_a_wheel_installed_in_the_cluster_python(wheel: Path, tmp_path: Path) -> None:
    python = cluster_python(tmp_path / "cluster-venv", wheel)
    source = make_source(str(tmp_path / "A"))
    result = submit(
        python,
        str(APP),
        source.url,
        str(tmp_path / "B"),
        str(tmp_path / "chk"),
        "--max-events",
        "200",
    )
    assert str(tmp_path / "cluster-venv") in result["replog_module"]  # the wheel, not src/
    assert result["batches"] == [200, 160] and not result["registered_explicitly"]
    check_masked_replica(source, str(tmp_path / "B"))


def test_recipe_b_py_files_with_register(wheel: Path, tmp_path: Path) -> None:
    python = cluster_python(tmp_path / "cluster-venv", None)
    source = make_source(str(tmp_path / "A"))
    result = submit(
        python,
        "--py-files",
        str(wheel),
        str(APP),
        source.url,
        str(tmp_path / "B"),
        str(tmp_path / "chk"),
        "--register",
        "--max-events",
        "200",
    )
    assert wheel.name in result["replog_module"]  # imported from the shipped wheel
    assert result["batches"] == [200, 160] and result["registered_explicitly"]
    check_masked_replica(source, str(tmp_path / "B"))

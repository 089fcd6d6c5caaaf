"""What a newcomer met in the docs and examples (issue 23, part 6; issue 33, part 6)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from replog.cli.parser import build_parser

ROOT = Path(__file__).parent.parent


def test_readme_links_only_documents_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"`((?:\.\./|docs/)[\w./-]+\.md)`", readme):
        assert (ROOT / target).exists(), target
    assert "docs/RELIABILITY.md" in readme


def test_readme_shows_what_a_first_run_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert '{"key": "orders/2"' in readme  # an example line for replog append
    create = readme.index("replog create /logs/inventory")
    assert create < readme.index("--format debezium", create)
    assert '.write.format("replog-sink").mode("append")' in readme
    assert "org.apache.spark:spark-sql-kafka-0-10_2.13:" in readme


def test_the_example_job_names_no_stale_wheel_and_no_shared_consumer() -> None:
    example = (ROOT / "examples" / "replicate_masked.py").read_text()
    assert "0.1.0" not in example and "pyspark_replog-*-py3-none-any.whl" in example
    assert not re.search(r'\.option\("consumer", "', example)  # a literal, shared name
    assert "--consumer" in example


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_docs_name_every_command_and_every_consumer_set_target() -> None:
    docs = "".join(
        (ROOT / name).read_text() for name in ("README.md", "docs/OPERATIONS.md", "docs/CDC.md")
    )
    for name in _subcommands():
        assert f"replog {name}" in docs, name
    for phrase in ("replog tail", "replog manifest show", "replog history"):
        assert phrase in docs, phrase
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    consumer = _subcommands()["consumer"]
    [targets] = [g for g in consumer._action_groups if g.title == "set: one target"]
    for action in targets._group_actions:
        assert action.option_strings[0] in operations, action.option_strings


def test_the_readme_says_what_make_does_about_java() -> None:
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "command -v java" in makefile and "apt-get install" in makefile  # checks only
    assert "which `make` does not install" in readme


def test_make_bench_runs_every_benchmark() -> None:
    makefile = (ROOT / "Makefile").read_text()
    bench = makefile[makefile.index("\nbench:") : makefile.index("\nclean:")]
    scripts = sorted(
        path.name
        for path in (ROOT / "benchmarks").glob("*.py")
        if path.name.startswith("bench_") or path.name in ("chaos.py", "fault_runs.py")
    )
    for script in scripts:
        assert f"benchmarks/{script}" in bench, script
    for section in ("python", "age", "spark", "s3", "writers", "stream"):
        assert section in bench


@pytest.mark.slow
def test_every_benchmark_starts_from_a_fresh_clone_as_documented(tmp_path: Path) -> None:
    """Run as their docstrings say (``.venv/bin/python benchmarks/X.py``, no PYTHONPATH):
    ``--help`` imports each one's modules, which is where a fresh clone failed."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if not (script.name.startswith("bench_") or script.name in ("chaos.py", "fault_runs.py")):
            continue
        done = subprocess.run(
            [sys.executable, str(script.relative_to(ROOT)), "--help"],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, (script.name, done.stderr[-2000:])
        assert "usage:" in done.stdout, script.name

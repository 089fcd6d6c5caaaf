"""What a newcomer met in the docs and examples (issue 23, part 6)."""

from __future__ import annotations

import re
from pathlib import Path

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

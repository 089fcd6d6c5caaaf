"""The README's and docs/CDC.md's code blocks, run as a newcomer would copy them.

Each fenced block runs, in document order: a ``python`` block in one namespace per
document (the tour is one script), a shell block as a bash script with ``replog`` on the
PATH (a block of ``$ ...`` lines and their output: the ``$`` lines), which must exit 0
(``bash -e``: every command). Paths under
``/tmp/``, ``/logs/``, ``/data/`` and ``s3://bucket/`` are taken to a fresh directory.
A block that cannot run here says why in a marker on the line before it::

    <!-- docs-test: skip: needs a Kafka broker -->

and one that uses what its reader has (their session, their log, their database, their
input file) names it::

    <!-- docs-test: given spark, url, dsn, mysql_dsn, debezium.jsonl, kafka -->

which this test provides: the test session, a log of Debezium customer changes, a
PostgreSQL database with a table ``public.orders``, a MariaDB database with a table
``orders`` (the session's server, started on first use), a file of Debezium change events, a
Kafka broker (a real one, tests/support/kafka.py: ``broker:9092`` in the block is its
address) whose topic ``dbserver1.inventory.products`` holds Debezium change events.
Every other block must run as written.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.cli import REPLOG

ROOT = Path(__file__).parent.parent
DEBEZIUM_FILE = ROOT / "tests" / "data" / "debezium" / "postgres_customers.jsonl"
MARKER = re.compile(r"<!-- docs-test: (skip|given)(?::)? (.*?) -->")
FENCE = re.compile(r"^( *)```(\w*)\s*$")
MOVED = ("/tmp/", "/logs/", "/data/", "s3://bucket/")
SHELL = ("", "sh", "shell", "bash", "console")


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    language: str
    text: str
    skip: str | None
    given: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks(document: str) -> Iterator[Block]:
    """The fenced code blocks of ``document`` (relative to the repository), with the
    marker on the line before each, if any."""
    lines = (ROOT / document).read_text().splitlines()
    index = 0
    while index < len(lines):
        opened = FENCE.match(lines[index])
        if opened is None:
            index += 1
            continue
        indent, language = opened.groups()
        end = index + 1
        while lines[end].strip() != "```":
            end += 1
        body = "\n".join(line[len(indent) :] for line in lines[index + 1 : end])
        before = next((line for line in reversed(lines[:index]) if line.strip()), "")
        marker = MARKER.search(before)
        kind, words = marker.groups() if marker else (None, "")
        yield Block(
            document,
            index + 1,
            language,
            body,
            skip=words if kind == "skip" else None,
            given=tuple(w.strip() for w in words.split(",")) if kind == "given" else (),
        )
        index = end + 1


def moved(text: str, root: Path) -> str:
    """``text`` with each path under one of :data:`MOVED` taken under ``root``, in one
    pass: replaced one prefix after another, ``s3://bucket/logs/x`` had its ``/logs/``
    moved first and pointed nowhere the test looked."""
    pattern = "|".join(re.escape(prefix) for prefix in sorted(MOVED, key=len, reverse=True))
    return re.sub(
        pattern,
        lambda m: f"{root}/{m.group(0).strip('/').replace('://', '-')}/",
        text,
    )


def script(block: Block) -> str:
    """A shell block as a script: the ``$`` lines of a transcript, else the block."""
    lines = block.text.splitlines()
    if any(line.startswith("$ ") for line in lines):
        return "\n".join(line[2:] for line in lines if line.startswith("$ "))
    return block.text


KAFKA_TOPIC = "dbserver1.inventory.products"


class Reader:
    """What a block's reader has (``given``), made on first use."""

    def __init__(
        self, root: Path, spark: Any, pg_dsn: str, kafka: Any, request: pytest.FixtureRequest
    ) -> None:
        self.root, self.spark, self.pg_dsn, self.kafka = root, spark, pg_dsn, kafka
        self.request = request
        self._mysql_dsn: str | None = None
        self._url: str | None = None
        self._dsn: str | None = None
        self._topic = False

    def bootstrap(self) -> str:
        """The broker's address, its topic holding the Debezium file's change events."""
        if not self._topic:
            from confluent_kafka import Producer

            producer = Producer({"bootstrap.servers": self.kafka.bootstrap, "log_level": 3})
            for line in DEBEZIUM_FILE.read_text().splitlines():
                producer.produce(KAFKA_TOPIC, value=line.encode())
            assert producer.flush(120) == 0
            self._topic = True
        return str(self.kafka.bootstrap)

    def url(self) -> str:
        if self._url is None:
            self._url = str(self.root / "given-log")
            run([REPLOG, "create", self._url, "--shards", "2"], self.root)
            run(
                [REPLOG, "append", self._url, str(DEBEZIUM_FILE), "--format", "debezium",
                 "--key-fields", "id"],
                self.root,
            )  # fmt: skip
        return self._url

    def dsn(self) -> str:
        if self._dsn is None:
            import psycopg

            with psycopg.connect(self.pg_dsn, autocommit=True) as connection:
                connection.execute("CREATE TABLE public.orders (id int PRIMARY KEY, total numeric)")
                connection.execute("INSERT INTO public.orders VALUES (1, 9.50), (2, 12.00)")
            self._dsn = self.pg_dsn
        return self._dsn

    def mysql_dsn(self) -> str:
        if self._mysql_dsn is None:
            db = self.request.getfixturevalue("mysql_db")
            db.sql(
                "CREATE TABLE orders (id int PRIMARY KEY, total decimal(8,2))",
                "INSERT INTO orders VALUES (1, 9.50), (2, 12.00)",
            )
            self._mysql_dsn = str(db.dsn)
        return self._mysql_dsn

    def provide(self, block: Block, namespace: dict[str, Any]) -> None:
        for name in block.given:
            if name == "spark":
                namespace["spark"] = self.spark
            elif name == "url":
                namespace["url"] = self.url()
            elif name == "dsn":
                namespace["dsn"] = self.dsn()
            elif name == "mysql_dsn":
                namespace["mysql_dsn"] = self.mysql_dsn()
            elif name == "chk":
                namespace["chk"] = str(self.root / "given-checkpoint")
            elif name == "kafka":
                self.bootstrap()
            elif name.endswith(".jsonl"):
                shutil.copy(DEBEZIUM_FILE, self.root / name)
            else:
                raise AssertionError(f"{block.where}: the test cannot give {name!r}")


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    path = f"{Path(REPLOG).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    environment = {**os.environ, "PATH": path}
    environment.pop("PYTHONPATH", None)  # a newcomer's shell: replog as installed
    done = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, check=False, env=environment
    )
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    return done


def run_document(document: str, root: Path, reader: Reader) -> list[str]:
    """Run every block of ``document``; the blocks skipped, with their reasons."""
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    skipped = []
    for block in blocks(document):
        if block.skip is not None:
            assert block.skip.strip(), f"{block.where}: a skipped block says why"
            skipped.append(f"{block.where}: {block.skip}")
            continue
        reader.provide(block, namespace)
        text = moved(block.text, root)
        if "kafka" in block.given:
            text = text.replace("broker:9092", reader.bootstrap())
        if block.language == "python":
            code = compile(text, block.where, "exec")
            exec(code, namespace)
        elif block.language in SHELL:
            run(["bash", "-e", "-o", "pipefail", "-c", moved(script(block), root)], root)
            assert "kafka" not in block.given, f"{block.where}: kafka is for Python blocks"
        else:
            raise AssertionError(f"{block.where}: a {block.language} block needs a marker")
    return skipped


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("document", ["README.md", "docs/CDC.md"])
def test_the_documents_code_blocks_run(  # noqa: PLR0917 - pytest fixtures
    document: str,
    tmp_path: Path,
    spark: Any,
    pg_dsn: str,
    kafka_broker: Any,
    request: pytest.FixtureRequest,
) -> None:
    for prefix in MOVED:
        (tmp_path / prefix.strip("/").replace("://", "-")).mkdir()
    reader = Reader(tmp_path, spark, pg_dsn, kafka_broker, request)
    skipped = run_document(document, tmp_path, reader)
    for query in spark.streams.active:  # a block's query left running is a failure
        query.stop()
        raise AssertionError(f"{document}: a block left query {query.name or query.id} running")
    print("\n".join(skipped))
    if document == "docs/CDC.md":  # "Many collections in one query" filled both tables
        from deltalake import DeltaTable

        from replog.tables.delta import read_table

        tables = tmp_path / "tmp" / "tables"
        customers = read_table(DeltaTable(str(tables / "customers")))
        orders = read_table(DeltaTable(str(tables / "orders")))
        assert customers.num_rows > 0
        assert sorted(orders.column("id").to_pylist()) == [1, 2]
        # "Kafka -> replog in Spark": the topic's changes in the log; "Debezium out": the
        # given log's events (and a tombstone per delete) in topic inventory.customers
        from replog.log import ReplicationLog

        products = ReplicationLog.open(str(tmp_path / "s3-bucket" / "logs" / "products"))
        # the file's seven changes (snapshot reads, creates, an update, a delete as a
        # Kafka record line), one of them a connector's redelivery: written once
        changes = [line for line in DEBEZIUM_FILE.read_text().splitlines() if '"op"' in line]
        assert sum(products.head().values()) == len(changes) - 1 == 6
        given = spark.read.format("replog").load(reader.url())
        expected = given.count() + given.where("operation = 'delete'").count()
        assert _topic_size(kafka_broker.bootstrap, "inventory.customers") == expected


def _topic_size(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "docs", "log_level": 3})
    metadata = consumer.list_topics(topic, timeout=60).topics[topic]
    total = 0
    for partition in metadata.partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=60)
        total += high - low
    consumer.close()
    return total


def test_markers_are_few_and_every_block_is_run_or_says_why() -> None:
    for document in ("README.md", "docs/CDC.md"):
        found = list(blocks(document))
        assert found, document
        run_here = [b for b in found if b.skip is None]
        assert len(run_here) > len(found) / 2, (document, len(run_here), len(found))
        for block in found:
            assert block.language in (*SHELL, "python") or block.skip, block.where


def test_the_tour_defines_spark_and_waits_for_its_query() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "spark = SparkSession.builder" in readme
    assert ".trigger(availableNow=True)" in readme and ".awaitTermination()" in readme

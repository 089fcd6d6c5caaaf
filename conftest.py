"""Shared fixtures: a real S3 endpoint over HTTP (moto server) and one SparkSession per run."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
for _name, _value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ.setdefault(_name, _value)


@dataclass(frozen=True)
class S3Endpoint:
    """A reset moto S3 server with one empty bucket."""

    endpoint_url: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    @property
    def fs_cli_args(self) -> list[str]:
        return [
            "--fs-option",
            f"endpoint_url={self.endpoint_url}",
            "--fs-option",
            "key=testing",
            "--fs-option",
            "secret=testing",
        ]

    @property
    def spark_options(self) -> dict[str, str]:
        return {"fs.endpoint_url": self.endpoint_url, "fs.key": "testing", "fs.secret": "testing"}

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *parts])


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_server: str) -> Iterator[S3Endpoint]:
    """A freshly reset S3 endpoint with an empty bucket."""
    import boto3
    import requests
    import s3fs

    requests.post(f"{moto_server}/moto-api/reset", timeout=30).raise_for_status()
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"replog-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket=bucket
    )
    yield S3Endpoint(moto_server, bucket)
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A unique memory:// location, removed afterwards."""
    import fsspec

    url = f"memory://replog-test-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _spark_kafka_jars() -> str:
    """Spark's Kafka connector and its few dependencies beyond Spark's own, as local jars
    (``make jars``): on the classpath at start-up, no resolution at each start. Empty when
    they were not fetched (the Kafka tests then fail in their broker fixture, saying so)."""
    from support.kafka import JARS

    return ",".join(str(jar) for jar in sorted((JARS / "spark-kafka").glob("*.jar")))


@pytest.fixture(scope="session")
def spark():
    """One SparkSession for the whole run; ``local[2,3]`` so failed tasks are retried;
    Spark's Kafka source and sink available (``format("kafka")``)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if _spark_kafka_jars():
        builder = builder.config("spark.jars", _spark_kafka_jars())
    session = (
        builder.master("local[2,3]")
        .appName("replog-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.pollingDelay", "50ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server with wal_level=logical for the whole session (capture tests)."""
    from support.postgres import running_server

    with running_server() as server:
        yield server


@pytest.fixture
def pg_dsn(postgres_server) -> Iterator[str]:
    """A fresh database on the session's server, dropped after the test."""
    with postgres_server.database() as dsn:
        yield dsn


@pytest.fixture(scope="session")
def mariadb_server():
    """A real MariaDB server (Debian's mariadb-server, started in a temporary directory on
    a free port, binlog in ROW/FULL/FULL, GTIDs) for the whole session (MySQL capture
    tests): started on first use, stopped and deleted at the end."""
    from support.mariadb import running_server

    with running_server() as server:
        yield server


@pytest.fixture
def mysql_dsn(mariadb_server) -> Iterator[str]:
    """A fresh database on the session's MariaDB server (``mysql://...``), dropped after."""
    with mariadb_server.database() as dsn:
        yield dsn


@pytest.fixture
def mysql_db(mariadb_server, mysql_dsn):
    """The fresh database of ``mysql_dsn``, with root access to it (tests/support/mysql.py)."""
    from support.mysql import Db

    return Db(mariadb_server, mysql_dsn)


@pytest.fixture(scope="session")
def kafka_broker():
    """A real Apache Kafka broker (KRaft, one node) for the whole session
    (tests/support/kafka.py): started on first use, stopped and deleted at the end."""
    from support.kafka import running_broker

    with running_broker() as broker:
        yield broker


@pytest.fixture(scope="session")
def peer_run(postgres_server, tmp_path_factory):
    """The session's one Debezium run (tests/support/debezium_workload.py): Debezium's
    PostgreSQL connector and ``replog capture`` over one workload on one database, for the
    Kafka tests and the differential test alike."""
    from support.debezium_workload import peer_run as run

    with run(postgres_server, tmp_path_factory.mktemp("peers")) as found:
        yield found


_REMOTE_SESSIONS: list[Any] = []
"""The Connect sessions tests made: stopped before their server is."""


@pytest.fixture(scope="session")
def connect_url() -> Iterator[str]:
    """A local Spark Connect server for the run, in a process of its own
    (tests/procs/connect_server.py): this process may hold the ``spark`` fixture's classic
    context, and a Python process holds one."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).parent / "tests" / "procs" / "connect_server.py"
    env = {**os.environ, "PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"]}
    for name in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE"):
        env.pop(name, None)
    server = subprocess.Popen(
        [sys.executable, str(script), "local[2,3]"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert server.stdin is not None and server.stdout is not None
    line = server.stdout.readline()
    if not line.startswith("READY "):
        server.kill()
        raise RuntimeError(f"the Spark Connect server did not start: {line!r}")
    yield f"sc://127.0.0.1:{line.split()[1]}"
    for session in _REMOTE_SESSIONS:  # else, at exit, each retries against a stopped
        session.stop()  # server for minutes (RETRIES_EXCEEDED) before pytest can end
    server.stdin.close()  # the server stops its session when its stdin closes
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture
def connect(connect_url: str) -> Iterator[Any]:
    """A Spark Connect session (one per run, on :func:`connect_url`). Connect mode is on
    for the test only: PySpark builds Connect or classic columns by that switch, and the
    ``spark`` fixture's tests need classic ones."""
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    try:
        session = RemoteSparkSession.builder.remote(connect_url).getOrCreate()
        if session not in _REMOTE_SESSIONS:
            _REMOTE_SESSIONS.append(session)
        yield session
    finally:
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


@pytest.fixture
def virtual_time() -> Iterator[None]:
    """The test's time (tests/support/virtual_time.py) at zero before and after."""
    from support.virtual_time import Virtual

    Virtual.reset()
    yield
    Virtual.reset()

"""A real Apache Kafka broker for the tests: KRaft, one node (broker and controller in one
JVM), started from Maven Central's jars (``make jars`` puts them in ``.jars/kafka``) in a
temporary directory on loopback, and stopped and deleted at the end of the session.

    with running_broker() as broker:
        broker.bootstrap          # "127.0.0.1:PORT", for Spark's and any client's options

The broker is started as Kafka's own ``kafka-server-start.sh`` starts it (``kafka.Kafka
server.properties``), after ``kafka-storage.sh format`` (``kafka.tools.StorageTool``).
Ports: two free ports are taken from the kernel and named in the configuration; a broker
that loses one to another process meanwhile fails to bind and exits, and is started again
on two new ones (at most five times), so no race can start a test against a wrong server.
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JARS = Path(os.environ.get("REPLOG_JARS", ROOT / ".jars"))
"""The Makefile's cache of Maven Central's jars (``make jars``; jvm/pom.xml says what)."""

READY_WITHIN_S = 300.0
"""How long a broker may take to answer before it is taken for hung (a wait for a hang,
not a limit on speed: a broker here answers in a few seconds)."""


def jars(module: str) -> list[Path]:
    """The jars of one module of jvm/ (``kafka``, ``spark-kafka``, ``debezium``)."""
    folder = JARS / module
    found = sorted(folder.glob("*.jar"))
    if not found:
        raise RuntimeError(
            f"no jars in {folder}: run `make jars` (make test does) to fetch them from "
            "Maven Central into the cache"
        )
    return found


def classpath(module: str) -> str:
    return os.pathsep.join(str(jar) for jar in jars(module))


def java() -> str:
    """The ``java`` the tests' Spark uses (JAVA_HOME's, else the PATH's)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise RuntimeError("no java on the PATH (Kafka and Spark need Java 17+)")
    return found


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (Kafka's Uuid)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


LOG4J2 = """\
Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: WARN
      AppenderRef:
        - ref: STDOUT
    Logger:
      - name: kafka.server.KafkaRaftServer
        level: INFO
"""


def _properties(directory: Path, broker_port: int, controller_port: int) -> str:
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{broker_port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(directory / "data"),
        "num.partitions": "1",
        "auto.create.topics.enable": "true",  # Kafka's default: the docs' topics
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "log.flush.interval.messages": "1",  # nothing acknowledged lives only in memory
    }
    return "".join(f"{name}={value}\n" for name, value in settings.items())


@dataclass
class Broker:
    """A running broker: its bootstrap address, its directory and its process."""

    bootstrap: str
    directory: Path
    process: subprocess.Popen[bytes]

    def output(self) -> str:
        return (self.directory / "broker.out").read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _jvm(directory: Path, main: str, *arguments: str, out: Path) -> subprocess.Popen[bytes]:
    command = [
        java(),
        "-Xms256m",
        "-Xmx512m",
        "-XX:+UseSerialGC",  # two cores shared by all: no parallel collector threads
        f"-Dlog4j2.configurationFile={directory / 'log4j2.yaml'}",
        "-cp",
        classpath("kafka"),
        main,
        *arguments,
    ]
    with out.open("ab") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=directory)


def _started(broker: Broker) -> bool:
    """Whether the broker says it started (KafkaRaftServer's line) and takes connections."""
    if "Kafka Server started" not in broker.output():
        return False
    host, port = broker.bootstrap.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        return False
    return True


def _start(directory: Path) -> Broker | None:
    """One try: format the storage and start the broker; None when a port was taken."""
    broker_port, controller_port = free_port(), free_port()
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / "log4j2.yaml").write_text(LOG4J2)
    properties = directory / "server.properties"
    properties.write_text(_properties(directory, broker_port, controller_port))
    out = directory / "broker.out"
    formatted = _jvm(
        directory,
        "kafka.tools.StorageTool",
        "format", f"--cluster-id={cluster_id()}", "-c", str(properties),  # an id may start with "-"
        out=out,
    )  # fmt: skip
    if formatted.wait() != 0:
        raise RuntimeError(f"kafka-storage format failed:\n{out.read_text()}")
    process = _jvm(directory, "kafka.Kafka", str(properties), out=out)
    broker = Broker(f"127.0.0.1:{broker_port}", directory, process)
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if "Address already in use" in broker.output():
                return None
            raise RuntimeError(
                f"the Kafka broker exited ({process.returncode}):\n{broker.output()}"
            )
        if _started(broker):
            return broker
        time.sleep(0.2)
    broker.stop()
    raise RuntimeError(
        f"the Kafka broker did not answer in {READY_WITHIN_S:.0f}s:\n{broker.output()}"
    )


@contextmanager
def running_broker() -> Iterator[Broker]:
    """A KRaft broker in a temporary directory, stopped and deleted afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="replog-kafka-"))
    try:
        for _ in range(5):
            broker = _start(parent / "broker")
            if broker is not None:
                break
        else:
            raise RuntimeError("the Kafka broker lost its ports to other processes five times")
        try:
            yield broker
        finally:
            broker.stop()
    finally:
        shutil.rmtree(parent, ignore_errors=True)

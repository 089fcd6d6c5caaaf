"""A throwaway MariaDB server for the MySQL demo and the MySQL capture tests: Debian's
``mariadb-server`` binaries (``make test`` installs the package when it is missing),
initialised with ``mariadb-install-db`` in a temporary directory, started on a free
loopback port with the binlog settings capture needs (``log_bin``, ``binlog_format=ROW``,
``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``, a ``server_id``, GTIDs in strict
mode), and stopped and deleted when done. Nothing of the system's own MariaDB (its
configuration files, data directory, service) is read or touched.

    with running_server() as server, server.database() as dsn:
        ...  # pymysql.connect(**server.connect_args()), replog capture mysql dsn ...

The DSN is ``mysql://replog:<password>@127.0.0.1:<port>/<database>``: a user with the
grants capture needs (``REPLICATION SLAVE``, ``REPLICATION CLIENT``, ``SELECT``, and
``CREATE``/``INSERT``/``UPDATE``/``DELETE`` on capture's own ``replog`` database for the watermark
rows); ``root`` over the socket is the admin.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql

READY_WITHIN_S = 300.0
"""How long a server may take to accept connections before it is taken for hung (a wait
for a hang, not a limit on speed: it answers in about two seconds)."""

USER, PASSWORD = "replog", "replog-secret"
CAPTURE_GRANTS = (
    f"GRANT SELECT, REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{USER}'@'%'",
    f"GRANT CREATE, INSERT, UPDATE, DELETE ON replog.* TO '{USER}'@'%'",
)
"""What capture needs (docs/CDC.md, "Capturing MySQL and MariaDB"): the binlog, the tables'
rows, and its own database for watermark rows."""

SETTINGS = (
    "--binlog-format=ROW",
    "--binlog-row-image=FULL",
    "--binlog-row-metadata=FULL",
    "--gtid-strict-mode=ON",
    "--gtid-domain-id=0",
    "--character-set-server=utf8mb4",
    "--collation-server=utf8mb4_general_ci",
    # not UTC: a TIMESTAMP read in the server's zone instead of UTC shows a wrong instant
    "--default-time-zone=+05:30",
    "--innodb-buffer-pool-size=128M",
    "--innodb-log-file-size=64M",
    "--innodb-flush-log-at-trx-commit=2",
    "--sync-binlog=0",
    "--max-connections=200",
    "--skip-name-resolve",
    "--performance-schema=OFF",
)
"""The server's settings: capture's binlog settings, and a small footprint for tests."""


def binary(*names: str) -> str:
    """The first of ``names`` on the PATH or in ``/usr/sbin`` (where Debian puts mariadbd)."""
    for name in names:
        found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
        if found:
            return found
    raise RuntimeError(
        f"no {' or '.join(names)}: install MariaDB's server (apt-get install -y "
        f"mariadb-server; `make test` does it when it is missing)"
    )


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """A running server; :meth:`database` makes a fresh database (one per test)."""

    port: int
    socket_path: str
    datadir: Path
    process: subprocess.Popen[bytes]
    server_id: int = 1
    extra: Sequence[str] = field(default_factory=tuple)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def dsn(self, database: str = "") -> str:
        """The capture user's DSN (``mysql://user:password@host:port/database``)."""
        return f"mysql://{USER}:{PASSWORD}@{self.host}:{self.port}/{database}"

    def admin(self, database: str | None = None, **options: Any) -> pymysql.Connection[Any]:
        """A root connection over the socket, autocommit."""
        return pymysql.connect(
            unix_socket=self.socket_path,
            user="root",
            database=database,
            autocommit=True,
            charset="utf8mb4",
            **options,
        )

    def sql(self, *statements: str, database: str | None = None) -> None:
        """Run each statement as root, autocommitted."""
        with self.admin(database) as connection, connection.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)

    def query(self, statement: str, database: str | None = None) -> list[tuple[Any, ...]]:
        with self.admin(database) as connection, connection.cursor() as cursor:
            cursor.execute(statement)
            return list(cursor.fetchall())

    @contextmanager
    def database(self, name: str | None = None) -> Iterator[str]:
        """A new empty database's DSN; dropped afterwards (with capture's watermark table)."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        self.sql(f"CREATE DATABASE `{name}`")
        try:
            yield self.dsn(name)
        finally:
            self.sql(f"DROP DATABASE IF EXISTS `{name}`")

    def stop(self) -> None:
        """Shut the server down cleanly (its data directory stays)."""
        if self.process.poll() is None:
            try:
                self.sql("SHUTDOWN")
            except pymysql.Error:
                self.process.terminate()
            self.process.wait(timeout=READY_WITHIN_S)

    def start(self) -> None:
        """Start it again on its data directory (after :meth:`stop`: a server restart)."""
        self.process = _start(self.datadir, self.port, self.socket_path, self.server_id,
                              self.extra)  # fmt: skip


def _start(
    datadir: Path, port: int, socket_path: str, server_id: int, extra: Sequence[str]
) -> subprocess.Popen[bytes]:
    command = [
        binary("mariadbd", "mysqld"),
        "--no-defaults",
        f"--datadir={datadir}",
        f"--port={port}",
        "--bind-address=127.0.0.1",
        f"--socket={socket_path}",
        f"--pid-file={datadir}/server.pid",
        f"--log-error={datadir}/error.log",
        f"--log-bin={datadir}/binlog",
        f"--server-id={server_id}",
        *SETTINGS,
        *extra,
    ]
    if os.geteuid() == 0:
        command.append("--user=root")  # a throwaway server in a directory of root's
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (datadir / "error.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"mariadbd exited with {process.returncode}:\n{log}")
        try:
            pymysql.connect(unix_socket=socket_path, user="root").close()
            return process
        except pymysql.Error:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"mariadbd did not accept connections within {READY_WITHIN_S:.0f} s")


@contextmanager
def running_server(*, server_id: int = 1, extra: Sequence[str] = ()) -> Iterator[Server]:
    """Initialise a data directory in a temporary directory, start a server on it with
    capture's settings (``extra``: more ``mariadbd`` options), create the capture user,
    and delete everything when done. A port another process takes meanwhile makes the
    server fail to bind: it is started again on another (at most five times)."""
    parent = Path(tempfile.mkdtemp(prefix="replog-mariadb-"))
    datadir = parent / "data"
    socket_path = str(parent / "mysqld.sock")
    try:
        install = [
            binary("mariadb-install-db", "mysql_install_db"),
            "--no-defaults",
            f"--datadir={datadir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
        ]
        if os.geteuid() == 0:
            install.append("--user=root")
        subprocess.run(install, check=True, capture_output=True)
        for attempt in range(5):
            port = _free_port()
            try:
                process = _start(datadir, port, socket_path, server_id, extra)
                break
            except RuntimeError:
                if attempt == 4:
                    raise
        server = Server(port, socket_path, datadir, process, server_id, tuple(extra))
        try:
            server.sql(
                f"CREATE USER '{USER}'@'%' IDENTIFIED BY '{PASSWORD}'",
                *CAPTURE_GRANTS,
            )
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(parent, ignore_errors=True)

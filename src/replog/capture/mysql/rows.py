"""A snapshot chunk's rows out of the server: the server's text of each column, as Arrow.

PyMySQL parses the text protocol in Python: it reads pgbench_accounts in 20,000-row
chunks at 270-325k rows/s on a 2-core machine, ~40% of a MySQL snapshot's time.
mysql-connector's C extension (libmysqlclient) reads the same statements at 1.0-1.5M
rows/s, but loads only before pyarrow in a process (glibc: "libstdc++.so.6: cannot
allocate memory in static TLS block") and before the ``ssl`` module (its own libssl
needs the newer libcrypto it ships). So a chunk is read by a child process that loads the
extension first (:func:`serve`) and hands back each column as an Arrow binary array (an
IPC stream over a pipe); where the extension cannot load, by PyMySQL in this process,
into the same arrays. Either way a NULL is null, and a server error is raised as the
PyMySQL error of its number, so the callers' handling (a table that moved, a connection
lost) is one.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa
import pymysql

from replog.capture.mysql.options import Dsn
from replog.capture.mysql.server import connect
from replog.errors import SourceConnectionError, SourcePrivilegeError

logger = logging.getLogger(__name__)

_CHILD = (
    "import _mysql_connector, runpy; "  # before anything loads pyarrow or ssl
    "runpy.run_module('replog.capture.mysql.rows', run_name='__main__')"
)
CHILD_READER = True
"""Read chunks in a child process through the C extension, where it loads (False:
PyMySQL here, always)."""
_LOST = (2006, 2013, 2055)
"""Client errors of a session that is gone (server gone, lost, lost at reading)."""


def pymysql_error(number: int, message: str) -> pymysql.err.MySQLError:
    """The PyMySQL error PyMySQL raises for the server's (or client's) error number."""
    kind = pymysql.err.error_map.get(
        number, pymysql.err.InternalError if number < 1000 else pymysql.err.OperationalError
    )
    return kind(number, message)


def columns_of(rows: Sequence[Sequence[Any]], width: int) -> list[pa.Array]:
    """Rows of server text (``str`` or ``bytes``; None for NULL) as binary columns."""
    return [pa.array([row[i] for row in rows], pa.binary()) for i in range(width)]


def _ipc(columns: list[pa.Array]) -> bytes:
    batch = pa.RecordBatch.from_arrays(columns, names=[str(i) for i in range(len(columns))])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as stream:
        stream.write_batch(batch)
    return sink.getvalue().to_pybytes()  # type: ignore[no-any-return]


class RowReader:
    """One session reading statements' rows; opened on first use: the C extension's in a
    child process, else PyMySQL's raw session here (:data:`CHILD_READER`)."""

    def __init__(self, dsn: Dsn) -> None:
        self.dsn = dsn
        self.fast = CHILD_READER
        self._child: subprocess.Popen[bytes] | None = None
        self._pipes: tuple[Connection, Connection] | None = None
        self._session: Any = None

    def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            session.close()
        self._stop_child()

    def columns(self, statement: str, args: Sequence[Any] | None) -> list[pa.Array]:
        """Each column of ``statement``'s rows (``%s`` placeholders, ``args``) as the
        server's text in an Arrow binary array."""
        if self.fast and self._pipes is None:
            self.fast = self._start_child()
        if not self.fast:
            if self._session is None:
                self._session = connect(self.dsn, raw=True)
            with self._session.cursor() as cursor:
                cursor.execute(statement, args)
                rows = cursor.fetchall()
                return columns_of(rows, len(cursor.description or ()))
        assert self._pipes is not None
        sending, receiving = self._pipes
        try:
            sending.send((statement, tuple(args) if args else None))
            kind, payload = receiving.recv()
        except (OSError, EOFError) as exc:
            self._stop_child()
            raise SourceConnectionError(f"the snapshot's reader process ended: {exc}") from exc
        if kind == "error":
            number, message = payload
            if number in _LOST:
                self._stop_child()
            raise pymysql_error(number, message)
        with pa.ipc.open_stream(pa.py_buffer(payload)) as stream:
            batch = stream.read_next_batch()
        return list(batch.columns)

    def _start_child(self) -> bool:
        """Start the reader process; whether it reads (False: PyMySQL reads here)."""
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        sending = Connection(os.dup(child.stdin.fileno()), readable=False)
        receiving = Connection(os.dup(child.stdout.fileno()), writable=False)
        child.stdin.close()
        child.stdout.close()
        self._child, self._pipes = child, (sending, receiving)
        try:
            sending.send(self.dsn.connect_args())
            kind, payload = receiving.recv()
        except (OSError, EOFError):
            kind, payload = "unavailable", f"it ended with {child.wait()}"
        if kind == "ok":
            logger.debug("snapshot rows are read through mysql-connector's C extension")
            return True
        self._stop_child()
        if kind == "unavailable":
            logger.info("snapshot rows are read through PyMySQL (the C extension: %s)", payload)
            return False
        number, message = payload
        if number == 1045:
            raise SourcePrivilegeError(
                f"{self.dsn.redacted()}: the server refused the login ({message})"
            )
        raise SourceConnectionError(f"cannot connect to {self.dsn.redacted()}: {message}")

    def _stop_child(self) -> None:
        if self._pipes is not None:
            for pipe in self._pipes:
                pipe.close()
            self._pipes = None
        if self._child is not None:
            child, self._child = self._child, None
            try:
                child.wait(timeout=10)  # its input closed: it ends
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _numbered(exc: Any) -> tuple[int, str]:
    """A mysql-connector error as (number, message). Its own client-side errors carry no
    number (or -1: "MySQL Connection not available." once the server cut the session):
    they are a lost connection (2013), as PyMySQL names the same moment."""
    number = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else 2013
    return number, exc.msg or str(exc)


def serve(receiving: Connection, sending: Connection) -> None:
    """The reader process: a session from the first message (connection arguments),
    then for each ``(statement, args)`` its rows as an Arrow IPC stream of binary
    columns, or ``("error", (number, message))``; until its input closes."""
    args = {name: value for name, value in receiving.recv().items() if value is not None}
    try:
        import mysql.connector  # noqa: PLC0415 - the child's own import, after the extension

        if not mysql.connector.HAVE_CEXT:
            raise ImportError("mysql-connector's C extension did not load")
    except ImportError as exc:
        sending.send(("unavailable", repr(exc)))
        return
    try:
        session = mysql.connector.connect(
            **args, use_pure=False, charset="utf8mb4", autocommit=True, connection_timeout=30
        )
        setup = session.cursor()
        setup.execute("SET time_zone = '+00:00'")
        setup.close()
    except mysql.connector.Error as exc:
        sending.send(("error", _numbered(exc)))
        return
    sending.send(("ok", None))
    while True:
        try:
            statement, values = receiving.recv()
        except EOFError:
            break
        try:
            cursor = session.cursor(raw=True)
            try:
                cursor.execute(statement, values)
                rows: Any = cursor.fetchall()
                width = len(cursor.description or ())
            finally:
                cursor.close()
        except mysql.connector.Error as exc:
            sending.send(("error", _numbered(exc)))
            continue
        sending.send(("rows", _ipc(columns_of(rows, width))))
    session.close()


if __name__ == "__main__":
    _out = os.dup(1)
    os.dup2(2, 1)  # a stray print goes to stderr, not into the replies
    serve(Connection(0, writable=False), Connection(_out, readable=False))

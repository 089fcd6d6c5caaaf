"""A real MariaDB server for the MySQL capture tests: the demo's throwaway server
(``examples/embedded_mariadb.py``: Debian's ``mariadb-server`` binaries, ``log_bin`` with
``binlog_format=ROW``, ``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``, GTIDs),
stopped and deleted at the end of the session. One module starts it for both."""

from __future__ import annotations

from embedded_mariadb import PASSWORD, USER, Server, running_server

__all__ = ["PASSWORD", "USER", "Server", "running_server"]

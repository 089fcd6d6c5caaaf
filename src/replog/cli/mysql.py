"""``replog capture mysql`` and ``replog snapshot mysql``: the MySQL/MariaDB capture's
commands (options of the PostgreSQL capture are refused here by name, and the other way
round, before anything connects)."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType
from typing import Any

from replog.capture.mysql.options import DEFAULT_NAME, MySqlOptions
from replog.capture.options import DEFAULT_HEARTBEAT_S
from replog.capture.progress import CaptureProgress
from replog.cli import capturing, results
from replog.cli.metrics import CaptureMetrics
from replog.cli.output import Output
from replog.errors import InvalidOptionError

_POSTGRES_ONLY = {
    "slot": "--slot",
    "publication": "--publication",
    "drop_slot": "--drop-slot",
    "reset_slot": "--reset-slot",
}
_MYSQL_ONLY = {
    "name": "--name",
    "server_id": "--server-id",
    "position": "--position",
    "reset_position": "--reset-position",
}


def refuse_foreign_options(args: argparse.Namespace) -> None:
    """Options of the other database's capture, given by mistake: an error naming them."""
    if args.source == "mysql":
        given = [flag for name, flag in _POSTGRES_ONLY.items() if getattr(args, name, None)]
        if getattr(args, "heartbeat", DEFAULT_HEARTBEAT_S) != DEFAULT_HEARTBEAT_S:
            given.append("--heartbeat")
        if getattr(args, "snapshot_workers", 1) != 1:
            given.append("--snapshot-workers")
        what = "PostgreSQL"
    else:
        given = [flag for name, flag in _MYSQL_ONLY.items() if getattr(args, name, None)]
        what = "MySQL"
    if given:
        raise InvalidOptionError(
            f"{', '.join(given)}: an option of the {what} capture, not of "
            f"'replog {args.command} {args.source}'"
        )


def _mysql() -> ModuleType:
    """:mod:`replog.capture.mysql.capture`, which needs the 'mysql' extra."""
    try:
        from replog.capture.mysql import capture  # noqa: PLC0415 - needs the 'mysql' extra
    except ImportError as exc:
        raise InvalidOptionError(
            f"reading MySQL needs mysql-replication and PyMySQL: pip install "
            f"'pyspark-replog[mysql]' ({exc})"
        ) from exc
    return capture


def options_of(args: argparse.Namespace) -> MySqlOptions:
    """The capture's options from the command line, checked."""
    refuse_foreign_options(args)
    options = MySqlOptions(
        **capturing.common_options(args),
        name=args.name or DEFAULT_NAME,
        server_id=args.server_id,
        position=args.position or "auto",
        reset_position=bool(args.reset_position),
    )
    options.check()
    keys = capturing.parse_keys(args.keys, options.qualified, "db.table")
    return replace(options, keys=keys)


def cmd_capture_mysql(args: argparse.Namespace, out: Output, fs_options: dict[str, Any]) -> int:
    """``replog capture mysql`` (:func:`capturing.run_capture`, as for PostgreSQL)."""
    options = options_of(args)
    mysql = _mysql()

    def check_source() -> None:
        """The server fit for capture, before a missing log is created (an unreachable
        server or a missing table leaves nothing behind)."""
        server = mysql.MySqlServer(options)
        try:
            server.check_settings()
            server.check_binlog_privileges()
            for table in options.tables:
                server.table(options.qualified(table))
        finally:
            server.close()

    def work(stop: threading.Event, progress: capturing.Progress) -> MySqlCaptured:
        log = capturing.capture_log(args, fs_options, check_source)
        with mysql.MySqlCapture(options, log, stop=stop, progress=progress) as running:
            captured = running.run()
            return MySqlCaptured.of(args.url, options.name, captured, running.position,
                                    running.zero_dates)  # fmt: skip

    metrics = CaptureMetrics(f"mysql.{options.name}", args.url)
    shown, _ = capturing.run_capture(out, metrics, args.metrics_port, work, log_name="binlog")
    out.show(shown)
    return 0


def cmd_snapshot_mysql(args: argparse.Namespace, out: Output) -> int:
    """``replog snapshot mysql``: a row in ``replog.signals`` for the capture ``--name``."""
    refuse_foreign_options(args)
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    signal_id = _mysql().request_snapshot(args.dsn, tables, args.name)
    out.show(MySqlSnapshotRequested({"name": args.name, "tables": tables, "signal_id": signal_id}))
    return 0


class MySqlCaptured(results.Result):
    schema = "capture-mysql"

    @classmethod
    def of(
        cls,
        url: str,
        name: str,
        progress: CaptureProgress,
        position: Any,
        zero_dates: dict[str, int],
    ) -> MySqlCaptured:
        document = progress.to_json()
        for member in ("lsn", "retained_wal_bytes", "slot_wal_status", "heartbeats",
                       "slot_dropped", "publication_dropped", "skipped_changes"):  # fmt: skip
            document.pop(member, None)
        document["lag_bytes"] = progress.lag_bytes
        return cls(
            {
                "url": url,
                "name": name,
                **document,
                "position": None if position is None else {
                    "file": position.file,
                    "pos": position.pos,
                    "gtids": position.gtids or None,
                    "mode": position.mode,
                    "version": position.version,
                    "server_id": position.server_id,
                },
                "zero_dates": dict(zero_dates),
            }
        )  # fmt: skip

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        where = d["position"] or {}
        at = f"{where.get('file')}:{where.get('pos')}"
        if where.get("gtids"):
            at += f" (GTID {where['gtids']})"
        yield results.captured_line(d, at)
        yield from results.table_event_lines(d["tables"])
        if d["zero_dates"]:
            total = sum(d["zero_dates"].values())
            columns = ", ".join(sorted(d["zero_dates"]))
            yield f"note: {total} zero dates (0000-00-00) written as null, in {columns}"
        yield from results.skipped_truncations_lines(d)


class MySqlSnapshotRequested(results.Result):
    schema = "snapshot-mysql"

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        whose = f"the MySQL capture {d['name']}" if d["name"] else "every MySQL capture"
        yield (
            f"asked {whose} to snapshot {', '.join(d['tables'])} (signal {d['signal_id']} in "
            f"replog.signals)"
        )


def server_binlog(dsn: str) -> tuple[str, int, dict[str, int]]:
    """A MySQL server's binlog position now and its files' sizes (``replog status
    --source-dsn mysql://...``)."""
    from replog.capture.mysql.options import Dsn  # noqa: PLC0415 - with the extra only

    _mysql()
    from replog.capture.mysql.server import connect  # noqa: PLC0415 - needs PyMySQL

    connection = connect(Dsn.parse(dsn))
    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW MASTER STATUS")
            row = cursor.fetchone()
            cursor.execute("SHOW BINARY LOGS")
            files = {str(name): int(size) for name, size, *_ in cursor.fetchall()}
    finally:
        connection.close()
    if row is None:
        raise InvalidOptionError(f"--source-dsn: {Dsn.parse(dsn).redacted()} writes no binlog")
    return str(row[0]), int(row[1]), files

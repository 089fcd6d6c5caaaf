"""The ``replog`` command line: sub-commands and their arguments."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from replog.about import __version__
from replog.capture.mysql.options import DEFAULT_NAME as MYSQL_DEFAULT_NAME
from replog.capture.mysql.options import POSITION_MODES as MYSQL_POSITION_MODES
from replog.capture.options import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_MAX_CHANGES,
    DEFAULT_STAGE_EVENTS,
    SNAPSHOT_MODES,
)
from replog.cli import commands
from replog.format.commits import DEFAULT_RETENTION_MS, DEFAULT_SHARDS, DEFAULT_SNAPSHOT_INTERVAL
from replog.ingest import FORMATS
from replog.ops.compaction import DEFAULT_TARGET_BYTES
from replog.ops.recovery import DEFAULT_GRACE_MS

_Command = Callable[..., argparse.ArgumentParser]


def _count(text: str) -> int:
    """A count of events: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (a whole number >= 0)")
    return value


def _port(text: str) -> int:
    """A TCP port to listen on, 0..65535 (0: any free port, chosen when it binds)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535; 0: any free port)")
    return value


def _duration(ms: int) -> str:
    """A default duration as the CLI writes it (``7200000`` -> ``2h``)."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _write_commands(command: _Command) -> None:
    """Commands that create logs and append to them."""
    p = command("create", commands.cmd_create, help="create an empty log")
    p.add_argument("url")
    p.add_argument(
        "--shards",
        type=int,
        default=DEFAULT_SHARDS,
        help=f"number of shards (default {DEFAULT_SHARDS})",
    )
    p.add_argument(
        "--retention",
        default=_duration(DEFAULT_RETENTION_MS),
        help="how long commits, snapshots and the files of merged or truncated segments "
        f"are kept before writers delete them (default {_duration(DEFAULT_RETENTION_MS)}; "
        "at least 10m; warned below recover's --grace plus 10m)",
    )
    p.add_argument(
        "--snapshot-interval",
        type=int,
        default=DEFAULT_SNAPSHOT_INTERVAL,
        help="commits between segment tables, which readers load instead of the commits "
        f"(default {DEFAULT_SNAPSHOT_INTERVAL})",
    )
    p.add_argument(
        "--no-auto-compact",
        dest="auto_compact",
        action="store_false",
        help="writers do not merge small files after their commits (run 'replog compact')",
    )

    p = command(
        "append",
        commands.cmd_append,
        help="append JSON lines as one atomic commit",
        description="Append events (one JSON object per line) as one atomic commit. Every "
        "line is validated first: a bad line names its number and nothing is written. "
        "Payloads given as JSON values are stored as their exact text.",
    )
    p.add_argument("url")
    p.add_argument("file", nargs="?", help="JSON lines file, or - for stdin (default)")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=FORMATS[0],
        help="replog change events (default), or Debezium change-event values",
    )
    p.add_argument("--key-fields", help="debezium: the row fields that make the key, e.g. id")
    p.add_argument(
        "--txn-app-id",
        help="with --txn-version: make the append idempotent (a version of this app id "
        "already in the log is skipped, so a run whose outcome was unknown can be repeated)",
    )
    p.add_argument("--txn-version", type=int, help="with --txn-app-id: this append's version")


def _capture_commands(command: _Command) -> None:
    """Change-data capture from a database into a log."""
    p = command(
        "capture",
        commands.cmd_capture,
        help="capture a database's changes into a log, each transaction exactly once",
        description="Capture PostgreSQL changes through a logical replication slot "
        "(pgoutput): an initial snapshot of the tables, then every committed transaction, "
        "each in exactly one commit of the log, which records the slot position with the "
        "events. The slot is advanced only after the commit; a restart resumes where the "
        "log ends. The log is created if absent. Ctrl-C or SIGTERM finishes the current "
        "commit and exits.",
    )
    p.add_argument("source", choices=["postgres", "mysql"], help="the kind of database")
    p.add_argument(
        "dsn",
        help="postgres: a libpq connection string or URI; mysql: "
        "mysql://user:password@host:port/database (MySQL 8.0.14+ or MariaDB 10.5+)",
    )
    p.add_argument("url", help="the log")
    p.add_argument(
        "--slot", help="postgres: the logical replication slot (created if absent; required)"
    )
    p.add_argument(
        "--publication",
        help="an existing publication to capture (default: one named after the slot, "
        "created for --tables)",
    )
    p.add_argument(
        "--tables",
        help="schema.table[,schema.table...] (default: those the log's capture of the slot "
        "captures when it resumes one, else the --publication's)",
    )
    p.add_argument(
        "--tables-changed",
        action="store_true",
        help="let --tables leave out tables the log's capture of the slot captures (they are "
        "no longer captured; their rows stay in tables built from the log)",
    )
    p.add_argument(
        "--keys",
        action="append",
        default=[],
        metavar="SCHEMA.TABLE=COL[,COL...]",
        help="key columns of a table without a primary key (repeatable)",
    )
    p.add_argument(
        "--snapshot",
        choices=SNAPSHOT_MODES,
        default=SNAPSHOT_MODES[0],
        help="initial: read the tables first (op r); never: only changes from the slot on",
    )
    p.add_argument("--follow", action="store_true", help="keep capturing until stopped")
    p.add_argument(
        "--drop-slot",
        action="store_true",
        help="drop the slot when capture ends (the server stops keeping WAL for it)",
    )
    p.add_argument(
        "--reset-slot",
        action="store_true",
        help="drop an existing slot this log does not own (or cannot resume) and start over "
        "with a new slot and a snapshot: the log that followed the slot can then never resume",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=DEFAULT_HEARTBEAT_S,
        metavar="SECONDS",
        help="--follow: confirm the position this often while the tables are idle and the "
        "server writes WAL, so the slot never holds WAL without bound (default "
        f"{DEFAULT_HEARTBEAT_S:g}; 0: never)",
    )
    p.add_argument(
        "--skip-truncate",
        action="store_true",
        help="warn about and count TRUNCATE instead of capturing it as truncate events",
    )
    p.add_argument(
        "--shards",
        type=int,
        help=f"shards of the log if capture creates it (default {DEFAULT_SHARDS}); a log "
        "that exists must have this many",
    )
    p.add_argument(
        "--max-changes",
        type=int,
        default=DEFAULT_MAX_CHANGES,
        help=f"changes per log commit, in whole transactions (default {DEFAULT_MAX_CHANGES})",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on this port while capturing (/metrics on every "
        "interface): changes per table, snapshot, lag in WAL bytes and seconds, retained "
        "WAL, heartbeats, errors. 0: any free port, said on stderr and in --json",
    )
    p.add_argument(
        "--snapshot-chunk-rows",
        type=int,
        default=DEFAULT_CHUNK_ROWS,
        help=f"rows a snapshot reads per chunk at most, each chunk one commit (default "
        f"{DEFAULT_CHUNK_ROWS}; fewer when rows are wide: a chunk holds about 16 MiB)",
    )
    p.add_argument(
        "--snapshot-workers",
        type=int,
        default=1,
        help="processes that read a snapshot chunk's key ranges at once (default 1)",
    )
    p.add_argument(
        "--stage-events",
        type=int,
        default=DEFAULT_STAGE_EVENTS,
        help="events held in memory before they are staged as files: bounds the memory of "
        f"a large transaction, still committed once (default {DEFAULT_STAGE_EVENTS})",
    )
    _mysql_capture_options(p)

    p = command(
        "slots",
        commands.cmd_slots,
        help="list the server's logical replication slots, or drop one ('slots drop DSN NAME')",
        usage="replog slots [--json] DSN\n       replog slots drop [--json] [--force] DSN NAME",
        description="'replog slots DSN' lists every logical replication slot of the server "
        "(any database): its plug-in, who reads or captures it, the log that owns it (named "
        "in capture's own publication), the WAL it keeps, its confirmed position and how far "
        "behind it is in bytes and in seconds (the oldest commit it holds unconfirmed, on the "
        "server's clock). 'replog slots drop DSN NAME' drops one after naming what depends "
        "on it, and capture's own publication of it; it asks first on a terminal (--force: "
        "never), and refuses a slot that is being read or captured.",
    )
    p.add_argument(
        "words",
        nargs="+",
        metavar="DSN | drop DSN NAME",
        help="a libpq connection string or URI (any database of the server); drop: also "
        "the slot's name",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="drop without asking (for scripts; a slot being read or captured is refused "
        "all the same)",
    )

    p = command(
        "snapshot",
        commands.cmd_snapshot,
        help="ask a capture to snapshot tables while it streams",
        description="Write a signal into the database's WAL asking the capture of --slot to "
        "snapshot the tables again: it reads them in chunks between watermarks while it "
        "goes on streaming (a running capture at once, a stopped one when it starts). The "
        "same as SELECT pg_logical_emit_message(true, 'replog.signal', "
        '\'{"snapshot": ["public.t"], "slot": "S"}\').',
    )
    p.add_argument("source", choices=["postgres", "mysql"], help="the kind of database")
    p.add_argument("dsn", help="a libpq connection string or URI; mysql: mysql://...")
    p.add_argument("--slot", help="postgres: the capture's slot (required)")
    p.add_argument(
        "--name",
        help="mysql: the capture's --name (default: every MySQL capture of the server)",
    )
    p.add_argument("--tables", required=True, help="schema.table[,schema.table...]")
    p.add_argument(
        "--publication",
        help="the capture's --publication, if it was given one (the tables are checked "
        "against it; default: the publication named after the slot)",
    )


def _mysql_capture_options(p: argparse.ArgumentParser) -> None:
    """``replog capture mysql``'s own options (refused for postgres, as the PostgreSQL
    ones are for mysql)."""
    p.add_argument(
        "--name",
        help=f"mysql: names the capture (its position in the log, its events' source.name; "
        f"default {MYSQL_DEFAULT_NAME})",
    )
    p.add_argument(
        "--server-id",
        type=int,
        help="mysql: the replica server_id to read the binlog with (default: one derived "
        "from the name and the log; it must differ from every replica's)",
    )
    p.add_argument(
        "--position",
        choices=MYSQL_POSITION_MODES,
        help="mysql: gtid (resume by GTID state: another server of the topology can take "
        "over), file (binlog file and offset), auto (default: GTIDs where the server has them)",
    )
    p.add_argument(
        "--reset-position",
        action="store_true",
        default=None,
        help="mysql: start over from the server's position now with a new snapshot into this "
        "log (the way on when the binlog after the log's position was purged)",
    )


def _read_commands(command: _Command) -> None:
    """Commands that read a log."""
    p = command("info", commands.cmd_info, help="summarise a log")
    p.add_argument("url")

    p = command(
        "schemas",
        commands.cmd_schemas,
        help="list the Kafka Connect schema versions registered in a log",
        description="List the schema versions 'append --format debezium' registered, per "
        "collection and oldest first, with each field's Arrow type, Connect type and "
        "logical name (io.debezium.time.Date, ...).",
    )
    p.add_argument("url")
    p.add_argument("--collection", help="only this collection (e.g. inventory.customers)")

    p = command(
        "read",
        commands.cmd_read,
        help="print events as JSON lines",
        description="Print events, one JSON object per line (with or without --json).",
    )
    p.add_argument("url")
    p.add_argument("--shard", type=int, help="only this shard")
    p.add_argument(
        "--from", dest="from_seq", default="earliest", help="first sequence, or earliest (default)"
    )
    p.add_argument("--limit", type=_count, help="at most this many events")

    p = command(
        "tail",
        commands.cmd_tail,
        help="print the newest events as JSON lines; --follow for new ones",
        description="Print the newest events of each shard, one JSON object per line (with "
        "or without --json); --follow keeps printing new ones until Ctrl-C (exit 0).",
    )
    p.add_argument("url")
    p.add_argument("--shard", type=int, help="only this shard")
    p.add_argument("-n", "--lines", type=_count, default=10, help="events per shard to start with")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    p.add_argument("--interval", default="1s", help="how often --follow looks (default 1s)")

    p = command("verify", commands.cmd_verify, help="check every checksummed file")
    p.add_argument("url")

    p = command(
        "history",
        commands.cmd_history,
        help="the log's commits, newest first (Delta's DESCRIBE HISTORY)",
        description="Each retained commit: version, time, operation, who wrote it (an app's "
        "transaction, a capture's slot and LSN, a sink's epoch), events and files added and "
        "removed. Commits older than the log's retention are gone.",
    )
    p.add_argument("url")
    p.add_argument("--limit", type=_count, help="only the newest N commits")
    _table_option(p)


def _table_option(p: argparse.ArgumentParser) -> None:
    """``--table``: the Delta replicas whose readable points ``history``/``status`` show."""
    p.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="PATH",
        help="a Delta table apply_changes writes from this log (repeatable): shows the "
        "oldest and newest position and time table_as_of can read it as of",
    )


def _checkpoint_commands(command: _Command) -> None:
    """Commands about consumers, sinks and their manifests."""
    p = command("manifest", commands.cmd_manifest, help="inspect checkpoint manifests")
    p.add_argument("action", choices=["list", "show", "validate"])
    p.add_argument("url", help="a manifest store, e.g. LOG/_replog/consumers/NAME")
    p.add_argument("--id", type=int, help="a checkpoint id (default: the latest valid)")

    p = command(
        "consumer",
        commands.cmd_consumer,
        help="list, show, set or delete consumers",
        description="'set' moves a consumer's committed offsets (like Kafka's "
        "--reset-offsets): it needs one target and only shows what it would do unless "
        "--execute. A running query reading as that consumer is fenced (it stops) at its next "
        "commit. 'delete' forgets a consumer, so retention stops waiting for it.",
    )
    p.add_argument("action", choices=["list", "show", "set", "delete"])
    p.add_argument("url", help="the log")
    p.add_argument("--consumer", help="the consumer's name")
    p.add_argument(
        "--create", action="store_true", help="set: create the consumer if it does not exist"
    )
    target = p.add_argument_group("set: one target")
    target.add_argument("--to-earliest", action="store_true", help="before the oldest event")
    target.add_argument("--to-latest", action="store_true", help="after the newest event")
    target.add_argument("--to-timestamp", help="before the first event at or after MS")
    target.add_argument(
        "--to-datetime",
        help="before the first event at or after an ISO 8601 time, e.g. 2024-03-01T10:00:00Z "
        "(no offset: UTC)",
    )
    target.add_argument(
        "--by-duration",
        help="before the first event at or after now minus DURATION (1h, 7d or ISO PT1H)",
    )
    target.add_argument(
        "--shift-by",
        type=int,
        help="move the committed offsets by N events per shard (negative: back), kept "
        "between earliest and latest",
    )
    target.add_argument("--offsets", help='JSON {"0": 41, ...}: last processed per shard')
    p.add_argument("--execute", action="store_true", help="do it (default: a dry run)")

    p = command(
        "status",
        commands.cmd_status,
        help="consumers (offsets, lag), sinks (epoch, status) and captures (LSN, lag)",
    )
    p.add_argument("url")
    p.add_argument(
        "--source-dsn",
        metavar="DSN",
        help="the PostgreSQL server the log's captures read: adds each capture's lag behind "
        "it (its current WAL position minus the log's) and its slot's confirmed position",
    )
    p.add_argument(
        "--format",
        choices=("text", "json", "prometheus"),
        default="text",
        help="json: as --json; prometheus: metrics in Prometheus' text format, for "
        "node_exporter's textfile collector",
    )
    _table_option(p)


def _operate_commands(command: _Command) -> None:
    """Operators' commands: retention, recovery, compaction."""
    p = command(
        "truncate",
        commands.cmd_truncate,
        help="retention: drop old events, never ones a known consumer has not committed",
        description="Raise the shards' low watermarks in one commit. Refuses (and changes "
        "nothing) if a known consumer has not committed the events it would drop, unless "
        "--force. Without --keep-from or --older-than, drops what every consumer committed.",
    )
    p.add_argument("url")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--keep-from", help='first sequence to keep per shard, JSON {"0": 1000}')
    how.add_argument(
        "--older-than", help="drop segments whose events are all older than this (e.g. 7d)"
    )
    p.add_argument("--force", action="store_true", help="drop even unconsumed events")
    p.add_argument("--dry-run", action="store_true", help="only say what would be dropped")

    p = command(
        "recover",
        commands.cmd_recover,
        help="resolve Pending sink commits and delete orphaned segment files",
        description="Resolve each sink's Pending epoch from the log (committed or rolled "
        "back) and delete segment files no commit references. Anything younger than "
        "--grace is left alone; it must exceed your longest micro-batch. Files of a batch "
        "write or compaction in progress are protected by its staging lease.",
    )
    p.add_argument("url")
    grace = _duration(DEFAULT_GRACE_MS)
    p.add_argument("--grace", default=grace, help=f"age below which nothing is touched ({grace})")
    p.add_argument("--dry-run", action="store_true", help="only say what would be done")

    p = command(
        "compact",
        commands.cmd_compact,
        help="merge small segments of each shard in one commit (--by-key: key compaction)",
    )
    p.add_argument("url")
    p.add_argument(
        "--target-bytes",
        type=int,
        default=DEFAULT_TARGET_BYTES,
        help="largest merged segment in bytes (default 64 MiB)",
    )
    p.add_argument(
        "--by-key",
        action="store_true",
        help="keep only the newest event per (collection, key) up to the slowest registered "
        "consumer's committed offset (the cleaner point); sequences keep their values",
    )
    p.add_argument(
        "--keep-deletes-for",
        metavar="DURATION",
        help="with --by-key: drop deletes (newest for their key) older than this, e.g. 1d "
        "(default: keep every delete)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be merged")


class UsageError(Exception):
    """Arguments argparse refused: shown as argparse shows them, or (``--json``) as an
    error document."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class UsageParser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` instead of exiting, so that
    ``main`` can report a usage error in the output the user asked for."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", self.format_usage())


def build_parser() -> argparse.ArgumentParser:
    common = UsageParser(add_help=False)
    common.add_argument(
        "--fs-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="fsspec storage option, e.g. endpoint_url=http://localhost:9000 (repeatable)",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    json_output = UsageParser(add_help=False)
    json_output.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (read, tail: JSON lines, one per event); an error is "
        "one too. Schemas: docs/OPERATIONS.md, 'JSON output'",
    )
    parser = UsageParser(
        prog="replog", description="Create, inspect and operate replog replication logs."
    )
    parser.add_argument("--version", action="version", version=f"replog {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, handler: commands.Command, **kwargs: object) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common, json_output], **kwargs)  # type: ignore[arg-type]
        p.set_defaults(handler=handler)
        return p

    groups = (
        _write_commands,
        _capture_commands,
        _read_commands,
        _checkpoint_commands,
        _operate_commands,
    )
    for add in groups:
        add(command)
    return parser

"""The ``replog`` commands: each turns parsed arguments into a core call and hands the
result, described by :mod:`replog.cli.results`, to the output (:mod:`replog.cli.output`);
long work shows its progress on stderr (:mod:`replog.cli.progress`)."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from replog import ingest
from replog import offsets as positions
from replog.capture.options import CaptureOptions
from replog.capture.progress import CaptureProgress
from replog.checkpoints import consumers
from replog.checkpoints.consumers import CONSUMERS_DIR
from replog.checkpoints.manifest import CheckpointManifest
from replog.checkpoints.sinks import SINKS_DIR
from replog.checkpoints.store import ManifestStore, named_stores
from replog.cli import capturing, results
from replog.cli import mysql as mysql_commands
from replog.cli.metrics import CaptureMetrics, status_metrics
from replog.cli.output import Output
from replog.cli.progress import BYTES, Display, Work, display_for
from replog.errors import (
    InvalidOptionError,
    ManifestNotFoundError,
    ReplogError,
)
from replog.format.commits import DESCRIPTOR_PATH, Transaction
from replog.format.limits import check_retention, check_shards, check_snapshot_interval
from replog.log import ReplicationLog
from replog.merges import plan_full
from replog.names import check_name
from replog.ops import compaction, history, keys, reach, recovery, retention, status, verify
from replog.schemas import registry
from replog.storage import coerce_option_value
from replog.timeutil import check_epoch_ms, duration_ms, iso_instant_ms, now_ms

if TYPE_CHECKING:  # psycopg is the 'postgres' extra's
    from replog.capture.slots import SlotProbe

PROGRESS_MIN_BYTES = 8 * 1024 * 1024
"""``append`` shows its progress for files at least this large."""

Command = Callable[[argparse.Namespace, Output], int]

INTERRUPTED = {
    "append": "nothing was appended (an append is one commit)",
    "compact": "nothing was committed; the merged files already written stay on storage "
    "until 'replog recover URL' deletes them (once older than its --grace)",
    "truncate": "a truncation is one commit: it either landed whole or not at all "
    "('replog info' shows the lows)",
    "recover": "the files deleted so far were garbage; run it again to finish",
    "capture": "the log holds every commit made before the stop; the next run resumes after "
    "the last one (a snapshot cut short starts again)",
}
"""What an interrupted command (Ctrl-C) leaves behind, said after 'interrupted'."""


def storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidOptionError(f"--fs-option expects name=value, got {pair!r}")
        options[name] = coerce_option_value(name, value)
    return options


def open_log(args: argparse.Namespace) -> ReplicationLog:
    return ReplicationLog.open(args.url, storage_options=storage_options(args.fs_option))


def _display(out: Output) -> Display:
    """Where this command shows its progress (nothing under ``--json``)."""
    return display_for(out.json)


def _counting(work: Work) -> Callable[[int, int], None]:
    """A core ``progress(done, total)`` callback that moves ``work``."""

    def moved(done: int, total: int) -> None:
        work.update(completed=done, total=total)

    return moved


# -- capture ---------------------------------------------------------------------------------


def _postgres() -> ModuleType:
    """:mod:`replog.capture.postgres`, which needs the 'postgres' extra (psycopg)."""
    try:
        from replog.capture import postgres  # noqa: PLC0415 - needs the 'postgres' extra
    except ImportError as exc:
        raise InvalidOptionError(
            f"reading PostgreSQL needs psycopg: pip install 'pyspark-replog[postgres]' ({exc})"
        ) from exc
    return postgres


def cmd_capture(args: argparse.Namespace, out: Output) -> int:
    """``replog capture postgres`` or ``replog capture mysql`` (:mod:`replog.cli.mysql`)."""
    if args.source == "mysql":
        return mysql_commands.cmd_capture_mysql(args, out, storage_options(args.fs_option))
    mysql_commands.refuse_foreign_options(args)
    return _capture_postgres(args, out)


def _capture_postgres(args: argparse.Namespace, out: Output) -> int:
    """``replog capture postgres`` (:func:`capturing.run_capture`)."""
    if not args.slot:
        raise InvalidOptionError("replog capture postgres needs --slot (the replication slot)")
    options = CaptureOptions(
        **capturing.common_options(args),
        slot=args.slot,
        publication=args.publication,
        keys=capturing.parse_keys(
            args.keys, lambda table: table if "." in table else f"public.{table}",
            "schema.table",
        ),
        drop_slot=args.drop_slot,
        snapshot_workers=args.snapshot_workers,
        heartbeat_s=args.heartbeat,
        reset_slot=args.reset_slot,
    )  # fmt: skip
    options.check()
    postgres = _postgres()
    from replog.capture.slots import SlotProbe  # noqa: PLC0415 - needs psycopg
    from replog.capture.source import safe_dsn  # noqa: PLC0415 - needs psycopg

    def check_source() -> None:
        source = postgres.PostgresSource(options)
        try:
            source.check()
        finally:
            source.close()

    def work(stop: threading.Event, progress: capturing.Progress) -> CaptureProgress:
        with postgres.PostgresCapture(options, log, stop=stop, progress=progress) as run:
            captured: CaptureProgress = run.run()
        # run() returns after --drop-slot only once the slot is dropped
        captured.slot_dropped = captured.slot_dropped or options.drop_slot
        return captured

    probe = SlotProbe(options.dsn, options.slot, options.publication or options.slot)
    try:
        log = capturing.capture_log(args, storage_options(args.fs_option), check_source)
        metrics = CaptureMetrics(args.slot, args.url, probe=lambda: _measured(probe))
        captured, port = capturing.run_capture(out, metrics, args.metrics_port, work)
    finally:
        probe.close()
    given = safe_dsn(options.dsn)  # never the password
    where = shlex.quote(given) if "=" in given else "DSN"
    drop = f"replog slots drop {where} {options.slot}"
    out.show(results.Captured.of(args.url, captured, options.slot, drop, port))
    return 0


def _measured(probe: SlotProbe) -> dict[str, Any] | None:
    """The capture's slot on the server at a scrape, as ``status --json`` names its fields."""
    slot = probe.measure()
    return None if slot is None else slot.to_json()


def cmd_slots(args: argparse.Namespace, out: Output) -> int:
    """``replog slots DSN`` lists the server's logical slots; ``replog slots drop DSN
    NAME`` drops one, after naming what depends on it and (on a terminal, unless
    ``--force``) asking."""
    words = list(args.words)
    _postgres()  # the 'postgres' extra, or a clear error
    from replog.capture import slots  # noqa: PLC0415 - needs psycopg

    if words[0] != "drop":
        if len(words) != 1 or args.force:
            raise InvalidOptionError(
                "slots: give one DSN to list the slots ('replog slots DSN'), or 'replog slots "
                "drop DSN NAME [--force]' to drop one"
            )
        out.show(results.Slots.of(slots.list_slots(words[0])))
        return 0
    if len(words) != 3:
        raise InvalidOptionError("slots drop: give the DSN and the slot's name: "
                                 "'replog slots drop DSN NAME [--force]'")  # fmt: skip
    dsn, name = words[1], words[2]
    slot = slots.inspect(dsn, name)
    slots.check_free(slot)
    if not args.force:
        if not sys.stdin.isatty():
            raise InvalidOptionError(
                f"slots drop {name}: not asking without a terminal; give --force to drop it "
                f"from a script ({'; '.join(slots.dependents(slot))})"
            )
        print(f"slot {name} (database {slot.database}, plug-in {slot.plugin}):", file=sys.stderr)
        for said in slots.dependents(slot):
            print(f"  - {said}", file=sys.stderr)
        print(f"drop slot {name}? [y/N] ", end="", file=sys.stderr, flush=True)
        answer = sys.stdin.readline()
        if answer.strip().lower() not in ("y", "yes"):
            out.show(results.SlotDropped.of(slot, dropped=False))
            return 1
    done = slots.drop(dsn, slot)
    out.show(results.SlotDropped.of(slot, dropped=True, publication=done.publication))
    return 0


def cmd_snapshot(args: argparse.Namespace, out: Output) -> int:
    """``replog snapshot postgres``: a signal in the WAL for the capture of the slot."""
    if args.source == "mysql":
        return mysql_commands.cmd_snapshot_mysql(args, out)
    mysql_commands.refuse_foreign_options(args)
    if not args.slot:
        raise InvalidOptionError("replog snapshot postgres needs --slot (the capture's slot)")
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    _postgres()  # the 'postgres' extra, or a clear error
    from replog.capture.snapshot import request_snapshot  # noqa: PLC0415 - needs psycopg

    signal_id, position = request_snapshot(args.dsn, tables, args.slot, args.publication)
    out.show(results.SnapshotRequested.of(args.slot, tables, position, signal_id))
    return 0


# -- create / append / info / read / tail / verify -----------------------------------------


def cmd_create(args: argparse.Namespace, out: Output) -> int:
    """The limits are ReplicationLog.create's (:mod:`replog.format.limits`), checked
    first under the options' names here."""
    retention = check_retention(
        duration_ms(args.retention, "--retention"), "--retention", given=args.retention
    )
    log = ReplicationLog.create(
        args.url,
        check_shards(args.shards, "--shards"),
        storage_options=storage_options(args.fs_option),
        snapshot_interval=check_snapshot_interval(args.snapshot_interval, "--snapshot-interval"),
        retention_ms=retention,
        auto_compact=args.auto_compact,
    )
    out.show(results.Created.of(log.info()))
    return 0


@contextmanager
def _input(path: str | None) -> Iterator[tuple[IO[str], int | None]]:
    if path in (None, "-"):
        yield sys.stdin, None
        return
    assert path is not None
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise InvalidOptionError(f"cannot read {path!r}: {exc}") from exc
    with handle:
        yield handle, os.path.getsize(path)


def _transaction(args: argparse.Namespace) -> Transaction | None:
    """The append's transaction from --txn-app-id/--txn-version, checked before any input
    is read."""
    if args.txn_app_id is None and args.txn_version is None:
        return None
    if args.txn_app_id is None or args.txn_version is None:
        raise InvalidOptionError("--txn-app-id and --txn-version go together")
    if args.txn_version < 0:
        raise InvalidOptionError(f"--txn-version must be >= 0, got {args.txn_version}")
    return Transaction(check_name(args.txn_app_id, "--txn-app-id"), args.txn_version)


def cmd_append(args: argparse.Namespace, out: Output) -> int:
    transaction = _transaction(args)
    log = open_log(args)
    key_fields = (
        tuple(f.strip() for f in args.key_fields.split(",") if f.strip()) if args.key_fields else ()
    )
    with _input(args.file) as (stream, total), _display(out) as display:
        shown = total is not None and total >= PROGRESS_MIN_BYTES
        work = display.work(f"reading {args.file}", total, BYTES) if shown else None
        report = ingest.append_lines(
            log,
            stream,
            format=args.format,
            key_fields=key_fields,
            progress=work.advance if work is not None else None,
            transaction=transaction,
        )
        if work is not None:
            work.done(f"read {report.lines:,} lines of {args.file}")
    out.show(results.Appended.of(report))
    return 0


def cmd_schemas(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    found = registry.versions(log.storage, args.collection)
    if args.collection is not None and not found:
        raise InvalidOptionError(
            registry.unknown_collection(log.storage, args.collection, "--collection")
        )
    out.show(results.Schemas.of(log.url, found))
    return 0


def cmd_info(args: argparse.Namespace, out: Output) -> int:
    out.show(results.Info.of(open_log(args).info()))
    return 0


def _first(log: ReplicationLog, shard: int, spec: str) -> int:
    state = log.refresh()
    if spec == "earliest":
        return state.lows[shard]
    if spec == "latest":
        return state.heads[shard] + 1
    try:
        return int(spec)
    except ValueError as exc:
        raise InvalidOptionError(f"--from: {spec!r} is not a sequence, earliest or latest") from exc


def _shards(log: ReplicationLog, shard: int | None) -> list[int]:
    """The shard ``--shard`` names (checked), or every shard."""
    return list(range(log.shards)) if shard is None else [log.check_shard(shard, "--shard")]


def _rows(
    log: ReplicationLog, shard: int, first: int, last: int | None = None
) -> Iterator[dict[str, Any]]:
    for batch in log.read(shard, first, last):
        yield from batch.to_pylist()


def cmd_read(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    shards = _shards(log, args.shard)
    remaining = args.limit
    for shard in shards:
        for row in _rows(log, shard, _first(log, shard, args.from_seq)):
            if remaining is not None and remaining <= 0:
                return 0
            out.events([row])
            if remaining is not None:
                remaining -= 1
    return 0


def cmd_tail(args: argparse.Namespace, out: Output) -> int:
    """The last ``-n`` events of each shard, then (``--follow``) every new event. Ctrl-C
    is how one stops following, whenever it comes: not a failure."""
    log = open_log(args)
    shards = _shards(log, args.shard)
    interval = duration_ms(args.interval, "--interval") / 1000
    try:
        state = log.refresh()
        next_sequence = {}
        for shard in shards:
            first = max(state.heads[shard] - args.lines + 1, state.lows[shard])
            out.events(_rows(log, shard, first, state.heads[shard]))
            next_sequence[shard] = state.heads[shard] + 1
        while args.follow:
            time.sleep(interval)
            state = log.refresh()
            for shard in shards:
                if state.heads[shard] >= next_sequence[shard]:
                    first = max(next_sequence[shard], state.lows[shard])
                    out.events(_rows(log, shard, first, state.heads[shard]))
                    next_sequence[shard] = state.heads[shard] + 1
    except KeyboardInterrupt:
        if not args.follow:
            raise
    return 0


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    with _display(out) as display:
        work = display.work("verifying segment files", None, "files")
        report = verify.verify(log, progress=_counting(work))
        work.done(f"checked {report.segments:,} segment files")
    out.show(results.Verified.of(report))
    return 0 if report.ok else 1


def cmd_history(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    found = history.log_history(log, args.limit)
    out.show(results.History.of(found, reach.reach(log, args.table)))
    return 0


# -- manifests and consumers ----------------------------------------------------------------


def cmd_manifest(args: argparse.Namespace, out: Output) -> int:
    store = ManifestStore(args.url, storage_options=storage_options(args.fs_option))
    if args.action == "list":
        listing: list[tuple[int, CheckpointManifest | str]] = []
        for checkpoint_id in store.list_ids():
            try:
                listing.append((checkpoint_id, store.load(checkpoint_id)))
            except (ReplogError, FileNotFoundError) as exc:
                listing.append((checkpoint_id, str(exc)))
        hint = None if listing else _stores_hint(store)
        out.show(results.Manifests.of(store.url, listing, store.latest_id(), hint))
        return 0
    manifest = store.load(args.id) if args.id is not None else store.load_latest()
    if manifest is None:
        hint = _stores_hint(store)
        raise ManifestNotFoundError(f"no manifests in {store.url}" + (f"; {hint}" if hint else ""))
    if args.action == "show":
        out.show(results.Manifest.of(manifest))
        return 0
    problems = manifest.validate()
    out.show(results.Validated.of(manifest, problems))
    return 1 if problems else 0


def _stores_hint(store: ManifestStore) -> str | None:
    """Where the manifests are, when a log was given instead of a manifest store."""
    if not store.storage.exists(DESCRIPTOR_PATH):
        return None
    found = [
        f"{store.url}/{directory}/{name}"
        for directory in (CONSUMERS_DIR, SINKS_DIR)
        for name in named_stores(store.storage, directory)[0]
    ]
    listed = ", ".join(found) if found else "none yet"
    return (
        f"{store.url} is a log: its manifest stores are {store.url}/{CONSUMERS_DIR}/<consumer> "
        f"and {store.url}/{SINKS_DIR}/<sinkId> ({listed})"
    )


def _shifted(
    log: ReplicationLog, current: dict[int, int] | None, shift: int, consumer: str
) -> dict[int, int]:
    """Committed offsets moved by ``shift`` events per shard, kept between earliest and
    latest (Kafka's ``--shift-by``)."""
    if current is None:
        raise InvalidOptionError(
            f"consumer set --shift-by {shift}: consumer {consumer!r} has no committed offsets "
            f"to shift; give an absolute target (--to-earliest, --to-datetime, ...)"
        )
    state = log.refresh()
    low, high = positions.earliest(state), positions.latest(state)
    return {
        shard: min(max(current.get(shard, low[shard]) + shift, low[shard]), high[shard])
        for shard in range(log.shards)
    }


def _target(
    log: ReplicationLog, args: argparse.Namespace, current: dict[int, int] | None
) -> dict[int, int]:
    given = [
        args.to_earliest,
        args.to_latest,
        args.offsets is not None,
        args.to_timestamp is not None,
        args.to_datetime is not None,
        args.by_duration is not None,
        args.shift_by is not None,
    ]
    if sum(given) != 1:
        raise InvalidOptionError(
            "consumer set: give exactly one target: --to-earliest, --to-latest, "
            "--offsets JSON, --to-timestamp MS, --to-datetime ISO8601, --by-duration "
            "DURATION or --shift-by N"
        )
    if args.shift_by is not None:
        return _shifted(log, current, args.shift_by, args.consumer)
    stamp: int | None = None
    if args.to_timestamp is not None:
        stamp = check_epoch_ms(args.to_timestamp, "--to-timestamp")
    elif args.to_datetime is not None:
        stamp = iso_instant_ms(args.to_datetime, "--to-datetime")
    elif args.by_duration is not None:
        stamp = max(now_ms() - duration_ms(args.by_duration, "--by-duration"), 0)
    if stamp is not None:
        return positions.resolve(log, "", "--to-timestamp", timestamp_ms=stamp)
    spec = "earliest" if args.to_earliest else "latest" if args.to_latest else args.offsets
    return positions.resolve(log, spec, "--offsets")


def cmd_consumer(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    if args.action == "list":
        out.show(results.Consumers.of(log.url, consumers.list_consumers(log)))
        return 0
    if args.consumer is None:
        raise InvalidOptionError(f"consumer {args.action}: --consumer NAME is required")
    check_name(args.consumer, "--consumer")
    if args.action == "show":
        out.show(results.Consumer.of(log.url, status.consumer_position(log, args.consumer)))
        return 0
    current = consumers.committed_position(log, args.consumer)
    if args.action == "delete":
        if args.execute:
            consumers.delete_consumer(log, args.consumer)
        elif args.consumer not in consumers.list_consumers(log):
            raise ManifestNotFoundError(f"{log.url} has no consumer {args.consumer!r}")
        out.show(results.ConsumerDeleted.of(log.url, args.consumer, current, args.execute))
        return 0
    target = _target(log, args, current.offsets if current else None)
    if current is None and not args.create:
        known = ", ".join(consumers.list_consumers(log)) or "none"
        raise ManifestNotFoundError(
            f"{log.url} has no consumer {args.consumer!r} (consumers: {known}); add "
            f"--create to create it at the given offsets"
        )
    if args.execute:
        owner = f"replog-cli@{socket.gethostname()}:{os.getpid()}"
        committer = consumers.OffsetCommitter(log, args.consumer, owner)
        committer.commit(target, log_version=log.state().version, note=consumers.OPERATOR_NOTE)
    before = current.offsets if current else {}
    out.show(results.ConsumerSet.of(log.url, args.consumer, before, target, args.execute))
    return 0


# -- operating a log: status / truncate / recover / compact ----------------------------------


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    report = status.log_status(log)
    if args.source_dsn and args.source_dsn.startswith(("mysql://", "mariadb://")):
        binlog = mysql_commands.server_binlog(args.source_dsn)
        report = status.with_mysql_server(report, *binlog)
    elif args.source_dsn:
        _postgres()  # the 'postgres' extra, or a clear error
        from replog.capture import slots  # noqa: PLC0415 - needs psycopg
        from replog.capture.snapshot import SnapshotPlan  # noqa: PLC0415 - needs psycopg

        tables = {}
        for capture in report.captures:
            plan = SnapshotPlan.load(log.storage, capture.slot, log.log_id)
            tables[capture.slot] = sorted(plan.tables) if plan is not None else []
        server, states = slots.capture_slots(args.source_dsn, tables)
        report = status.with_server(report, server.server_lsn, states)
    shown = results.Status.of(report, reach.reach(log, args.table))
    if args.format == "prometheus":
        out.stream.write(status_metrics(shown.document))
        return 0
    out.show(shown)
    return 0


def cmd_truncate(args: argparse.Namespace, out: Output) -> int:
    log = open_log(args)
    if args.keep_from is not None:
        requested = positions.parse_offsets_json(args.keep_from, log.shards, "--keep-from")
    elif args.older_than is not None:
        cutoff = now_ms() - duration_ms(args.older_than, "--older-than")
        requested = retention.lows_older_than(log.refresh(), cutoff)
    else:
        requested = retention.consumed_lows(log)
    if args.dry_run:
        plan = retention.plan_truncation(log, requested)
        out.show(results.Truncated.of(log.url, plan, dry_run=True, force=args.force))
        return 1 if plan.blockers and not args.force else 0
    plan, record = retention.truncate(log, requested, force=args.force)
    out.show(
        results.Truncated.of(
            log.url,
            plan,
            dry_run=False,
            force=args.force,
            version=record.version if record else None,
            removed=len(record.remove) if record else 0,
        )
    )
    return 0


def cmd_recover(args: argparse.Namespace, out: Output) -> int:
    grace_ms = duration_ms(args.grace, "--grace")
    log = open_log(args)
    with _display(out) as display:
        work = display.work("deleting garbage files", None, "files")
        report = recovery.recover(
            log, grace_ms=grace_ms, dry_run=args.dry_run, progress=_counting(work)
        )
        work.done()
    out.show(results.Recovered.of(log.url, report))
    return 0


def cmd_compact(args: argparse.Namespace, out: Output) -> int:
    if args.keep_deletes_for is not None and not args.by_key:
        raise InvalidOptionError("--keep-deletes-for needs --by-key")
    keep_deletes_for = (
        None
        if args.keep_deletes_for is None
        else duration_ms(args.keep_deletes_for, "--keep-deletes-for")
    )
    log = open_log(args)
    if args.by_key:
        result = keys.compact_by_key(
            log, keep_deletes_for_ms=keep_deletes_for, dry_run=args.dry_run
        )
        below = _segments_below(log, result.cleaner_points)
        out.show(results.Compacted.by_key(log.url, result, args.dry_run, below))
        return 0
    if args.dry_run:
        merges = plan_full(log.refresh(), target_bytes=args.target_bytes)
        planned = compaction.CompactionResult(tuple(merges), None)
        out.show(results.Compacted.merged(log.url, planned, True))
        return 0
    with _display(out) as display:
        work = display.work("compacting", None, "events")
        merged = compaction.compact(log, target_bytes=args.target_bytes, progress=_counting(work))
        work.done()
    out.show(results.Compacted.merged(log.url, merged, False))
    return 0


def _segments_below(log: ReplicationLog, points: dict[int, int]) -> int:
    """Whole segments at or below the cleaner points: what key compaction may rewrite."""
    state = log.refresh()
    return sum(
        1
        for shard, lane in enumerate(state.segments)
        for segment in lane
        if segment.last_sequence <= points.get(shard, 0)
    )

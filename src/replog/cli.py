"""The ``replog`` command: create, append, info, read, verify, and the operator commands."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import IO, Any

import pyarrow as pa

from replog import compaction, consumers, recovery, retention, status
from replog.errors import InvalidEventError, InvalidOptionError, ReplogError
from replog.events import events_from_records
from replog.log import ReplicationLog, now_ms
from replog.manifest import CheckpointManifest
from replog.manifest_store import ManifestStore
from replog.offsets import parse_offsets_json
from replog.storage import coerce_option_value

logger = logging.getLogger("replog.cli")

PARSE_CHUNK_LINES = 50_000
PROGRESS_MIN_BYTES = 8 * 1024 * 1024


def _fs_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidOptionError(f"--fs-option expects name=value, got {pair!r}")
        options[name] = coerce_option_value(value)
    return options


def _open(args: argparse.Namespace) -> ReplicationLog:
    return ReplicationLog.open(args.url, storage_options=_fs_options(args.fs_option))


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, sort_keys=True))


# -- create / append / info / read / verify -------------------------------------------


def cmd_create(args: argparse.Namespace) -> int:
    log = ReplicationLog.create(args.url, args.shards, storage_options=_fs_options(args.fs_option))
    print(f"created {log.url} with {log.shards} shards")
    return 0


def _json_lines(stream: IO[str], total_bytes: int | None) -> Iterator[tuple[int, str]]:
    progress = None
    if total_bytes is not None and total_bytes >= PROGRESS_MIN_BYTES:
        from tqdm import tqdm  # noqa: PLC0415 - only for large inputs

        progress = tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="parsing", file=sys.stderr
        )
    for number, line in enumerate(stream, start=1):
        if progress is not None:
            progress.update(len(line.encode("utf-8")))
        if line.strip():
            yield number, line
    if progress is not None:
        progress.close()


def _parse_chunk(chunk: list[tuple[int, str]]) -> pa.Table:
    records = []
    for number, line in chunk:
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise InvalidEventError(f"line {number}: not valid JSON: {exc}") from exc
    return events_from_records(records, where=lambda index: f"line {chunk[index][0]}")


def cmd_append(args: argparse.Namespace) -> int:
    log = _open(args)
    if args.file in (None, "-"):
        stream, total = sys.stdin, None
    else:
        try:
            stream = open(args.file, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise InvalidOptionError(f"cannot read {args.file!r}: {exc}") from exc
        total = os.path.getsize(args.file)
    # Parse and validate every line before writing anything: a bad line commits nothing.
    tables, chunk = [], []
    try:
        for item in _json_lines(stream, total):
            chunk.append(item)
            if len(chunk) >= PARSE_CHUNK_LINES:
                tables.append(_parse_chunk(chunk))
                chunk = []
        if chunk:
            tables.append(_parse_chunk(chunk))
    finally:
        if stream is not sys.stdin:
            stream.close()
    if not tables:
        print("nothing to append (no events in the input)")
        return 0
    commit = log.append(pa.concat_tables(tables))
    assert commit is not None
    events = sum(segment.events for segment in commit.add)
    print(
        f"appended {events} events to {log.url} as version {commit.version} "
        f"({len(commit.add)} segments)"
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    info = _open(args).info()
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    print(f"log        {info['url']}")
    print(f"log id     {info['log_id']} (format version {info['format_version']})")
    print(f"shards     {info['shards']}")
    print(f"version    {info['version']}")
    print(f"events     {info['events']}")
    print(f"segments   {info['segments']} ({info['bytes']:,} bytes)")
    for shard, head in info["heads"].items():
        print(f"  shard {shard:>4}: sequences {info['lows'][shard]}..{head}")
    for sink, mark in info["sinks"].items():
        print(f"sink {sink}: epoch {mark['epoch']} of query {mark['query_id']}")
    return 0


def _event_json(row: dict[str, Any]) -> dict[str, Any]:
    document = {name: value for name, value in row.items() if name != "data"}
    stamp = row["timestamp"]
    document["timestamp"] = stamp.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    data: bytes = row["data"]
    try:
        document["data"] = data.decode("utf-8")
    except UnicodeDecodeError:
        document["data_base64"] = base64.b64encode(data).decode("ascii")
    return document


def cmd_read(args: argparse.Namespace) -> int:
    log = _open(args)
    shards = [args.shard] if args.shard is not None else list(range(log.shards))
    remaining = args.limit
    for shard in shards:
        for batch in log.read(shard, args.from_seq):
            for row in batch.to_pylist():
                if remaining is not None and remaining <= 0:
                    return 0
                print(json.dumps(_event_json(row), sort_keys=True))
                if remaining is not None:
                    remaining -= 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    log = _open(args)
    problems = log.verify()
    for problem in problems:
        print(f"BAD {problem}")
    if problems:
        print(f"{len(problems)} problem(s) found in {log.url}", file=sys.stderr)
        return 1
    info = log.info()
    print(f"ok: {info['segments']} segments, {info['events']} events, version {info['version']}")
    return 0


# -- manifests and consumers ----------------------------------------------------------


def cmd_manifest(args: argparse.Namespace) -> int:
    store = ManifestStore(args.url, storage_options=_fs_options(args.fs_option))
    if args.action == "list":
        ids = store.list_ids()
        latest = store.latest_id()
        for checkpoint_id in ids:
            try:
                listed = store.load(checkpoint_id)
                stamp = datetime.fromtimestamp(listed.timestamp_ms / 1000, timezone.utc)
                summary = f"epoch {listed.epoch}  {stamp:%Y-%m-%d %H:%M:%S}Z"
            except (ReplogError, FileNotFoundError) as exc:
                summary = f"UNREADABLE: {exc}"
            marker = "*" if checkpoint_id == latest else " "
            print(f"{marker} {checkpoint_id:>8}  {summary}")
        if not ids:
            print(f"no manifests in {store.url}")
        return 0
    manifest: CheckpointManifest | None = (
        store.load(args.id) if args.id is not None else store.load_latest()
    )
    if manifest is None:
        raise InvalidOptionError(f"no manifests in {store.url}")
    if args.action == "show":
        _print_json(manifest.to_json())
        return 0
    problems = manifest.validate()
    for problem in problems:
        print(f"INVALID checkpoint {manifest.checkpoint_id}: {problem}")
    if not problems:
        print(f"ok: checkpoint {manifest.checkpoint_id} is valid")
    return 1 if problems else 0


def cmd_consumer(args: argparse.Namespace) -> int:
    log = _open(args)
    if args.action == "list":
        for name in consumers.list_consumers(log):
            print(name)
        return 0
    if args.action == "show":
        position = consumers.committed_offsets(log, args.consumer)
        offsets = position.offsets if position else {}
        lag = consumers.consumer_lag(log, offsets)
        document = {
            "consumer": args.consumer,
            "committed": position is not None,
            "checkpoint_id": position.checkpoint_id if position else None,
            "epoch": position.epoch if position else None,
            "offsets": {str(item.shard): item.committed for item in lag},
            "heads": {str(item.shard): item.head for item in lag},
            "lag": {str(item.shard): item.events for item in lag},
            "total_lag": sum(item.events for item in lag),
        }
        if args.json:
            print(json.dumps(document, sort_keys=True))
        else:
            state = (
                "never committed"
                if position is None
                else (f"checkpoint {position.checkpoint_id}, epoch {position.epoch}")
            )
            print(f"consumer {args.consumer} of {log.url}: {state}")
            for item in lag:
                print(
                    f"  shard {item.shard:>4}: committed {item.committed:>10}  "
                    f"head {item.head:>10}  lag {item.events:>10}"
                )
            print(f"  total lag {document['total_lag']} events")
        return 0
    # set: only safe while the consumer's query is stopped (documented in the help text).
    heads = log.head()
    target = args.offsets
    if target == "earliest":
        offsets = {shard: max(low - 1, 0) for shard, low in enumerate(log.state().lows)}
    elif target == "latest":
        offsets = dict(heads)
    else:
        offsets = parse_offsets_json(target, log.shards, "--offsets")
    for shard, sequence in offsets.items():
        if sequence > heads[shard]:
            raise InvalidOptionError(
                f"--offsets: shard {shard} set to {sequence}, beyond its head {heads[shard]}"
            )
    manifest = consumers.commit_offsets(log, args.consumer, offsets, epoch=0, note="replog-cli")
    print(
        f"consumer {args.consumer}: offsets set to {offsets} (checkpoint {manifest.checkpoint_id})"
    )
    return 0


# -- operating a log: status / truncate / recover / compact ----------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_DURATION_UNITS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def duration_ms(text: str, option: str) -> int:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"7d"``, ``"250ms"`` or ``"0"`` in milliseconds."""
    match = _DURATION.match(text.strip().lower())
    if match is None or (match.group(2) is None and float(match.group(1)) != 0):
        raise InvalidOptionError(
            f"{option}: {text!r} is not a duration; use a number with ms, s, m, h or d, e.g. 1h"
        )
    return int(float(match.group(1)) * _DURATION_UNITS[match.group(2) or "ms"])


def _age(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = max((now_ms() - ms) / 1000, 0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.1f}s ago"


def cmd_status(args: argparse.Namespace) -> int:
    report = status.log_status(_open(args))
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    events = sum(int(h) - int(report["lows"][s]) + 1 for s, h in report["heads"].items())
    print(f"log {report['url']}: version {report['version']}, {events:,} events retained")
    print(f"consumers ({len(report['consumers'])}):")
    for consumer in report["consumers"]:
        committed = (
            f"checkpoint {consumer['checkpoint_id']}, {_age(consumer['committed_ms'])}"
            if consumer["checkpoint_id"] is not None
            else "never committed"
        )
        print(
            f"  {consumer['name']:<24} lag {consumer['total_lag']:>12,} events   "
            f"oldest unconsumed {_age(consumer['oldest_unconsumed_ms']):>12}   ({committed})"
        )
    print(f"sinks ({len(report['sinks'])}):")
    for sink in report["sinks"]:
        print(
            f"  {sink['sink_id']:<24} epoch {sink['epoch']}  {sink['status']}  "
            f"query {sink['query_id']}  updated {_age(sink['updated_ms'])}  "
            f"(log holds epoch {sink['log_epoch']} at version {sink['log_version']})"
        )
    return 0


def cmd_truncate(args: argparse.Namespace) -> int:
    log = _open(args)
    if args.keep_from is not None:
        requested = parse_offsets_json(args.keep_from, log.shards, "--keep-from")
    elif args.older_than is not None:
        cutoff = now_ms() - duration_ms(args.older_than, "--older-than")
        requested = retention.lows_older_than(log.refresh(), cutoff)
    else:
        requested = retention.consumed_lows(log)
    if args.dry_run:
        plan = retention.plan_truncation(log, requested)
        for blocker in plan.blockers:
            print(f"BLOCKED {blocker}")
        print(
            f"would drop {plan.total_dropped:,} events; new lows {plan.lows or 'unchanged'}"
            + (" (needs --force)" if plan.blockers else "")
        )
        return 1 if plan.blockers and not args.force else 0
    plan, record = retention.truncate(log, requested, force=args.force)
    if record is None:
        print("nothing to truncate: every shard already starts at or after the requested low")
        return 0
    print(
        f"truncated {log.url} at version {record.version}: dropped {plan.total_dropped:,} "
        f"events, removed {len(record.remove)} segments from the log, new lows "
        f"{record.low_watermarks}; 'replog recover' deletes the files after the grace period"
    )
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    log = _open(args)
    report = recovery.recover(
        log, grace_ms=duration_ms(args.grace, "--grace"), dry_run=args.dry_run
    )
    verb = "would resolve" if args.dry_run else "resolved"
    for sink_id, resolution in sorted(report.resolved.items()):
        outcome = "Committed (the log holds it)" if resolution.committed else "rolled back"
        print(f"sink {sink_id}: {verb} Pending epoch {resolution.epoch} -> {outcome}")
    for sink_id, epoch in sorted(report.pending_too_recent.items()):
        print(
            f"sink {sink_id}: Pending epoch {epoch} is younger than --grace {args.grace}; "
            f"left alone (its driver may be committing)"
        )
    print(
        f"{'would delete' if args.dry_run else 'deleted'} {len(report.garbage)} garbage "
        f"segment files older than {args.grace}"
    )
    for relative in report.garbage if args.verbose else []:
        print(f"  {relative}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    log = _open(args)
    if args.dry_run:
        merges = compaction.plan_compaction(log.refresh(), target_bytes=args.target_bytes)
        before = sum(len(merge.sources) for merge in merges)
        print(f"would merge {before} segments into {len(merges)}")
        return 0
    result = compaction.compact(log, target_bytes=args.target_bytes)
    if result.record is None:
        print("nothing to compact")
        return 0
    print(
        f"compacted {log.url} at version {result.record.version}: merged "
        f"{result.segments_before} segments into {len(result.merges)}; 'replog recover' "
        f"deletes the replaced files after the grace period"
    )
    return 0


# -- argument parsing -----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--fs-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="fsspec storage option, e.g. endpoint_url=http://localhost:9000 (repeatable)",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser = argparse.ArgumentParser(
        prog="replog", description="Create, inspect and operate replog replication logs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("create", parents=[common], help="create an empty log")
    p.add_argument("url")
    p.add_argument("--shards", type=int, default=8, help="number of shards (default 8)")
    p.set_defaults(handler=cmd_create)

    p = sub.add_parser("append", parents=[common], help="append JSON lines as one atomic commit")
    p.add_argument("url")
    p.add_argument("file", nargs="?", help="JSON lines file, or - for stdin (default)")
    p.set_defaults(handler=cmd_append)

    p = sub.add_parser("info", parents=[common], help="summarise a log")
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_info)

    p = sub.add_parser("read", parents=[common], help="print events as JSON lines")
    p.add_argument("url")
    p.add_argument("--shard", type=int, help="only this shard")
    p.add_argument("--from", dest="from_seq", type=int, default=1, help="first sequence")
    p.add_argument("--limit", type=int, help="at most this many events")
    p.set_defaults(handler=cmd_read)

    p = sub.add_parser("verify", parents=[common], help="check every checksum")
    p.add_argument("url")
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("manifest", parents=[common], help="inspect checkpoint manifests")
    p.add_argument("action", choices=["list", "show", "validate"])
    p.add_argument("url", help="a manifest store, e.g. LOG/_replog/consumers/NAME")
    p.add_argument("--id", type=int, help="a checkpoint id (default: the latest valid)")
    p.set_defaults(handler=cmd_manifest)

    p = sub.add_parser(
        "consumer",
        parents=[common],
        help="show or set a consumer's committed offsets",
        description="'set' rewrites a consumer's committed offsets. It is safe only while "
        "every query reading as that consumer is stopped; a running query keeps its own "
        "Spark checkpoint and overwrites the manifest on its next commit.",
    )
    p.add_argument("action", choices=["list", "show", "set"])
    p.add_argument("url", help="the log")
    p.add_argument("--consumer", default="default")
    p.add_argument(
        "--offsets", default="earliest", help='for set: earliest, latest, or JSON {"0": 41}'
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_consumer)

    p = sub.add_parser(
        "status", parents=[common], help="consumers (offsets, lag) and sinks (epoch, status)"
    )
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser(
        "truncate",
        parents=[common],
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
    p.set_defaults(handler=cmd_truncate)

    p = sub.add_parser(
        "recover",
        parents=[common],
        help="resolve Pending sink commits and delete orphaned segment files",
        description="Resolve each sink's Pending epoch from the log (committed or rolled "
        "back) and delete segment files no commit references. Anything younger than "
        "--grace is left alone; it must exceed your longest micro-batch.",
    )
    p.add_argument("url")
    p.add_argument("--grace", default="1h", help="age below which nothing is touched (1h)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be done")
    p.set_defaults(handler=cmd_recover)

    p = sub.add_parser(
        "compact",
        parents=[common],
        help="merge small segments of each shard in one atomic commit",
    )
    p.add_argument("url")
    p.add_argument(
        "--target-bytes",
        type=int,
        default=compaction.DEFAULT_TARGET_BYTES,
        help="largest merged segment in bytes (default 64 MiB)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be merged")
    p.set_defaults(handler=cmd_compact)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.handler(args))
    except (ReplogError, FileNotFoundError, ValueError) as exc:
        print(f"replog: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

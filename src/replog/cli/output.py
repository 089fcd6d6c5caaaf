"""How the ``replog`` command shows results: one renderer for text, one for JSON.

Commands compute typed results with the core functions and hand them to an
:class:`Output`; nothing else in the CLI prints results.
"""

from __future__ import annotations

import base64
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import IO, Any

from replog.capture.pgoutput import lsn_to_text
from replog.capture.progress import CaptureProgress
from replog.checkpoints.consumers import ConsumerPosition
from replog.checkpoints.manifest import CheckpointManifest
from replog.format.commits import TXN_QUERY
from replog.ingest import AppendReport
from replog.log import LogInfo
from replog.ops.compaction import CompactionResult
from replog.ops.keys import KeyCompactionResult
from replog.ops.recovery import RecoveryReport
from replog.ops.retention import TruncationPlan
from replog.ops.status import CaptureStatus, ConsumerStatus, LogStatus
from replog.ops.verify import VerifyReport
from replog.schemas.connect import Column
from replog.schemas.registry import SchemaVersion
from replog.timeutil import now_ms


def event_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """An event as ``replog read`` prints it: payloads as text when they are UTF-8."""
    document = {
        name: value for name, value in row.items() if name not in ("data", "before", "timestamp")
    }
    stamp: datetime = row["timestamp"]
    document["timestamp"] = stamp.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    for name in ("data", "before"):
        payload: bytes | None = row.get(name)
        if payload is None:
            document[name] = None
            continue
        try:
            document[name] = payload.decode("utf-8")
        except UnicodeDecodeError:
            document[f"{name}_base64"] = base64.b64encode(payload).decode("ascii")
    return document


def age(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = max((now_ms() - ms) / 1000, 0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.1f}s ago"


def _capture_line(capture: CaptureStatus, server_asked: bool) -> str:
    line = (
        f"at LSN {lsn_to_text(capture.position)} (log version {capture.log_version}, "
        f"{age(capture.committed_ms)})"
    )
    if not server_asked:
        return line + "; lag: give --source-dsn"
    assert capture.server_lsn is not None
    if capture.slot_lsn is None:
        return line + f"; the server has no slot {capture.slot!r}"
    return (
        f"{line}; server at {lsn_to_text(capture.server_lsn)}, lag {capture.lag_bytes:,} bytes, "
        f"slot confirmed {lsn_to_text(capture.slot_lsn)}"
    )


class Output(ABC):
    """Where a command's results go: :class:`TextOutput` for people, :class:`JsonOutput`
    for scripts. Every result has an abstract method, so a renderer that misses one fails
    when it is built, not by printing the other format."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout

    def line(self, text: str = "") -> None:
        print(text, file=self.stream)

    def events(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Events as JSON lines (both renderers: one event per line is what scripts and
        people both read)."""
        for row in rows:
            print(json.dumps(event_json(row), sort_keys=True), file=self.stream, flush=True)

    @abstractmethod
    def created(self, info: LogInfo) -> None: ...

    @abstractmethod
    def appended(self, report: AppendReport) -> None: ...

    @abstractmethod
    def captured(self, url: str, progress: CaptureProgress) -> None: ...

    @abstractmethod
    def snapshot_requested(self, slot: str, tables: list[str], position: int) -> None: ...

    @abstractmethod
    def info(self, info: LogInfo) -> None: ...

    @abstractmethod
    def schemas(self, url: str, versions: list[SchemaVersion]) -> None: ...

    @abstractmethod
    def verified(self, report: VerifyReport) -> None: ...

    @abstractmethod
    def manifests(
        self, url: str, listing: list[tuple[int, CheckpointManifest | str]], latest: int
    ) -> None: ...

    @abstractmethod
    def manifest(self, manifest: CheckpointManifest) -> None: ...

    @abstractmethod
    def validated(self, manifest: CheckpointManifest, problems: list[str]) -> None: ...

    @abstractmethod
    def names(self, names: list[str]) -> None: ...

    @abstractmethod
    def consumer(self, url: str, status: ConsumerStatus) -> None: ...

    @abstractmethod
    def consumer_set(
        self, name: str, before: dict[int, int], after: dict[int, int], executed: bool
    ) -> None: ...

    @abstractmethod
    def consumer_deleted(
        self, name: str, position: ConsumerPosition | None, executed: bool
    ) -> None: ...

    @abstractmethod
    def status(self, report: LogStatus) -> None: ...

    @abstractmethod
    def truncation_plan(self, plan: TruncationPlan, force: bool) -> None: ...

    @abstractmethod
    def truncated(
        self, url: str, plan: TruncationPlan, version: int | None, removed: int
    ) -> None: ...

    @abstractmethod
    def recovered(self, report: RecoveryReport, grace: str, verbose: bool) -> None: ...

    @abstractmethod
    def compacted(self, url: str, result: CompactionResult, dry_run: bool) -> None: ...

    @abstractmethod
    def key_compacted(self, url: str, result: KeyCompactionResult, dry_run: bool) -> None: ...


class TextOutput(Output):
    """Text output (for people)."""

    def created(self, info: LogInfo) -> None:
        self.line(f"created {info.url} with {info.shards} shards")

    def appended(self, report: AppendReport) -> None:
        skipped = ", ".join(f"{count} {kind}" for kind, count in sorted(report.skipped.items()))
        if report.already_applied:
            assert report.transaction is not None
            self.line(
                f"nothing appended: transaction {report.transaction.app_id} version "
                f"{report.transaction.version} is already in {report.url}"
            )
        elif report.record is None:
            self.line("nothing to append (no new events in the input)")
        else:
            self.line(
                f"appended {report.events} events to {report.url} as version "
                f"{report.record.version} ({len(report.record.add)} segments)"
            )
        dropped = [
            f"{report.duplicates} duplicates of earlier lines" if report.duplicates else "",
            f"{report.behind} events at or before the source position already in the log"
            if report.behind
            else "",
        ]
        if any(dropped):
            self.line("not appended: " + ", ".join(d for d in dropped if d))
        if report.transaction is not None and report.record is not None:
            self.line(
                f"recorded {report.transaction.app_id} at version {report.transaction.version}"
            )
        if report.transactions or report.partial_transactions:
            self.line(
                f"{report.transactions} whole source transactions"
                + (
                    f"; part of {len(report.partial_transactions)} more "
                    f"({', '.join(report.partial_transactions[:3])})"
                    if report.partial_transactions
                    else ""
                )
            )
        if skipped:
            self.line(f"skipped {skipped}")

    def schemas(self, url: str, versions: list[SchemaVersion]) -> None:
        if not versions:
            self.line(f"no schemas registered in {url}")
        for version in versions:
            stamp = datetime.fromtimestamp(version.registered_ms / 1000, timezone.utc)
            self.line(
                f"{version.collection}  version {version.digest}  "
                f"(registered {stamp:%Y-%m-%d %H:%M:%S}Z)"
            )
            for column in version.columns():
                self._column(column, "  ")

    def _column(self, column: Column, indent: str) -> None:
        logical = f"  {column.logical}" if column.logical else ""
        optional = "" if column.optional else "  not null"
        kind = f"{column.type!s:<28} {column.connect}"
        self.line(f"{indent}{column.name:<20} {kind}{logical}{optional}")
        if column.connect == "struct":
            for child in column.children:
                self._column(child, indent + "  ")

    def snapshot_requested(self, slot: str, tables: list[str], position: int) -> None:
        self.line(
            f"asked the capture of slot {slot} to snapshot {', '.join(tables)} "
            f"(signal at LSN {lsn_to_text(position)})"
        )

    def captured(self, url: str, progress: CaptureProgress) -> None:
        self.line(
            f"captured {progress.rows} rows ({progress.snapshot_rows} in the snapshot) of "
            f"{progress.transactions} transactions into {url} in {progress.commits} commits; "
            f"position {progress.to_json()['position']}"
            + (
                f" ({progress.skipped_transactions} transactions were already in the log)"
                if progress.skipped_transactions
                else ""
            )
        )
        if progress.skipped_truncations:
            self.line(
                f"warning: {progress.skipped_truncations} TRUNCATE(s) of captured tables were "
                f"not captured (see the log messages): tables built from the log keep those rows"
            )

    def info(self, info: LogInfo) -> None:
        self.line(f"log        {info.url}")
        self.line(f"log id     {info.log_id} (format version {info.format_version})")
        self.line(f"shards     {info.shards}")
        self.line(f"version    {info.version}")
        self.line(f"events     {info.events}")
        self.line(f"segments   {info.segments} in {info.files} files ({info.bytes:,} bytes)")
        self.line(
            f"retention  {info.retention_ms / 3_600_000:g} h (history kept from version "
            f"{info.retained_from}); automatic merges {'on' if info.auto_compact else 'off'}"
        )
        for shard, head in info.heads.items():
            low = info.lows[shard]
            held = f"sequences {low}..{head}" if head >= low else "empty"
            dropped = f" (1..{low - 1} removed by retention)" if low > 1 else ""
            self.line(f"  shard {shard:>4}: {held}{dropped}")
        for sink, mark in info.sinks.items():
            if mark["query_id"] == TXN_QUERY:
                self.line(f"transaction {sink}: version {mark['epoch']}")
            else:
                self.line(f"sink {sink}: epoch {mark['epoch']} of query {mark['query_id']}")

    def verified(self, report: VerifyReport) -> None:
        for problem in report.problems:
            self.line(f"BAD {problem}")
        if report.ok:
            self.line(
                f"ok: {report.commits} commits, {report.snapshots} snapshots, "
                f"{report.segments} segments ({report.events} events), {report.manifests} "
                f"manifests"
            )
        else:
            print(f"{len(report.problems)} problem(s) found in {report.url}", file=sys.stderr)

    def manifests(
        self, url: str, listing: list[tuple[int, CheckpointManifest | str]], latest: int
    ) -> None:
        for checkpoint_id, found in listing:
            if isinstance(found, CheckpointManifest):
                stamp = datetime.fromtimestamp(found.timestamp_ms / 1000, timezone.utc)
                summary = f"epoch {found.epoch}  {stamp:%Y-%m-%d %H:%M:%S}Z"
            else:
                summary = f"UNREADABLE: {found}"
            marker = "*" if checkpoint_id == latest else " "
            self.line(f"{marker} {checkpoint_id:>8}  {summary}")
        if not listing:
            self.line(f"no manifests in {url}")

    def manifest(self, manifest: CheckpointManifest) -> None:
        self.line(json.dumps(manifest.to_json(), indent=2, sort_keys=True))

    def validated(self, manifest: CheckpointManifest, problems: list[str]) -> None:
        for problem in problems:
            self.line(f"INVALID checkpoint {manifest.checkpoint_id}: {problem}")
        if not problems:
            self.line(f"ok: checkpoint {manifest.checkpoint_id} is valid")

    def names(self, names: list[str]) -> None:
        for name in names:
            self.line(name)

    def consumer(self, url: str, status: ConsumerStatus) -> None:
        state = (
            "never committed"
            if status.checkpoint_id is None
            else f"checkpoint {status.checkpoint_id}, {age(status.committed_ms)}"
        )
        self.line(f"consumer {status.name} of {url}: {state}")
        for shard, offset in status.offsets.items():
            self.line(
                f"  shard {shard:>4}: committed {offset:>10}  head {status.heads[shard]:>10}  "
                f"lag {status.lag_events[shard]:>10}"
            )
        self.line(f"  total lag {status.total_lag} events")

    def consumer_set(
        self, name: str, before: dict[int, int], after: dict[int, int], executed: bool
    ) -> None:
        self.line(f"consumer {name}:")
        for shard in sorted(after):
            old = before.get(shard)
            self.line(
                f"  shard {shard:>4}: {'-' if old is None else old:>10} -> {after[shard]:>10}"
            )
        if executed:
            self.line("offsets set")
        else:
            self.line("dry run: nothing changed; add --execute to set these offsets")

    def consumer_deleted(
        self, name: str, position: ConsumerPosition | None, executed: bool
    ) -> None:
        where = f" (committed {position.offsets})" if position else ""
        if executed:
            self.line(f"deleted consumer {name}{where}")
        else:
            self.line(f"dry run: would delete consumer {name}{where}; add --execute")

    def status(self, report: LogStatus) -> None:
        self.line(f"log {report.url}: version {report.version}, {report.events:,} events retained")
        self.line(f"consumers ({len(report.consumers)}):")
        for consumer in report.consumers:
            committed = (
                f"checkpoint {consumer.checkpoint_id}, {age(consumer.committed_ms)}"
                if consumer.checkpoint_id is not None
                else "never committed"
            )
            self.line(
                f"  {consumer.name:<24} lag {consumer.total_lag:>12,} events   "
                f"oldest unconsumed {age(consumer.oldest_unconsumed_ms):>12}   ({committed})"
            )
        self.line(f"sinks ({len(report.sinks)}):")
        for sink in report.sinks:
            self.line(
                f"  {sink.sink_id:<24} epoch {sink.epoch}  {sink.status}  query {sink.query_id}  "
                f"updated {age(sink.updated_ms)}  (log holds epoch {sink.log_epoch} at version "
                f"{sink.log_version})"
            )
        if report.transactions:
            self.line(f"transactions ({len(report.transactions)}):")
            for app_id, version in sorted(report.transactions.items()):
                self.line(f"  {app_id:<24} version {version}")
        if report.captures:
            self.line(f"captures ({len(report.captures)}):")
            for capture in report.captures:
                self.line(f"  {capture.slot:<24} {_capture_line(capture, report.server_asked)}")

    def truncation_plan(self, plan: TruncationPlan, force: bool) -> None:
        for blocker in plan.blockers:
            self.line(f"BLOCKED {blocker}")
        self.line(
            f"would drop {plan.total_dropped:,} events; new lows {plan.lows or 'unchanged'}"
            + (" (needs --force)" if plan.blockers and not force else "")
        )

    def truncated(self, url: str, plan: TruncationPlan, version: int | None, removed: int) -> None:
        if version is None:
            self.line(
                "nothing to truncate: every shard already starts at or after the requested low"
            )
            return
        self.line(
            f"truncated {url} at version {version}: dropped {plan.total_dropped:,} events, "
            f"removed {removed} segments from the log, new lows {plan.lows}; "
            f"'replog recover' deletes the files after the grace period"
        )

    def recovered(self, report: RecoveryReport, grace: str, verbose: bool) -> None:
        verb = "would resolve" if report.dry_run else "resolved"
        for sink_id, resolution in sorted(report.resolved.items()):
            outcome = "Committed (the log holds it)" if resolution.committed else "rolled back"
            self.line(f"sink {sink_id}: {verb} Pending epoch {resolution.epoch} -> {outcome}")
        for sink_id, epoch in sorted(report.pending_too_recent.items()):
            self.line(
                f"sink {sink_id}: Pending epoch {epoch} is younger than --grace {grace}; "
                f"left alone (its driver may be committing)"
            )
        kept = report.scan
        self.line(
            f"{'would delete' if report.dry_run else 'deleted'} {len(report.garbage)} garbage "
            f"segment files older than {grace} (kept: {kept.kept_young} young, "
            f"{kept.kept_leased} under a staging lease, {kept.kept_removed_recently} recently "
            f"removed, {kept.kept_pending} named by a Pending commit)"
        )
        for relative in report.garbage if verbose else []:
            self.line(f"  {relative}")

    def compacted(self, url: str, result: CompactionResult, dry_run: bool) -> None:
        if dry_run:
            self.line(f"would merge {result.segments_before} segments into {len(result.merges)}")
        elif result.record is None:
            self.line("nothing to compact")
        else:
            self.line(
                f"compacted {url} at version {result.record.version}: merged "
                f"{result.segments_before} segments into {result.segments_after}; the replaced "
                f"files are deleted after the log's retention"
            )

    def key_compacted(self, url: str, result: KeyCompactionResult, dry_run: bool) -> None:
        points = ", ".join(f"{s}:{p}" for s, p in sorted(result.cleaner_points.items()))
        who = (
            f"{len(result.consumers)} registered consumers" if result.consumers else "no consumers"
        )
        self.line(f"cleaner points (shard:sequence, {who}): {points}")
        if not result.shards:
            self.line("nothing to compact: no event below the cleaner points is superseded")
            return
        verb = "would keep" if dry_run else "kept"
        for shard in result.shards:
            self.line(
                f"  shard {shard.shard} sequences {shard.first}..{shard.last}: {verb} "
                f"{shard.events_after} of {shard.events_before} events "
                f"({shard.deletes_dropped} old deletes dropped)"
            )
        if result.record is not None:
            self.line(
                f"key-compacted {url} at version {result.record.version}: "
                f"{result.events_before} events -> {result.events_after}; sequences keep "
                f"their values, the replaced files are deleted after the log's retention"
            )


class JsonOutput(Output):
    """One JSON document per result (for scripts and monitoring agents)."""

    def document(self, document: Any) -> None:
        print(json.dumps(document, sort_keys=True), file=self.stream)

    def created(self, info: LogInfo) -> None:
        self.document(info.to_json())

    def appended(self, report: AppendReport) -> None:
        self.document(report.to_json())

    def captured(self, url: str, progress: CaptureProgress) -> None:
        self.document({"url": url, **progress.to_json()})

    def snapshot_requested(self, slot: str, tables: list[str], position: int) -> None:
        self.document({"slot": slot, "tables": tables, "signal_lsn": lsn_to_text(position)})

    def info(self, info: LogInfo) -> None:
        self.document(info.to_json())

    def schemas(self, url: str, versions: list[SchemaVersion]) -> None:
        self.document({"url": url, "versions": [version.to_json() for version in versions]})

    def verified(self, report: VerifyReport) -> None:
        self.document(report.to_json())

    def manifests(
        self, url: str, listing: list[tuple[int, CheckpointManifest | str]], latest: int
    ) -> None:
        self.document(
            [
                {
                    "checkpoint_id": checkpoint_id,
                    "latest": checkpoint_id == latest,
                    "manifest": found.to_json() if isinstance(found, CheckpointManifest) else None,
                    "error": found if isinstance(found, str) else None,
                }
                for checkpoint_id, found in listing
            ]
        )

    def manifest(self, manifest: CheckpointManifest) -> None:
        self.document(manifest.to_json())

    def validated(self, manifest: CheckpointManifest, problems: list[str]) -> None:
        self.document({"checkpoint_id": manifest.checkpoint_id, "problems": problems})

    def names(self, names: list[str]) -> None:
        self.document(names)

    def consumer(self, url: str, status: ConsumerStatus) -> None:
        self.document(status.to_json(now_ms()))

    def consumer_set(
        self, name: str, before: dict[int, int], after: dict[int, int], executed: bool
    ) -> None:
        self.document(
            {
                "consumer": name,
                "executed": executed,
                "before": {str(s): v for s, v in sorted(before.items())},
                "after": {str(s): v for s, v in sorted(after.items())},
            }
        )

    def consumer_deleted(
        self, name: str, position: ConsumerPosition | None, executed: bool
    ) -> None:
        self.document(
            {
                "consumer": name,
                "executed": executed,
                "position": position.to_json() if position else None,
            }
        )

    def status(self, report: LogStatus) -> None:
        self.document(report.to_json())

    def truncation_plan(self, plan: TruncationPlan, force: bool) -> None:
        self.document(plan.to_json())

    def truncated(self, url: str, plan: TruncationPlan, version: int | None, removed: int) -> None:
        self.document({**plan.to_json(), "version": version, "segments_removed": removed})

    def recovered(self, report: RecoveryReport, grace: str, verbose: bool) -> None:
        self.document(report.to_json())

    def compacted(self, url: str, result: CompactionResult, dry_run: bool) -> None:
        self.document(result.to_json(dry_run))

    def key_compacted(self, url: str, result: KeyCompactionResult, dry_run: bool) -> None:
        self.document(result.to_json(dry_run))

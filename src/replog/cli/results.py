"""What each ``replog`` command reports, described once per result.

A result is the JSON document that ``--json`` prints (valid against the command's schema,
shipped in ``replog/cli/json_schemas/`` and listed in docs/OPERATIONS.md, "JSON output")
together with its text for people, which is read from that same document: the two
renderings cannot disagree, and a field added to a document is one place to change (as
pyiceberg's ``cli/output.py`` derives its console and JSON siblings from one model).

Conventions of every document: an object; times as ms since the epoch (``*_ms``); a
PostgreSQL LSN as its text, ``"0/16B3748"`` (``lsn``, ``*_lsn``), never as a number;
per-shard maps keyed by the shard number as a string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar

from replog.capture.options import capture_slot
from replog.capture.pgoutput import lsn_to_text
from replog.capture.progress import CaptureProgress
from replog.checkpoints.consumers import ConsumerPosition
from replog.checkpoints.manifest import CheckpointManifest
from replog.format.commits import TXN_QUERY
from replog.ingest import AppendReport
from replog.log import LogInfo
from replog.ops.compaction import CompactionResult
from replog.ops.history import LogHistory
from replog.ops.keys import KeyCompactionResult
from replog.ops.recovery import RecoveryReport
from replog.ops.retention import TruncationPlan
from replog.ops.status import ConsumerStatus, LogStatus
from replog.ops.verify import VerifyReport
from replog.schemas.registry import SchemaVersion
from replog.timeutil import now_ms

if TYPE_CHECKING:  # psycopg is the 'postgres' extra's: the CLI works without it
    from replog.capture.slots import ServerSlots, SlotState


def age(ms: int | None) -> str:
    """How long ago ``ms`` was, in words (``1.5m ago``); ``-`` for None."""
    if ms is None:
        return "-"
    seconds = max((now_ms() - ms) / 1000, 0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.1f}s ago"


def duration(ms: int) -> str:
    """A duration as the CLI's options write it (``7200000`` -> ``2h``)."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def utc(ms: int) -> str:
    """``2025-01-01 00:00:00Z``."""
    return f"{datetime.fromtimestamp(ms / 1000, timezone.utc):%Y-%m-%d %H:%M:%S}Z"


def shard_map(values: Mapping[str, int]) -> str:
    """``{"0": 4, "1": 3}`` as ``0:4, 1:3``."""
    return ", ".join(f"{shard}:{value}" for shard, value in values.items()) or "-"


def _shards(values: Mapping[int, int]) -> dict[str, int]:
    return {str(shard): value for shard, value in sorted(values.items())}


class Result:
    """One command's result: :attr:`document` is what ``--json`` prints; :meth:`lines` its
    text, read from the document. :attr:`schema` names the JSON Schema the document is
    valid against (``replog/cli/json_schemas/<schema>.json``)."""

    schema: ClassVar[str]
    kinds: ClassVar[dict[str, type[Result]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        Result.kinds[cls.schema] = cls

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def lines(self, verbose: bool = False) -> Iterator[str]:
        """The result in words, one line at a time (stdout)."""
        raise NotImplementedError

    def notes(self) -> Iterator[str]:
        """Lines for stderr in text mode (a summary of problems); none by default."""
        return iter(())


# -- create / info / append / capture / schemas ------------------------------------------


def _info_document(info: LogInfo) -> dict[str, Any]:
    document = info.to_json()
    for app_id, mark in document["sinks"].items():
        if mark["query_id"] == TXN_QUERY and capture_slot(app_id) is not None:
            mark["lsn"] = lsn_to_text(mark["epoch"])
    return document


class Created(Result):
    schema = "create"

    @classmethod
    def of(cls, info: LogInfo) -> Created:
        return cls(_info_document(info))

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield f"created {d['url']} with {d['shards']} shards"


class Info(Result):
    schema = "info"

    @classmethod
    def of(cls, info: LogInfo) -> Info:
        return cls(_info_document(info))

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield f"log        {d['url']}"
        yield f"log id     {d['log_id']} (format version {d['format_version']})"
        yield f"shards     {d['shards']}"
        yield f"version    {d['version']}"
        yield f"events     {d['events']}"
        yield f"segments   {d['segments']} in {d['files']} files ({d['bytes']:,} bytes)"
        yield (
            f"retention  {d['retention_ms'] / 3_600_000:g} h (history kept from version "
            f"{d['retained_from']}); automatic merges {'on' if d['auto_compact'] else 'off'}"
        )
        for shard, head in d["heads"].items():
            low = d["lows"][shard]
            held = f"sequences {low}..{head}" if head >= low else "empty"
            dropped = f" (1..{low - 1} removed by retention)" if low > 1 else ""
            yield f"  shard {shard:>4}: {held}{dropped}"
        for sink, mark in d["sinks"].items():
            if "lsn" in mark:
                yield f"capture {capture_slot(sink)}: LSN {mark['lsn']}"
            elif mark["query_id"] == TXN_QUERY:
                yield f"transaction {sink}: version {mark['epoch']}"
            else:
                yield f"sink {sink}: epoch {mark['epoch']} of query {mark['query_id']}"


class Appended(Result):
    schema = "append"

    @classmethod
    def of(cls, report: AppendReport) -> Appended:
        return cls(report.to_json())

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        transaction = d["transaction"]
        if d["already_applied"]:
            yield (
                f"nothing appended: transaction {transaction['app_id']} version "
                f"{transaction['version']} is already in {d['url']}"
            )
        elif d["version"] is None:
            yield "nothing to append (no new events in the input)"
        else:
            yield (
                f"appended {d['events']} events to {d['url']} as version {d['version']} "
                f"({d['segments']} segments)"
            )
        dropped = [
            f"{d['duplicates']} duplicates of earlier lines" if d["duplicates"] else "",
            f"{d['behind_source_position']} events at or before the source position already "
            f"in the log"
            if d["behind_source_position"]
            else "",
        ]
        if any(dropped):
            yield "not appended: " + ", ".join(item for item in dropped if item)
        if transaction is not None and d["version"] is not None:
            yield f"recorded {transaction['app_id']} at version {transaction['version']}"
        partial = d["partial_source_transactions"]
        if d["source_transactions"] or partial:
            more = f"; part of {len(partial)} more ({', '.join(partial[:3])})" if partial else ""
            yield f"{d['source_transactions']} whole source transactions{more}"
        if d["skipped"]:
            yield "skipped " + ", ".join(f"{n} {kind}" for kind, n in d["skipped"].items())
        if d["unkeyed"] and d["version"] is not None:
            yield (
                f"{d['unkeyed']} events had no key: each is keyed by its event_id (no order "
                f"with other events)"
            )
        if d["without_source_position"] and d["version"] is not None:
            yield (
                f"{d['without_source_position']} events had no usable source position: "
                f"appended without redelivery detection"
            )


def captured_line(document: dict[str, Any], position: str) -> str:
    """What a capture captured, as its summary's first line says it (either database)."""
    d = document
    skipped = (
        f" ({d['skipped_transactions']} transactions were already in the log)"
        if d["skipped_transactions"]
        else ""
    )
    return (
        f"captured {d['rows']} rows ({d['snapshot_rows']} in the snapshot) of "
        f"{d['transactions']} transactions into {d['url']} in {d['commits']} commits; "
        f"position {position}{skipped}"
    )


def skipped_truncations_lines(document: dict[str, Any]) -> Iterator[str]:
    """The warning of a capture that left TRUNCATEs out (``--skip-truncate``)."""
    if document["skipped_truncations"]:
        yield (
            f"warning: {document['skipped_truncations']} TRUNCATE(s) of captured tables were "
            f"not captured (see the log messages): tables built from the log keep those rows"
        )


def table_event_lines(tables: dict[str, dict[str, int]]) -> Iterator[str]:
    """A capture's events per table and operation (``--json``'s ``tables``), a line each."""
    for table, operations in tables.items():
        counts = ", ".join(f"{number:,} {operation}" for operation, number in operations.items())
        yield f"  {table}: {counts}"


class Captured(Result):
    schema = "capture"

    @classmethod
    def of(
        cls,
        url: str,
        progress: CaptureProgress,
        slot: str | None = None,
        drop_command: str | None = None,
        metrics_port: int | None = None,
    ) -> Captured:
        """``drop_command``: how to drop the slot (``replog slots drop DSN SLOT``), said
        when the capture did not drop it; ``metrics_port``: the port ``--metrics-port``
        bound (0 asks for any free one)."""
        return cls(
            {
                "url": url,
                "slot": slot,
                **progress.to_json(),
                "slot_drop_command": None if progress.slot_dropped else drop_command,
                "metrics_port": metrics_port,
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield captured_line(d, d["lsn"])
        yield from table_event_lines(d["tables"])
        if d["truncations"] or d["heartbeats"]:
            yield f"{d['truncations']} TRUNCATE(s) captured, {d['heartbeats']} heartbeats written"
        yield from skipped_truncations_lines(d)
        if d["slot_dropped"]:
            publication = d["publication_dropped"]
            also = f" and its publication {publication}" if publication else ""
            yield (
                f"dropped the replication slot{also}: the server no longer keeps WAL for "
                f"this capture"
            )
        elif d["slot"] is not None:
            kept = d["retained_wal_bytes"]
            amount = f"{kept:,} bytes of WAL" if kept is not None else "WAL"
            yield (
                f"slot {d['slot']} keeps {amount} on the server (wal_status "
                f"{d['slot_wal_status'] or 'unknown'}), growing with every write until a "
                f"capture reads it again"
                + (
                    f"; if none will, drop it: {d['slot_drop_command']}"
                    if d["slot_drop_command"]
                    else ""
                )
            )


def _slot_state(slot: Mapping[str, Any]) -> str:
    """Who reads the slot, in words."""
    holder = slot["holder"]
    if holder is not None:
        who = holder["application_name"] or "a session"
        return f"captured by {who} (server process {holder['pid']}, from {holder['client']})"
    if slot["active_pid"] is not None:
        return f"read now by server process {slot['active_pid']}"
    released = slot["inactive_since_ms"]
    return "not read" + (f", last released {age(released)}" if released is not None else "")


class Slots(Result):
    """``replog slots DSN``: the server's logical replication slots."""

    schema = "slots"

    @classmethod
    def of(cls, found: ServerSlots) -> Slots:
        return cls(found.to_json())

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        limit = d["max_slot_wal_keep_size"]
        yield (
            f"server at {d['server_lsn']}, max_slot_wal_keep_size "
            f"{'unlimited' if limit == '-1' else limit}; {len(d['slots'])} logical slot(s)"
        )
        for slot in d["slots"]:
            yield (
                f"{slot['name']}  database {slot['database']}, {slot['plugin']}"
                f"{', temporary' if slot['temporary'] else ''}: {_slot_state(slot)}"
            )
            owner = slot["owner"]
            if owner is not None:
                yield f"    owner     log {owner.get('log', '?')} (id {owner['log_id']})"
            elif slot["owner_note"] is not None:
                yield f"    owner     unknown: {slot['owner_note']}"
            else:
                yield "    owner     no replog log (another tool's slot, or an older replog's)"
            lag_s = slot["lag_s"]
            seconds = (
                f"{lag_s:,.1f}s behind (oldest unconfirmed commit)"
                if lag_s is not None
                else f"seconds behind unknown: {slot['lag_note']}"
            )
            lag = "-" if slot["lag_bytes"] is None else f"{slot['lag_bytes']:,}"
            yield f"    confirmed {slot['confirmed_lsn']}: {lag} bytes of WAL behind; {seconds}"
            kept = "-" if slot["retained_wal_bytes"] is None else f"{slot['retained_wal_bytes']:,}"
            safe = (
                f", {slot['safe_wal_bytes']:,} bytes before it is at risk"
                if slot["safe_wal_bytes"] is not None
                else ""
            )
            lost = f", INVALIDATED ({slot['invalidation']})" if slot["invalidation"] else ""
            yield f"    keeps     {kept} bytes of WAL (wal_status {slot['wal_status']}{safe}{lost})"


class SlotDropped(Result):
    """``replog slots drop DSN NAME``."""

    schema = "slots-drop"

    @classmethod
    def of(cls, slot: SlotState, *, dropped: bool, publication: str | None = None) -> SlotDropped:
        """``slot``: as it was before the drop."""
        return cls(
            {
                "slot": slot.name,
                "database": slot.database,
                "dropped": dropped,
                "owner": slot.owner,
                "publication_dropped": publication,
                "retained_wal_bytes": slot.retained_bytes,
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        if not d["dropped"]:
            yield f"slot {d['slot']} not dropped"
            return
        also = (
            f" and capture's own publication {d['publication_dropped']}"
            if d["publication_dropped"]
            else ""
        )
        kept = d["retained_wal_bytes"]
        freed = f" (it kept {kept:,} bytes of WAL)" if kept is not None else ""
        yield (
            f"dropped slot {d['slot']}{also} in database {d['database']}{freed}: the server "
            f"frees the WAL at its next checkpoint"
        )
        owner = d["owner"]
        if owner is not None:
            yield (
                f"the capture of log {owner.get('log', '?')} can no longer resume; a capture "
                f"into a new slot starts over with a snapshot"
            )


class SnapshotRequested(Result):
    schema = "snapshot"

    @classmethod
    def of(
        cls, slot: str, tables: Sequence[str], position: int, signal_id: str
    ) -> SnapshotRequested:
        return cls(
            {
                "slot": slot,
                "tables": list(tables),
                "signal_id": signal_id,
                "signal_lsn": lsn_to_text(position),
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield (
            f"asked the capture of slot {d['slot']} to snapshot {', '.join(d['tables'])} "
            f"(signal {d['signal_id']} at LSN {d['signal_lsn']})"
        )


class Schemas(Result):
    schema = "schemas"

    @classmethod
    def of(cls, url: str, versions: Sequence[SchemaVersion]) -> Schemas:
        return cls({"url": url, "versions": [version.to_json() for version in versions]})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        if not d["versions"]:
            yield f"no schemas registered in {d['url']}"
        for version in d["versions"]:
            yield (
                f"{version['collection']}  version {version['version']}  "
                f"(registered {utc(version['registered_ms'])})"
            )
            yield from _columns(version["fields"], "  ")


def _columns(fields: list[dict[str, Any]], indent: str) -> Iterator[str]:
    for column in fields:
        logical = f"  {column['logical']}" if column["logical"] else ""
        optional = "" if column["optional"] else "  not null"
        kind = f"{column['type']:<28} {column['connect']}"
        yield f"{indent}{column['name']:<20} {kind}{logical}{optional}"
        if column["connect"] == "struct":
            yield from _columns(column.get("fields", []), indent + "  ")


# -- verify / history ---------------------------------------------------------------------


class Verified(Result):
    schema = "verify"

    @classmethod
    def of(cls, report: VerifyReport) -> Verified:
        return cls(report.to_json())

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        for problem in d["problems"]:
            yield f"BAD {problem['path']}: {problem['message']}"
        if d["ok"]:
            checked = d["checked"]
            yield (
                f"ok: {checked['commits']} commits, {checked['snapshots']} snapshots, "
                f"{checked['segments']} segments ({d['events']} events), "
                f"{checked['manifests']} manifests"
            )

    def notes(self) -> Iterator[str]:
        if not self.document["ok"]:
            yield f"{len(self.document['problems'])} problem(s) found in {self.document['url']}"


def _capture_writer(capture: dict[str, Any]) -> str:
    if capture.get("source") == "mysql":
        return f"mysql capture {capture['name']} at position {capture['version']}"
    return f"slot {capture['slot']} at LSN {capture['lsn']}"


def _writer(commit: dict[str, Any]) -> str:
    if commit["capture"] is not None:
        return _capture_writer(commit["capture"])
    if commit["transaction"] is not None:
        return f"app {commit['transaction']['app_id']} version {commit['transaction']['version']}"
    if commit["sink"] is not None:
        return f"sink {commit['sink']['sink_id']} epoch {commit['sink']['epoch']}"
    if commit["gc_cutoff_ms"] is not None:
        return f"files staged before {utc(commit['gc_cutoff_ms'])}"
    if commit["low_watermarks"]:
        return f"lows {shard_map(commit['low_watermarks'])}"
    return "-"


class History(Result):
    schema = "history"

    @classmethod
    def of(cls, history: LogHistory, as_of: dict[str, Any] | None = None) -> History:
        """``as_of``: which points reads as of can be given (:mod:`replog.ops.reach`)."""
        return cls({**history.to_json(), **({"as_of": as_of} if as_of is not None else {})})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield (
            f"{'version':>8}  {'time (UTC)':<20}  {'operation':<11}  {'events':>13}  "
            f"{'files':>9}  writer"
        )
        for commit in d["commits"]:
            events = f"+{commit['events_added']} -{commit['events_removed']}"
            files = f"+{commit['files_added']} -{commit['files_removed']}"
            yield (
                f"{commit['version']:>8}  {utc(commit['timestamp_ms']):<20}  "
                f"{commit['kind']:<11}  {events:>13}  {files:>9}  {_writer(commit)}"
            )
        oldest = d["commits"][-1]["version"] if d["commits"] else d["version"] + 1
        if oldest > max(d["retained_from"], 1):
            yield f"({oldest - 1} older commits not shown: --limit)"
        elif d["retained_from"] > 1:
            yield (
                f"(commits before version {d['retained_from']} expired with the log's retention)"
            )
        if "as_of" in d:
            yield from _as_of_lines(d["as_of"])


def _reach(found: Mapping[str, Any]) -> str:
    """A reach (``replog.tables.as_of.Reach``) in words: from which point to which."""
    oldest = (
        "the beginning"
        if found["from_beginning"]
        else " / ".join(
            p
            for p in (
                found["oldest_lsn"],
                utc(found["oldest_ms"]) if found["oldest_ms"] is not None else None,
            )
            if p
        )
        or "-"
    )
    newest = " / ".join(
        p
        for p in (
            found["newest_lsn"],
            utc(found["newest_ms"]) if found["newest_ms"] is not None else None,
        )
        if p
    )
    return f"from {oldest} to {newest or '-'}"


def _as_of_lines(as_of: Mapping[str, Any]) -> Iterator[str]:
    """Which points reads as of can be given (``replog.ops.reach``)."""
    yield "readable as of (LSN / time):"
    log = as_of["log"]
    yield "  log alone (view=latest): " + (
        _reach(log) if log is not None else "no point: retention removed its first events"
    )
    for replica in as_of["replicas"]:
        yield f"  {replica['path']} (version {replica['version']}): {_reach(replica)}"


# -- manifests and consumers --------------------------------------------------------------


class Manifests(Result):
    schema = "manifest-list"

    @classmethod
    def of(
        cls,
        url: str,
        listing: Sequence[tuple[int, CheckpointManifest | str]],
        latest: int | None,
        hint: str | None = None,
    ) -> Manifests:
        return cls(
            {
                "url": url,
                "latest": latest if listing else None,
                "manifests": [
                    {
                        "checkpoint_id": checkpoint_id,
                        "latest": checkpoint_id == latest,
                        "epoch": found.epoch if isinstance(found, CheckpointManifest) else None,
                        "timestamp_ms": (
                            found.timestamp_ms if isinstance(found, CheckpointManifest) else None
                        ),
                        "manifest": (
                            found.to_json() if isinstance(found, CheckpointManifest) else None
                        ),
                        "error": found if isinstance(found, str) else None,
                    }
                    for checkpoint_id, found in listing
                ],
                "hint": hint,
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        for entry in d["manifests"]:
            if entry["error"] is None:
                summary = f"epoch {entry['epoch']}  {utc(entry['timestamp_ms'])}"
            else:
                summary = f"UNREADABLE: {entry['error']}"
            marker = "*" if entry["latest"] else " "
            yield f"{marker} {entry['checkpoint_id']:>8}  {summary}"
        if not d["manifests"]:
            yield f"no manifests in {d['url']}"
        if d["hint"]:
            yield d["hint"]


class Manifest(Result):
    schema = "manifest-show"

    @classmethod
    def of(cls, manifest: CheckpointManifest) -> Manifest:
        return cls(manifest.to_json())

    def lines(self, verbose: bool = False) -> Iterator[str]:
        yield json.dumps(self.document, indent=2, sort_keys=True)


class Validated(Result):
    schema = "manifest-validate"

    @classmethod
    def of(cls, manifest: CheckpointManifest, problems: Sequence[str]) -> Validated:
        return cls(
            {
                "checkpoint_id": manifest.checkpoint_id,
                "valid": not problems,
                "problems": list(problems),
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        for problem in d["problems"]:
            yield f"INVALID checkpoint {d['checkpoint_id']}: {problem}"
        if d["valid"]:
            yield f"ok: checkpoint {d['checkpoint_id']} is valid"


class Consumers(Result):
    schema = "consumer-list"

    @classmethod
    def of(cls, url: str, names: Sequence[str]) -> Consumers:
        return cls({"url": url, "consumers": list(names)})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        yield from self.document["consumers"]


def _consumer_document(status: ConsumerStatus) -> dict[str, Any]:
    return status.to_json(now_ms())


class Consumer(Result):
    schema = "consumer-show"

    @classmethod
    def of(cls, url: str, status: ConsumerStatus) -> Consumer:
        return cls({"url": url, **_consumer_document(status)})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        state = (
            "never committed"
            if d["checkpoint_id"] is None
            else f"checkpoint {d['checkpoint_id']}, {age(d['committed_ms'])}"
        )
        yield f"consumer {d['name']} of {d['url']}: {state}"
        for shard, offset in d["offsets"].items():
            yield (
                f"  shard {shard:>4}: committed {offset:>10}  head {d['heads'][shard]:>10}  "
                f"lag {d['lag_events'][shard]:>10}"
            )
        yield f"  total lag {d['total_lag']} events"


class ConsumerSet(Result):
    schema = "consumer-set"

    @classmethod
    def of(
        cls,
        url: str,
        name: str,
        before: Mapping[int, int],
        after: Mapping[int, int],
        executed: bool,
    ) -> ConsumerSet:
        return cls(
            {
                "url": url,
                "consumer": name,
                "executed": executed,
                "before": _shards(before),
                "after": _shards(after),
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield f"consumer {d['consumer']}:"
        for shard, offset in d["after"].items():
            old = d["before"].get(shard, "-")
            yield f"  shard {shard:>4}: {old:>10} -> {offset:>10}"
        if d["executed"]:
            yield "offsets set"
        else:
            yield "dry run: nothing changed; add --execute to set these offsets"


class ConsumerDeleted(Result):
    schema = "consumer-delete"

    @classmethod
    def of(
        cls, url: str, name: str, position: ConsumerPosition | None, executed: bool
    ) -> ConsumerDeleted:
        return cls(
            {
                "url": url,
                "consumer": name,
                "executed": executed,
                "position": position.to_json() if position else None,
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        position = d["position"]
        where = f" (committed {shard_map(position['offsets'])})" if position else ""
        if d["executed"]:
            yield f"deleted consumer {d['consumer']}{where}"
        else:
            yield f"dry run: would delete consumer {d['consumer']}{where}; add --execute"


# -- status -------------------------------------------------------------------------------


def _mysql_capture_line(capture: dict[str, Any]) -> str:
    where = (
        f"{capture['file']}:{capture['pos']}"
        + (f" (GTID {capture['gtids']})" if capture["gtids"] else "")
        if capture["file"] is not None
        else f"version {capture['version']} (no position record)"
    )
    line = (
        f"at {where} (log version {capture['log_version']}, {age(capture['committed_ms'])}); "
        f"run {capture['run'] or 'unknown'}" + (f": {capture['error']}" if capture["error"] else "")
    )
    if capture["server_file"] is None:
        return line
    lag = (
        "unknown (its binlog file is gone)"
        if capture["lag_bytes"] is None
        else (f"{capture['lag_bytes']:,} bytes")
    )
    return f"{line}; server at {capture['server_file']}:{capture['server_pos']}, lag {lag}"


def _run_words(run: dict[str, Any] | None) -> str:
    if run is None:
        return "no run record"
    where = f"on {run['host']} (pid {run['pid']}"
    if run["state"] == "running":
        return f"running {where}, since {age(run['started_ms'])}, beat {age(run['beat_ms'])})"
    if run["state"] == "gone":
        return f"gone {where}: no beat since {age(run['beat_ms'])}, killed?)"
    return f"{run['state']} {age(run['stopped_ms'])} {where})"


def _capture_lines(capture: dict[str, Any]) -> Iterator[str]:
    yield (
        f"  {capture['slot']:<24} {_run_words(capture['run'])}; at LSN {capture['lsn']} (log "
        f"version {capture['log_version']}, {age(capture['committed_ms'])})"
    )
    run = capture["run"]
    if run is not None and run["error"]:
        yield f"      last error: {run['error']}"
    if capture["server_lsn"] is None:
        yield "      lag: give --source-dsn"
    elif capture["slot_lsn"] is not None:
        lag_s = capture["lag_s"]
        seconds = f"{lag_s:,.1f}s" if lag_s is not None else f"? s ({capture['lag_note']})"
        kept = (
            f"{capture['retained_wal_bytes']:,} bytes of WAL kept ({capture['wal_status']}"
            + (
                f", {capture['safe_wal_bytes']:,} bytes before it is at risk"
                if capture["safe_wal_bytes"] is not None
                else ""
            )
            + ")"
        )
        yield (
            f"      server at {capture['server_lsn']}, slot confirmed {capture['slot_lsn']}: "
            f"lag {capture['lag_bytes']:,} bytes and {seconds}; {kept}"
        )
    if capture["problem"]:
        yield f"      CANNOT RESUME: {capture['problem']}"


class Status(Result):
    schema = "status"

    @classmethod
    def of(cls, report: LogStatus, as_of: dict[str, Any] | None = None) -> Status:
        """``as_of``: which points reads as of can be given (:mod:`replog.ops.reach`)."""
        return cls({**report.to_json(), **({"as_of": as_of} if as_of is not None else {})})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield f"log {d['url']}: version {d['version']}, {d['events']:,} events retained"
        yield f"consumers ({len(d['consumers'])}):"
        for consumer in d["consumers"]:
            committed = (
                f"checkpoint {consumer['checkpoint_id']}, {age(consumer['committed_ms'])}"
                if consumer["checkpoint_id"] is not None
                else "never committed"
            )
            yield (
                f"  {consumer['name']:<24} lag {consumer['total_lag']:>12,} events   "
                f"oldest unconsumed {age(consumer['oldest_unconsumed_ms']):>12}   ({committed})"
            )
        yield f"sinks ({len(d['sinks'])}):"
        for sink in d["sinks"]:
            yield (
                f"  {sink['sink_id']:<24} epoch {sink['epoch']}  {sink['status']}  "
                f"query {sink['query_id']}  updated {age(sink['updated_ms'])}  (log holds "
                f"epoch {sink['log_epoch']} at version {sink['log_version']})"
            )
        if d["transactions"]:
            yield f"transactions ({len(d['transactions'])}):"
            for app_id, version in sorted(d["transactions"].items()):
                yield f"  {app_id:<24} version {version}"
        if d["captures"]:
            yield f"captures ({len(d['captures'])}):"
            for capture in d["captures"]:
                yield from _capture_lines(capture)
        if d.get("mysql_captures"):
            yield f"mysql captures ({len(d['mysql_captures'])}):"
            for capture in d["mysql_captures"]:
                yield f"  {capture['name']:<24} {_mysql_capture_line(capture)}"
        if "as_of" in d:
            yield from _as_of_lines(d["as_of"])


# -- truncate / recover / compact ---------------------------------------------------------


class Truncated(Result):
    """``truncate``, done or (``--dry-run``) planned."""

    schema = "truncate"

    @classmethod
    def of(
        cls,
        url: str,
        plan: TruncationPlan,
        *,
        dry_run: bool,
        force: bool,
        version: int | None = None,
        removed: int = 0,
    ) -> Truncated:
        return cls(
            {
                "url": url,
                "dry_run": dry_run,
                "force": force,
                **plan.to_json(),
                "version": version,
                "segments_removed": removed,
            }
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        if d["dry_run"]:
            for blocker in d["blockers"]:
                yield f"BLOCKED {blocker}"
            needs = " (needs --force)" if d["blockers"] and not d["force"] else ""
            lows = shard_map(d["lows"]) if d["lows"] else "unchanged"
            yield f"would drop {d['total_dropped']:,} events; new lows {lows}{needs}"
        elif d["version"] is None:
            yield "nothing to truncate: every shard already starts at or after the requested low"
        else:
            yield (
                f"truncated {d['url']} at version {d['version']}: dropped "
                f"{d['total_dropped']:,} events, removed {d['segments_removed']} segments from "
                f"the log, new lows {shard_map(d['lows'])}; 'replog recover' deletes the files "
                f"after the grace period"
            )


class Recovered(Result):
    schema = "recover"

    @classmethod
    def of(cls, url: str, report: RecoveryReport) -> Recovered:
        return cls({"url": url, **report.to_json()})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        grace = duration(d["grace_ms"])
        verb = "would resolve" if d["dry_run"] else "resolved"
        for sink_id, resolution in d["resolved"].items():
            outcome = "Committed (the log holds it)" if resolution["committed"] else "rolled back"
            yield f"sink {sink_id}: {verb} Pending epoch {resolution['epoch']} -> {outcome}"
        for sink_id, epoch in d["pending_too_recent"].items():
            yield (
                f"sink {sink_id}: Pending epoch {epoch} is younger than --grace {grace}; "
                f"left alone (its driver may be committing)"
            )
        kept = d["kept"]
        yield (
            f"{'would delete' if d['dry_run'] else 'deleted'} {len(d['garbage'])} garbage "
            f"segment files older than {grace} (kept: {kept['young']} young, "
            f"{kept['leased']} under a staging lease, {kept['removed_recently']} recently "
            f"removed, {kept['pending']} named by a Pending commit)"
        )
        for relative in d["garbage"] if verbose else []:
            yield f"  {relative}"


class Compacted(Result):
    """``compact``: merged (``by_key`` false) or key-compacted (``by_key`` true)."""

    schema = "compact"

    @classmethod
    def merged(cls, url: str, result: CompactionResult, dry_run: bool) -> Compacted:
        return cls({"url": url, "by_key": False, **result.to_json(dry_run)})

    @classmethod
    def by_key(
        cls, url: str, result: KeyCompactionResult, dry_run: bool, segments_below: int
    ) -> Compacted:
        """``segments_below``: whole segments at or below the cleaner points (only those
        are rewritten), which says why nothing was compacted."""
        return cls(
            {"url": url, **result.to_json(dry_run), "segments_below_cleaner_points": segments_below}
        )

    def lines(self, verbose: bool = False) -> Iterator[str]:
        d = self.document
        yield from self._by_key() if d["by_key"] else self._merged()

    def _merged(self) -> Iterator[str]:
        d = self.document
        if d["dry_run"]:
            yield f"would merge {d['segments_before']} segments into {d['segments_after']}"
        elif d["version"] is None:
            yield "nothing to compact"
        else:
            yield (
                f"compacted {d['url']} at version {d['version']}: merged "
                f"{d['segments_before']} segments into {d['segments_after']}; the replaced "
                f"files are deleted after the log's retention"
            )

    def _by_key(self) -> Iterator[str]:
        d = self.document
        points = shard_map(d["cleaner_points"])
        consumers = d["consumers"]
        who = f"{len(consumers)} registered consumers" if consumers else "no consumers"
        yield f"cleaner points (shard:sequence, {who}): {points}"
        if not d["shards"]:
            if not d["segments_below_cleaner_points"]:
                yield (
                    "nothing to compact: no whole segment lies at or below the cleaner points "
                    "(only whole segments are rewritten: the slowest consumer's offsets, or "
                    "'replog compact' merging small segments first, move that line)"
                )
            else:
                yield "nothing to compact: no event below the cleaner points is superseded"
            return
        verb = "would keep" if d["dry_run"] else "kept"
        for shard in d["shards"]:
            yield (
                f"  shard {shard['shard']} sequences {shard['first_sequence']}.."
                f"{shard['last_sequence']}: {verb} {shard['events_after']} of "
                f"{shard['events_before']} events ({shard['deletes_dropped']} old deletes "
                f"dropped)"
            )
        if d["version"] is not None:
            yield (
                f"key-compacted {d['url']} at version {d['version']}: {d['events_before']} "
                f"events -> {d['events_after']}; sequences keep their values, the replaced "
                f"files are deleted after the log's retention"
            )


class Failed(Result):
    """An error: under ``--json`` the one document a failed command prints (stdout)."""

    schema = "error"

    @classmethod
    def of(cls, message: str, exit_code: int, kind: str) -> Failed:
        return cls({"error": message, "type": kind, "exit_code": exit_code})

    def lines(self, verbose: bool = False) -> Iterator[str]:
        yield f"replog: error: {self.document['error']}"

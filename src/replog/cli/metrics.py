"""Prometheus metrics, through ``prometheus-client``.

* ``replog capture ... --metrics-port N`` serves a running capture's metrics over HTTP
  (:class:`CaptureMetrics`), read at each scrape from the capture's
  :class:`~replog.capture.progress.CaptureProgress`: Debezium's streaming and snapshot
  metrics under Prometheus names (docs/OPERATIONS.md, "Metrics").
* ``replog status --format prometheus`` prints a log's consumers, sinks, transactions
  and captures as metrics for node_exporter's textfile collector
  (:func:`status_metrics`), read from the same document as ``status --json``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replog.capture.progress import CaptureProgress
from replog.errors import InvalidOptionError
from replog.spark.options import normalize_location

SINK_STATES = ("Committed", "Pending", "Failed")


class CaptureMetrics(Collector):
    """A capture's metrics, labelled with its slot and log (:func:`log_label`).
    :meth:`update` is the capture's ``progress=`` callback (or is called by it); a scrape
    reads the latest progress and, through ``probe``, measures the slot on the source
    server (lag, retained WAL: the same gauges as ``status --format prometheus``)."""

    def __init__(
        self, slot: str, url: str, probe: Callable[[], Mapping[str, Any] | None] | None = None
    ) -> None:
        self.labels = {"slot": slot, "log": log_label(url)}
        self.progress = CaptureProgress()
        self.probe = probe
        self._lock = threading.Lock()

    def update(self, progress: CaptureProgress) -> None:
        with self._lock:
            self.progress = progress

    def failed(self) -> None:
        """The capture stopped on an error: count it for a last scrape."""
        with self._lock:
            self.progress.errors += 1

    def collect(self) -> Iterator[Metric]:
        measured = self.probe() if self.probe is not None else None
        with self._lock:
            p = self.progress
            counters = {
                "changes": (
                    p.rows,
                    "Changes captured from the slot (snapshot rows: replog_capture_snapshot_rows"
                    "; Debezium: TotalNumberOfEventsSeen).",
                ),
                "transactions": (p.transactions, "Source transactions captured."),
                "commits": (p.commits, "Log commits made."),
                "skipped_transactions": (
                    p.skipped_transactions,
                    "Transactions skipped because the log held them already.",
                ),
                "truncations": (p.truncations, "TRUNCATEs of captured tables captured as events."),
                "skipped_truncations": (
                    p.skipped_truncations,
                    "TRUNCATEs of captured tables not captured.",
                ),
                "heartbeats": (
                    p.heartbeats,
                    "Heartbeats written while the captured tables were idle and the server "
                    "wrote WAL (each lets the slot advance).",
                ),
                "errors": (p.errors, "Errors the capture met."),
            }
            gauges = {
                "snapshot_rows": (p.snapshot_rows, "Rows the snapshot committed so far."),
                "snapshot_rows_estimate": (
                    p.snapshot_rows_total or 0,
                    "The snapshot's rows as the server's statistics estimate them "
                    "(pg_class.reltuples; 0 if unknown).",
                ),
                "snapshot_running": (
                    int(p.snapshot_running),
                    "1 while the snapshot is read (Debezium: SnapshotRunning).",
                ),
                "snapshot_completed": (
                    int(p.snapshot_completed),
                    "1 once this capture's snapshot is committed (Debezium: SnapshotCompleted).",
                ),
            }
            last_commit_ms = p.last_commit_ms
            tables = {table: dict(ops) for table, ops in p.table_events.items()}
            if measured is None:  # no probe, or the server did not answer: the capture's own
                measured = {"lag_bytes": p.lag_bytes, "retained_wal_bytes": p.retained_wal_bytes}
        for name, (value, text) in counters.items():
            yield self._one(CounterMetricFamily, name, text, value)
        for name, (value, text) in gauges.items():
            yield self._one(GaugeMetricFamily, name, text, value)
        yield self._table_events(tables)
        server = _server_gauges(self._gauge, {})
        _add_server(server, list(self.labels.values()), measured)
        yield from (gauge for name, gauge in server.items() if name != "resumable")
        if last_commit_ms is not None:
            yield self._one(
                GaugeMetricFamily,
                "last_source_commit_timestamp_seconds",
                "Source commit time of the last captured transaction.",
                last_commit_ms / 1000,
            )

    def _gauge(self, name: str, text: str, labels: Mapping[str, str]) -> GaugeMetricFamily:
        """A gauge named as :func:`status_metrics` names it, with this capture's labels."""
        return GaugeMetricFamily(f"replog_{name}", text, labels=[*self.labels, *labels])

    def _table_events(self, tables: Mapping[str, Mapping[str, int]]) -> Metric:
        metric = CounterMetricFamily(
            "replog_capture_table_events",
            "Events this capture wrote to the log per captured table and operation (insert, "
            "update, delete, truncate; read: snapshot rows).",
            labels=[*self.labels, "table", "op"],
        )
        for table, operations in sorted(tables.items()):
            for operation, count in sorted(operations.items()):
                metric.add_metric([*self.labels.values(), table, operation], count)
        return metric

    def _one(
        self,
        family: type[CounterMetricFamily] | type[GaugeMetricFamily],
        name: str,
        text: str,
        value: float,
    ) -> Metric:
        metric = family(f"replog_capture_{name}", text, labels=list(self.labels))
        metric.add_metric(list(self.labels.values()), value)
        return metric


def serve(collector: Collector, port: int, addr: str = "") -> tuple[WSGIServer, threading.Thread]:
    """Serve ``collector``'s metrics on ``port`` (all interfaces unless ``addr``), in a
    daemon thread; the caller shuts the server down."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        return start_http_server(port, addr=addr or "0.0.0.0", registry=registry)
    except OSError as exc:
        raise InvalidOptionError(f"--metrics-port {port}: cannot listen there ({exc})") from exc


class _StatusCollector(Collector):
    """A ``status`` document as metrics."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self.document = document

    def collect(self) -> Iterator[Metric]:
        d = {**self.document, "url": log_label(self.document["url"])}
        log = {"log": d["url"]}

        def gauge(name: str, text: str, labels: Mapping[str, str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"replog_{name}", text, labels=list(labels))

        version = gauge("log_version", "The log's newest version.", log)
        version.add_metric([d["url"]], d["version"])
        yield version
        events = gauge("log_events", "Sequences retained (key compaction's holes count).", log)
        events.add_metric([d["url"]], d["events"])
        yield events
        shard = {**log, "shard": ""}
        heads = gauge("log_shard_head", "The last sequence of each shard.", shard)
        lows = gauge("log_shard_low", "The first retained sequence of each shard.", shard)
        for number, head in d["heads"].items():
            heads.add_metric([d["url"], number], head)
            lows.add_metric([d["url"], number], d["lows"][number])
        yield heads
        yield lows
        yield from self._consumers(d, gauge)
        yield from self._sinks(d, gauge)
        yield from self._captures(d, gauge)

    @staticmethod
    def _consumers(d: Mapping[str, Any], gauge: Any) -> Iterator[Metric]:
        labels = {"log": "", "consumer": ""}
        lag = gauge("consumer_lag_events", "Events after the consumer's committed offsets.", labels)
        shard_lag = gauge(
            "consumer_shard_lag_events",
            "Events after the consumer's committed offset, per shard.",
            {**labels, "shard": ""},
        )
        oldest = gauge(
            "consumer_oldest_unconsumed_age_seconds",
            "Age of the oldest event the consumer has not committed (absent: none).",
            labels,
        )
        committed = gauge(
            "consumer_committed_timestamp_seconds",
            "When the consumer last committed (absent: never).",
            labels,
        )
        for consumer in d["consumers"]:
            key = [d["url"], consumer["name"]]
            lag.add_metric(key, consumer["total_lag"])
            for number, value in consumer["lag_events"].items():
                shard_lag.add_metric([*key, number], value)
            if consumer["oldest_unconsumed_age_s"] is not None:
                oldest.add_metric(key, consumer["oldest_unconsumed_age_s"])
            if consumer["committed_ms"] is not None:
                committed.add_metric(key, consumer["committed_ms"] / 1000)
        yield from (lag, shard_lag, oldest, committed)

    @staticmethod
    def _sinks(d: Mapping[str, Any], gauge: Any) -> Iterator[Metric]:
        labels = {"log": "", "sink": ""}
        epoch = gauge("sink_epoch", "The sink's last epoch in its manifest.", labels)
        log_epoch = gauge("sink_log_epoch", "The sink's last epoch the log holds.", labels)
        state = gauge(
            "sink_status",
            "1 for the sink's current commit status (Committed, Pending, Failed).",
            {**labels, "status": ""},
        )
        updated = gauge(
            "sink_updated_timestamp_seconds", "When the sink's manifest was last saved.", labels
        )
        for sink in d["sinks"]:
            key = [d["url"], sink["sink_id"]]
            if sink["epoch"] is not None:
                epoch.add_metric(key, sink["epoch"])
            if sink["log_epoch"] is not None:
                log_epoch.add_metric(key, sink["log_epoch"])
            current = (sink["status"] or "").split("(")[0]
            for name in SINK_STATES:
                state.add_metric([*key, name], int(current == name))
            if sink["updated_ms"] is not None:
                updated.add_metric(key, sink["updated_ms"] / 1000)
        yield from (epoch, log_epoch, state, updated)

    @staticmethod
    def _captures(d: Mapping[str, Any], gauge: Any) -> Iterator[Metric]:
        version = gauge(
            "transaction_version",
            "The last version of each idempotent app id the log holds.",
            {"log": "", "app_id": ""},
        )
        for app_id, value in d["transactions"].items():
            version.add_metric([d["url"], app_id], value)
        yield version
        labels = {"log": "", "slot": ""}
        committed = gauge(
            "capture_committed_timestamp_seconds",
            "When the log commit holding the capture's position was made.",
            labels,
        )
        state = gauge(
            "capture_state",
            "1 for the state of the capture's last run, from its run record in the log: "
            "running, stopped, failed (ended on an error) or gone (no beat for a minute: killed).",
            {**labels, "state": ""},
        )
        beat = gauge(
            "capture_beat_timestamp_seconds",
            "When the capture's run last wrote its run record (every few seconds while it runs).",
            labels,
        )
        server = _server_gauges(gauge, labels)
        for capture in d["captures"]:
            key = [d["url"], capture["slot"]]
            if capture["committed_ms"] is not None:
                committed.add_metric(key, capture["committed_ms"] / 1000)
            run = capture["run"]
            if run is not None:
                for name in RUN_STATES:
                    state.add_metric([*key, name], int(run["state"] == name))
                beat.add_metric(key, run["beat_ms"] / 1000)
            _add_server(server, key, capture)
        for capture in d.get("mysql_captures", []):
            _add_mysql(committed, state, server, [d["url"], f"mysql.{capture['name']}"], capture)
        yield from (committed, state, beat, *server.values())


def _add_mysql(
    committed: GaugeMetricFamily,
    state: GaugeMetricFamily,
    server: Mapping[str, GaugeMetricFamily],
    key: list[str],
    capture: Mapping[str, Any],
) -> None:
    """A MySQL capture's measures (``status --json``'s ``mysql_captures``), labelled
    ``slot=mysql.<name>``: its commit time, its run's state, its lag in binlog bytes."""
    if capture["committed_ms"] is not None:
        committed.add_metric(key, capture["committed_ms"] / 1000)
    if capture["run"] is not None:
        for name in RUN_STATES:
            state.add_metric([*key, name], int(capture["run"] == name))
    if capture["lag_bytes"] is not None:
        server["lag_bytes"].add_metric(key, capture["lag_bytes"])


RUN_STATES = ("running", "stopped", "failed", "gone")

SERVER_GAUGES = {
    "lag_bytes": (
        "capture_lag_bytes",
        "WAL the source server wrote past the slot's confirmed position (MySQL: binlog "
        "bytes past the capture's position; its captures are labelled slot=mysql.<name>).",
    ),
    "lag_s": (
        "capture_lag_seconds",
        "Time since the oldest source commit the slot holds unconfirmed, on the source's "
        "clock (0: caught up; grows while capture is down).",
    ),
    "retained_wal_bytes": (
        "capture_retained_wal_bytes",
        "WAL the source server keeps for the slot (from its restart_lsn).",
    ),
    "safe_wal_bytes": (
        "capture_safe_wal_bytes",
        "WAL the server may still write before the slot is at risk (max_slot_wal_keep_size).",
    ),
}
"""Measures of a capture's slot on the source server: ``status --source-dsn`` and the
``--metrics-port`` endpoint give each under the same name, read from the same fields."""


def _server_gauges(gauge: Any, labels: Mapping[str, str]) -> dict[str, GaugeMetricFamily]:
    found = {field: gauge(name, text, labels) for field, (name, text) in SERVER_GAUGES.items()}
    found["resumable"] = gauge(
        "capture_resumable",
        "1 if this log's capture can resume its slot on the source; 0 if not (no slot, "
        "invalidated, another log's, or consumed past the log: status --json says why).",
        labels,
    )
    return found


def _add_server(
    gauges: Mapping[str, GaugeMetricFamily], key: list[str], measured: Mapping[str, Any]
) -> None:
    """A slot's measures (``status --json``'s capture fields) into ``gauges``; those
    unknown are left out."""
    for field in SERVER_GAUGES:
        value = measured.get(field)
        if value is not None:
            gauges[field].add_metric(key, value)
    if measured.get("server_lsn") is not None:
        gauges["resumable"].add_metric(key, int(measured.get("problem") is None))


def log_label(url: str) -> str:
    """The ``log`` label of every replog metric: the log's URL in one spelling per place
    (a local path absolute, ``s3a://`` as ``s3://``, no trailing ``/``), so the capture's
    endpoint and ``status --format prometheus``, given the URL in different spellings,
    label one log alike."""
    return normalize_location(url)


def status_metrics(document: Mapping[str, Any]) -> str:
    """A ``status`` document in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(document))
    return generate_latest(registry).decode("utf-8")

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
from collections.abc import Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replog.capture.progress import CaptureProgress
from replog.errors import InvalidOptionError

SINK_STATES = ("Committed", "Pending", "Failed")


class CaptureMetrics(Collector):
    """A capture's metrics, labelled with its slot and log. :meth:`update` is the
    capture's ``progress=`` callback (or is called by it); a scrape reads the latest."""

    def __init__(self, slot: str, url: str) -> None:
        self.labels = {"slot": slot, "log": url}
        self.progress = CaptureProgress()
        self._lock = threading.Lock()

    def update(self, progress: CaptureProgress) -> None:
        with self._lock:
            self.progress = progress

    def failed(self) -> None:
        """The capture stopped on an error: count it for a last scrape."""
        with self._lock:
            self.progress.errors += 1

    def collect(self) -> Iterator[Metric]:
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
                "skipped_truncations": (
                    p.skipped_truncations,
                    "TRUNCATEs of captured tables not captured.",
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
                "lag_bytes": (
                    p.lag_bytes,
                    "WAL the server wrote past the captured position.",
                ),
            }
            lag_ms, last_commit_ms = p.lag_ms, p.last_commit_ms
        for name, (value, text) in counters.items():
            yield self._one(CounterMetricFamily, name, text, value)
        for name, (value, text) in gauges.items():
            yield self._one(GaugeMetricFamily, name, text, value)
        if lag_ms is not None:
            yield self._one(
                GaugeMetricFamily,
                "lag_seconds",
                "Time from the last captured transaction's source commit to its capture "
                "(Debezium: MilliSecondsBehindSource / 1000).",
                lag_ms / 1000,
            )
        if last_commit_ms is not None:
            yield self._one(
                GaugeMetricFamily,
                "last_source_commit_timestamp_seconds",
                "Source commit time of the last captured transaction.",
                last_commit_ms / 1000,
            )

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
        d = self.document
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
        lag = gauge(
            "capture_lag_bytes",
            "WAL (MySQL: binlog) the source server wrote past the log's capture position "
            "(with --source-dsn; MySQL captures are labelled slot=mysql.<name>).",
            labels,
        )
        for capture in d["captures"]:
            key = [d["url"], capture["slot"]]
            if capture["committed_ms"] is not None:
                committed.add_metric(key, capture["committed_ms"] / 1000)
            if capture["lag_bytes"] is not None:
                lag.add_metric(key, capture["lag_bytes"])
        for capture in d.get("mysql_captures", []):
            key = [d["url"], f"mysql.{capture['name']}"]
            if capture["committed_ms"] is not None:
                committed.add_metric(key, capture["committed_ms"] / 1000)
            if capture["lag_bytes"] is not None:
                lag.add_metric(key, capture["lag_bytes"])
        yield from (committed, lag)


def status_metrics(document: Mapping[str, Any]) -> str:
    """A ``status`` document in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(document))
    return generate_latest(registry).decode("utf-8")

"""Prometheus metrics: a running ``replog capture --metrics-port`` scraped over HTTP, and
``replog status --format prometheus`` parsed as a textfile collector would."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cli import REPLOG, replog
from support.logs import commit_offsets, filled_log, log_rows
from test_cli_output import validate

from replog.capture.options import capture_app_id
from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.format.commits import Transaction


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        text = response.read().decode()
    return {name: value for (name, _), value in samples(text).items()}


@pytest.mark.slow
def test_a_running_capture_serves_its_metrics(pg_dsn: str, tmp_path: Path) -> None:
    import psycopg

    url = str(tmp_path / "log")
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        connection.execute("INSERT INTO t SELECT i, i FROM generate_series(1, 25) i")
    port = free_port()
    command = [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "metrics", "--tables", "t"]
    process = subprocess.Popen(
        [*command, "--follow", "--metrics-port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    # stderr is not a terminal: plain progress lines, the first once the snapshot landed
    first = process.stderr.readline()
    assert first.startswith("replog: capture: "), first + process.communicate()[1]
    before = scrape(port)
    assert before["replog_capture_snapshot_rows"] == 25
    assert before["replog_capture_changes_total"] >= 0
    assert before["replog_capture_commits_total"] >= 1
    assert before["replog_capture_errors_total"] == 0
    assert "replog_capture_lag_bytes" in before
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        for i in range(3):
            connection.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i + 1,))
    after = before
    while after["replog_capture_transactions_total"] < 3:
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.1)
        after = scrape(port)
    assert after["replog_capture_changes_total"] == before["replog_capture_changes_total"] + 3
    assert after["replog_capture_last_source_commit_timestamp_seconds"] > time.time() - 3600
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    assert "replog: stopping: finishing the commit in progress" in stderr
    assert "captured 3 rows (25 in the snapshot)" in stdout
    with pytest.raises(OSError):  # the endpoint is gone with the capture
        scrape(port)
    # a capture's --json summary: one document valid against its schema, LSN as text
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("UPDATE t SET v = 0 WHERE id = 9")
    result = replog(*command[1:], "--json", "--drop-slot")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # --json: no progress on stderr
    document = json.loads(result.stdout)
    validate(document, "capture")
    assert document["rows"] == 1 and "position" not in document
    assert document["slot_dropped"] is True
    assert document["lsn"].count("/") == 1


def test_status_as_prometheus_metrics(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    log = filled_log(url, commits=2, per_commit=10, shards=2, auto_compact=False)
    commit_offsets(log, "etl", {0: 4, 1: 3})
    since = log.refresh().version
    SinkCommitter(log, "s1").commit(
        Batch("q-1", 0, tuple(log.stage(log_rows(4, 900))), since_version=since)
    )
    log.append([{"key": "b", "data": {}}], transaction=Transaction(capture_app_id("shop"), 77))
    log.append([{"key": "c", "data": {}}], transaction=Transaction("nightly", 3))
    result = replog("status", url, "--format", "prometheus")
    assert result.returncode == 0, result.stderr
    found = samples(result.stdout)
    heads = log.refresh().heads
    assert found[("replog_consumer_lag_events", (("consumer", "etl"), ("log", url)))] == (
        heads[0] - 4 + heads[1] - 3
    )
    shard_lag = (
        "replog_consumer_shard_lag_events",
        (("consumer", "etl"), ("log", url), ("shard", "1")),
    )
    assert found[shard_lag] == heads[1] - 3
    sink = (("log", url), ("sink", "s1"))
    assert found[("replog_sink_epoch", sink)] == 0
    assert found[("replog_sink_status", (*sink, ("status", "Committed")))] == 1
    assert found[("replog_sink_status", (*sink, ("status", "Pending")))] == 0
    assert found[("replog_transaction_version", (("app_id", "nightly"), ("log", url)))] == 3
    assert ("replog_capture_committed_timestamp_seconds", (("log", url), ("slot", "shop"))) in found
    assert found[("replog_log_version", (("log", url),))] == log.refresh().version

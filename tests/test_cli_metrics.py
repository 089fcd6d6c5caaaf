"""Prometheus metrics: a running ``replog capture --metrics-port`` scraped over HTTP, and
``replog status --format prometheus`` parsed as a textfile collector would."""

from __future__ import annotations

import json
import re
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


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        text = response.read().decode()
    return {name: value for (name, _), value in samples(text).items()}


def scrape_labelled(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        return samples(response.read().decode())


def bound_port(line: str) -> int:
    """The port a capture given ``--metrics-port 0`` says it bound."""
    found = re.fullmatch(r"replog: metrics at http://[^:]+:(\d+)/metrics\n", line)
    assert found, line
    return int(found.group(1))


@pytest.mark.slow
def test_a_running_capture_serves_its_metrics(pg_dsn: str, tmp_path: Path) -> None:
    import psycopg

    url = str(tmp_path / "log")
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        connection.execute("INSERT INTO t SELECT i, i FROM generate_series(1, 25) i")
    command = [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "metrics", "--tables", "t"]
    # the log as a relative path, in the log's directory: its label is the absolute path,
    # as status --format prometheus labels it given the absolute path
    process = subprocess.Popen(
        [*command[:4], "log", *command[5:], "--follow", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert process.stderr is not None
    # --metrics-port 0: any free port, said first (no test depends on a port staying free)
    port = bound_port(process.stderr.readline())
    # stderr is not a terminal: plain progress lines, the first once the snapshot landed
    first = process.stderr.readline()
    assert first.startswith("replog: capture: "), first + process.communicate()[1]
    before = scrape(port)
    assert before["replog_capture_snapshot_rows"] == 25
    assert before["replog_capture_changes_total"] >= 0
    assert before["replog_capture_commits_total"] >= 1
    assert before["replog_capture_errors_total"] == 0
    assert before["replog_capture_heartbeats_total"] >= 0
    assert before["replog_capture_truncations_total"] == 0
    assert "replog_capture_lag_bytes" in before and "replog_capture_retained_wal_bytes" in before
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        for i in range(3):
            connection.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i + 1,))
        connection.execute("DELETE FROM t WHERE id = 25")
    after = before
    while after["replog_capture_transactions_total"] < 4:
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.1)
        after = scrape(port)
    assert after["replog_capture_changes_total"] == before["replog_capture_changes_total"] + 4
    assert after["replog_capture_last_source_commit_timestamp_seconds"] > time.time() - 3600
    labelled = scrape_labelled(port)
    labels = (("log", url), ("slot", "metrics"))

    def per_table(op: str) -> float:
        found = tuple(sorted((*labels, ("op", op), ("table", "public.t"))))
        return labelled[("replog_capture_table_events_total", found)]

    assert (per_table("read"), per_table("update"), per_table("delete")) == (25, 3, 1)
    # caught up: nothing committed at the source is unconfirmed (measured on the server)
    while labelled[("replog_capture_lag_seconds", labels)] != 0:
        time.sleep(0.1)
        labelled = scrape_labelled(port)
    _status_labels_alike(pg_dsn, url, labelled)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    assert "replog: stopping: finishing the commit in progress" in stderr
    assert "captured 4 rows (25 in the snapshot)" in stdout
    with pytest.raises(OSError):  # the endpoint is gone with the capture
        scrape(port)
    _json_summary(pg_dsn, command)


def _status_labels_alike(
    dsn: str, url: str, labelled: dict[tuple[str, tuple[tuple[str, str], ...]], float]
) -> None:
    """``status --format prometheus`` of the log the endpoint serves, given as an absolute
    path: the same label set for the gauges both give, read from the source alike."""
    labels = (("log", url), ("slot", "metrics"))
    status = replog("status", url, "--source-dsn", dsn, "--format", "prometheus")
    assert status.returncode == 0, status.stderr
    from_status = samples(status.stdout)
    for name in ("replog_capture_lag_bytes", "replog_capture_lag_seconds",
                 "replog_capture_retained_wal_bytes"):  # fmt: skip
        assert (name, labels) in from_status and (name, labels) in labelled, name
    running = tuple(sorted((*labels, ("state", "running"))))
    assert from_status[("replog_capture_state", running)] == 1
    assert from_status[("replog_capture_resumable", labels)] == 1


def _json_summary(dsn: str, command: list[str]) -> None:
    """A capture's --json summary: one document valid against its schema, LSN as text,
    its per-table counts and the port --metrics-port 0 bound."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("UPDATE t SET v = 0 WHERE id = 9")
    result = replog(*command[1:], "--json", "--drop-slot", "--metrics-port", "0")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    validate(document, "capture")
    where = f"http://{socket.gethostname()}:{document['metrics_port']}/metrics"
    assert result.stderr == f"replog: metrics at {where}\n"  # and nothing else under --json
    assert document["rows"] == 1 and "position" not in document
    assert document["tables"] == {"public.t": {"update": 1}}
    assert document["slot_dropped"] is True and document["slot_drop_command"] is None
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

"""Small commits: a log of many small appends against the same events in one append.

The workload of issue 20: 8 shards, 5,000 appends of 10 events (~100-byte JSON payloads)
against the same 50,000 events in one append. Each section prints a Markdown table with
every figure beside its goal; the figures go into docs/BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_commits.py python     # reads, bytes, append latency
    .venv/bin/python benchmarks/bench_commits.py age        # append latency at 50,000 commits
    .venv/bin/python benchmarks/bench_commits.py spark      # AvailableNow -> noop, beside Parquet
    .venv/bin/python benchmarks/bench_commits.py s3         # reads on moto, 0 and 20 ms per request
    .venv/bin/python benchmarks/bench_commits.py writers    # commits/s on moto: 1, 4, 16 writers
    .venv/bin/python benchmarks/bench_commits.py stream     # replog -> replog-sink, 500 ev / 0.5 s

(``PYSPARK_PYTHON`` must name the venv's Python for the Spark sections, as ``make bench``
sets it.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replog.appender import GroupAppender
from replog.log import ReplicationLog
from replog.ops import compaction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.logs import short_retention_log  # the tests' helper

SHARDS = 8
PARQUET_DDL = "key STRING, collection STRING, operation STRING, data STRING"
COMMITS = 5_000
PER_COMMIT = 10


def events(commit: int, per_commit: int = PER_COMMIT) -> list[dict[str, Any]]:
    """One small commit's events: ~100-byte JSON payloads, keys spread over the shards."""
    base = commit * per_commit
    return [
        {
            "key": f"order-{(base + j) % 9973}",
            "collection": "orders",
            "operation": "update",
            "data": {"id": base + j, "status": "paid", "total": 12.5, "note": "x" * 40},
        }
        for j in range(per_commit)
    ]


def disk_usage(root: Path) -> tuple[int, int, int]:
    """Bytes, files, and bytes under ``_replog/`` below ``root``."""
    files = [path for path in root.rglob("*") if path.is_file()]
    meta = sum(path.stat().st_size for path in files if "_replog" in path.parts)
    return sum(path.stat().st_size for path in files), len(files), meta


def best(function: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def read_everything(url: str, **options: Any) -> int:
    """A new reader reads every event, shard by shard (``read_table``), as a user would."""
    log = ReplicationLog.open(url, storage_options=options or None)
    return sum(log.read_table(shard).num_rows for shard in range(log.shards))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def append_many(log: ReplicationLog, commits: int, start: int = 0) -> list[float]:
    latencies = []
    for commit in range(start, start + commits):
        began = time.perf_counter()
        log.append(events(commit))
        latencies.append(time.perf_counter() - began)
    return latencies


def build_logs(root: Path, retention_ms: int | None = None) -> tuple[str, str, list[float]]:
    one = str(root / "one")
    many = str(root / "many")
    ReplicationLog.create(one, SHARDS).append(
        [event for commit in range(COMMITS) for event in events(commit)]
    )
    log = (
        ReplicationLog.create(many, SHARDS)
        if retention_ms is None
        else short_retention_log(many, SHARDS, retention_ms)  # below what create allows
    )
    latencies = append_many(log, COMMITS)
    log.flush()  # the writer's last background merge and retention
    return one, many, latencies


def row(what: str, value: str, goal: str = "", met: str = "") -> None:
    print(f"| {what} | {value} | {goal} | {met} |")


def header(title: str) -> None:
    print(f"\n### {title}\n\n| figure | measured | goal | met? |\n|---|---|---|---|")


def yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


# -- sections ----------------------------------------------------------------------------------


def alternating_best(urls: list[str], rounds: int = 15) -> list[float]:
    """Best time of ``read_everything`` for each URL, measured in alternation (the
    machine's noise then falls on every log alike)."""
    times = [float("inf")] * len(urls)
    for _ in range(rounds):
        for index, url in enumerate(urls):
            start = time.perf_counter()
            assert read_everything(url) == COMMITS * PER_COMMIT
            times[index] = min(times[index], time.perf_counter() - start)
    return times


def section_python(root: Path) -> None:
    one, many, latencies = build_logs(root / "default")
    compacted = str(root / "compacted")
    shutil.copytree(many, compacted)
    compaction.compact(ReplicationLog.open(compacted))
    read_one, read_many, read_compacted = alternating_best([one, many, compacted])
    header(
        "Python API, local disk: 5,000 appends of 10 events vs one append of 50,000 "
        "(reads: best of 15, alternating)"
    )
    row("read every event (new reader, read_table per shard), one commit", f"{read_one:.4f} s")
    row(
        "the same, 5,000 commits (writers merged as they went)",
        f"{read_many:.4f} s = {read_many / read_one:.2f}x",
        "≤ 3x",
        yes(read_many <= 3 * read_one),
    )
    state = ReplicationLog.open(many).refresh()
    files = {s.path for lane in state.segments for s in lane}
    row(
        "live files after 5,000 commits (one commit: 8)", f"{len(files)} ({state.version} versions)"
    )

    # Parquet beside it: 5,000 small files against one (pyarrow.dataset).
    pq_one, pq_many = root / "parquet-one", root / "parquet-many"
    pq_one.mkdir()
    pq_many.mkdir()
    table = pa.Table.from_pylist(
        [{**e, "data": json.dumps(e["data"])} for c in range(COMMITS) for e in events(c)]
    )
    pq.write_table(table, pq_one / "part-0.parquet")
    for commit in range(COMMITS):
        pq.write_table(table.slice(commit * PER_COMMIT, PER_COMMIT), pq_many / f"{commit}.parquet")
    pq_read_one = best(lambda: pq.read_table(pq_one))
    pq_read_many = best(lambda: pq.read_table(pq_many), repeat=3)
    row("Parquet (pyarrow.dataset), one file", f"{pq_read_one:.4f} s")
    row("Parquet, 5,000 files", f"{pq_read_many:.4f} s = {pq_read_many / pq_read_one:.0f}x")

    row(
        "after `replog compact`",
        f"{read_compacted:.4f} s = {read_compacted / read_one:.2f}x",
        "≤ 1.3x",
        yes(read_compacted <= 1.3 * read_one),
    )

    bytes_one, files_one, _ = disk_usage(Path(one))
    bytes_many, files_many, meta_many = disk_usage(Path(many))
    row("bytes on storage, one commit", f"{bytes_one / 1e6:.2f} MB ({files_one} files)")
    row(
        "bytes, 5,000 commits, default retention (2 h: nothing expired yet)",
        f"{bytes_many / 1e6:.2f} MB = {bytes_many / bytes_one:.1f}x ({files_many} files, "
        f"{meta_many / 1e6:.2f} MB under _replog/)",
        "≤ 3x",
        yes(bytes_many <= 3 * bytes_one),
    )
    _, short, short_latencies = build_logs(root / "short", retention_ms=1_000)
    bytes_short, files_short, meta_short = disk_usage(Path(short))
    row(
        "bytes, 5,000 commits, retention 1 s (a log of replog 0.5: the steady state)",
        f"{bytes_short / 1e6:.2f} MB = {bytes_short / bytes_one:.1f}x ({files_short} files, "
        f"{meta_short / 1e6:.2f} MB under _replog/)",
        "≤ 3x",
        yes(bytes_short <= 3 * bytes_one),
    )
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    last50, last99 = percentile(latencies[-500:], 0.5), percentile(latencies[-500:], 0.99)
    row(
        "append latency, all 5,000 (p50 / p99)",
        f"{p50 * 1000:.1f} / {p99 * 1000:.1f} ms = {p99 / p50:.1f}x",
        "p99 ≤ 5x p50",
        yes(p99 <= 5 * p50),
    )
    row(
        "append latency, last 500 (p50 / p99)",
        f"{last50 * 1000:.1f} / {last99 * 1000:.1f} ms = {last99 / last50:.1f}x",
        "p99 ≤ 5x p50",
        yes(last99 <= 5 * last50),
    )
    s50, s99 = percentile(short_latencies, 0.5), percentile(short_latencies, 0.99)
    row(
        "append latency with retention 1 s (expiry runs), p50 / p99",
        f"{s50 * 1000:.1f} / {s99 * 1000:.1f} ms = {s99 / s50:.1f}x",
        "p99 ≤ 5x p50",
        yes(s99 <= 5 * s50),
    )


def section_age(root: Path, commits: int) -> None:
    log = ReplicationLog.create(str(root / "aged"), SHARDS)
    header(f"Append latency as the log ages ({commits:,} commits of 10 events, local disk)")
    done = 0
    for checkpoint in (5_000, commits):
        latencies = append_many(log, checkpoint - done, start=done)
        done = checkpoint
        window = latencies[-1000:]
        p50, p99 = percentile(window, 0.5), percentile(window, 0.99)
        row(
            f"commits {checkpoint - 999:,} to {checkpoint:,}: p50 / p99",
            f"{p50 * 1000:.1f} / {p99 * 1000:.1f} ms = {p99 / p50:.1f}x",
            "p99 ≤ 5x p50",
            yes(p99 <= 5 * p50),
        )
    log.flush()
    state = log.refresh()
    files = {s.path for lane in state.segments for s in lane}
    row("live files / versions at the end", f"{len(files)} / {state.version:,}")
    bytes_, count, meta = disk_usage(root / "aged")
    row("bytes on storage at the end (retention 2 h)", f"{bytes_ / 1e6:.1f} MB in {count} files "
        f"({meta / 1e6:.1f} MB metadata)")  # fmt: skip


def section_spark(root: Path) -> None:
    from workload import bench_session, stream_run

    one, many, _ = build_logs(root)
    pq_one, pq_many = root / "parquet-one", root / "parquet-many"
    pq_one.mkdir()
    pq_many.mkdir()
    table = pa.Table.from_pylist(
        [{**e, "data": json.dumps(e["data"])} for c in range(COMMITS) for e in events(c)]
    )
    pq.write_table(table, pq_one / "part-0.parquet")
    for commit in range(COMMITS):
        pq.write_table(table.slice(commit * PER_COMMIT, PER_COMMIT), pq_many / f"{commit}.parquet")
    spark = bench_session()
    runs: dict[str, list[float]] = {}
    sources = {
        "replog, one commit": lambda: spark.readStream.format("replog").load(one),
        "replog, 5,000 commits": lambda: spark.readStream.format("replog").load(many),
        "Parquet, one file": lambda: spark.readStream.schema(PARQUET_DDL).parquet(str(pq_one)),
        "Parquet, 5,000 files": lambda: spark.readStream.schema(PARQUET_DDL).parquet(str(pq_many)),
    }  # fmt: skip
    stream_run(sources["replog, one commit"](), root / "chk-warm")  # first load of the format
    for _ in range(3):
        for name, reader in sources.items():
            run = stream_run(reader(), root / "chk")
            assert run.rows == COMMITS * PER_COMMIT, (name, run.rows)
            runs.setdefault(name, []).append(run.seconds)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    header("Spark AvailableNow → noop, 50,000 events (median of 3, one session)")
    for name, seconds in medians.items():
        row(name, f"{seconds:.2f} s ({COMMITS * PER_COMMIT / seconds:,.0f} events/s)")
    ratio = medians["replog, 5,000 commits"] / medians["replog, one commit"]
    row("replog 5,000 commits / one commit", f"{ratio:.2f}x", "≤ 3x", yes(ratio <= 3))
    parquet_ratio = medians["Parquet, 5,000 files"] / medians["Parquet, one file"]
    row("Parquet 5,000 files / one file", f"{parquet_ratio:.2f}x")
    spark.stop()


def _upload(local: Path, s3_url: str, options: dict[str, Any]) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(s3_url, **options)
    for file in local.rglob("*"):
        if file.is_file():
            fs.pipe_file(f"{path}/{file.relative_to(local).as_posix()}", file.read_bytes())


class _MotoProcess:
    """A moto S3 server in a process of its own: in a thread of the benchmark it would
    share the writers' interpreter lock, and its own request handling would be measured."""

    def __init__(self) -> None:
        import socket
        import subprocess

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def _moto() -> tuple[_MotoProcess, str]:
    import boto3

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    server = _MotoProcess()
    endpoint = f"http://127.0.0.1:{server.port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(100):
        try:
            client.create_bucket(Bucket="bench")
            break
        except Exception:  # not listening yet
            time.sleep(0.1)
    return server, endpoint


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}  # fmt: skip


def section_s3(root: Path) -> None:
    import s3fs
    from delay_proxy import DelayProxy

    one, many, _ = build_logs(root)
    server, endpoint = _moto()
    try:
        for name, local in (("one", one), ("many", many)):
            _upload(Path(local), f"s3://bench/{name}", _s3_options(endpoint))
        header("Reading from S3 (moto), every event, 0 and 20 ms per request")
        results: dict[tuple[str, float], tuple[float, int]] = {}
        for delay in (0.0, 0.02):
            proxy = DelayProxy(endpoint, delay).start()
            try:
                for name in ("one", "many"):
                    times = []
                    for _ in range(3):
                        s3fs.S3FileSystem.clear_instance_cache()
                        proxy.requests.clear()
                        start = time.perf_counter()
                        options = _s3_options(proxy.url)
                        log = ReplicationLog.open(f"s3://bench/{name}", storage_options=options)
                        assert log.read_all().num_rows == COMMITS * PER_COMMIT
                        times.append(time.perf_counter() - start)
                    results[(name, delay)] = (min(times), sum(proxy.requests.values()))
            finally:
                proxy.stop()
        for (name, delay), (seconds, requests) in results.items():
            row(f"{name}, {delay * 1000:.0f} ms per request (read_all, best of 3)",
                f"{seconds:.3f} s, {requests} requests")  # fmt: skip
        ratio = results[("many", 0.02)][0] / results[("many", 0.0)][0]
        row("5,000 commits: 20 ms / 0 ms", f"{ratio:.2f}x", "≤ 2x", yes(ratio <= 2))
    finally:
        server.stop()


def _run_for(seconds: float, threads: int, call: Callable[[int], None]) -> list[float]:
    """Run ``call(n)`` repeatedly in ``threads`` threads for ``seconds``; its latencies."""
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def loop(n: int) -> None:
        count = 0
        while time.monotonic() < deadline:
            began = time.perf_counter()
            call(n * 1_000_000 + count)
            with lock:
                latencies.append(time.perf_counter() - began)
            count += 1

    workers = [threading.Thread(target=loop, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return latencies


def section_writers(root: Path, seconds: float) -> None:
    server, endpoint = _moto()
    options = _s3_options(endpoint)
    header(f"Commits per second per log on S3 (moto), 10-event appends, {seconds:.0f} s each")
    try:
        for writers in (1, 4, 16):
            url = f"s3://bench/writers-{writers}"
            ReplicationLog.create(url, SHARDS, storage_options=options)
            logs = [ReplicationLog.open(url, storage_options=options) for _ in range(writers)]
            latencies = _run_for(
                seconds, writers, lambda n, logs=logs: logs[n // 1_000_000].append(events(n))
            )
            row(
                f"{writers} writer(s), each its own log object and commits",
                f"{len(latencies) / seconds:.1f} commits/s, "
                f"p50 {percentile(latencies, 0.5) * 1000:.0f} ms",
            )
        for threads in (4, 16):
            url = f"s3://bench/group-{threads}"
            ReplicationLog.create(url, SHARDS, storage_options=options)
            log = ReplicationLog.open(url, storage_options=options)
            with GroupAppender(log, linger_ms=5) as appender:
                latencies = _run_for(
                    seconds, threads, lambda n, a=appender: a.append(events(n)) and None
                )
            row(
                f"{threads} threads through one GroupAppender",
                f"{len(latencies) / seconds:.1f} appends/s in "
                f"{appender.commits / seconds:.1f} commits/s, "
                f"p50 {percentile(latencies, 0.5) * 1000:.0f} ms",
            )
    finally:
        server.stop()


def section_stream(root: Path, seconds: float) -> None:
    from workload import bench_session

    source = ReplicationLog.create(str(root / "A"), SHARDS)
    target_url = str(root / "B")
    spark = bench_session()
    query = (
        spark.readStream.format("replog")
        .load(source.url)
        .writeStream.format("replog-sink")
        .option("checkpointLocation", str(root / "chk"))
        .trigger(processingTime="0 seconds")
        .start(target_url)
    )
    produced = 0
    deadline = time.monotonic() + seconds
    writer = ReplicationLog.open(source.url)
    while time.monotonic() < deadline:
        began = time.monotonic()
        writer.append(events(produced // 500, per_commit=500))
        produced += 500
        time.sleep(max(0.0, 0.5 - (time.monotonic() - began)))
    target = ReplicationLog.open(target_url)
    while sum(target.refresh().heads) < produced:
        time.sleep(0.2)
    query.stop()
    state = target.refresh()
    batches = max(mark.epoch for mark in state.sinks.values()) + 1
    files = {s.path for lane in state.segments for s in lane}
    read_target = best(lambda: read_everything(target_url))
    one = ReplicationLog.create(str(root / "one"), SHARDS)
    one.append([e for c in range(produced // 500) for e in events(c, per_commit=500)])
    read_one = best(lambda: read_everything(one.url))
    header(f"Streaming replog → replog-sink, 500 events every 0.5 s for {seconds:.0f} s")
    row("events produced / in the target", f"{produced:,} / {sum(state.heads):,}")
    row("micro-batches (the sink's last epoch + 1)", f"{batches:,}")
    row("target versions / live files", f"{state.version:,} / {len(files)}")
    row("read the target (new reader) vs the same events in one commit",
        f"{read_target:.3f} s vs {read_one:.3f} s = {read_target / read_one:.2f}x", "≤ 3x",
        yes(read_target <= 3 * read_one))  # fmt: skip
    bytes_target, count, meta = disk_usage(Path(target_url))
    bytes_one, _, _ = disk_usage(Path(one.url))
    row("target bytes vs one commit", f"{bytes_target / 1e6:.1f} MB ({count} files, "
        f"{meta / 1e6:.1f} MB metadata) vs {bytes_one / 1e6:.1f} MB")  # fmt: skip
    spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", choices=["python", "age", "spark", "s3", "writers", "stream"])
    parser.add_argument("--dir", default="bench-data/commits")
    parser.add_argument("--commits", type=int, default=50_000, help="for 'age'")
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args()
    root = Path(args.dir) / args.section
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sys.path.insert(0, str(Path(__file__).parent))
    if args.section == "python":
        section_python(root)
    elif args.section == "age":
        section_age(root, args.commits)
    elif args.section == "spark":
        section_spark(root)
    elif args.section == "s3":
        section_s3(root)
    elif args.section == "writers":
        section_writers(root, args.seconds or 20)
    else:
        section_stream(root, args.seconds or 600)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

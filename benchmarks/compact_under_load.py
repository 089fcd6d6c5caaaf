"""Operator compactions under ordinary load (issue 32, hole 3).

A log of 200,000 events; two producer processes append 10-event batches back to back, at
most ``--rate`` appends/s together (writers merge their small files as they commit);
meanwhile ``replog compact`` and ``replog compact --by-key`` run, one after another,
``--runs`` times each, as an operator would run them (the CLI, a process of its own).
Prints each run's outcome and time, the producers' rate, and checks afterwards that no
event is doubled, that the newest acknowledged event of every key is in the log (key
compaction drops the older ones), and that ``verify`` is clean.

    .venv/bin/python benchmarks/compact_under_load.py --runs 10 --rate 100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from replog.log import ReplicationLog
from replog.ops.verify import verify

PRODUCER = textwrap.dedent(
    """
    import json, os, sys, time
    from replog.log import ReplicationLog
    url, name, stop, rate = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    log = ReplicationLog.open(url)
    acked = failed = 0
    began = time.monotonic()
    while not os.path.exists(stop):
        ahead = began + acked / rate - time.monotonic()  # at most `rate` appends/s
        if ahead > 0:
            time.sleep(ahead)
        base = acked * 10
        events = [{"event_id": f"{name}-{base + j}", "key": f"{name}-k{(base + j) % 5000}",
                   "collection": "orders", "data": {"n": base + j, "note": "x" * 60}}
                  for j in range(10)]
        try:
            log.append(events)
            acked += 1
        except Exception as exc:
            failed += 1
            print(f"{name}: append failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            break  # an unknown outcome would make the count below uncertain
    log.flush()
    print(json.dumps({"name": name, "acked": acked, "failed": failed}), flush=True)
    """
)


def event(event_id: str, key: str, n: int) -> dict[str, object]:
    return {"event_id": event_id, "key": key, "collection": "orders",
            "data": {"n": n, "note": "x" * 60}}  # fmt: skip


def prefill(url: str, events: int, shards: int) -> None:
    log = ReplicationLog.create(url, shards)
    per_append = 2_000
    for start in range(0, events, per_append):
        stop = min(events, start + per_append)
        log.append([event(f"pre-{n}", f"k{n % 20000}", n) for n in range(start, stop)])
    log.flush()


def run_compaction(url: str, by_key: bool) -> tuple[int, float, str]:
    command = [str(Path(sys.executable).parent / "replog"), "compact", url]
    if by_key:
        command.append("--by-key")
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return done.returncode, time.perf_counter() - began, lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each compaction")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument(
        "--rate", type=float, default=100.0, help="appends/s of all producers together, at most"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = str(Path(tmp) / "log")
        began = time.perf_counter()
        prefill(url, args.events, args.shards)
        print(f"prefilled {args.events} events in {time.perf_counter() - began:.1f} s")
        script = Path(tmp) / "producer.py"
        script.write_text(PRODUCER)
        stop = Path(tmp) / "stop"
        per_producer = args.rate / args.producers
        start_version = ReplicationLog.open(url).refresh().version
        producing = time.perf_counter()
        producers = [
            subprocess.Popen(
                [sys.executable, str(script), url, f"p{n}", str(stop), str(per_producer)],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ},
            )
            for n in range(args.producers)
        ]
        time.sleep(3)  # let the producers reach their pace
        load_began = time.perf_counter()
        results: dict[str, list[tuple[int, float, str]]] = {"compact": [], "compact --by-key": []}
        for run in range(args.runs):
            for name, by_key in (("compact --by-key", True), ("compact", False)):
                outcome = run_compaction(url, by_key)
                results[name].append(outcome)
                rc, seconds, last = outcome
                print(f"run {run + 1} {name}: exit {rc} in {seconds:.1f} s  {last}")
        load_s = time.perf_counter() - load_began
        stop.touch()
        produced_s = time.perf_counter() - producing
        reports = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in producers]
        log = ReplicationLog.open(url)
        version = log.refresh().version
        ids = log.read_all().column("event_id").to_pylist()
        acked = sum(r["acked"] for r in reports)
        produced = {i for i in ids if not i.startswith("pre-")}
        # Key compaction keeps the newest event of each key: each producer's keys are its
        # own, so the newest acknowledged event of every key must be there.
        newest: dict[str, int] = {}
        for r in reports:
            for n in range(r["acked"] * 10):
                newest[f"{r['name']}-k{n % 5000}"] = n
        expected = {f"{key.split('-k')[0]}-{n}" for key, n in newest.items()}
        report = verify(ReplicationLog.open(url))

    print()
    print("| | figure |")
    print("|---|---|")
    for name, outcomes in results.items():
        ok = sum(1 for rc, _, _ in outcomes if rc == 0)
        times = sorted(seconds for _, seconds, _ in outcomes)
        print(f"| `replog {name}`: runs finished | {ok} of {len(outcomes)} |")
        print(f"| `replog {name}`: time (min / median / max) | "
              f"{times[0]:.1f} / {times[len(times) // 2]:.1f} / {times[-1]:.1f} s |")  # fmt: skip
    failed = sum(r["failed"] for r in reports)
    print(f"| producers' appends (10 events each) | {acked:,} in {produced_s:.0f} s "
          f"({acked / produced_s:.0f}/s); failed: {failed} |")  # fmt: skip
    print(f"| compactions' run time | {load_s:.0f} s |")
    print(f"| commits during the run | {version - start_version:,} |")
    print(f"| newest acknowledged event of a key missing / event ids doubled | "
          f"{len(expected - produced)} / "
          f"{len(ids) - len(set(ids))} |")  # fmt: skip
    print(f"| `verify` | {'ok' if report.ok else report.problems} |")


if __name__ == "__main__":
    main()

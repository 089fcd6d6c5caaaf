"""Fault-injection runs: every writer under storage that fails the way object stores fail.

Each seed simulates a sequence of processes sharing one log (memory://). Every process
reaches storage through a FaultInjector (replog.storage.faults): 503/500 and
connection resets before a request, lost answers and 412-to-a-retried-create after a
write landed, and crashes (the process dies between two requests; a new process takes
over). The operations: appends, sink micro-batch commits (retried as Spark retries an
epoch, aborted as Spark aborts one), compactions, truncations of what the sink's
consumer read, and recover runs. After each seed, on clean storage: verify, then count
every event.

An event is lost if an acknowledged append or a committed epoch is missing; doubled
if its id appears twice; an append that reported failure must be all there or absent.

Run: .venv/bin/python benchmarks/fault_runs.py [--seeds 200]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import uuid
from collections import Counter

from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.errors import ReplogError
from replog.format.events import events_from_records
from replog.log import ReplicationLog
from replog.ops import compaction, recovery, retention
from replog.ops.verify import verify
from replog.storage import RetryPolicy
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage, SimulatedCrash
from replog.timeutil import now_ms

RATES = FaultRates(
    unavailable=0.04, reset=0.02, lost_response=0.04, retried_create=0.03, crash=0.01
)
FAST_RETRY = RetryPolicy(attempts=4, first_delay_s=0.0, max_delay_s=0.0)
FAILURES = (ReplogError, OSError, SimulatedCrash)


def events(prefix: str, n: int) -> list[dict]:
    return [{"event_id": f"{prefix}-{i}", "key": f"k{i % 7}", "data": {"i": i}} for i in range(n)]


class Process:
    """One simulated process: a log handle whose storage injects faults."""

    def __init__(self, url: str, seed: int, totals: Counter[str]) -> None:
        self.injector = FaultInjector(seed=seed, rates=RATES)
        clean = ReplicationLog.open(url)  # opening is not under test: start from its descriptor
        storage = FaultyStorage.wrap(clean.storage, self.injector)
        storage.retry = FAST_RETRY
        self.log = ReplicationLog(storage, clean.descriptor)
        self.totals = totals

    def close(self) -> None:
        self.totals.update(self.injector.faults)
        self.totals["requests"] += self.injector.requests


def run(seed: int, totals: Counter[str]) -> Counter[str]:
    url = f"memory://fault-runs/{uuid.uuid4().hex}"
    ReplicationLog.create(url, 3, snapshot_interval=4)
    outcome: Counter[str] = Counter()
    acknowledged: set[str] = set()
    uncertain: list[set[str]] = []
    process = Process(url, seed * 1000, totals)
    generation = 0

    def restart() -> None:
        nonlocal process, generation
        process.close()
        generation += 1
        outcome["crashes"] += 1
        process = Process(url, seed * 1000 + generation, totals)

    for round_ in range(8):
        batch = events(f"a{round_}", 10)
        outcome["operations"] += 1
        try:
            process.log.append(batch)
            acknowledged |= {e["event_id"] for e in batch}
        except FAILURES as exc:
            outcome["failed operations"] += 1
            uncertain.append({e["event_id"] for e in batch})
            if isinstance(exc, SimulatedCrash):
                restart()
        for _attempt in range(30):  # Spark retries an epoch until it commits
            outcome["operations"] += 1
            run_id = f"run-{generation}"
            attempt = Batch("q", round_, run_id=run_id)
            try:
                committer = SinkCommitter(process.log, "sink")
                # as Spark's planning writer records it, before the tasks stage
                attempt = Batch(
                    "q",
                    round_,
                    run_id=run_id,
                    since_version=process.log.refresh().version,
                    since_ms=now_ms(),
                )
                staged = tuple(process.log.stage(events_from_records(events(f"s{round_}", 6))))
                attempt = dataclasses.replace(attempt, staged=staged)
                committer.commit(attempt)
                break
            except FAILURES as exc:
                outcome["failed operations"] += 1
                if isinstance(exc, SimulatedCrash):
                    restart()
                    continue
                with contextlib.suppress(*FAILURES):  # Spark ignores a failing abort
                    committer.abort(attempt, "retry")
        else:
            raise AssertionError(f"seed {seed}: epoch {round_} never committed")
        acknowledged |= {f"s{round_}-{i}" for i in range(6)}
        for operation in (
            (lambda: compaction.compact(process.log)) if round_ % 3 == 1 else None,
            (lambda: recovery.recover(process.log, grace_ms=60_000)) if round_ % 3 == 2 else None,
        ):
            if operation is None:
                continue
            outcome["operations"] += 1
            try:
                operation()
            except FAILURES as exc:
                outcome["failed operations"] += 1
                if isinstance(exc, SimulatedCrash):
                    restart()
    process.close()

    clean = ReplicationLog.open(url)
    report = verify(clean)
    outcome["verify problems"] += len(report.problems)
    ids = []
    for shard in range(clean.shards):
        ids += clean.read_table(shard).column("event_id").to_pylist()
    present = set(ids)
    outcome["events checked"] += len(acknowledged)
    outcome["events doubled"] += len(ids) - len(present)
    outcome["events lost"] += len(acknowledged - present)
    outcome["failed appends landed whole"] += sum(1 for g in uncertain if g <= present)
    outcome["failed appends absent"] += sum(1 for g in uncertain if not g & present)
    outcome["failed appends landed partly"] += sum(
        1 for g in uncertain if g & present and not g <= present
    )
    epoch = clean.refresh().sinks["sink"].epoch_of("q")
    outcome["sink epochs missing"] += 7 - (epoch if epoch is not None else -1)
    # Retention and a final recover on clean storage must keep every live event.
    retention.truncate(clean, {0: 1}, force=True)
    recovery.recover(clean, grace_ms=0)
    after = ReplicationLog.open(url)
    outcome["verify problems"] += len(verify(after).problems)
    outcome["events lost"] += len(
        present
        - {
            e
            for s in range(after.shards)
            for e in after.read_table(s).column("event_id").to_pylist()
        }
    )
    return outcome


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # every repair logs a WARNING: thousands here
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=200)
    args = parser.parse_args()
    totals: Counter[str] = Counter()
    outcome: Counter[str] = Counter()
    for seed in range(args.seeds):
        outcome += run(seed, totals)
    print(f"| fault runs ({args.seeds} seeds, rates {RATES}) | count |")
    print("|---|---|")
    for name in ("operations", "failed operations", "crashes"):
        print(f"| {name} | {outcome[name]:,} |")
    print(f"| storage requests | {totals['requests']:,} |")
    for name, count in sorted(totals.items()):
        if name != "requests":
            print(f"| fault: {name} | {count:,} |")
    for name in (
        "events checked",
        "events lost",
        "events doubled",
        "sink epochs missing",
        "failed appends landed whole",
        "failed appends absent",
        "failed appends landed partly",
        "verify problems",
    ):
        print(f"| {name} | {outcome[name]:,} |")


if __name__ == "__main__":
    main()

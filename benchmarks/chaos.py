"""The chaos run: many OS processes misbehaving at once against one S3 endpoint (moto, in a
process of its own), then every acknowledged event counted in every replica.

For ``--seconds`` (default 600) the harness keeps running, each as its own process:

* appenders writing small batches to log A: two plain, one with transactions (it
  retries a version until the log has it), all through storage that injects faults
  (503s, resets, lost answers, a retried create answered 412, crashes); each is
  SIGKILLed now and then and restarted, resuming after the last event it *tried*;
* two replications A -> B1 and A -> B2 (``integration/apps/replicate.py``: replog ->
  replog-sink under Spark), each SIGKILLed at random moments or killed by a crash point
  at a step of the sink protocol, and restarted; B2 now and then restarts on a fresh
  checkpoint with the same consumer and sink id;
* ``replog compact`` (A, B1, B2), ``replog recover --grace 10s`` (A, B1, B2) and
  ``replog truncate`` of A (behind the slowest consumer), each on a timer. Both
  replications' consumers are registered (at the earliest offsets) before anything is
  appended: truncation waits only for consumers it knows.

Then the appenders stop, each replication runs to the end once more, and the harness
checks: every acknowledged event is in B1 and in B2 exactly once, no event id appears
twice anywhere, each key's events keep their order, and ``verify`` is clean on A, B1
and B2. An append whose outcome was unknown (its process died, or storage failed) may
be in the log or not, never twice.

Run: .venv/bin/python benchmarks/chaos.py [--seconds 600] [--workdir DIR]
(``integration/test_chaos.py`` runs a short version in ``make test``.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPLICATE_APP = ROOT / "integration" / "apps" / "replicate.py"
FAULT_STEPS = ("staged", "after_pending", "after_log_commit", "after_committed")
APPENDERS = {"plain-1": False, "plain-2": False, "txn-1": True}
CRASH_EXIT = 3
logger = logging.getLogger("chaos")


# -- the appender process --------------------------------------------------------------------


def appender_main(url: str, writer: str, ledger: Path, options: dict[str, Any]) -> None:
    """Append batches to ``url`` until killed, through storage that injects faults.
    ``ledger`` records each batch as tried (before) and acknowledged (after)."""
    from replog.errors import ReplogError
    from replog.format.commits import Transaction
    from replog.log import ReplicationLog
    from replog.storage import RetryPolicy
    from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage, SimulatedCrash

    transactional = APPENDERS[writer]
    tried, acked = read_ledger(ledger)
    next_n = max((last for _, last in tried), default=-1) + 1
    clean = ReplicationLog.open(url, storage_options=options, auto_compact=writer == "plain-1")
    rates = FaultRates(
        unavailable=0.02, reset=0.01, lost_response=0.02, retried_create=0.01, crash=0.002
    )
    injector = FaultInjector(seed=random.randrange(1 << 30), rates=rates)
    storage = FaultyStorage.wrap(clean.storage, injector)
    storage.retry = RetryPolicy(attempts=5, first_delay_s=0.01, max_delay_s=0.2)
    log = ReplicationLog(storage, clean.descriptor)
    rng = random.Random()
    with ledger.open("a") as out:
        if transactional and tried and tried[-1] not in acked:
            next_n = tried[-1][0]  # the version it was trying: tried again, idempotently
        while True:
            size = 10 if transactional else rng.randint(1, 20)
            first, last = next_n, next_n + size - 1
            events = [
                {
                    "event_id": f"{writer}-{n}",
                    "key": f"{writer}-k{n % 5}",
                    "data": {"n": n, "writer": writer},
                    "collection": writer,
                }
                for n in range(first, last + 1)
            ]
            out.write(json.dumps({"tried": [first, last]}) + "\n")
            out.flush()
            transaction = Transaction(writer, first // 10) if transactional else None
            try:
                log.append(events, transaction=transaction)
            except (ReplogError, OSError, SimulatedCrash) as exc:
                if isinstance(exc, SimulatedCrash):
                    os._exit(CRASH_EXIT)  # the process dies here, as a crash would
                if transactional:
                    time.sleep(0.05)
                    continue  # the same version again: the log takes it once
                next_n = last + 1  # outcome unknown: never reuse these ids
                continue
            faults = sum(injector.faults.values())
            out.write(json.dumps({"acked": [first, last], "pid": os.getpid(), "faults": faults}))
            out.write("\n")
            out.flush()
            next_n = last + 1
            time.sleep(rng.uniform(0, 0.05))


def read_ledger(ledger: Path) -> tuple[list[tuple[int, int]], set[tuple[int, int]]]:
    tried: list[tuple[int, int]] = []
    acked: set[tuple[int, int]] = set()
    if ledger.exists():
        for line in ledger.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line torn by a kill
            if "tried" in entry:
                tried.append(tuple(entry["tried"]))  # type: ignore[arg-type]
            elif "acked" in entry:
                acked.add(tuple(entry["acked"]))  # type: ignore[arg-type]
    return tried, acked


# -- the harness ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """How often replications die where: a crash point at a sink protocol step (else a
    SIGKILL at a random moment within ``kill_after_s``), and how often B2 restarts on a
    fresh checkpoint (same consumer and sink id)."""

    crash_point_rate: float = 0.3
    kill_after_s: tuple[float, float] = (10, 60)
    fresh_checkpoint_rate: float = 0.25


SHORT_MIX = Mix(crash_point_rate=0.8, kill_after_s=(40, 90), fresh_checkpoint_rate=1.0)
"""For short runs: most deaths at protocol steps, every B2 restart on a fresh checkpoint
(the interleavings that double or skip a micro-batch when a guard is missing)."""


@dataclass
class Tally:
    appends_acked: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    runs: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    failed_operations: Counter[str] = field(default_factory=Counter)
    fresh_checkpoints: int = 0


class Chaos:
    def __init__(
        self, workdir: Path, endpoint: str, seconds: float, seed: int, mix: Mix = Mix()
    ) -> None:
        self.workdir = workdir
        self.mix = mix
        self.endpoint = endpoint
        self.options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        self.deadline = time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.urls = {name: f"s3://chaos/{name}" for name in ("A", "B1", "B2")}
        self.env = {
            **os.environ,
            "AWS_DEFAULT_REGION": "us-east-1",
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        }

    # processes

    def _python(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return spawn_python(self.workdir, args, env or self.env)

    def _kill(self, process: subprocess.Popen[bytes], what: str) -> None:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            with self.lock:
                self.tally.kills[what] += 1

    def cli(self, *args: str) -> bool:
        return run_cli(args, self.options, self.env)

    # roles

    def appender(self, writer: str) -> None:
        ledger = self.workdir / f"ledger-{writer}.jsonl"
        while not self.stop.is_set():
            process = self._python(
                __file__, "append", self.urls["A"], writer, str(ledger), json.dumps(self.options)
            )
            with self.lock:
                self.tally.runs[f"appender {writer}"] += 1
            self.stop.wait(self.rng.uniform(20, 90))
            if process.poll() == CRASH_EXIT:
                with self.lock:
                    self.tally.kills["appender crashed (injected)"] += 1
            self._kill(process, "appender")

    def replication(self, target: str) -> None:
        generation = final_runs = 0
        while True:
            final = self.stop.is_set()
            checkpoint = self.workdir / f"chk-{target}-{generation}"
            args = [
                str(REPLICATE_APP),
                self.urls["A"],
                self.urls[target],
                str(checkpoint),
                "--fs-json",
                json.dumps(self.options),
                "--sink-id",
                f"to-{target}",
                "--consumer",
                f"to-{target}",
                "--master",
                "local[1]",
                "--max-events",
                "400",
            ]
            env = dict(self.env)
            fault = None
            if not final and self.rng.random() < self.mix.crash_point_rate:
                fault = self.rng.choice(FAULT_STEPS)
                env["REPLOG_FAULT"] = fault
            process = self._python(*args, env=env)
            with self.lock:
                self.tally.runs[f"replication {target}"] += 1
            if final:  # no faults now: run to the end (a few tries: a run may be fenced)
                final_runs += 1
                if process.wait() == 0 or final_runs >= 5:
                    return
                continue
            killed_after = self.rng.uniform(*self.mix.kill_after_s)
            try:
                code = process.wait(timeout=killed_after)
                if fault and code != 0:
                    with self.lock:
                        self.tally.kills[f"crash point {fault}"] += 1
            except subprocess.TimeoutExpired:
                self._kill(process, "replication")
            if target == "B2" and self.rng.random() < self.mix.fresh_checkpoint_rate:
                generation += 1  # a fresh checkpoint, same consumer and sink id
                with self.lock:
                    self.tally.fresh_checkpoints += 1

    def operator(self, name: str, every_s: float, commands: list[list[str]]) -> None:
        while not self.stop.wait(self.rng.uniform(every_s * 0.5, every_s * 1.5)):
            for command in commands:
                ok = self.cli(*command)
                with self.lock:
                    self.tally.operations[name] += 1
                    if not ok:
                        self.tally.failed_operations[name] += 1

    # the run

    def run(self) -> dict[str, Any]:
        from replog.log import ReplicationLog
        from replog.ops import verify  # noqa: F401  (loaded now: the check runs at the end)

        for url in self.urls.values():
            ReplicationLog.create(url, 4, storage_options=self.options, snapshot_interval=20)
        for target in ("B1", "B2"):  # truncate waits only for consumers it knows
            consumer = ["--consumer", f"to-{target}", "--to-earliest", "--create", "--execute"]
            if not self.cli("consumer", "set", self.urls["A"], *consumer):
                raise RuntimeError(f"could not register consumer to-{target}")
        threads = [threading.Thread(target=self.appender, args=(w,), name=w) for w in APPENDERS]
        threads += [
            threading.Thread(target=self.operator, args=(op, every, commands), name=op)
            for op, every, commands in (
                ("compact", 25, [["compact", url] for url in self.urls.values()]),
                ("recover", 35, [["recover", url, "--grace", "10s"] for url in self.urls.values()]),
                ("truncate", 50, [["truncate", self.urls["A"]]]),
            )
        ]
        replications = [
            threading.Thread(target=self.replication, args=(t,), name=t) for t in ("B1", "B2")
        ]
        for thread in threads + replications:
            thread.start()
        while time.monotonic() < self.deadline:
            time.sleep(1)
        self.stop.set()
        for thread in threads:
            thread.join()
        logger.info("appenders and operators stopped; replications finish")
        for thread in replications:
            thread.join()
        return self.check()

    def check(self) -> dict[str, Any]:
        from replog.log import ReplicationLog
        from replog.ops.verify import verify

        acked: set[str] = set()
        tried: set[str] = set()
        for writer in APPENDERS:
            tries, acks = read_ledger(self.workdir / f"ledger-{writer}.jsonl")
            self.tally.appends_acked += len(acks)
            acked |= {f"{writer}-{n}" for first, last in acks for n in range(first, last + 1)}
            tried |= {f"{writer}-{n}" for first, last in tries for n in range(first, last + 1)}
        report: dict[str, Any] = {
            "acknowledged_events": len(acked),
            "acknowledged_appends": self.tally.appends_acked,
        }
        for name in ("B1", "B2"):
            log = ReplicationLog.open(self.urls[name], storage_options=self.options)
            rows = log.read_all().select(["event_id", "key", "data", "shard", "sequence"])
            ids = Counter(rows.column("event_id").to_pylist())
            report[name] = {
                "events": rows.num_rows,
                "lost": len(acked - set(ids)),
                "doubled": sum(1 for count in ids.values() if count > 1),
                "unknown": len(set(ids) - tried),
                "out_of_order_keys": out_of_order(rows.to_pylist()),
            }
        for name, url in self.urls.items():
            result = verify(ReplicationLog.open(url, storage_options=self.options))
            report[f"verify {name}"] = "ok" if result.ok else [str(p) for p in result.problems]
        report["kills"] = dict(self.tally.kills)
        report["runs"] = dict(self.tally.runs)
        report["operations"] = dict(self.tally.operations)
        report["failed_operations"] = dict(self.tally.failed_operations)
        report["fresh_checkpoints"] = self.tally.fresh_checkpoints
        report["storage_faults_survived"] = sum(
            count_faults(self.workdir / f"ledger-{writer}.jsonl") for writer in APPENDERS
        )
        return report


def spawn_python(
    workdir: Path, args: Sequence[str], env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """``python args`` in ``workdir``, in a session of its own (a kill takes the whole
    group: JVM, Python workers), its output appended to ``workdir/process.log``."""
    with (workdir / "process.log").open("ab") as log:  # the child holds its own copy
        return subprocess.Popen(
            [sys.executable, *args],
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            cwd=workdir,
        )


def run_cli(args: Sequence[str], options: dict[str, str], env: dict[str, str]) -> bool:
    """``replog args`` with the storage ``options``; whether it succeeded (a failure is
    logged: chaos makes some)."""
    fs = [item for k, v in options.items() for item in ("--fs-option", f"{k}={v}")]
    done = subprocess.run(
        [str(Path(sys.executable).parent / "replog"), *args, *fs],
        capture_output=True,
        check=False,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        logger.info("replog %s failed: %s", args[0], done.stderr.decode()[-300:])
    return done.returncode == 0


def out_of_order(rows: list[dict[str, Any]]) -> int:
    """Keys whose events (in log order: a key lives on one shard) go back in ``n``."""
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for row in rows:
        by_key[row["key"]].append((row["sequence"], json.loads(row["data"])["n"]))
    return sum(
        1
        for pairs in by_key.values()
        if [n for _, n in sorted(pairs)] != sorted(n for _, n in pairs)
    )


def count_faults(ledger: Path) -> int:
    """Storage faults injected into an appender's processes, up to each one's last
    acknowledged append (each process notes its running total)."""
    latest: dict[int, int] = {}
    for line in ledger.read_text().splitlines() if ledger.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if "faults" in entry:
            latest[entry["pid"]] = max(latest.get(entry["pid"], 0), entry["faults"])
    return sum(latest.values())


# -- moto ------------------------------------------------------------------------------------


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    for _ in range(200):
        try:
            client.create_bucket(Bucket="chaos")
            return server, endpoint
        except Exception:  # not listening yet
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto did not start")


def run_chaos(seconds: float, workdir: Path, seed: int = 0, mix: Mix = Mix()) -> dict[str, Any]:
    server, endpoint = start_moto()
    try:
        return Chaos(workdir, endpoint, seconds, seed, mix).run()
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "append":
        url, writer, ledger, options = sys.argv[2:6]
        logging.basicConfig(level=logging.WARNING)
        appender_main(url, writer, Path(ledger), json.loads(options))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="replog-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = run_chaos(args.seconds, workdir, args.seed)
    report["wall_seconds"] = round(time.monotonic() - started)
    print(json.dumps(report, indent=2))
    bad = any(
        report[name]["lost"] or report[name]["doubled"] or report[name]["unknown"]
        for name in ("B1", "B2")
    )
    sys.exit(1 if bad or any(report[f"verify {n}"] != "ok" for n in ("A", "B1", "B2")) else 0)


if __name__ == "__main__":
    main()

"""The whole pipeline under chaos: PostgreSQL -> capture -> log A -> Spark replog-sink ->
log B -> Spark apply_changes -> Delta tables, every stage killed again and again, all on
one S3 endpoint (moto, in a process of its own); at the end each Delta table equals its
PostgreSQL table row by row.

For ``--seconds`` (default 600) the harness keeps running, each as its own process:

* a workload on PostgreSQL (embedded, ``wal_level=logical``): small transactions of
  inserts, updates, key changes and deletes on three tables: ``accounts`` (numeric(14,4),
  text, timestamptz), ``orders`` (a two-column key, numeric(12,2), timestamp without
  time zone, ``REPLICA IDENTITY FULL``) and ``docs`` (a text body often TOASTed, left
  unchanged by most updates, timestamptz). It starts once capture's first commit landed
  (from then on every transaction must be in log A) while the initial snapshot goes on;
* capture (``integration/apps/capture_faulty.py``: ``replog capture postgres``'s Python
  form, its log's storage injecting faults: 503s, resets, lost answers, a retried create
  answered 412, crashes) into log A, SIGKILLed at random moments or at its crash points
  (``capture_committed``, ``capture_staged``), and restarted;
* a replication A -> B (``integration/apps/replicate.py``: replog -> replog-sink), killed
  at random and at the sink's protocol steps, now and then restarted on a fresh
  checkpoint (same consumer and sink id);
* ``apply_changes`` B -> Delta (``integration/apps/apply_routed.py``: one query, target
  ``s3://chaos/delta/{collection}``, keys and types from the schema registry), killed at
  random and at ``apply_before_delta`` / ``apply_after_delta``;
* ``replog compact`` and ``replog recover --grace 10s`` of A and B on timers.

Then the workload stops, and each stage runs to the end once more, in order (capture
without faults, then replication, then apply). The harness checks: every workload
transaction is in A whole and once (its events counted by ``txId``), no event id twice in
A or B, B holds exactly A's events, no snapshot row read twice, ``verify`` clean on A and
B, and each Delta table equals its PostgreSQL table row by row (typed: numerics to the
digit, timestamps as instants, NULLs).

Run: .venv/bin/python benchmarks/chaos_pipeline.py [--seconds 600] [--workdir DIR]
(``integration/test_chaos_pipeline.py`` runs a short version in ``make test``; the
figures of the long run are in docs/RELIABILITY.md.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from chaos import count_faults, run_cli, spawn_python, start_moto  # noqa: E402

APPS = ROOT / "integration" / "apps"
SLOT = "chaos_pipeline"
TABLES = ("accounts", "orders", "docs")
KEYS = {"accounts": ("id",), "orders": ("region", "id"), "docs": ("id",)}
CREATE = """
CREATE TABLE accounts (
    id bigint PRIMARY KEY,
    owner text NOT NULL,
    balance numeric(14, 4),
    opened_at timestamptz NOT NULL,
    note text
);
CREATE TABLE orders (
    region text,
    id int,
    amount numeric(12, 2),
    placed_at timestamp NOT NULL,
    status text NOT NULL,
    PRIMARY KEY (region, id)
);
ALTER TABLE orders REPLICA IDENTITY FULL;
CREATE TABLE docs (
    id int PRIMARY KEY,
    title text NOT NULL,
    body text,
    edited_at timestamptz NOT NULL
);
"""
CAPTURE_FAULTS = {
    "unavailable": 0.02,
    "reset": 0.01,
    "lost_response": 0.02,
    "retried_create": 0.01,
    "crash": 0.002,
}
"""Per storage request of capture (the appenders' rates in ``benchmarks/chaos.py``)."""
CAPTURE_STEPS = ("capture_committed", "capture_staged")
SINK_STEPS = ("staged", "after_pending", "after_log_commit", "after_committed")
APPLY_STEPS = ("apply_before_delta", "apply_after_delta")
CRASH_EXIT = 3
"""capture_faulty.py's exit code for an injected storage crash."""
HANG_S = 900
"""A Spark run with a crash point is killed after this long (a hang, not slowness)."""
OWNERS = ("Ada", "Zoë Ørsted", 'Bob "the builder"', "O'Brien", "李雷", "Ana\\Maria", "  spaced  ")
STATUSES = ("new", "paid", "shipped", "cancelled")
REGIONS = ("eu", "us", "apac")
EPOCH = datetime(2020, 1, 1, tzinfo=timezone.utc)
logger = logging.getLogger("chaos_pipeline")


# -- the workload --------------------------------------------------------------------------


class Workload:
    """Small transactions on the three tables, one at a time (commit order is issue
    order), paced to ``rate`` a second. Remembers each committed transaction's id and
    the events capture must make of it (an update of the key: a delete and a create)."""

    def __init__(self, dsn: str, seed: int, rate: float) -> None:
        self.dsn, self.rate = dsn, rate
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.expected: dict[int, int] = {}
        self.changes: Counter[str] = Counter()
        self.live: dict[str, list[tuple[Any, ...]]] = {t: [] for t in TABLES}
        self.next_id = 1
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self.run, name="workload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    # values

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _instant(self) -> datetime:
        return EPOCH + timedelta(microseconds=self.rng.randrange(0, 6 * 365 * 86_400 * 10**6))

    def _decimal(self, digits: int, scale: int) -> Decimal | None:
        if self.rng.random() < 0.08:
            return None
        if self.rng.random() < 0.05:
            return Decimal(10**digits - 1).scaleb(-scale)  # the column's largest
        return Decimal(self.rng.randrange(-(10 ** (digits - 1)), 10 ** (digits - 1))).scaleb(-scale)

    def _body(self) -> str | None:
        pick = self.rng.random()
        if pick < 0.1:
            return None
        if pick < 0.55:
            return secrets.token_hex(self.rng.randrange(2_000, 5_000))  # TOASTed
        return f"short body {self.rng.randrange(10**6)} \u00e9\n\ttab"

    # changes: each returns the events capture makes of it

    def _insert(self, cursor: psycopg.Cursor[Any], table: str) -> int:
        new = self._id()
        if table == "accounts":
            row: tuple[Any, ...] = (
                new,
                self.rng.choice(OWNERS),
                self._decimal(10, 4),
                self._instant(),
                self.rng.choice((None, "vip", "note with \"quotes\" and 'apostrophes'")),
            )
            cursor.execute("INSERT INTO accounts VALUES (%s, %s, %s, %s, %s)", row)
            self.live[table].append((new,))
        elif table == "orders":
            region = self.rng.choice(REGIONS)
            placed = self._instant().replace(tzinfo=None)
            row = (region, new, self._decimal(10, 2), placed, self.rng.choice(STATUSES))
            cursor.execute("INSERT INTO orders VALUES (%s, %s, %s, %s, %s)", row)
            self.live[table].append((region, new))
        else:
            row = (new, f"doc {new}", self._body(), self._instant())
            cursor.execute("INSERT INTO docs VALUES (%s, %s, %s, %s)", row)
            self.live[table].append((new,))
        return 1

    def _where(self, table: str) -> str:
        return " AND ".join(f"{k} = %s" for k in KEYS[table])

    def _update(self, cursor: psycopg.Cursor[Any], table: str) -> int:
        key = self.rng.choice(self.live[table])
        choice = self.rng.randrange(3)
        if table == "accounts":
            column, value = [
                ("balance", self._decimal(10, 4)),
                ("note", self.rng.choice((None, "changed", "ünïcode"))),
                ("opened_at", self._instant()),
            ][choice]
        elif table == "orders":
            column, value = [
                ("amount", self._decimal(10, 2)),
                ("status", self.rng.choice(STATUSES)),
                ("placed_at", self._instant().replace(tzinfo=None)),
            ][choice]
        else:  # most leave the (TOASTed) body as it is: the server then does not send it
            column, value = [
                ("title", f"title {self.rng.randrange(10**6)}"),
                ("edited_at", self._instant()),
                ("body", self._body()),
            ][choice]
        cursor.execute(
            f"UPDATE {table} SET {column} = %s WHERE {self._where(table)}", (value, *key)
        )
        assert cursor.rowcount == 1, (table, key)
        return 1

    def _change_key(self, cursor: psycopg.Cursor[Any], table: str) -> int:
        live = self.live[table]
        key = live.pop(self.rng.randrange(len(live)))
        if table == "orders":  # moves to another region, keeps its id
            new: tuple[Any, ...] = (self.rng.choice([r for r in REGIONS if r != key[0]]), key[1])
            cursor.execute(
                "UPDATE orders SET region = %s WHERE region = %s AND id = %s", (new[0], *key)
            )
        else:
            new = (self._id(),)
            cursor.execute(f"UPDATE {table} SET id = %s WHERE id = %s", (new[0], key[0]))
        assert cursor.rowcount == 1, (table, key)
        live.append(new)
        return 2  # a delete of the old key, a create of the new one

    def _delete(self, cursor: psycopg.Cursor[Any], table: str) -> int:
        live = self.live[table]
        key = live.pop(self.rng.randrange(len(live)))
        cursor.execute(f"DELETE FROM {table} WHERE {self._where(table)}", key)
        assert cursor.rowcount == 1, (table, key)
        return 1

    def _change(self, cursor: psycopg.Cursor[Any]) -> int:
        table = self.rng.choice(TABLES)
        pick = self.rng.random()
        kind = (
            "insert"
            if pick < 0.3 or len(self.live[table]) < 20
            else "update"
            if pick < 0.75
            else "key change"
            if pick < 0.85
            else "delete"
        )
        self.changes[kind] += 1
        change: dict[str, Callable[[psycopg.Cursor[Any], str], int]] = {
            "insert": self._insert,
            "update": self._update,
            "key change": self._change_key,
            "delete": self._delete,
        }
        return change[kind](cursor, table)

    # running

    def create(self, rows: int) -> None:
        """The tables and ``rows`` rows in each (the initial snapshot reads them)."""
        with psycopg.connect(self.dsn) as connection, connection.cursor() as cursor:
            cursor.execute(CREATE)
            for table in TABLES:
                for _ in range(rows):
                    self._insert(cursor, table)

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as connection:
                while not self.stop.is_set():
                    begun = time.monotonic()
                    with connection.cursor() as cursor:
                        row = cursor.execute("SELECT txid_current()").fetchone()
                        assert row is not None
                        events = sum(self._change(cursor) for _ in range(self.rng.randint(1, 4)))
                    connection.commit()
                    self.expected[row[0] & 0xFFFF_FFFF] = events  # pgoutput's 32-bit xid
                    self.stop.wait(max(0.0, 1 / self.rate - (time.monotonic() - begun)))
        except BaseException as exc:  # reported by the check
            self.error = exc
            logger.exception("the workload failed")


# -- the harness ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """How often each stage dies where: at a crash point (else a SIGKILL at a random
    moment within its ``kill_after``), and how often the replication restarts on a fresh
    checkpoint. A Spark stage's crash point aims at the micro-batch it runs next or one
    of the ``epoch_spread`` after it. ``crash_until_fired``: every run carries a crash
    point until one has killed the stage, and the chaos lasts until each stage was so
    killed (at most :data:`FIRE_WITHIN` times ``--seconds``): a short run then kills each
    stage at a protocol step however slowly Spark starts."""

    capture_kill_after_s: tuple[float, float] = (3, 40)
    capture_crash_point_rate: float = 0.2
    spark_kill_after_s: tuple[float, float] = (20, 120)
    spark_crash_point_rate: float = 0.4
    fresh_checkpoint_rate: float = 0.15
    epoch_spread: int = 2
    crash_until_fired: bool = False


FIRE_WITHIN = 6
"""With ``crash_until_fired``, the chaos lasts until every stage died at a crash point, at
most this many times ``--seconds``. Three was too few on a machine running another test
at the same time: a stage whose crash point a replayed micro-batch passed over (nothing to
commit) needs another Spark start, 30-60 s there, for each try."""

SHORT_MIX = Mix(
    capture_kill_after_s=(3, 20),
    capture_crash_point_rate=0.3,
    spark_kill_after_s=(40, 90),
    spark_crash_point_rate=0.6,
    fresh_checkpoint_rate=0.3,
    epoch_spread=0,
    crash_until_fired=True,
)


@dataclass
class Tally:
    runs: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    """By stage and how: ``SIGKILL``, ``crash point <step>``, ``storage crash``."""
    failed_runs: Counter[str] = field(default_factory=Counter)
    """Runs that exited with an error (a storage fault past its retries, a busy slot)."""
    final_failures: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    failed_operations: Counter[str] = field(default_factory=Counter)
    fresh_checkpoints: int = 0


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline as a process the harness starts again and again."""

    name: str
    command: Callable[[bool, int], list[str]]
    """(final run, generation) -> the process's arguments."""
    steps: tuple[str, ...]
    kill_after_s: tuple[float, float]
    crash_point_rate: float
    after: threading.Event
    """Set when the stage may make its final run (the one before it is done)."""
    checkpoint: Callable[[int], Path] | None = None
    """A Spark stage's checkpoint (by generation): its crash points aim at a micro-batch
    near the next one (``step@epoch``), not always the first of a run."""
    done: threading.Event = field(default_factory=threading.Event)


class PipelineChaos:
    def __init__(  # noqa: PLR0917 - the run's settings
        self,
        workdir: Path,
        endpoint: str,
        dsn: str,
        seconds: float,
        seed: int,
        mix: Mix = Mix(),
        rate: float = 15.0,
        rows: int = 300,
    ) -> None:
        self.workdir, self.endpoint, self.dsn, self.mix = workdir, endpoint, dsn, mix
        self.seconds, self.rows = seconds, rows
        self.options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        self.delta_options = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
        self.urls = {"A": "s3://chaos/A", "B": "s3://chaos/B"}
        self.delta = "s3://chaos/delta/{collection}"
        self.rng = random.Random(seed)
        self.workload = Workload(dsn, seed, rate)
        self.tally = Tally()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.env = {
            **os.environ,
            "AWS_DEFAULT_REGION": "us-east-1",
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        }
        self.env.pop("REPLOG_FAULT", None)
        self.ledger = workdir / "capture-faults.jsonl"
        self.workload_done = threading.Event()
        self.fired: set[str] = set()
        """The stages a crash point killed."""

    # processes

    def _count(self, counter: Counter[str], what: str) -> None:
        with self.lock:
            counter[what] += 1

    # the stages

    def _capture(self, final: bool, generation: int) -> list[str]:
        del generation
        return [
            str(APPS / "capture_faulty.py"),
            self.dsn,
            self.urls["A"],
            "--slot",
            SLOT,
            "--tables",
            ",".join(f"public.{t}" for t in TABLES),
            "--fs-json",
            json.dumps(self.options),
            "--faults-json",
            "{}" if final else json.dumps(CAPTURE_FAULTS),
            "--ledger",
            str(self.ledger),
            *([] if final else ["--follow"]),
        ]

    def _replication_checkpoint(self, generation: int) -> Path:
        return self.workdir / f"chk-replicate-{generation}"

    def _apply_checkpoint(self, generation: int) -> Path:
        del generation  # a new checkpoint would need a new app_id: always the same one
        return self.workdir / "chk-apply"

    def _replicate(self, final: bool, generation: int) -> list[str]:
        del final
        return [
            str(APPS / "replicate.py"),
            self.urls["A"],
            self.urls["B"],
            str(self._replication_checkpoint(generation)),
            "--fs-json",
            json.dumps(self.options),
            "--sink-id",
            "to-B",
            "--consumer",
            "to-B",
            "--master",
            "local[1]",
            "--max-events",
            "500",
        ]

    def _apply(self, final: bool, generation: int) -> list[str]:
        del final
        return [
            str(APPS / "apply_routed.py"),
            self.urls["B"],
            self.delta,
            str(self._apply_checkpoint(generation)),
            "--app-id",
            "chaos-pipeline",
            "--registry",
            self.urls["A"],  # replog-sink does not copy the schema registry to B
            "--fs-json",
            json.dumps(self.options),
            "--delta-json",
            json.dumps(self.delta_options),
            "--consumer",
            "to-delta",
            "--max-events",
            "600",
        ]

    def stage(self, stage: Stage) -> None:
        """Run ``stage`` again and again, killing it, until the stop; then once more to
        the end (a few tries: a run may fail on a busy slot or be fenced)."""
        generation = 0
        fired = False
        while not self.stop.is_set():
            fired |= self._chaotic_run(stage, generation, fired)
            if stage.name == "replication" and self.rng.random() < self.mix.fresh_checkpoint_rate:
                generation += 1  # a fresh checkpoint, the same consumer and sink id
                with self.lock:
                    self.tally.fresh_checkpoints += 1
        stage.after.wait()
        for _ in range(5):
            process = spawn_python(self.workdir, stage.command(True, generation), dict(self.env))
            self._count(self.tally.runs, stage.name)
            if process.wait() == 0:
                break
            self._count(self.tally.final_failures, stage.name)
            time.sleep(3)
        stage.done.set()

    def _fault(self, stage: Stage, generation: int, fired: bool) -> str | None:
        """The crash point of the next run, if it gets one."""
        if not stage.steps:
            return None
        forced = self.mix.crash_until_fired and not fired
        if not forced and self.rng.random() >= stage.crash_point_rate:
            return None
        step = self.rng.choice(stage.steps)
        if stage.checkpoint is None:
            return step
        epoch = next_batch(stage.checkpoint(generation))
        return f"{step}@{epoch + self.rng.randint(0, self.mix.epoch_spread)}"

    def _chaotic_run(self, stage: Stage, generation: int, fired: bool) -> bool:
        """One run of ``stage``, killed at random or at a crash point; whether a crash
        point killed it."""
        env = dict(self.env)
        fault = self._fault(stage, generation, fired)
        if fault:
            env["REPLOG_FAULT"] = fault
        process = spawn_python(self.workdir, stage.command(False, generation), env)
        self._count(self.tally.runs, stage.name)
        if fault:
            # it dies at its crash point (a Spark stage's micro-batch) or ends (AvailableNow):
            # a random kill first would spare the crash point most times on a loaded
            # machine (a Spark start takes 30-60 s, a capture's first commit seconds)
            kill_at = time.monotonic() + HANG_S
        else:
            kill_at = time.monotonic() + self.rng.uniform(*stage.kill_after_s)
        missed = False
        while process.poll() is None and time.monotonic() < kill_at and not self.stop.is_set():
            time.sleep(0.2)
            if fault and stage.checkpoint is not None and _passed(stage, generation, fault):
                missed = True  # e.g. a replayed micro-batch Delta already holds: no commit
                break
        code = process.poll()
        if code is None:  # a random moment, a crash point passed (or the stop): SIGKILL
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            self._count(
                self.tally.kills,
                f"{stage.name}: SIGKILL" + (" (crash point passed)" if missed else ""),
            )
        elif code == -signal.SIGKILL and fault:
            self._count(self.tally.kills, f"{stage.name}: crash point {fault.split('@')[0]}")
            with self.lock:
                self.fired.add(stage.name)
            return True
        elif code == CRASH_EXIT:
            self._count(self.tally.kills, f"{stage.name}: injected storage crash")
        elif code != 0:
            self._count(self.tally.failed_runs, stage.name)
            self.stop.wait(1)
        else:  # AvailableNow ran out of input
            self.stop.wait(2)
        return False

    def operator(self, name: str, every_s: float, commands: list[list[str]]) -> None:
        while not self.stop.wait(self.rng.uniform(every_s * 0.5, every_s * 1.5)):
            for command in commands:
                ok = run_cli(command, self.options, self.env)
                self._count(self.tally.operations, name)
                if not ok:
                    self._count(self.tally.failed_operations, name)

    # the run

    def _captured_once(self) -> bool:
        from replog.capture.options import capture_app_id
        from replog.errors import LogNotFoundError
        from replog.log import ReplicationLog

        try:
            log = ReplicationLog.open(self.urls["A"], storage_options=self.options)
        except LogNotFoundError:
            return False
        return log.transaction_version(capture_app_id(SLOT)) is not None

    def run(self) -> dict[str, Any]:
        from replog.log import ReplicationLog
        from replog.ops import verify  # noqa: F401  (loaded now: the check runs at the end)

        started = time.monotonic()
        deadline = started + self.seconds
        self.workload.create(self.rows)
        for url in self.urls.values():
            ReplicationLog.create(url, 4, storage_options=self.options, snapshot_interval=20)
        capture = Stage(
            "capture",
            self._capture,
            CAPTURE_STEPS,
            self.mix.capture_kill_after_s,
            self.mix.capture_crash_point_rate,
            after=self.workload_done,
        )
        replication = Stage(
            "replication",
            self._replicate,
            SINK_STEPS,
            self.mix.spark_kill_after_s,
            self.mix.spark_crash_point_rate,
            after=capture.done,
            checkpoint=self._replication_checkpoint,
        )
        apply = Stage(
            "apply",
            self._apply,
            APPLY_STEPS,
            self.mix.spark_kill_after_s,
            self.mix.spark_crash_point_rate,
            after=replication.done,
            checkpoint=self._apply_checkpoint,
        )
        stages = [threading.Thread(target=self.stage, args=(capture,), name="capture")]
        stages[0].start()
        while not self._captured_once():  # then every transaction must reach A
            if time.monotonic() > deadline + 600:
                raise RuntimeError("capture never committed (see process.log)")
            time.sleep(0.5)
        logger.info("capture committed; the workload starts")
        self.workload.start()
        stages += [
            threading.Thread(target=self.stage, args=(s,), name=s.name)
            for s in (replication, apply)
        ]
        operators = [
            threading.Thread(target=self.operator, args=(op, every, commands), name=op)
            for op, every, commands in (
                ("compact", 30, [["compact", url] for url in self.urls.values()]),
                ("recover", 40, [["recover", url, "--grace", "10s"] for url in self.urls.values()]),
            )
        ]
        for thread in stages[1:] + operators:
            thread.start()
        while time.monotonic() < deadline or (
            self.mix.crash_until_fired
            and len(self.fired) < len(stages)
            and time.monotonic() < started + FIRE_WITHIN * self.seconds
        ):
            time.sleep(1)
        chaos_s = time.monotonic() - started
        self.stop.set()
        self.workload.stop.set()
        self.workload.join()
        self.workload_done.set()
        for thread in operators:
            thread.join()
        logger.info("workload and operators stopped; every stage runs to the end")
        for thread in stages:
            thread.join()
        report = self.check()
        report["chaos_seconds"] = round(chaos_s)
        report["catch_up_seconds"] = round(time.monotonic() - started - chaos_s)
        return report

    # the check

    def check(self) -> dict[str, Any]:
        from replog.log import ReplicationLog
        from replog.ops.verify import verify
        from replog.schemas import registry

        workload = self.workload
        report: dict[str, Any] = {
            "workload_error": repr(workload.error) if workload.error else None,
            "transactions": len(workload.expected),
            "changes": dict(workload.changes),
            "expected_change_events": sum(workload.expected.values()),
        }
        logs = {
            n: ReplicationLog.open(u, storage_options=self.options) for n, u in self.urls.items()
        }
        a = logs["A"].read_all().select(["event_id", "collection", "key", "operation", "metadata"])
        report["A"] = self._check_a(a.to_pylist())
        a_ids = set(a.column("event_id").to_pylist())
        b_ids = Counter(logs["B"].read_all().column("event_id").to_pylist())
        report["B"] = {
            "events": sum(b_ids.values()),
            "lost": len(a_ids - set(b_ids)),
            "doubled": sum(n - 1 for n in b_ids.values() if n > 1),
            "unknown": len(set(b_ids) - a_ids),
        }
        report["B"]["registered_schemas"] = sum(  # replog-sink does not copy A's registry
            len(registry.versions(logs["B"].storage, f"public.{t}")) for t in TABLES
        )
        for name, log in logs.items():
            result = verify(log)
            report[f"verify {name}"] = "ok" if result.ok else [str(p) for p in result.problems]
        report["delta"] = {t: self._compare(t) for t in TABLES}
        report["rows_compared"] = sum(d["rows"] for d in report["delta"].values())
        report["rows_unequal"] = sum(d["unequal"] for d in report["delta"].values())
        report["kills"] = dict(sorted(self.tally.kills.items()))
        report["kills_by_stage"] = dict(
            Counter(what.split(":")[0] for what in self.tally.kills.elements())
        )
        report["runs"] = dict(self.tally.runs)
        report["failed_runs"] = dict(self.tally.failed_runs)
        report["final_failures"] = dict(self.tally.final_failures)
        report["fresh_checkpoints"] = self.tally.fresh_checkpoints
        report["operations"] = dict(self.tally.operations)
        report["failed_operations"] = dict(self.tally.failed_operations)
        report["capture_storage_faults"] = count_faults(self.ledger)
        return report

    def _check_a(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Every workload transaction's events in A, once; nothing else but snapshot rows."""
        ids = Counter(row["event_id"] for row in rows)
        by_txn: Counter[int] = Counter()
        snapshot_keys: Counter[tuple[str, str]] = Counter()
        for row in rows:
            metadata = json.loads(row["metadata"])
            if metadata["op"] == "r":
                snapshot_keys[(row["collection"], row["key"])] += 1
            else:
                by_txn[int(metadata["source"]["txId"])] += 1
        expected = self.workload.expected
        return {
            "events": len(rows),
            "snapshot_events": sum(snapshot_keys.values()),
            "lost": sum(max(n - by_txn.get(txid, 0), 0) for txid, n in expected.items()),
            "doubled": sum(n - 1 for n in ids.values() if n > 1),
            "transactions_missing": sum(1 for txid in expected if txid not in by_txn),
            "transactions_wrong_count": sum(
                1 for txid, n in expected.items() if txid in by_txn and by_txn[txid] != n
            ),
            "events_of_unknown_transactions": sum(
                n for txid, n in by_txn.items() if txid not in expected
            ),
            "snapshot_rows_read_twice": sum(1 for n in snapshot_keys.values() if n > 1),
        }

    def _compare(self, table: str) -> dict[str, Any]:
        """The Delta table against PostgreSQL's, row by row (typed values)."""
        from deltalake import DeltaTable

        from replog.tables.delta import read_table

        keys = KEYS[table]
        with psycopg.connect(self.dsn) as connection:
            connection.execute("SET TIME ZONE 'UTC'")
            cursor = connection.execute(f"SELECT * FROM {table}")
            names = [d.name for d in cursor.description or ()]
            source = {
                tuple(row[names.index(k)] for k in keys): dict(zip(names, row, strict=True))
                for row in cursor.fetchall()
            }
        delta = DeltaTable(
            self.delta.format(collection=f"public.{table}"), storage_options=self.delta_options
        )
        built = {}
        for row in read_table(delta).to_pylist():
            values = {k: v for k, v in row.items() if not k.startswith("__")}
            built[tuple(values[k] for k in keys)] = values
        missing = source.keys() - built.keys()
        extra = built.keys() - source.keys()
        changed = {
            key: [
                (column, want, built[key].get(column, "<absent>"))
                for column, want in source[key].items()
                if not same(want, built[key].get(column, "<absent>"))
            ]
            for key in source.keys() & built.keys()
        }
        changed = {key: diffs for key, diffs in changed.items() if diffs}
        samples = [
            f"{key}: " + "; ".join(f"{c} PG {short(w)}, Delta {short(g)}" for c, w, g in diffs)
            for key, diffs in list(changed.items())[:5]
        ]
        return {
            "rows": len(source),
            "delta_rows": len(built),
            "missing": len(missing),
            "extra": len(extra),
            "changed": len(changed),
            "unequal": len(missing) + len(extra) + len(changed),
            "samples": samples
            + [f"missing {k}" for k in list(missing)[:3]]
            + [f"extra {k}" for k in list(extra)[:3]],
            "delta_version": delta.version(),
        }


def _passed(stage: Stage, generation: int, fault: str) -> bool:
    """Whether the run's Spark checkpoint committed the micro-batch its crash point aimed
    at without the step being reached (a batch replayed where its commit was made already
    makes none): the run would otherwise go on until the hang limit, never killed."""
    assert stage.checkpoint is not None
    return next_batch(stage.checkpoint(generation)) > int(fault.split("@")[1])


def next_batch(checkpoint: Path) -> int:
    """The micro-batch id a query on this Spark checkpoint runs next: the newest one
    planned if it was not committed (a replay), else the one after."""

    def ids(folder: str) -> list[int]:
        path = checkpoint / folder
        return [int(p.name) for p in path.iterdir() if p.name.isdigit()] if path.is_dir() else []

    planned = max(ids("offsets"), default=-1)
    return planned + 1 if planned in ids("commits") or planned < 0 else planned


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:45]}...({len(text)} chars)"


def same(want: Any, got: Any) -> bool:
    """Equal typed values: numerics to the digit (``1.5`` is not ``1.50``), timestamps as
    instants (a ``timestamp`` without time zone read as UTC), NULL only as NULL."""
    if isinstance(want, Decimal) or isinstance(got, Decimal):
        return type(want) is type(got) and str(want) == str(got)
    if isinstance(want, datetime) and isinstance(got, datetime):
        return instant(want) == instant(got)
    return type(want) is type(got) and want == got


def instant(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


# -- running it ----------------------------------------------------------------------------


@contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """``dsn``, or a fresh database on an embedded server."""
    if dsn is not None:
        yield dsn
        return
    from embedded_pg import running_server

    with running_server() as server, server.database("chaos") as fresh:
        yield fresh


def run_pipeline_chaos(
    seconds: float,
    workdir: Path,
    *,
    seed: int = 0,
    mix: Mix = Mix(),
    dsn: str | None = None,
    rate: float = 15.0,
    rows: int = 300,
) -> dict[str, Any]:
    server, endpoint = start_moto()
    try:
        with database(dsn) as source:
            return PipelineChaos(workdir, endpoint, source, seconds, seed, mix, rate, rows).run()
    finally:
        server.terminate()
        server.wait(timeout=30)


def failures(report: dict[str, Any]) -> list[str]:
    """What the run found wrong (empty: nothing lost, doubled or unequal)."""
    found = [
        f"A {name}: {report['A'][name]}"
        for name in (
            "lost",
            "doubled",
            "transactions_missing",
            "transactions_wrong_count",
            "events_of_unknown_transactions",
            "snapshot_rows_read_twice",
        )
        if report["A"][name]
    ]
    found += [
        f"B {name}: {report['B'][name]}"
        for name in ("lost", "doubled", "unknown")
        if report["B"][name]
    ]
    found += [
        f"verify {n}: {report[f'verify {n}']}" for n in ("A", "B") if report[f"verify {n}"] != "ok"
    ]
    found += [
        f"{t}: {d['unequal']} rows unequal {d['samples']}"
        for t, d in report["delta"].items()
        if d["unequal"]
    ]
    if report["workload_error"]:
        found.append(f"workload: {report['workload_error']}")
    if report["final_failures"]:
        found.append(f"final runs failed: {report['final_failures']}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=15.0, help="workload transactions/s")
    parser.add_argument("--rows", type=int, default=300, help="rows per table before capture")
    parser.add_argument("--dsn", help="a database to use instead of an embedded server")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="replog-chaos-pipeline-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logger.info("working in %s", workdir)
    started = time.monotonic()
    report = run_pipeline_chaos(
        args.seconds, workdir, seed=args.seed, dsn=args.dsn, rate=args.rate, rows=args.rows
    )
    report["wall_seconds"] = round(time.monotonic() - started)
    print(json.dumps(report, indent=2, default=str))
    found = failures(report)
    for problem in found:
        print("FAILED:", problem)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()

"""Stress for issue 32's fixes: retention racing stalled writers on skewed clocks, with
operators' compactions and collections running, and group commit alongside.

One log with a retention of ``--retention-ms`` (as replog 0.5 allowed: a second; every
commit's writer then checks its base, and expiry deletes commits all the time). For ``--seconds``:

* ``--writers`` threads, each with its own log object on a clock skewed by up to
  ``--skew-s``, append 5-event batches; their storage stalls a commit's put now and
  then, before it (a slot may be emptied under the writer) or after it lands (its base
  may expire before the writer checks it), for up to ``--stall-s``;
* ``--group`` threads submit to one :class:`GroupAppender` (some of them cancel now and
  then: a cancelled submission must not be sent, or must be acknowledged);
* a compactor alternates ``compact`` and ``compact --by-key`` (keys are unique: nothing is
  superseded), a collector runs ``recover --grace 0``.

Then every acknowledged event must be read back exactly once and ``verify`` be clean.
Appends whose outcome was unknown (``CommitOutcomeUnknownError``) are counted apart: each
must be in the log at most once.

    .venv/bin/python benchmarks/attack_32_stress.py --seconds 60
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from replog.appender import GroupAppender
from replog.errors import CommitOutcomeUnknownError, ReplogError
from replog.log import ReplicationLog
from replog.ops.compaction import compact
from replog.ops.keys import compact_by_key
from replog.ops.recovery import recover
from replog.ops.verify import verify
from replog.storage import Storage
from replog.timeutil import use_clock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.logs import short_retention_log  # the tests' helper


class Stalling(Storage):
    """Storage whose commit puts stall now and then, before or after they land."""

    stall_s = 0.0
    rate = 0.0
    stalls: Counter[str] = Counter()

    def _create_once(self, path: str, data: bytes, durability: Any) -> None:
        commit = "/_replog/commits/" in path
        if commit and random.random() < self.rate:
            Stalling.stalls["before put"] += 1
            time.sleep(random.uniform(0, self.stall_s))
        super()._create_once(path, data, durability)
        if commit and random.random() < self.rate:
            Stalling.stalls["after put"] += 1
            time.sleep(random.uniform(0, self.stall_s))


def stalling(log: ReplicationLog) -> ReplicationLog:
    copy = log.storage.child("")
    copy.__class__ = Stalling
    log.storage = copy
    return log


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: list[str] = []
        self.unknown: list[str] = []
        self.failed: list[str] = []
        self.cancelled: list[str] = []
        self.errors: Counter[str] = Counter()

    def note(self, kind: str, ids: list[str], error: BaseException | None = None) -> None:
        with self.lock:
            getattr(self, kind).extend(ids)
            if error is not None:
                self.errors[f"{type(error).__name__}: {str(error).split(': ', 1)[-1][:90]}"] += 1


class Notes(logging.Handler):
    """Counts what writers said about where their commits landed."""

    said: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for what in ("landed in a range retention deleted", "landed on the log's history",
                     "staging the append again", "could not tell where"):  # fmt: skip
            if what in text:
                Notes.said[what] += 1


def s3_log() -> tuple[str, dict[str, Any]]:
    """A log URL on a moto S3 server started here, and its storage options."""
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket="stress"
    )
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}  # fmt: skip
    return "s3://stress/log", options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--retention-ms", type=int, default=1500)
    parser.add_argument("--skew-s", type=float, default=300)
    parser.add_argument("--stall-s", type=float, default=3.0)
    parser.add_argument("--stall-rate", type=float, default=0.03)
    parser.add_argument("--cancel-rate", type=float, default=0.05)
    parser.add_argument("--s3", action="store_true", help="on a moto S3 server")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    random.seed(args.seed)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("replog").setLevel(logging.INFO)
    logging.getLogger("replog").addHandler(Notes())
    logging.getLogger().handlers[0].setLevel(logging.ERROR)
    Stalling.stall_s, Stalling.rate = args.stall_s, args.stall_rate
    url = str(Path(tempfile.mkdtemp(prefix="attack32-")) / "log")
    options: dict[str, Any] | None = None
    if args.s3:
        url, options = s3_log()
    short_retention_log(  # below the 10 minutes a log is created with since replog 0.6
        url, 4, args.retention_ms, snapshot_interval=10, storage_options=options
    )

    def open_log(**kwargs: Any) -> ReplicationLog:
        return ReplicationLog.open(url, storage_options=options, **kwargs)

    stop = threading.Event()
    tally = Tally()
    operators: Counter[str] = Counter()

    def writer(name: str, skew_s: float) -> None:
        log = stalling(open_log())
        n = 0
        with use_clock(lambda: time.time() + skew_s):
            while not stop.is_set():
                ids = [f"{name}-{n}-{j}" for j in range(5)]
                n += 1
                try:
                    log.append([{"event_id": i, "key": i, "data": {"n": n}} for i in ids])
                    tally.note("acked", ids)
                except CommitOutcomeUnknownError as exc:
                    tally.note("unknown", ids, exc)
                    log = stalling(open_log())
                except ReplogError as exc:
                    tally.note("failed", ids, exc)
                    log = stalling(open_log())
            log.flush()

    appender = GroupAppender(stalling(open_log()), linger_ms=5)

    def submitter(name: str) -> None:
        n = 0
        while not stop.is_set():
            ids = [f"{name}-{n}-{j}" for j in range(5)]
            n += 1
            future: Future[Any] = appender.submit(
                [{"event_id": i, "key": i, "data": {"n": n}} for i in ids]
            )
            if random.random() < args.cancel_rate and future.cancel():
                tally.note("cancelled", ids)
                continue
            try:
                future.result()
                tally.note("acked", ids)
            except CommitOutcomeUnknownError as exc:
                tally.note("unknown", ids, exc)
            except ReplogError as exc:
                tally.note("failed", ids, exc)

    def compactor() -> None:
        log = open_log(auto_compact=False)
        turn = 0
        while not stop.is_set():
            turn += 1
            try:
                if turn % 2:
                    compact(log)
                else:
                    compact_by_key(log)
                operators["compactions done"] += 1
            except ReplogError as exc:
                operators[f"compaction failed: {type(exc).__name__}"] += 1
            stop.wait(1.0)

    def collector() -> None:
        log = open_log(auto_compact=False)
        while not stop.is_set():
            try:
                recover(log, grace_ms=0)
                operators["recovers done"] += 1
            except ReplogError as exc:
                operators[f"recover failed: {type(exc).__name__}"] += 1
            stop.wait(1.5)

    threads = [
        threading.Thread(target=writer, args=(f"w{i}", random.uniform(-args.skew_s, args.skew_s)))
        for i in range(args.writers)
    ]
    threads += [threading.Thread(target=submitter, args=(f"g{i}",)) for i in range(args.group)]
    threads += [threading.Thread(target=compactor), threading.Thread(target=collector)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join()
    appender.close()
    elapsed = time.monotonic() - began

    final = open_log()
    counts = Counter(str(i) for i in final.read_all().column("event_id").to_pylist())
    lost = [i for i in tally.acked if counts[i] != 1 and counts[i] == 0]
    doubled = [i for i, c in counts.items() if c > 1]
    unknown_in = sum(1 for i in tally.unknown if counts[i])
    failed_in = [i for i in tally.failed if counts[i]]
    cancelled_in = [i for i in tally.cancelled if counts[i]]
    report = verify(final)
    print(f"log {url}, {elapsed:.0f} s, version {final.refresh().version}")
    print(f"events acknowledged {len(tally.acked)}, read back {sum(counts.values())}")
    print(f"lost {len(lost)}, doubled {len(doubled)}")
    print(f"unknown outcome {len(tally.unknown)} (in the log: {unknown_in})")
    print(f"failed {len(tally.failed)} (in the log: {len(failed_in)})")
    print(f"cancelled {len(tally.cancelled)} (in the log: {len(cancelled_in)})")
    print(f"errors {dict(tally.errors)}")
    print(f"stalls {dict(Stalling.stalls)}; operators {dict(operators)}")
    print(f"writers said {dict(Notes.said)}; retained from {final.refresh().retained_from}")
    print(f"verify ok: {report.ok} {report.problems[:3]}")
    if lost or doubled or failed_in or cancelled_in or not report.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

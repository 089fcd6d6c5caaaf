"""Chaos driver: ``replog capture postgres`` (its Python form) into a log whose storage
injects faults (503s, resets, lost answers, a retried create answered 412, crashes).

Usage: capture_faulty.py DSN URL --slot S --tables T[,T...] [--fs-json JSON]
       [--faults-json RATES] [--seed N] [--ledger FILE] [--follow] [--max-changes N]
       [--stage-events N] [--snapshot-chunk-rows N]

Capture's own code is unchanged: the log it is given is the one it would open, its
storage wrapped by :class:`replog.storage.faults.FaultyStorage`. An injected crash ends
the process at once (exit 3), as a machine failure would; any other failure exits 1
after the error is logged. ``--ledger`` gets one JSON line per change of the running
total of faults injected (``{"pid", "faults", "commits"}``). Crash points
(``REPLOG_FAULT=capture_committed`` / ``capture_staged``) kill the process group.
"""

import argparse
import json
import logging
import os
import random
import sys
from pathlib import Path

from replog.capture.options import CaptureOptions
from replog.capture.postgres import capture
from replog.capture.progress import CaptureProgress
from replog.log import ReplicationLog
from replog.storage import RetryPolicy
from replog.storage.faults import FaultInjector, FaultRates, FaultyStorage, SimulatedCrash

CRASH_EXIT = 3

parser = argparse.ArgumentParser()
parser.add_argument("dsn")
parser.add_argument("url")
parser.add_argument("--slot", required=True)
parser.add_argument("--tables", required=True)
parser.add_argument("--fs-json", default="{}")
parser.add_argument("--faults-json", default="{}", help="FaultRates fields; {} for none")
parser.add_argument("--seed", type=int, default=None)
parser.add_argument("--ledger", type=Path, default=None)
parser.add_argument("--follow", action="store_true")
parser.add_argument("--shards", type=int, default=4)
parser.add_argument("--max-changes", type=int, default=200)
parser.add_argument("--stage-events", type=int, default=50)
parser.add_argument("--snapshot-chunk-rows", type=int, default=100)
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

options = json.loads(args.fs_json)
clean = ReplicationLog.open_or_create(args.url, args.shards, storage_options=options)
rates = json.loads(args.faults_json)
injector = FaultInjector(
    seed=args.seed if args.seed is not None else random.randrange(1 << 30),
    rates=FaultRates.only(**rates),
)
storage = FaultyStorage.wrap(clean.storage, injector)
storage.retry = RetryPolicy(attempts=5, first_delay_s=0.01, max_delay_s=0.2)
log = ReplicationLog(storage, clean.descriptor)
ledger = args.ledger.open("a") if args.ledger else None
noted = [-1]


def note(progress: CaptureProgress) -> None:
    faults = sum(injector.faults.values())
    if ledger is not None and faults != noted[0]:
        noted[0] = faults
        ledger.write(json.dumps({"pid": os.getpid(), "faults": faults}) + "\n")
        ledger.flush()


capture_options = CaptureOptions(
    dsn=args.dsn,
    slot=args.slot,
    tables=tuple(args.tables.split(",")),
    follow=args.follow,
    max_changes=args.max_changes,
    stage_events=args.stage_events,
    snapshot_chunk_rows=args.snapshot_chunk_rows,
)
try:
    done = capture(capture_options, log, progress=note)
except SimulatedCrash:
    os._exit(CRASH_EXIT)  # the process dies here, as a crash would
except Exception:
    logging.exception("capture failed (faults injected so far: %s)", dict(injector.faults))
    sys.exit(1)
print("CAPTURED", json.dumps({"rows": done.rows, "transactions": done.transactions}))

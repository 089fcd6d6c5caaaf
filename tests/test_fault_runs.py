"""Random storage faults (seeded) against every writer: nothing lost, nothing doubled.

Each run drives appends, sink commits (retried as Spark retries an epoch), compactions
through storage that fails 13% of requests the ways object stores do:
503s and resets before a request, lost answers after a write landed, 412 to a retried
create that had landed. Afterwards, on clean storage: every event is there exactly once
or (only for an append that reported failure) not at all, every sink epoch exactly
once, every checksum holds, and ``recover`` deletes nothing live.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from support.logcheck import check_log

from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.errors import ReplogError
from replog.format.events import events_from_records
from replog.log import ReplicationLog
from replog.ops import compaction, recovery
from replog.ops.verify import verify
from replog.storage import RetryPolicy
from replog.storage.faults import FaultInjector, FaultyStorage
from replog.timeutil import now_ms

FAST_RETRY = RetryPolicy(attempts=4, first_delay_s=0.0, max_delay_s=0.0)


def events(prefix: str, n: int) -> list[dict]:
    return [{"event_id": f"{prefix}-{i}", "key": f"k{i % 7}", "data": {"i": i}} for i in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_random_storage_faults_lose_and_double_nothing(memory_url: str, seed: int) -> None:
    ReplicationLog.create(memory_url, 3, snapshot_interval=4)
    injector = FaultInjector(seed=seed)
    storage = FaultyStorage.wrap(ReplicationLog.open(memory_url).storage, injector)
    storage.retry = FAST_RETRY
    log = ReplicationLog.from_storage(storage)
    acknowledged: set[str] = set()
    uncertain: dict[str, set[str]] = {}
    for round_ in range(6):
        batch = events(f"a{round_}", 12)
        ids = {e["event_id"] for e in batch}
        try:
            log.append(batch)
            acknowledged |= ids
        except (ReplogError, OSError):
            uncertain[f"a{round_}"] = ids  # the append failed: landed whole, or not at all
        committer = SinkCommitter(log, "sink")
        for _attempt in range(20):  # Spark retries the epoch until it commits
            attempt = Batch("q", round_, run_id="r1")
            try:  # the staging start, as Spark's planning writer records it
                attempt = Batch(
                    "q", round_, run_id="r1", since_version=log.refresh().version, since_ms=now_ms()
                )
                staged = tuple(log.stage(events_from_records(events(f"s{round_}", 8))))
                attempt = dataclasses.replace(attempt, staged=staged)
                committer.commit(attempt)
                break
            except (ReplogError, OSError):
                # Spark ignores a failing abort too; garbage is then recover's job.
                with contextlib.suppress(ReplogError, OSError):
                    committer.abort(attempt, "retry")
        else:
            pytest.fail(f"epoch {round_} never committed under seed {seed}")
        acknowledged |= {f"s{round_}-{i}" for i in range(8)}
        if round_ % 2:
            with contextlib.suppress(ReplogError, OSError):  # a failure changes nothing visible
                compaction.compact(log)
    rows = check_log(ReplicationLog.open(memory_url))  # no id twice, no sequence gap
    present = {row["event_id"] for row in rows}
    assert acknowledged <= present, "acknowledged events are missing"
    for group, ids in uncertain.items():
        assert ids & present in (set(), ids), f"append {group} landed partly"
    assert present <= acknowledged | set().union(*uncertain.values())
    state = ReplicationLog.open(memory_url).refresh()
    assert state.sinks["sink"].epoch_of("q") == 5
    assert verify(ReplicationLog.open(memory_url)).ok
    recovery.recover(ReplicationLog.open(memory_url), grace_ms=0)
    assert verify(ReplicationLog.open(memory_url)).ok
    assert {r["event_id"] for r in check_log(ReplicationLog.open(memory_url))} == present
    assert sum(injector.faults.values()) > 0  # faults really happened

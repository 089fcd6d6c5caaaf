"""Assertions shared by tests: every event once, gapless sequences, per-key order."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from replog.log import ReplicationLog


def read_all(log: ReplicationLog, bounds: tuple[list[int], list[int]] | None = None) -> pa.Table:
    """Every event of each shard from its low watermark to its head, as ``bounds`` (lows,
    heads) give them (default: the log's newest): a writer committing meanwhile adds
    nothing to what is read."""
    lows, heads = bounds or _bounds(log)
    return pa.concat_tables(
        log.read_table(shard, lows[shard], heads[shard]) for shard in range(log.shards)
    )


def _bounds(log: ReplicationLog) -> tuple[list[int], list[int]]:
    """The newest lows and heads, copied (a later refresh may update the state in place)."""
    state = log.refresh()
    return list(state.lows), list(state.heads)


def check_log(log: ReplicationLog) -> list[dict[str, Any]]:
    """Read every event of one state of the log (a writer may go on committing);
    assert gapless per-shard sequences and unique event ids."""
    lows, heads = _bounds(log)
    rows = read_all(log, (lows, heads)).to_pylist()
    by_shard: dict[int, list[int]] = defaultdict(list)
    for row in rows:
        by_shard[row["shard"]].append(row["sequence"])
    for shard, sequences in by_shard.items():
        expected = list(range(lows[shard], heads[shard] + 1))
        missing = sorted(set(expected) - set(sequences))[:5]
        assert sequences == expected, (
            f"shard {shard} has gaps: {missing} missing of {lows[shard]}..{heads[shard]}"
        )
    ids = [row["event_id"] for row in rows]
    duplicates = {i for i in ids if ids.count(i) > 1} if len(ids) != len(set(ids)) else set()
    assert not duplicates, f"duplicated event ids: {sorted(duplicates)[:10]}"
    return rows


def check_key_order(rows: list[dict[str, Any]]) -> None:
    """Events of each key appear in increasing ``n`` (the writer's order)."""
    by_key: dict[str, list[int]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r["shard"], r["sequence"])):
        by_key[row["key"]].append(json.loads(row["data"])["n"])
    for key, ns in by_key.items():
        assert ns == sorted(ns), f"key {key} out of order: {ns[:20]}"


def run_concurrently(*functions: Callable[[], Any]) -> list[Any]:
    """Run every function in its own thread, all at once; return their results in order.

    The first exception any of them raised is re-raised here: a failing thread fails the
    test (pytest's ``filterwarnings = error`` catches any thread that escapes this too).
    """
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException] = []

    def run(index: int, function: Callable[[], Any]) -> None:
        try:
            results[index] = function()
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(functions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def check_intact(url: str) -> None:
    """The log's commits name only files that exist (``verify``), and every event reads
    back once, in gapless sequences."""
    from replog.ops.verify import verify

    final = ReplicationLog.open(url)
    report = verify(final)
    assert report.ok, f"a commit names a deleted or damaged file: {report.problems}"
    check_log(final)

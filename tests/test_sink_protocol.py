"""The sink's commit protocol without Spark: replays, aborts, crashes and zombie drivers."""

from __future__ import annotations

from pathlib import Path

from logcheck import check_log

from replog.events import events_from_records
from replog.log import ReplicationLog
from replog.manifest import SinkCommitStatus
from replog.records import WriterInfo
from replog.sink_protocol import PENDING_SEGMENTS, Outcome, SinkCommitter


def rows(start: int, count: int):
    return events_from_records(
        [
            {"event_id": f"e{i}", "key": f"k{i % 5}", "data": {"n": i}}
            for i in range(start, start + count)
        ]
    )


def leave_pending(committer: SinkCommitter, query: str, epoch: int, staged: list) -> None:
    """What a driver killed right after writing Pending(epoch) leaves: the manifest says
    Pending and names ``staged``; the log has no commit of the epoch."""
    pending = committer._load().next(epoch=epoch)
    pending.sink_commit_statuses[committer.sink_id] = SinkCommitStatus.pending()
    pending.sink_query_ids[committer.sink_id] = query
    pending.extra[PENDING_SEGMENTS] = {committer.sink_id: [s.path for s in staged]}
    committer.store.save(pending)


def test_a_replayed_epoch_is_committed_once(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "B"), 2)
    committer = SinkCommitter(log, "s")
    assert committer.commit("q", 0, log.stage(rows(0, 10))) is Outcome.COMMITTED
    replay = log.stage(rows(0, 10))
    assert committer.commit("q", 0, replay) is Outcome.REPLAYED
    assert not any(log.storage.exists(s.path) for s in replay)  # the replay's files are gone
    assert len(check_log(log)) == 10


def test_abort_after_commit_keeps_the_epoch(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "B"), 2)
    committer = SinkCommitter(log, "s")
    staged = log.stage(rows(0, 10))
    committer.commit("q", 0, staged)
    committer.abort("q", 0, staged, reason="commit raised afterwards")
    assert log.verify() == [] and len(check_log(log)) == 10
    assert committer.store.load_latest().sink_commit_statuses["s"].is_committed


def test_a_zombie_driver_committing_after_a_rollback_loses_nothing(tmp_path: Path) -> None:
    """A restarted driver rolls back a Pending epoch while the crashed attempt's driver
    (a zombie) is still alive and then commits it: no missing files, no duplicates."""
    log = ReplicationLog.create(str(tmp_path / "B"), 2)
    zombie = SinkCommitter(log, "s")
    zombie.commit("q", 0, log.stage(rows(0, 10)))
    zombie_files = log.stage(rows(10, 10))
    leave_pending(zombie, "q", 1, zombie_files)

    restarted = SinkCommitter(ReplicationLog.open(log.url), "s")
    resolution = restarted.recover()
    assert resolution is not None and resolution.committed is False
    assert all(log.storage.exists(s.path) for s in zombie_files)  # left for `recover`

    # The zombie's log commit now lands, naming its (still present) files.
    assert log.commit_staged(zombie_files, writer=WriterInfo("s", "q", 1)) is not None
    # Spark's replay of epoch 1 in the restarted driver defers to it.
    assert restarted.commit("q", 1, restarted.log.stage(rows(10, 10))) is Outcome.REPLAYED
    final = ReplicationLog.open(log.url)
    assert final.verify() == []
    assert sorted(r["event_id"] for r in check_log(final)) == sorted(f"e{i}" for i in range(20))
    assert restarted.store.load_latest().sink_epochs["s"] == 1

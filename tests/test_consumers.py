"""Consumers (replog.checkpoints.consumers): names, fencing, deletion, sink links."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.logs import commit_offsets, filled_log, log_rows

from replog.checkpoints import consumers
from replog.checkpoints.consumers import OffsetCommitter, SinkLink
from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.errors import (
    ConsumerResetError,
    FencedError,
    InvalidOptionError,
    ManifestNotFoundError,
)
from replog.format.commits import SourcePosition
from replog.log import ReplicationLog
from replog.ops import retention


@pytest.mark.parametrize("name", ["etl\n", "", "a/b", "..", " x", "x" * 300])
def test_bad_consumer_names_are_refused(tmp_path: Path, name: str) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    with pytest.raises(InvalidOptionError, match="consumer"):
        OffsetCommitter(log, name, "run")


def test_a_second_reader_of_one_consumer_fences_the_first(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    first = OffsetCommitter(log, "etl", "run-1")
    first.commit({0: 1, 1: 1}, log_version=1, note="batch 0")
    second = OffsetCommitter(log, "etl", "run-2")
    second.commit({0: 2, 1: 2}, log_version=1, note="batch 0")
    with pytest.raises(FencedError, match="run-2"):
        first.commit({0: 3, 1: 3}, log_version=1, note="batch 1")
    position = consumers.committed_position(log, "etl")
    assert position is not None and position.offsets == {0: 2, 1: 2}
    assert position.owner == "run-2" and position.generation == 2


def test_offsets_must_name_every_shard(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=1)
    with pytest.raises(InvalidOptionError, match=r"shards 0\.\.1"):
        OffsetCommitter(log, "etl", "run").commit({0: 1}, log_version=1, note="x")


def test_deleting_a_dead_consumer_unblocks_retention(tmp_path: Path) -> None:
    log = filled_log(str(tmp_path / "log"), commits=2)
    heads = log.head()
    commit_offsets(log, "live", {0: heads[0], 1: heads[1]})
    commit_offsets(log, "dead", {0: 0, 1: 0})
    assert retention.consumed_lows(log) == {0: 1, 1: 1}
    consumers.delete_consumer(log, "dead")
    assert consumers.list_consumers(log) == ["live"]
    assert retention.consumed_lows(log) == {0: heads[0] + 1, 1: heads[1] + 1}
    with pytest.raises(ManifestNotFoundError, match="no consumer 'dead'"):
        consumers.delete_consumer(log, "dead")


def test_a_replaced_checkpoint_resumes_past_what_a_linked_sink_wrote(tmp_path: Path) -> None:
    """The sink's log commit records the source positions it covers; a consumer whose
    own offsets lag behind (Spark's commit never came) resumes from the sink's."""
    source = filled_log(str(tmp_path / "A"), commits=2)
    target = ReplicationLog.create(str(tmp_path / "B"), 2)
    commit_offsets(source, "mirror", {0: 5, 1: 5})
    consumers.write_link(source.storage, "mirror", SinkLink(target.url, target.log_id, "to-b"))
    position = SourcePosition(source.log_id, "mirror", {0: 30, 1: 20})
    batch = Batch("q", 0, tuple(target.stage(log_rows(4))), sources=(position,))
    SinkCommitter(target, "to-b").commit(batch)
    resumed = consumers.resume_offsets(source, "mirror", {})
    assert resumed is not None and resumed.offsets == {0: 30, 1: 20}
    # A sink that wrote less than the consumer committed does not move it back.
    commit_offsets(source, "mirror", {0: 40, 1: 10})
    resumed = consumers.resume_offsets(source, "mirror", {})
    assert resumed is not None and resumed.offsets == {0: 40, 1: 20}


def test_a_link_to_a_log_that_is_gone_is_ignored(tmp_path: Path) -> None:
    source = filled_log(str(tmp_path / "A"), commits=1)
    commit_offsets(source, "mirror", {0: 5, 1: 5})
    consumers.write_link(
        source.storage, "mirror", SinkLink(str(tmp_path / "gone"), "some-id", "to-b")
    )
    resumed = consumers.resume_offsets(source, "mirror", {})
    assert resumed is not None and resumed.offsets == {0: 5, 1: 5}


def test_a_reader_resuming_elsewhere_does_not_undo_an_operators_reset(tmp_path: Path) -> None:
    """``replog consumer set`` moved the consumer back; a reader that then takes the
    consumer over from another position (a query restarted on its old checkpoint) stops
    and says how to apply the reset, instead of silently moving the consumer back."""
    log = filled_log(str(tmp_path / "log"), commits=2, per_commit=20)
    version = log.refresh().version
    OffsetCommitter(log, "etl", "query-run-1").commit(
        {0: 15, 1: 15}, log_version=version, note="spark"
    )
    operator = OffsetCommitter(log, "etl", "replog-cli")
    operator.commit({0: 2, 1: 2}, log_version=version, note=consumers.OPERATOR_NOTE)
    restarted = OffsetCommitter(log, "etl", "query-run-2")
    with pytest.raises(ConsumerResetError, match="new checkpoint"):
        restarted.commit({0: 15, 1: 15}, log_version=version, note="spark")
    assert consumers.committed_position(log, "etl").offsets == {0: 2, 1: 2}  # type: ignore[union-attr]
    fresh = OffsetCommitter(log, "etl", "query-run-3")  # a new checkpoint starts at the reset
    fresh.commit({0: 2, 1: 2}, log_version=version, note="spark")
    fresh.commit({0: 9, 1: 9}, log_version=version, note="spark")  # and moves on from it
    again = OffsetCommitter(log, "etl", "replog-cli")  # a second reset by an operator is fine
    again.commit({0: 20, 1: 20}, log_version=version, note=consumers.OPERATOR_NOTE)


def test_an_operators_rewind_is_not_raised_back_to_what_a_linked_sink_wrote(
    tmp_path: Path,
) -> None:
    """After ``replog consumer set`` rewinds a consumer that feeds a replog sink, a query
    on a new checkpoint starts at the rewind (it is meant to repeat), not at the sink's
    positions, and its first commit passes the reset check."""
    source = filled_log(str(tmp_path / "A"), commits=2)
    target = ReplicationLog.create(str(tmp_path / "B"), 2)
    consumers.write_link(source.storage, "mirror", SinkLink(target.url, target.log_id, "to-b"))
    position = SourcePosition(source.log_id, "mirror", {0: 20, 1: 20})
    SinkCommitter(target, "to-b").commit(
        Batch("q", 0, tuple(target.stage(log_rows(4))), sources=(position,))
    )
    version = source.refresh().version
    OffsetCommitter(source, "mirror", "cli").commit(
        {0: 0, 1: 0}, log_version=version, note=consumers.OPERATOR_NOTE
    )
    resumed = consumers.resume_offsets(source, "mirror", {})
    assert resumed is not None and resumed.offsets == {0: 0, 1: 0}
    OffsetCommitter(source, "mirror", "new-query").commit(
        resumed.offsets, log_version=version, note="spark"
    )

"""Damage is named, never silent (issue 40): what ``replog read``, ``verify``, ``recover``,
``history``, writers and a reader that is running do with a log whose files were deleted,
truncated, or put under another name (FORMAT.md, "Damage"). The Spark source's side is in
test_spark_source.py.

Each log has 3 shards, a header every 10 commits and a table every 20, and commit c
(1-based) holds the 4 events ``c-0`` .. ``c-3``."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from independent import format_reader
from independent.format_reader import read_log
from support.cli import replog
from support.storages import as_class

from replog.core import history
from replog.errors import CorruptionError, MissingCommitError
from replog.format.commits import commit_path
from replog.log import ReplicationLog
from replog.storage import Storage

PER_COMMIT = 4


def add(log: ReplicationLog, first: int, last: int) -> None:
    """Commits ``first..last`` (each with its own 4 events)."""
    for c in range(first, last + 1):
        log.append([{"key": f"{c}-{j}", "event_id": f"{c}-{j}", "data": {"c": c}}
                    for j in range(PER_COMMIT)])  # fmt: skip
    log.flush()


def damaged(tmp_path: Path, commits: int = 35) -> tuple[ReplicationLog, Path]:
    url = tmp_path / "log"
    log = ReplicationLog.create(str(url), 3, snapshot_interval=20, auto_compact=False)
    add(log, 1, commits)
    return log, url


def event_ids(url: Path | str) -> list[str]:
    """Every event ``replog read`` prints (it must exit 0)."""
    result = replog("read", str(url))
    assert result.returncode == 0, result.stderr
    return sorted(json.loads(line)["event_id"] for line in result.stdout.splitlines())


def of_commits(first: int, last: int) -> list[str]:
    return sorted(f"{c}-{j}" for c in range(first, last + 1) for j in range(PER_COMMIT))


def verified(url: Path) -> list[dict[str, str]]:
    """``replog verify --json``'s problems (it must exit 1: there are some)."""
    result = replog("verify", str(url), "--json")
    assert result.returncode == 1, result.stdout
    return list(json.loads(result.stdout)["problems"])


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- item 1: a header under another version's name ----------------------------------------


@pytest.mark.parametrize("hint", ["removed", "naming it"])
def test_a_header_under_another_versions_name_is_passed_over_and_named(
    tmp_path: Path, hint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Header 20 copied over header 30 (a partial restore): ``read`` and ``verify``
    stopped with "KeyError: 30". Now the header is unusable like a corrupt one: every
    event is read from header 20 and the commits after it (as the second reader does),
    and ``verify`` names the file."""
    _, url = damaged(tmp_path)
    shutil.copyfile(url / history.header_path(20), url / history.header_path(30))
    if hint == "removed":
        (url / history.SNAPSHOT_HINT_PATH).unlink()
    else:
        (url / history.SNAPSHOT_HINT_PATH).write_text(json.dumps({"version": 30}))
    with caplog.at_level(logging.WARNING):
        assert event_ids(url) == of_commits(1, 35)
    assert any("holds the header of version 20, not 30" in w for w in warnings_of(caplog))
    with pytest.warns(format_reader.FormatWarning, match="does not match the file name"):
        assert len(read_log(str(url))["events"]) == 35 * PER_COMMIT
    [problem] = verified(url)
    assert problem["path"].endswith(history.header_path(30))
    assert "holds the header of version 20, not 30" in problem["message"]


# -- item 2: a missing commit with later commits present ----------------------------------


def test_a_missing_commit_in_the_middle_is_named_by_read_verify_recover_and_writers(
    tmp_path: Path,
) -> None:
    """Commit 33 deleted, 34 and 35 present, header 30 the newest: ``read`` printed the
    events up to commit 32 and exited 0. Now it fails naming the commit, ``verify`` says
    readers stop there, ``recover`` deletes nothing (the files of commits 33-35 would
    have looked like garbage), and a writer refuses rather than fill the gap."""
    _, url = damaged(tmp_path)
    (url / commit_path(33)).unlink()
    files = sorted((url / "shards").rglob("*.arrow"))
    failed = replog("read", str(url))
    assert failed.returncode == 2 and failed.stdout == ""
    assert f"{commit_path(33)}: commit 33 is missing, but commit 34 exists" in failed.stderr
    assert "Restore the file" in failed.stderr
    [problem] = verified(url)
    assert problem["path"].endswith(commit_path(33))
    assert "readers and writers stop at version 32" in problem["message"]
    recovered = replog("recover", str(url), "--grace", "0s")
    assert recovered.returncode == 2 and "commit 33 is missing" in recovered.stderr
    assert sorted((url / "shards").rglob("*.arrow")) == files
    with pytest.raises(MissingCommitError, match="commit 33 is missing"):
        ReplicationLog.open(str(url)).append([{"key": "k", "data": 1}])
    assert not (url / commit_path(33)).exists()
    with pytest.raises(format_reader.CorruptionError, match="commit 33 is missing"):
        read_log(str(url))


def test_a_gap_of_several_commits_below_the_next_checkpoint_is_found_at_open(
    tmp_path: Path,
) -> None:
    """Opening looks at the commits up to a checkpoint's worth past a missing one."""
    _, url = damaged(tmp_path, 38)
    for version in (32, 33, 34, 35, 36):
        (url / commit_path(version)).unlink()
    with pytest.raises(MissingCommitError, match="commit 32 is missing, but commit 37 exists"):
        ReplicationLog.open(str(url)).refresh()


def test_a_gap_below_a_usable_header_is_read_past_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Commit 25 deleted and the hint moved back to 20: header 30, found by listing,
    holds the state past the gap, so every event is read (it says so), and ``verify``
    says readers do not need the commit."""
    _, url = damaged(tmp_path)
    (url / commit_path(25)).unlink()
    (url / history.SNAPSHOT_HINT_PATH).write_text(json.dumps({"version": 20}))
    with caplog.at_level(logging.WARNING):
        assert event_ids(url) == of_commits(1, 35)
    assert any("commit 25 is missing (commit 26 exists), but header 30" in w
               for w in warnings_of(caplog))  # fmt: skip
    [problem] = verified(url)
    assert "readers do not need it (snapshot 30 holds the state past it)" in problem["message"]


class MissesOnce(Storage):
    """Storage on which the first read of commit 33 finds it missing: it lands (with 34)
    between that read and the next ones, as a writer's commits may."""

    missed = False

    def read_optional(self, relative: str) -> bytes | None:
        if relative == commit_path(33) and not MissesOnce.missed:
            MissesOnce.missed = True
            return None
        return super().read_optional(relative)


def test_commits_that_land_between_a_miss_and_the_look_past_it_are_no_gap(
    tmp_path: Path,
) -> None:
    _, url = damaged(tmp_path)
    reader = ReplicationLog.open(str(url))
    storage = as_class(reader.storage, MissesOnce)
    state = history.load_state(storage, reader.descriptor)
    assert MissesOnce.missed and state.version == 32  # the head as it looked: no error
    assert history.catch_up(storage, state) and state.version == 35


# -- a reader that is running when the damage happens -------------------------------------


@pytest.mark.parametrize("past_it", [False, True])
def test_a_running_reader_names_a_gap_or_reads_on_from_a_header_past_it(
    tmp_path: Path, past_it: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader at version 25; a writer commits up to 29 (or 45: headers 30 and 40), and
    commit 27 is deleted before the reader looks. It stopped at 26 as if at the head,
    and stayed there; now it fails naming commit 27, or, with a header past the gap,
    reads every event from there (with a warning)."""
    log, url = damaged(tmp_path, 25)
    reader = ReplicationLog.open(str(url))
    assert reader.refresh().version == 25
    add(log, 26, 45 if past_it else 29)
    (url / commit_path(27)).unlink()
    if not past_it:
        with pytest.raises(MissingCommitError, match="commit 27 is missing, but commit 28"):
            reader.refresh()
        return
    with caplog.at_level(logging.WARNING):
        assert reader.refresh().version == 45
    assert any("commit 27 is missing (commit 28 exists), but snapshot 40" in w
               for w in warnings_of(caplog))  # fmt: skip
    ids = sorted(reader.read_all().column("event_id").to_pylist())
    assert ids == of_commits(1, 45)


# -- item 3: the quiet cases, decided -------------------------------------------------------


def corrupt_newest_header(url: Path) -> None:
    (url / history.header_path(30)).write_bytes(b'{"version": 30, "checksum": "0"}')


def delete_checkpoint_commit(url: Path) -> None:
    (url / commit_path(30)).unlink()


def delete_hint(url: Path) -> None:
    (url / history.SNAPSHOT_HINT_PATH).unlink()


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (corrupt_newest_header, history.header_path(30)),
        (delete_checkpoint_commit, commit_path(30)),
        (delete_hint, None),
    ],
)
def test_damage_readers_do_not_need_is_read_past_quietly_and_named_by_verify(
    tmp_path: Path, damage: Any, named: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """FORMAT.md, "Damage": the newest header corrupt while the hint's copy of it holds,
    the checkpoint's own commit deleted (commits after it present), the hint deleted.
    Readers never read the damaged file (the copy, header 30 and its changes file, or
    probing for headers, give the same answer): every event, no warning. ``verify``
    names the damaged file; a missing hint is no damage (it is a hint)."""
    _, url = damaged(tmp_path)
    damage(url)
    with caplog.at_level(logging.WARNING):
        assert event_ids(url) == of_commits(1, 35)
        assert ReplicationLog.open(str(url)).refresh().version == 35
    assert warnings_of(caplog) == []
    if named is None:
        assert replog("verify", str(url)).returncode == 0
        return
    [problem] = verified(url)
    assert problem["path"].endswith(named)
    if damage is delete_checkpoint_commit:
        assert "readers do not need it" in problem["message"]


def test_history_names_a_missing_commit_instead_of_ending_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``replog history`` took a missing commit for retention's and listed nothing older."""
    _, url = damaged(tmp_path)
    delete_checkpoint_commit(url)
    shown = json.loads(replog("history", str(url), "--json").stdout)
    assert [c["version"] for c in shown["commits"]] == [v for v in range(35, 0, -1) if v != 30]
    assert any("commit 30 is missing, though older ones exist" in w for w in warnings_of(caplog))


# -- adversarial: other ways a log can be damaged or misread --------------------------------


def test_a_truncated_commit_a_reader_needs_is_named(tmp_path: Path) -> None:
    _, url = damaged(tmp_path)
    path = url / commit_path(33)
    path.write_bytes(path.read_bytes()[:100])
    failed = replog("read", str(url))
    assert failed.returncode == 2 and f"{commit_path(33)}: not valid JSON" in failed.stderr
    [problem] = verified(url)
    assert problem["path"].endswith(commit_path(33))


def test_a_header_past_the_newest_commit_is_passed_over_and_named_by_verify(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Commits 36-40 deleted, header 40 (the hint's) left: nothing tells them from
    commits a header was written for late, so readers read up to 35, warning; ``verify``
    said the log was fine, and now names the header past the commits."""
    _, url = damaged(tmp_path, 40)
    for version in range(36, 41):
        (url / commit_path(version)).unlink()
    with caplog.at_level(logging.WARNING):
        assert event_ids(url) == of_commits(1, 35)
    assert any("snapshot header 40" in w and "unusable" in w for w in warnings_of(caplog))
    [problem] = verified(url)
    assert problem["path"].endswith(history.header_path(40))
    assert "past the newest commit (35): commits 36..40 are missing" in problem["message"]


def test_a_commit_far_ahead_is_named_by_verify(tmp_path: Path) -> None:
    """A stray commit 60 after a head of 35: no reader looks that far without listing
    (FORMAT.md, "Damage", the limits); ``verify``, which lists, names every missing one."""
    _, url = damaged(tmp_path)
    shutil.copyfile(url / commit_path(35), url / commit_path(60))
    assert event_ids(url) == of_commits(1, 35)
    problems = verified(url)
    missing = [p for p in problems if "commit is missing (later commits exist)" in p["message"]]
    assert [p["path"][-25:-5] for p in missing] == [f"{v:020d}" for v in range(36, 60)]
    assert all("readers and writers stop at version 35" in p["message"] for p in missing)
    assert any(p["path"].endswith(commit_path(60)) and "holds version 35" in p["message"]
               for p in problems)  # fmt: skip


def test_a_hint_past_every_header_is_survived(tmp_path: Path) -> None:
    _, url = damaged(tmp_path)
    (url / history.SNAPSHOT_HINT_PATH).write_text(json.dumps({"version": 80}))
    assert event_ids(url) == of_commits(1, 35)


def test_corruption_in_a_commit_after_a_gap_is_no_reason_to_read_past_it(
    tmp_path: Path,
) -> None:
    """The commit after the missing one is only looked for, never trusted: a gap is named
    whatever the later commit holds."""
    _, url = damaged(tmp_path)
    (url / commit_path(33)).unlink()
    (url / commit_path(34)).write_bytes(b"not json")
    with pytest.raises(CorruptionError, match="commit 33 is missing, but commit 34 exists"):
        ReplicationLog.open(str(url)).refresh()


# -- on S3, where commits are read in parallel rounds ---------------------------------------


def test_a_gap_on_s3_is_named_at_open_and_by_a_running_reader(s3: Any) -> None:
    """On remote storage the commits after a header are read C at once, and a reader's
    check reads the commit after the round alongside: the same gaps are found there."""
    options = s3.storage_options
    log = ReplicationLog.create(s3.url("log"), 3, storage_options=options, auto_compact=False)
    add(log, 1, 15)
    reader = ReplicationLog.open(log.url, storage_options=options)
    assert reader.refresh().version == 15
    add(log, 16, 19)
    log.storage.delete(commit_path(17))
    with pytest.raises(MissingCommitError, match="commit 17 is missing, but commit 18 exists"):
        reader.refresh()
    with pytest.raises(MissingCommitError, match="commit 17 is missing, but commit 18 exists"):
        ReplicationLog.open(log.url, storage_options=options).refresh()
    with pytest.raises(MissingCommitError, match="commit 17 is missing"):
        ReplicationLog.open(log.url, storage_options=options).append([{"key": "k", "data": 1}])
    assert not log.storage.exists(commit_path(17))

"""Every operator command against one log (shared by the local-disk and S3 tests)."""

from __future__ import annotations

import json
import time
from typing import Any

from support.cli import replog
from support.logcheck import check_log
from support.logs import commit_offsets, filled_log, segment_files


def run_operator_commands(
    url: str, storage_options: dict[str, Any] | None = None, fs_args: tuple[str, ...] = ()
) -> None:
    log = filled_log(url, commits=4, storage_options=storage_options)
    commit_offsets(log, "etl", {0: 8, 1: 8})
    shown = replog("status", url, *fs_args)
    assert shown.returncode == 0 and "etl" in shown.stdout and "lag" in shown.stdout
    report = json.loads(replog("status", url, "--json", *fs_args).stdout)
    assert report["consumers"][0]["name"] == "etl"

    refused = replog("truncate", url, "--keep-from", '{"0": 30}', *fs_args)
    assert refused.returncode == 2 and "consumer 'etl'" in refused.stderr
    assert log.refresh().lows == [1, 1]
    dry = replog("truncate", url, "--keep-from", '{"0": 30}', "--dry-run", *fs_args)
    assert dry.returncode == 1 and "BLOCKED" in dry.stdout and "--force" in dry.stdout
    done = replog("truncate", url, *fs_args)  # what every consumer committed
    assert done.returncode == 0, done.stderr
    assert log.refresh().lows == [9, 9]
    forced = replog("truncate", url, "--keep-from", '{"0": 30}', "--force", *fs_args)
    assert forced.returncode == 0 and log.refresh().lows[0] == 30
    bad = replog("truncate", url, "--older-than", "soon", *fs_args)
    assert bad.returncode == 2 and "--older-than: 'soon' is not a duration" in bad.stderr

    compacted = replog("compact", url, *fs_args)
    assert compacted.returncode == 0 and "merged" in compacted.stdout, compacted.stderr
    assert log.refresh().segment_count == 2
    kept = replog("recover", url, *fs_args)
    assert kept.returncode == 0 and "deleted 0 garbage" in kept.stdout, kept.stdout
    live = {segment.path for lane in log.refresh().segments for segment in lane}
    garbage = segment_files(log) - live  # the files compaction and truncation replaced
    assert len(garbage) >= 4
    # S3 stamps may have whole seconds: with the mark in a later second than the
    # compaction, "removed before the cut-off" is certain (a tie keeps files, the safe side)
    time.sleep(1.1)
    collected = replog("recover", url, "--grace", "0", *fs_args)
    assert collected.returncode == 0 and f"deleted {len(garbage)} garbage" in collected.stdout
    assert segment_files(log) == live
    assert replog("verify", url, *fs_args).returncode == 0
    assert len(check_log(log)) == 160 - 29 - 8  # shard 0 keeps from 30, shard 1 from 9

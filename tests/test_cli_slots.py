"""What an operator sees of captures on a real PostgreSQL: ``replog slots`` (every logical
slot, its owner log, the capture holding it, the WAL it keeps, how far behind it is),
``replog slots drop`` (what depends on a slot named first, a running capture refused, a
question on a terminal), a one-shot capture's word on the WAL its slot keeps, and
``replog status --source-dsn``: lag in bytes and in seconds on the source's clock (growing
while capture is down, 0 once caught up), the run's state and last error, and why a
capture cannot resume."""

from __future__ import annotations

import json
import os
import pty
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo
from support.capture import captured, following, query, run, sql
from support.cli import REPLOG, replog
from test_cli_output import validate

from replog.capture import slots
from replog.errors import SourcePositionError
from replog.log import ReplicationLog
from replog.timeutil import now_ms, use_clock


def _json(*args: str, schema: str, code: int = 0) -> Any:
    result = replog(*args, "--json")
    assert result.returncode == code, (args, result.stdout, result.stderr)
    document = json.loads(result.stdout)
    validate(document, schema)
    return document


def _slots(dsn: str) -> dict[str, dict[str, Any]]:
    document = _json("slots", dsn, schema="slots")
    return {slot["name"]: slot for slot in document["slots"]}


def _status(url: str, dsn: str) -> dict[str, Any]:
    [capture] = _json("status", url, "--source-dsn", dsn, schema="status")["captures"]
    return capture  # type: ignore[no-any-return]


def _tables(dsn: str) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT g, 0 FROM generate_series(1, 10) g",
        "CREATE TABLE u (id int PRIMARY KEY, filler text)",
    )


# -- replog slots ---------------------------------------------------------------------------


def test_slots_lists_every_logical_slot_with_its_owner_holder_wal_and_lag(
    pg_dsn: str, postgres_server: Any, tmp_path: Path
) -> None:
    _tables(pg_dsn)
    shop, live = str(tmp_path / "shop"), str(tmp_path / "live")
    run(pg_dsn, shop, tables=("t",), slot="shop")  # one-shot: the slot stays, unread
    sql(pg_dsn, "UPDATE t SET v = 1 WHERE id = 1")  # unconfirmed: shop is behind
    with postgres_server.database() as elsewhere:  # another tool's slot, another database
        sql(elsewhere, "SELECT pg_create_logical_replication_slot('other_tool', 'pgoutput')")
        with following(pg_dsn, live, "live", ("u",)):
            found = _slots(pg_dsn)
            text = replog("slots", pg_dsn)
    log = ReplicationLog.open(shop)
    slot = found["shop"]
    assert slot["owner"] == {"slot": "shop", "log_id": log.log_id, "log": shop}
    assert (slot["publication"], slot["plugin"], slot["holder"], slot["active_pid"]) == (
        "shop", "pgoutput", None, None,
    )  # fmt: skip
    assert slot["inactive_since_ms"] is not None  # released by the one-shot capture
    assert slot["retained_wal_bytes"] > 0 and slot["lag_bytes"] > 0
    assert slot["lag_s"] > 0 and slot["lag_note"] is None  # the UPDATE is unconfirmed
    assert slot["oldest_unconfirmed_commit_ms"] <= now_ms()
    holder = found["live"]["holder"]  # a running capture holds its slot's lock
    assert holder["application_name"].startswith(f"replog capture live pid {os.getpid()} on ")
    assert found["live"]["owner"]["log"] == live
    other = found["other_tool"]
    assert other["database"] != slot["database"] and other["owner"] is None
    assert other["lag_s"] is None and "no publication" in other["lag_note"]
    assert text.returncode == 0, text.stderr
    for phrase in (
        f"shop  database {slot['database']}, pgoutput: not read, last released ",
        f"    owner     log {shop} (id {log.log_id})",
        "behind (oldest unconfirmed commit)",
        "live  database ",
        "captured by replog capture live pid ",
        "other_tool  database ",
        "    owner     no replog log",
    ):
        assert phrase in text.stdout, (phrase, text.stdout)


def test_slots_drop_names_what_depends_and_refuses_while_a_capture_holds_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    _tables(pg_dsn)
    url = str(tmp_path / "log")
    with following(pg_dsn, url, "live", ("t",)):
        refused = replog("slots", "drop", pg_dsn, "live", "--force")
        assert refused.returncode == 2
        assert "slot 'live' is being captured by replog capture live pid" in refused.stderr
        assert "stop that capture first" in refused.stderr
    # no terminal to ask on, and no --force: what depends on it is named, nothing dropped
    unasked = replog("slots", "drop", pg_dsn, "live")
    assert unasked.returncode == 2
    own = "capture's own publication 'live' is dropped with it"
    for phrase in ("give --force", f"the log {url} (id ", "can never resume", own, "of WAL"):
        assert phrase in unasked.stderr, (phrase, unasked.stderr)
    assert query(pg_dsn, "SELECT count(*) FROM pg_replication_slots") == [(1,)]
    dropped = _json("slots", "drop", pg_dsn, "live", "--force", schema="slots-drop")
    assert dropped["dropped"] is True and dropped["publication_dropped"] == "live"
    assert dropped["owner"]["log"] == url
    assert query(pg_dsn, "SELECT count(*) FROM pg_replication_slots") == [(0,)]
    assert query(pg_dsn, "SELECT count(*) FROM pg_publication") == [(0,)]
    # the log that followed it can never resume, and status says so with the way on
    with pytest.raises(SourcePositionError, match="the slot does not exist"):
        run(pg_dsn, url, tables=("t",), slot="live")
    capture = _status(url, pg_dsn)
    assert capture["run"]["state"] == "failed"
    assert capture["run"]["error"].startswith("SourcePositionError: the log holds capture position")
    assert capture["problem"].startswith("the server has no slot 'live'")
    assert "--reset-slot" in capture["problem"]


def test_slots_drop_keeps_a_publication_no_capture_made(pg_dsn: str) -> None:
    """A slot of another tool with a publication of the same name: the slot goes, the
    publication (no replog owner in its comment) stays."""
    _tables(pg_dsn)
    sql(pg_dsn, "CREATE PUBLICATION tool FOR TABLE t",
        "SELECT pg_create_logical_replication_slot('tool', 'pgoutput')")  # fmt: skip
    dropped = _json("slots", "drop", pg_dsn, "tool", "--force", schema="slots-drop")
    assert (dropped["owner"], dropped["publication_dropped"]) == (None, None)
    assert query(pg_dsn, "SELECT pubname FROM pg_publication") == [("tool",)]
    missing = replog("slots", "drop", pg_dsn, "tool", "--force")
    assert missing.returncode == 2 and "has no logical replication slot 'tool'" in missing.stderr


@pytest.mark.parametrize(("answer", "code", "left"), [(b"n\n", 1, 1), (b"y\n", 0, 0)])
def test_slots_drop_asks_on_a_terminal(
    pg_dsn: str, tmp_path: Path, answer: bytes, code: int, left: int
) -> None:
    _tables(pg_dsn)
    run(pg_dsn, str(tmp_path / "log"), tables=("t",), slot="asked")
    controller, terminal = pty.openpty()
    try:
        os.write(controller, answer)  # typed ahead: the terminal holds it for the read
        done = subprocess.run(
            [REPLOG, "slots", "drop", pg_dsn, "asked"],
            stdin=terminal,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.close(terminal)
        os.close(controller)
    assert done.returncode == code, done.stderr
    assert "drop slot asked? [y/N]" in done.stderr and "can never resume" in done.stderr
    assert query(pg_dsn, "SELECT count(*) FROM pg_replication_slots") == [(left,)]


# -- a one-shot capture says what its slot keeps ------------------------------------------


def test_a_one_shot_capture_says_the_wal_its_slot_keeps_and_how_to_drop_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    _tables(pg_dsn)
    dsn = make_conninfo(pg_dsn, password="sekrit")  # the server trusts: any password
    url = str(tmp_path / "log")
    done = replog("capture", "postgres", dsn, url, "--slot", "once", "--tables", "t")
    assert done.returncode == 0, done.stderr
    assert "sekrit" not in done.stdout + done.stderr
    [said] = [line for line in done.stdout.splitlines() if line.startswith("slot once keeps ")]
    assert "bytes of WAL on the server (wal_status reserved)" in said
    command = said.split("if none will, drop it: ")[1]
    assert command.startswith("replog slots drop ") and command.endswith(" once")
    again = _json("capture", "postgres", dsn, url, "--slot", "once", schema="capture")
    assert again["slot_drop_command"] == command and again["retained_wal_bytes"] > 0
    # the command it names works as given (from a script: --force)
    dropped = replog(*shlex.split(command)[1:], "--force")
    assert dropped.returncode == 0, dropped.stderr
    assert query(pg_dsn, "SELECT count(*) FROM pg_replication_slots") == [(0,)]


# -- replog status --source-dsn: lag, state, resumable ---------------------------------------


def test_lag_in_seconds_grows_while_capture_is_down_and_reads_zero_when_caught_up(
    pg_dsn: str, tmp_path: Path
) -> None:
    _tables(pg_dsn)
    url = str(tmp_path / "log")
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "INSERT INTO u SELECT g, 'x' FROM generate_series(1, 1000) g")
    idle = _status(url, pg_dsn)  # WAL moved, but nothing captured is unconfirmed
    assert (idle["lag_s"], idle["oldest_unconfirmed_commit_ms"]) == (0, None)
    assert idle["lag_bytes"] > 0 and idle["retained_wal_bytes"] > 0
    assert idle["run"]["state"] == "stopped" and idle["problem"] is None
    sql(pg_dsn, "UPDATE t SET v = 5 WHERE id = 5")
    first = _status(url, pg_dsn)
    time.sleep(1.5)
    later = _status(url, pg_dsn)
    assert first["oldest_unconfirmed_commit_ms"] == later["oldest_unconfirmed_commit_ms"]
    assert later["lag_s"] >= first["lag_s"] + 1.5 > 1.5  # on the server's clock
    assert later["lag_bytes"] >= first["lag_bytes"]
    text = replog("status", url, "--source-dsn", pg_dsn).stdout
    assert (
        f"lag {later['lag_bytes']:,} bytes and " in text and "bytes of WAL kept (reserved" in text
    )
    run(pg_dsn, url, tables=("t",))  # caught up
    caught = _status(url, pg_dsn)
    assert (caught["lag_s"], caught["oldest_unconfirmed_commit_ms"]) == (0, None)
    assert caught["lsn"] == caught["slot_lsn"]


def test_measuring_the_lag_never_disturbs_a_running_capture(pg_dsn: str, tmp_path: Path) -> None:
    """The lag is read from a copy of the slot: a peek of the slot itself while the
    capture reads it would make one of the two fail ("replication slot ... is active"),
    which measuring without a pause while the capture follows writes would meet."""
    _tables(pg_dsn)
    url = str(tmp_path / "log")
    notes: list[str | None] = []
    done = threading.Event()

    def measure() -> None:
        with slots.connect(pg_dsn) as connection:
            while not done.is_set():
                slot = slots.read_slots(connection, "live").get("live")
                if slot is not None:
                    notes.append(slots.with_lag(connection, slot, ["live"]).lag_note)

    with following(pg_dsn, url, "live", ("t",)) as capture:
        measuring = threading.Thread(target=measure, daemon=True)
        measuring.start()
        written = 0
        while len(notes) < 100:  # a hundred measures while the capture reads writes
            sql(pg_dsn, f"UPDATE t SET v = {written} WHERE id = {written % 10 + 1}")
            written += 1
            assert capture.is_alive() and measuring.is_alive()
        while _slots(pg_dsn)["live"]["lag_s"] != 0:  # the capture catches up
            assert capture.is_alive()
            time.sleep(0.05)
        done.set()
        measuring.join(300)
    assert set(notes) == {None}, [n for n in notes if n][:3]
    updates = [e for e in captured(ReplicationLog.open(url)) if e["op"] == "u"]
    assert len(updates) == written


def test_status_says_when_a_capture_cannot_resume_and_how_its_last_run_ended(
    pg_dsn: str, tmp_path: Path
) -> None:
    _tables(pg_dsn)
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    run(pg_dsn, mine, tables=("t",))
    run(pg_dsn, theirs, tables=("t",), reset_slot=True)  # takes the slot over
    taken = _status(mine, pg_dsn)
    assert taken["problem"].startswith(f"slot 'cap' belongs to log {theirs} (id ")
    assert taken["owner"]["log"] == theirs
    prometheus = replog("status", mine, "--source-dsn", pg_dsn, "--format", "prometheus")
    assert f'replog_capture_resumable{{log="{mine}",slot="cap"}} 0.0' in prometheus.stdout
    ok = replog("status", theirs, "--source-dsn", pg_dsn, "--format", "prometheus").stdout
    assert f'replog_capture_resumable{{log="{theirs}",slot="cap"}} 1.0' in ok
    assert f'replog_capture_state{{log="{theirs}",slot="cap",state="stopped"}} 1.0' in ok
    text = replog("status", mine, "--source-dsn", pg_dsn).stdout
    assert "CANNOT RESUME: slot 'cap' belongs to log" in text


def test_a_killed_capture_is_gone_once_it_stops_beating(pg_dsn: str, tmp_path: Path) -> None:
    _tables(pg_dsn)
    url = str(tmp_path / "log")
    process = subprocess.Popen(
        [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "cap", "--tables", "t", "--follow"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    assert process.stderr.readline().startswith("replog: capture: ")  # the snapshot landed
    running = _status(url, pg_dsn)
    assert running["run"]["state"] == "running" and running["run"]["pid"] == process.pid
    assert running["holder"]["application_name"].startswith(f"replog capture cap pid {process.pid}")
    process.send_signal(signal.SIGKILL)
    process.wait()
    with use_clock(lambda: time.time() + 120):  # two minutes on: no beat for a minute
        gone = _status(url, pg_dsn)
        text = replog("status", url).stdout
    assert gone["run"]["state"] == "gone" and gone["run"]["stopped_ms"] is None
    assert "gone on " in text and "killed?" in text

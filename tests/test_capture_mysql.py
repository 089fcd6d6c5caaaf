"""``replog capture mysql`` against a real MariaDB server: Debezium MySQL's events, keys,
exactly once through failures at each step, whole transactions staged in pieces, and a
refusal, before anything is written, of what capture cannot do (a setting, a grant, a
table without a key)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.cli import REPLOG, replog
from support.mysql import Db, changes, events, rows_of, run
from test_cli_output import validate

from replog.capture.mysql.options import Dsn, MySqlOptions, capture_app_id
from replog.capture.mysql.positions import PositionRecord
from replog.capture.mysql.server import connect
from replog.errors import (
    InjectedFaultError,
    InvalidOptionError,
    SourceConfigError,
    SourcePrivilegeError,
)
from replog.log import ReplicationLog
from replog.schemas import registry

pytestmark = pytest.mark.slow  # a MariaDB server for the session


def _orders(db: Db) -> None:
    db.sql(
        "CREATE TABLE orders (id int PRIMARY KEY, customer varchar(20), total decimal(12,2))",
        "INSERT INTO orders VALUES (1, 'ann', 10.50), (2, 'bob', 20.00)",
    )


def test_snapshot_then_changes_as_debezium_mysql_events(mysql_db: Db, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _orders(mysql_db)
    run(mysql_db.dsn, url, tables=("orders",))
    mysql_db.transaction(
        "INSERT INTO orders VALUES (3, 'cy', 3.00)",
        "UPDATE orders SET total = 11.50 WHERE id = 1",
    )
    mysql_db.sql(
        "UPDATE orders SET id = 20 WHERE id = 2",  # a key change: delete, then create
        "DELETE FROM orders WHERE id = 3",
    )
    run(mysql_db.dsn, url, tables=("orders",))
    found = events(url)
    collection = f"{mysql_db.name}.orders"
    assert [(e["op"], e["key"], e["data"]) for e in found] == [
        ("r", '{"id":1}', '{"id":1,"customer":"ann","total":10.50}'),
        ("r", '{"id":2}', '{"id":2,"customer":"bob","total":20.00}'),
        ("c", '{"id":3}', '{"id":3,"customer":"cy","total":3.00}'),
        ("u", '{"id":1}', '{"id":1,"customer":"ann","total":11.50}'),
        ("d", '{"id":2}', '{"id":2,"customer":"bob","total":20.00}'),
        ("c", '{"id":20}', '{"id":20,"customer":"bob","total":20.00}'),
        ("d", '{"id":3}', '{"id":3,"customer":"cy","total":3.00}'),
    ]
    assert {e["collection"] for e in found} == {collection}
    update = found[3]
    assert update["before"] == '{"id":1,"customer":"ann","total":10.50}'
    source = update["source"]
    assert source["connector"] == "mysql" and source["name"] == "mysql"
    assert (source["db"], source["table"]) == (mysql_db.name, "orders")
    assert source["snapshot"] == "false" and source["row"] == 0
    assert source["file"].startswith("binlog.") and source["pos"] > 0
    assert source["gtid"].startswith("0-1-") and source["server_id"] == 1
    # the insert and the update are one transaction: one id, orders 1 and 2, one commit
    insert = found[2]
    assert insert["metadata"]["transaction"]["id"] == update["metadata"]["transaction"]["id"]
    assert (insert["order"], update["order"]) == (1, 2)
    assert insert["version"] == update["version"]
    deleted, created = found[4], found[5]
    assert deleted["metadata"]["new_key"] == '{"id":20}'
    assert created["metadata"]["old_key"] == '{"id":2}'
    assert found[0]["source"]["snapshot"] == "true"
    # schemas: registered once, named by every event
    [version] = registry.versions(ReplicationLog.open(url).storage, collection)
    assert {e["metadata"]["schema"] for e in found} == {version.digest}
    # the position: a GTID count, recorded with the commit
    log = ReplicationLog.open(url)
    logged = log.transaction_version(capture_app_id("mysql"))
    record = PositionRecord.load(log.storage, "mysql", log.log_id)
    assert record is not None and logged is not None
    position = record.at(logged)
    assert position is not None and position.mode == "gtid"
    [(gtids,)] = mysql_db.query("SELECT @@gtid_binlog_pos")
    assert position.gtids == gtids and logged == sum(int(g.split("-")[2]) for g in gtids.split(","))


def test_keys_are_written_in_their_shortest_form(mysql_db: Db, tmp_path: Path) -> None:
    """A DECIMAL key 1.50 is the key {"k":1.5} (its row keeps 1.50), as for PostgreSQL:
    retyped to another scale, a row keeps its key and shard."""
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE d (k decimal(6,2), n bigint unsigned, PRIMARY KEY (k, n))",
        "INSERT INTO d VALUES (1.50, 18446744073709551615)",
    )
    run(mysql_db.dsn, url, tables=("d",))
    mysql_db.sql("UPDATE d SET k = 2.00")
    run(mysql_db.dsn, url, tables=("d",))
    reads = [(e["key"], e["data"]) for e in events(url) if e["op"] == "r"]
    assert reads == [('{"k":1.5,"n":18446744073709551615}', '{"k":1.50,"n":18446744073709551615}')]
    assert changes(url) == [
        ("d", '{"k":1.5,"n":18446744073709551615}', '{"k":1.50,"n":18446744073709551615}'),
        ("c", '{"k":2,"n":18446744073709551615}', '{"k":2.00,"n":18446744073709551615}'),
    ]


def test_a_table_without_a_primary_key_is_refused_unless_keys_name_a_unique_not_null_one(
    mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE nokey (code varchar(8) NOT NULL, alt int NULL, n int NOT NULL, "
        "UNIQUE KEY (code), UNIQUE KEY (alt))",
        "INSERT INTO nokey VALUES ('a', 1, 1)",
    )
    with pytest.raises(SourceConfigError, match=r"nokey has no primary key.*--keys"):
        run(mysql_db.dsn, url, tables=("nokey",))
    table = f"{mysql_db.name}.nokey"
    with pytest.raises(InvalidOptionError, match="alt may be NULL"):
        run(mysql_db.dsn, url, tables=("nokey",), keys={table: ("alt",)})
    with pytest.raises(InvalidOptionError, match="no unique index"):
        run(mysql_db.dsn, url, tables=("nokey",), keys={table: ("n",)})
    assert not Path(url).exists() or ReplicationLog.open(url).refresh().version == 0
    run(mysql_db.dsn, url, tables=("nokey",), keys={table: ("code",)})
    mysql_db.sql("UPDATE nokey SET n = 2 WHERE code = 'a'", "DELETE FROM nokey")
    run(mysql_db.dsn, url, tables=("nokey",), keys={table: ("code",)})
    assert [(op, key) for op, key, _ in changes(url)] == [
        ("u", '{"code":"a"}'),
        ("d", '{"code":"a"}'),
    ]


def test_settings_and_grants_are_checked_before_anything_is_written(
    mysql_db: Db, tmp_path: Path
) -> None:
    """Each missing setting or grant is named with its fix, and neither the log nor the
    source (capture's own tables) is written to."""
    _orders(mysql_db)
    url = str(tmp_path / "log")
    server = mysql_db.server
    server.sql(
        "SET GLOBAL binlog_row_metadata = 'MINIMAL'", "SET GLOBAL binlog_row_image = 'MINIMAL'"
    )
    try:
        result = replog("capture", "mysql", mysql_db.dsn, url, "--tables", "orders")
    finally:
        server.sql(
            "SET GLOBAL binlog_row_metadata = 'FULL'", "SET GLOBAL binlog_row_image = 'FULL'"
        )
    assert result.returncode == 2
    assert "binlog_row_metadata is MINIMAL, must be FULL" in result.stderr
    assert "binlog_row_image is MINIMAL, must be FULL" in result.stderr
    assert not Path(url).exists()

    user = f"u{mysql_db.name[-6:]}"
    dsn = mysql_db.dsn.replace("replog:replog-secret@", f"{user}:pw@")
    server.sql(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'",
               f"GRANT SELECT ON *.* TO '{user}'@'%'")  # fmt: skip
    try:
        with pytest.raises(SourcePrivilegeError, match="GRANT REPLICATION CLIENT"):
            run(dsn, url, tables=("orders",))
        server.sql(f"GRANT REPLICATION CLIENT ON *.* TO '{user}'@'%'")
        with pytest.raises(SourcePrivilegeError, match="GRANT REPLICATION SLAVE"):
            run(dsn, url, tables=("orders",))
        server.sql(f"GRANT REPLICATION SLAVE ON *.* TO '{user}'@'%'")
        server.sql(f"REVOKE SELECT ON *.* FROM '{user}'@'%'")
        with pytest.raises(SourceConfigError, match=f"GRANT SELECT ON {mysql_db.name}"):
            run(dsn, url, tables=("orders",))
        server.sql(f"GRANT SELECT ON {mysql_db.name}.* TO '{user}'@'%'")
        if not server.query(
            "SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = 'replog'"
        ):
            with pytest.raises(SourcePrivilegeError, match="GRANT CREATE, INSERT, UPDATE, DELETE"):
                run(dsn, url, tables=("orders",))
    finally:
        server.sql(f"DROP USER '{user}'@'%'")
    assert ReplicationLog.open(url).refresh().version == 0  # nothing was committed


def test_truncate_is_a_truncate_event_on_every_shard(mysql_db: Db, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _orders(mysql_db)
    run(mysql_db.dsn, url, tables=("orders",))
    mysql_db.sql("TRUNCATE TABLE orders", "INSERT INTO orders VALUES (7, 'new', 1.00)")
    progress = run(mysql_db.dsn, url, tables=("orders",))
    assert progress.truncations == 1
    truncates = [e for e in events(url) if e["op"] == "t"]
    assert sorted(e["shard"] for e in truncates) == [0, 1, 2, 3]
    assert {e["operation"] for e in truncates} == {"truncate"}
    assert {e["metadata"]["truncate"]["shards"] for e in truncates} == {4}
    assert rows_of(url, f"{mysql_db.name}.orders") == {
        '{"id":7}': '{"id":7,"customer":"new","total":1.00}'
    }
    mysql_db.sql("TRUNCATE orders")
    run(mysql_db.dsn, url, tables=("orders",), skip_truncate=True)
    assert len([e for e in events(url) if e["op"] == "t"]) == 4  # skipped: no new truncate


def test_a_failure_after_each_commit_leaves_every_transaction_once(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture stopped right after each commit (before it notes anything of it): the
    restart reads the position the log holds from the position record and goes on after
    it, so every transaction is in the log once, in order."""
    url = str(tmp_path / "log")
    _orders(mysql_db)
    run(mysql_db.dsn, url, tables=("orders",))
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    for n in range(5):
        mysql_db.sql(f"INSERT INTO orders VALUES ({100 + n}, 'x', {n})")
        with pytest.raises(InjectedFaultError):
            run(mysql_db.dsn, url, tables=("orders",), max_changes=1)
    monkeypatch.delenv("REPLOG_FAULT")
    run(mysql_db.dsn, url, tables=("orders",))
    assert [key for _, key, _ in changes(url)] == [f'{{"id":{100 + n}}}' for n in range(5)]


def test_a_large_transaction_is_staged_in_pieces_and_committed_once(
    mysql_db: Db, tmp_path: Path
) -> None:
    """A transaction of 3,000 rows with --stage-events 128: staged as it is read, one
    commit. Killed (SIGKILL) while staging: nothing is visible, and the next run commits
    it whole."""
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE big (id int PRIMARY KEY, v int)",
        "INSERT INTO big SELECT seq, 0 FROM seq_1_to_3000",
    )
    run(mysql_db.dsn, url, tables=("big",))
    mysql_db.sql("UPDATE big SET v = v + 1")
    version = ReplicationLog.open(url).refresh().version
    command = [REPLOG, "capture", "mysql", mysql_db.dsn, url, "--tables", "big",
               "--stage-events", "128"]  # fmt: skip
    killed = subprocess.run(
        command,
        env={**os.environ, "REPLOG_FAULT": "capture_staged"},
        capture_output=True,
        text=True,
        check=False,
        start_new_session=True,
    )
    assert killed.returncode == -9, killed.stderr
    assert ReplicationLog.open(url).refresh().version == version  # nothing visible
    run(mysql_db.dsn, url, tables=("big",), stage_events=128)
    updates = [e for e in events(url) if e["op"] == "u"]
    assert len(updates) == 3000 and len({e["version"] for e in updates}) == 1
    assert len({e["event_id"] for e in updates}) == 3000
    assert [e["order"] for e in updates] == list(range(1, 3001))


def test_the_cli_captures_and_prints_its_position(mysql_db: Db, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _orders(mysql_db)
    result = replog("capture", "mysql", mysql_db.dsn, url, "--tables", "orders", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    validate(document, "capture-mysql")
    assert document["snapshot_rows"] == 2 and document["name"] == "mysql"
    [(file, pos, *_)] = mysql_db.query("SHOW MASTER STATUS")
    assert document["position"]["mode"] == "gtid"
    assert (document["position"]["file"], document["position"]["pos"]) == (file, pos)
    assert document["tables"] == {f"{mysql_db.name}.orders": {"read": 2}}
    mysql_db.sql("INSERT INTO orders VALUES (3, 'cy', 1)")
    mysql_db.sql("UPDATE orders SET total = 2 WHERE id = 3")
    counted = replog("capture", "mysql", mysql_db.dsn, url, "--json")
    assert json.loads(counted.stdout)["tables"] == {
        f"{mysql_db.name}.orders": {"insert": 1, "update": 1}
    }
    mysql_db.sql("INSERT INTO orders VALUES (4, 'dy', 1)")
    text = replog("capture", "mysql", mysql_db.dsn, url)  # resumes the log's tables
    assert text.returncode == 0, text.stderr
    [(file, pos, *_)] = mysql_db.query("SHOW MASTER STATUS")
    assert "captured 1 rows" in text.stdout and f"position {file}:{pos}" in text.stdout
    wrong = replog("capture", "mysql", mysql_db.dsn, url, "--slot", "s", "--heartbeat", "1")
    assert wrong.returncode == 2
    assert "--slot, --heartbeat: an option of the PostgreSQL capture" in wrong.stderr
    assert "password" not in wrong.stderr and "replog-secret" not in wrong.stderr


def test_options_are_refused_before_anything_connects(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    for options, message in [
        ({"dsn": "postgres://h/db"}, "not a MySQL URL"),
        ({"dsn": "mysql://u:secret@h:99999/db"}, "Port"),
        ({"dsn": "mysql://u@h/db", "name": "Bad-Name"}, "capture name 'Bad-Name'"),
        ({"dsn": "mysql://u@h/", "tables": ("t",)}, "names no database"),
        ({"dsn": "mysql://u@h/db", "position": "lsn"}, "position mode 'lsn'"),
        ({"dsn": "mysql://u@h/db", "server_id": 0}, "--server-id"),
    ]:
        with pytest.raises(InvalidOptionError, match=message) as raised:
            MySqlOptions(**options).check()  # type: ignore[arg-type]
        assert "secret" not in str(raised.value)
    assert not Path(url).exists()


def test_status_history_and_metrics_show_the_capture_and_its_lag(
    mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _orders(mysql_db)
    run(mysql_db.dsn, url, tables=("orders",))
    status = replog("status", url, "--json", "--source-dsn", mysql_db.dsn)
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    validate(document, "status")
    [capture] = document["mysql_captures"]
    [(file, pos, *_)] = mysql_db.query("SHOW MASTER STATUS")
    assert (capture["file"], capture["pos"], capture["lag_bytes"]) == (file, pos, 0)
    assert capture["run"] == "stopped" and capture["error"] is None
    assert document["transactions"] == {}  # the capture's position is not an app's
    mysql_db.sql("INSERT INTO orders VALUES (9, 'late', 1)")
    behind = json.loads(replog("status", url, "--json", "--source-dsn", mysql_db.dsn).stdout)
    assert behind["mysql_captures"][0]["lag_bytes"] > 0
    text = replog("status", url, "--source-dsn", mysql_db.dsn).stdout
    assert "mysql captures (1):" in text and f"at {file}:{pos}" in text and "lag " in text
    metrics = replog("status", url, "--format", "prometheus", "--source-dsn", mysql_db.dsn).stdout
    assert 'replog_capture_lag_bytes{log="' in metrics and 'slot="mysql.mysql"' in metrics
    history = json.loads(replog("history", url, "--json").stdout)
    validate(history, "history")
    newest = history["commits"][0]
    assert newest["kind"] == "capture"
    assert newest["capture"] == {"source": "mysql", "name": "mysql", "version": capture["version"]}


def test_connections_share_one_tls_context_and_still_connect(mysql_db: Db) -> None:
    """PyMySQL makes a TLS context per connection (the system's certificates loaded each
    time: tens of ms); capture's connections share one, in PyMySQL's PREFERRED mode (TLS
    where the server offers it, plain where not), and still work."""
    dsn = Dsn.parse(mysql_db.dsn)
    first, second = connect(dsn), connect(dsn, raw=True)
    try:
        assert first.ctx is not None and first.ctx is second.ctx
        assert first._ssl_required is False
        with first.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
    finally:
        first.close()
        second.close()

"""The ``replog`` command (replog.cli), run in process; a few smoke tests run the script."""

import json
from pathlib import Path

import pytest
from support.cli import replog, replog_process
from support.operators import run_operator_commands

from replog.log import ReplicationLog

LINES = (
    "\n".join(
        json.dumps(
            {
                "key": f"k{i % 4}",
                "data": {"n": i},
                "collection": "orders",
                "operation": ["insert", "update", "delete"][i % 3],
            }
        )
        for i in range(25)
    )
    + "\n"
)


def test_create_append_info_read_verify(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    assert replog("create", url, "--shards", "3").returncode == 0
    source = tmp_path / "events.jsonl"
    source.write_text(LINES)
    appended = replog("append", url, str(source))
    assert appended.returncode == 0, appended.stderr
    assert "appended 25 events" in appended.stdout
    assert replog("append", url, "-", stdin=LINES).returncode == 0
    info = json.loads(replog("info", url, "--json").stdout)
    assert info["shards"] == 3 and sum(info["heads"].values()) == 50
    assert info["segments"] == 6 and info["bytes"] > 0
    read = replog("read", url, "--shard", "0", "--from", "2", "--limit", "3")
    rows = [json.loads(line) for line in read.stdout.splitlines()]
    assert [r["sequence"] for r in rows] == [2, 3, 4] and {r["shard"] for r in rows} == {0}
    assert json.loads(rows[0]["data"])["n"] >= 0
    assert replog("verify", url).returncode == 0


def test_read_prints_payloads_exactly_and_before_images(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url, "--shards", "1")
    line = '{"key":"k","data":{"price":12345678901234567890.123456789},"before":{"price":1}}\n'
    assert replog("append", url, "-", stdin=line).returncode == 0
    row = json.loads(replog("read", url).stdout)
    assert row["data"] == '{"price":12345678901234567890.123456789}'  # the text, unchanged
    assert row["before"] == '{"price":1}'


def test_binary_data_is_base64(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 1)
    log.append([{"data": b"\xff\xfe\x00", "key": "k"}])
    row = json.loads(replog("read", url).stdout)
    assert row["data_base64"] == "//4A" and "data" not in row


def test_bad_line_commits_nothing_and_names_line(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url)
    bad = LINES + '{"data": 1, "operation": "upsert"}\n'
    result = replog("append", url, "-", stdin=bad)
    assert result.returncode == 2
    assert "line 26: unknown operation 'upsert'" in result.stderr
    result = replog("append", url, "-", stdin='{"data": 1}\n\n{oops\n')
    assert "line 3: not valid JSON" in result.stderr
    assert json.loads(replog("info", url, "--json").stdout)["version"] == 0


def test_append_with_a_transaction_is_skipped_when_run_again(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url, "--shards", "2")
    txn = ("--txn-app-id", "nightly-load", "--txn-version", "7")
    first = replog("append", url, "-", *txn, stdin=LINES)
    assert first.returncode == 0, first.stderr
    again = replog("append", url, "-", *txn, "--json", stdin=LINES)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["already_applied"] and report["events"] == 0
    assert report["transaction"] == {"app_id": "nightly-load", "version": 7}
    text = replog("append", url, "-", *txn, stdin=LINES).stdout
    assert "nothing appended: transaction nightly-load version 7 is already in" in text
    assert sum(ReplicationLog.open(url).head().values()) == 25
    half = replog("append", url, "-", "--txn-app-id", "nightly-load", stdin=LINES)
    assert half.returncode == 2 and "--txn-app-id and --txn-version go together" in half.stderr
    bad = replog("append", url, "-", "--txn-app-id", "no/slash", "--txn-version", "1", stdin=LINES)
    assert bad.returncode == 2 and "--txn-app-id" in bad.stderr
    assert sum(ReplicationLog.open(url).head().values()) == 25  # refused before reading


def test_append_debezium_reports_what_it_skipped(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url, "--shards", "2")
    lines = "\n".join(
        [
            '{"schema":{},"payload":{"op":"c","before":null,"after":{"id":1,"w":1.10},'
            '"source":{"db":"inventory","table":"products","ts_ms":1700000000000}}}',
            "null",
            '{"op":"t","source":{"db":"inventory","table":"products"}}',
        ]
    )
    result = replog(
        "append", url, "-", "--format", "debezium", "--key-fields", "id", "--json", stdin=lines
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["events"] == 1 and report["skipped"] == {
        "tombstone (null value)": 1,
        "truncate event (op t)": 1,
    }
    row = json.loads(replog("read", url, "--json").stdout.splitlines()[0])
    assert row["key"] == '{"id":1}' and row["collection"] == "inventory.products"
    missing = replog("append", url, "-", "--format", "debezium", stdin=lines)
    assert missing.returncode == 2 and "--key-fields" in missing.stderr


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    missing = replog("info", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "holds no replog log" in missing.stderr
    scheme = replog("info", "gopher://x/y")
    assert scheme.returncode == 2 and "gopher" in scheme.stderr
    url = str(tmp_path / "log")
    replog("create", url)
    again = replog("create", url)
    assert again.returncode == 2 and "already holds a replog log" in again.stderr
    no_data = replog("append", url, "-", stdin='{"key": "k"}\n')
    assert "line 1: 'data' is required" in no_data.stderr
    secret = replog(
        "info",
        "s3://no-bucket/x",
        "--fs-option",
        "secret=hunter2",
        "--fs-option",
        "endpoint_url=http://127.0.0.1:9",
    )
    assert secret.returncode == 2 and "hunter2" not in secret.stderr


def test_verify_names_the_corrupt_file(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url, "--shards", "2")
    replog("append", url, "-", stdin=LINES)
    segment = sorted((tmp_path / "log" / "shards").rglob("*.arrow"))[0]
    data = bytearray(segment.read_bytes())
    data[-40] ^= 0x01
    segment.write_bytes(bytes(data))
    result = replog("verify", url)
    assert result.returncode == 1
    assert str(segment) in result.stdout and "checksum mismatch" in result.stdout


def consumer_json(url: str, name: str) -> dict:
    shown = replog("consumer", "show", url, "--consumer", name, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_consumer_commands(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url, "--shards", "2")
    replog("append", url, "-", stdin=LINES)
    unknown = replog("consumer", "show", url, "--consumer", "etl")
    assert unknown.returncode == 2 and "no consumer 'etl'" in unknown.stderr
    no_target = replog("consumer", "set", url, "--consumer", "etl", "--execute")
    assert no_target.returncode == 2 and "--to-earliest" in no_target.stderr

    dry = replog("consumer", "set", url, "--consumer", "etl", "--offsets", '{"0": 3}', "--create")
    assert dry.returncode == 0 and "dry run" in dry.stdout.lower()
    assert replog("consumer", "list", url).stdout.split() == []
    done = replog(
        "consumer",
        "set",
        url,
        "--consumer",
        "etl",
        "--offsets",
        '{"0": 3}',
        "--create",
        "--execute",
    )
    assert done.returncode == 0, done.stderr
    shown = consumer_json(url, "etl")
    assert shown["offsets"]["0"] == 3 and shown["total_lag"] == 22
    replog("consumer", "set", url, "--consumer", "etl", "--to-latest", "--execute")
    assert consumer_json(url, "etl")["total_lag"] == 0
    replog("consumer", "set", url, "--consumer", "etl", "--to-earliest", "--execute")
    assert consumer_json(url, "etl")["total_lag"] == 25
    seconds = replog(
        "consumer", "set", url, "--consumer", "etl", "--to-timestamp", "1700000000", "--execute"
    )
    assert seconds.returncode == 2 and "seconds" in seconds.stderr
    beyond = replog(
        "consumer", "set", url, "--consumer", "etl", "--offsets", '{"1": 999}', "--execute"
    )
    assert beyond.returncode == 2 and "beyond its head" in beyond.stderr
    bad_shard = replog("consumer", "set", url, "--consumer", "etl", "--offsets", '{"7": 1}')
    assert "shard 7 does not exist" in bad_shard.stderr
    assert replog("consumer", "list", url).stdout.split() == ["etl"]

    store = f"{url}/_replog/consumers/etl"
    listing = replog("manifest", "list", store)
    assert listing.returncode == 0 and "* " in listing.stdout
    assert json.loads(replog("manifest", "show", store).stdout)["checkpoint_id"] == 3
    assert replog("manifest", "validate", store).returncode == 0

    assert replog("consumer", "delete", url, "--consumer", "etl", "--execute").returncode == 0
    assert replog("consumer", "list", url).stdout.split() == []


def test_operator_commands(tmp_path: Path) -> None:
    run_operator_commands(str(tmp_path / "log"))


@pytest.mark.slow
def test_the_installed_script_runs_and_reports_errors(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    assert replog_process("create", url, "--shards", "2").returncode == 0
    appended = replog_process("append", url, "-", stdin=LINES)
    assert appended.returncode == 0 and "appended 25 events" in appended.stdout
    version = replog_process("--version")
    assert version.returncode == 0 and version.stdout.strip()
    broken = replog_process("append", url, "-", stdin="{oops\n")
    assert broken.returncode == 2 and "line 1" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_append_refuses_a_lone_surrogate_naming_the_line(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    lines = '{"key": "a", "data": 1}\n{"key": "\\ud800", "data": 2}\n'
    result = replog("append", url, "-", stdin=lines)
    assert result.returncode != 0
    assert "line 2: 'key' holds" in result.stderr and "surrogate" in result.stderr
    assert "Traceback" not in result.stderr
    assert ReplicationLog.open(url).refresh().version == 0  # nothing half-written


def test_read_and_tail_name_a_shard_the_log_does_not_have(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 8)
    for command in ("read", "tail"):
        result = replog(command, url, "--shard", "9")
        assert result.returncode == 2
        assert "--shard 9 does not exist" in result.stderr and "8 shards (0..7)" in result.stderr


@pytest.mark.parametrize("option", [("read", "--limit"), ("tail", "-n")])
def test_negative_counts_are_refused(tmp_path: Path, option: tuple[str, str]) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    result = replog(option[0], url, option[1], "-3")
    assert result.returncode == 2 and "'-3' is not a count" in result.stderr


def test_consumer_set_on_an_unknown_consumer_needs_create(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 2)
    refused = replog("consumer", "set", url, "--consumer", "nobody", "--to-earliest", "--execute")
    assert refused.returncode == 2 and "has no consumer 'nobody'" in refused.stderr
    assert replog("consumer", "list", url).stdout.strip() == ""
    created = replog(
        "consumer", "set", url, "--consumer", "nobody", "--to-earliest", "--create", "--execute"
    )
    assert created.returncode == 0, created.stderr
    assert "nobody" in replog("consumer", "list", url).stdout


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("hdfs://namenode:8020/logs/x", "HDFS needs a Java runtime"),
        ("ftp://example.invalid/x", "cannot open URL 'ftp://example.invalid/x'"),
    ],
)
def test_a_backend_that_cannot_start_gets_a_short_error_naming_the_url(url: str, says: str) -> None:
    for command in ("info", "create"):
        result = replog(command, url)
        assert result.returncode == 2
        assert says in result.stderr and url in result.stderr
        assert len(result.stderr) < 600


def test_status_lists_transactions_apart_from_sinks(tmp_path: Path) -> None:
    from replog.format.commits import Transaction

    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 2)
    log.append([{"key": "a", "data": 1}], transaction=Transaction("nightly-load", 7))
    text = replog("status", url).stdout
    assert "sinks (0):" in text and "transactions (1):" in text and "nightly-load" in text
    document = json.loads(replog("status", url, "--json").stdout)
    assert document["sinks"] == [] and document["transactions"] == {"nightly-load": 7}
    assert "transaction nightly-load: version 7" in replog("info", url).stdout

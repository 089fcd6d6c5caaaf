import json
from pathlib import Path

from clirun import replog

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


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    missing = replog("info", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "holds no replog log" in missing.stderr
    scheme = replog("info", "gopher://x/y")
    assert scheme.returncode == 2 and "Protocol not known: gopher" in scheme.stderr
    url = str(tmp_path / "log")
    replog("create", url)
    again = replog("create", url)
    assert again.returncode == 2 and "already holds a replog log" in again.stderr
    no_data = replog("append", url, "-", stdin='{"key": "k"}\n')
    assert "line 1: 'data' is required" in no_data.stderr


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


def test_consumer_offsets_and_manifest_commands(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    replog("create", url, "--shards", "2")
    replog("append", url, "-", stdin=LINES)
    shown = json.loads(replog("consumer", "show", url, "--consumer", "etl", "--json").stdout)
    assert shown["committed"] is False and shown["total_lag"] == 25
    result = replog("consumer", "set", url, "--consumer", "etl", "--offsets", '{"0": 3}')
    assert result.returncode == 0, result.stderr
    shown = json.loads(replog("consumer", "show", url, "--consumer", "etl", "--json").stdout)
    assert shown["offsets"]["0"] == 3 and shown["total_lag"] == 22
    assert (
        replog("consumer", "set", url, "--consumer", "etl", "--offsets", "latest").returncode == 0
    )
    shown = json.loads(replog("consumer", "show", url, "--consumer", "etl", "--json").stdout)
    assert shown["total_lag"] == 0
    beyond = replog("consumer", "set", url, "--consumer", "etl", "--offsets", '{"1": 999}')
    assert beyond.returncode == 2 and "beyond its head" in beyond.stderr
    bad_shard = replog("consumer", "set", url, "--consumer", "etl", "--offsets", '{"7": 1}')
    assert "shard 7 does not exist" in bad_shard.stderr
    assert replog("consumer", "list", url).stdout.split() == ["etl"]

    store = f"{url}/_replog/consumers/etl"
    listing = replog("manifest", "list", store)
    assert listing.returncode == 0 and "* " in listing.stdout
    shown_manifest = json.loads(replog("manifest", "show", store).stdout)
    assert shown_manifest["checkpoint_id"] == 2
    assert replog("manifest", "validate", store).returncode == 0

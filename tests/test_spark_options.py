"""Source and sink option parsing (:mod:`replog.spark.options`): defaults, each option's
valid values, and errors that name the option. The parser is pure: no SparkSession."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replog.errors import InvalidOptionError
from replog.format.commits import DEFAULT_SHARDS, MAX_SHARDS, Transaction
from replog.spark.options import (
    DEFAULT_MAX_EVENTS_PER_PARTITION,
    SinkOptions,
    SourceOptions,
    id_from_location,
    normalize_location,
)

LOG = "/data/log"


def source(streaming: bool = True, **options: str) -> SourceOptions:
    return SourceOptions.parse({"path": LOG, **options}, streaming=streaming)


def sink(streaming: bool = True, **options: str) -> SinkOptions:
    return SinkOptions.parse({"path": LOG, **options}, streaming=streaming)


# -- source ----------------------------------------------------------------------------


def test_source_defaults() -> None:
    parsed = source()
    assert parsed == SourceOptions(
        path=LOG,
        consumer=None,
        starting_offsets="manifest",
        starting_timestamp_ms=None,
        ending_offsets="latest",
        max_events_per_trigger=None,
        max_bytes_per_trigger=None,
        max_events_per_partition=DEFAULT_MAX_EVENTS_PER_PARTITION,
        min_events_per_trigger=None,
        max_trigger_delay_ms=15 * 60_000,
        fail_on_data_loss=True,
    )
    assert parsed.storage_options == {}


def test_a_batch_read_starts_at_the_earliest_event_by_default() -> None:
    assert source(streaming=False).starting_offsets == "earliest"


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        ("earliest", "earliest"),
        ("LATEST", "latest"),
        (" Earliest ", "earliest"),
        ('{"0": 41, "1": 0}', '{"0": 41, "1": 0}'),
    ],
)
def test_starting_offsets_values(given: str, parsed: str) -> None:
    assert source(startingOffsets=given).starting_offsets == parsed


def test_starting_offsets_manifest_resumes_a_named_consumer() -> None:
    parsed = source(startingOffsets="manifest", consumer="etl")
    assert (parsed.starting_offsets, parsed.consumer) == ("manifest", "etl")


def test_ending_offsets_values_in_batch_reads() -> None:
    assert source(streaming=False, endingOffsets="Latest").ending_offsets == "latest"
    assert source(streaming=False, endingOffsets='{"0": 9}').ending_offsets == '{"0": 9}'


def test_limits_timestamp_delay_and_data_loss() -> None:
    parsed = source(
        consumer="etl",
        startingTimestamp="1735689600000",
        maxEventsPerTrigger="1000",
        maxBytesPerTrigger="2048",
        maxEventsPerPartition="50",
        minEventsPerTrigger="10",
        maxTriggerDelay="90s",
        failOnDataLoss="False",
    )
    assert parsed.consumer == "etl"
    assert parsed.starting_timestamp_ms == 1_735_689_600_000
    assert parsed.max_events_per_trigger == 1000
    assert parsed.max_bytes_per_trigger == 2048
    assert parsed.max_events_per_partition == 50
    assert parsed.min_events_per_trigger == 10
    assert parsed.max_trigger_delay_ms == 90_000
    assert parsed.fail_on_data_loss is False
    assert source(failOnDataLoss="TRUE").fail_on_data_loss is True


def test_option_names_are_case_insensitive() -> None:
    parsed = SourceOptions.parse({"PATH": LOG, "maxeventspertrigger": "7", "CONSUMER": "c1"})
    assert (parsed.path, parsed.max_events_per_trigger, parsed.consumer) == (LOG, 7, "c1")


def test_fs_options_become_coerced_storage_options() -> None:
    parsed = SourceOptions.parse(
        {
            "path": "s3://bucket/log",
            "fs.endpoint_url": "http://localhost:9000",
            "fs.anon": "true",
            "fs.max_retries": "5",
            "fs.secret": "123",
        }
    )
    assert parsed.path == "s3://bucket/log"
    assert parsed.storage_options == {
        "endpoint_url": "http://localhost:9000",
        "anon": True,
        "max_retries": 5,
        "secret": "123",  # a secret is passed exactly as given
    }
    assert "secret" not in repr(parsed)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"startingOffsets": "beginning"}, "option 'startingOffsets': 'beginning'"),
        ({"startingOffsets": "manifest"}, "set option 'consumer' too"),
        ({"startingTimestamp": "1700000000"}, "startingTimestamp: 1700000000 .* seconds"),
        ({"startingTimestamp": "soon"}, "startingTimestamp: 'soon' is not an ISO 8601 time"),
        (
            {"startingTimestamp": "1735689600000", "startingOffsets": "earliest"},
            "'startingOffsets' and 'startingTimestamp' are both set",
        ),
        ({"endingOffsets": "latest"}, "option 'endingOffsets' is for batch reads"),
        ({"consumer": "../etc"}, "option 'consumer': '../etc' is not a valid name"),
        ({"maxEventsPerTrigger": "0"}, "option 'maxEventsPerTrigger': must be a positive"),
        ({"maxBytesPerTrigger": "1k"}, "option 'maxBytesPerTrigger': '1k' is not an integer"),
        ({"maxEventsPerPartition": "-1"}, "option 'maxEventsPerPartition': must be a positive"),
        ({"minEventsPerTrigger": "x"}, "option 'minEventsPerTrigger': 'x' is not an integer"),
        ({"maxTriggerDelay": "1m"}, "option 'maxTriggerDelay' needs 'minEventsPerTrigger'"),
        (
            {"minEventsPerTrigger": "5", "maxTriggerDelay": "soon"},
            "option 'maxTriggerDelay': 'soon' is not a duration",
        ),
        ({"failOnDataLoss": "yes"}, "option 'failOnDataLoss': expected true or false, got 'yes'"),
        ({"maxOffsetsPerTrigger": "5"}, "'maxOffsetsPerTrigger'; maxOffsetsPerTrigger is Kafka"),
        ({"maxEventPerTrigger": "5"}, "'maxEventPerTrigger'; did you mean maxEventsPerTrigger"),
        ({"colour": "red"}, "unknown option 'colour' \\(options: asOfLsn, asOfTimestamp, con"),
    ],
)
def test_bad_source_options_name_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        source(**options)


@pytest.mark.parametrize("options", [{}, {"path": "  "}])
def test_a_missing_path_is_refused(options: dict[str, str]) -> None:
    with pytest.raises(InvalidOptionError, match="option 'path' is required"):
        SourceOptions.parse(options)


def test_a_bad_ending_offsets_in_a_batch_read_names_the_option() -> None:
    with pytest.raises(InvalidOptionError, match="option 'endingOffsets': 'earliest'"):
        source(streaming=False, endingOffsets="earliest")


# -- sink ------------------------------------------------------------------------------


def test_sink_defaults() -> None:
    parsed = sink(sinkId="s1")
    assert parsed == SinkOptions(
        path=LOG,
        sink_id="s1",
        checkpoint=None,
        shards=DEFAULT_SHARDS,
        collection=None,
        transaction=None,
    )


def test_a_streaming_sink_id_derives_from_the_checkpoint_location(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "chk")
    parsed = sink(checkpointLocation=checkpoint)
    assert parsed.checkpoint == checkpoint
    assert parsed.sink_id == id_from_location(checkpoint)
    assert parsed.sink_id.startswith("chk-")
    assert sink(checkpointLocation=f"file://{checkpoint}/").sink_id == parsed.sink_id
    assert sink(checkpointLocation=checkpoint, sinkId="named").sink_id == "named"


def test_sink_shards_and_collection() -> None:
    parsed = sink(sinkId="s", shards=str(MAX_SHARDS), collection="orders")
    assert (parsed.shards, parsed.collection) == (MAX_SHARDS, "orders")


def test_a_batch_write_takes_a_transaction() -> None:
    parsed = sink(streaming=False, txnAppId="nightly", txnVersion="0")
    assert parsed.transaction == Transaction("nightly", 0)
    assert parsed.sink_id is None
    assert sink(streaming=False).transaction is None


@pytest.mark.parametrize(
    ("streaming", "options", "message"),
    [
        (True, {}, "option 'sinkId' is required"),
        (True, {"sinkId": "a/b"}, "option 'sinkId': 'a/b' is not a valid name"),
        (True, {"sinkId": "s", "txnAppId": "a", "txnVersion": "1"}, "'txnAppId'/'txnVersion'"),
        (False, {"sinkId": "s"}, "option 'sinkId' names a streaming writer"),
        (False, {"txnAppId": "a"}, "options 'txnAppId' and 'txnVersion' go together"),
        (False, {"txnVersion": "1"}, "options 'txnAppId' and 'txnVersion' go together"),
        (False, {"txnAppId": "a", "txnVersion": "-1"}, "option 'txnVersion': must be an integer"),
        (False, {"txnAppId": "a b", "txnVersion": "1"}, "option 'txnAppId': 'a b' is not a"),
        (False, {"shards": "0"}, f"option 'shards' must be an integer from 1 to {MAX_SHARDS}"),
        (False, {"shards": "eight"}, "option 'shards': 'eight' is not an integer"),
        (False, {"shards": str(MAX_SHARDS + 1)}, f"from 1 to {MAX_SHARDS}, got {MAX_SHARDS + 1}"),
        (False, {"topic": "t"}, "unknown option 'topic'; topic is Kafka's"),
    ],
)
def test_bad_sink_options_name_the_option(
    streaming: bool, options: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        sink(streaming=streaming, **options)


# -- locations -------------------------------------------------------------------------


def test_relative_paths_are_made_absolute_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert source(path="logs/a/").path == os.path.join(str(tmp_path), "logs", "a")
    assert source(path="file:///data/x").path == "/data/x"
    with pytest.raises(InvalidOptionError, match="a file: URL names no other host"):
        source(path="file://elsewhere/data/x")


@pytest.mark.parametrize(
    ("spellings", "normal"),
    [
        (["/data/x", "file:/data/x", "file:///data/x", "/data//x/"], "/data/x"),
        (["s3a://b/x/", "s3://b//x", "S3N://b/x"], "s3://b/x"),
    ],
)
def test_one_spelling_per_location(spellings: list[str], normal: str) -> None:
    assert {normalize_location(spelling) for spelling in spellings} == {normal}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"asOfLsn": "0/1"}, "option 'asOfLsn' reads the latest rows as of a point: set option"),
        ({"view": "latest", "asOfLsn": "16B3748"}, "option 'asOfLsn': '16B3748' is not a Postgr"),
        ({"view": "latest", "asOfTimestamp": "soon"}, "option 'asOfTimestamp': 'soon' is not"),
        ({"view": "latest", "asOfLsn": "0/1", "asOfTimestamp": "0"}, "give one of them"),
    ],
)
def test_bad_as_of_options_name_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        source(streaming=False, **options)


def test_as_of_options_are_read() -> None:
    found = source(streaming=False, view="latest", asOfLsn="16/B374D848")
    assert (found.as_of_position, found.as_of_ms) == (0x16B374D848, None)
    found = source(streaming=False, view="latest", asOfTimestamp="2025-01-01T00:00:00")
    assert (found.as_of_position, found.as_of_ms) == (None, 1735689600000)

"""replog's errors as a Spark user meets them: the one-line message right after a
one-frame traceback (not at the end of 10-24 lines of replog's frames), options named as
the user wrote them, and a refused streaming option not buried under pyspark's own
UnboundLocalError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replog.log import ReplicationLog

pytestmark = pytest.mark.spark


def lines_before(message: str, phrase: str) -> int:
    """How many lines of ``message`` come before the one holding ``phrase``."""
    lines = message.splitlines()
    return next(i for i, line in enumerate(lines) if phrase in line)


@pytest.fixture
def log_url(tmp_path: Path) -> str:
    url = str(tmp_path / "log")
    ReplicationLog.create(url, 1).append([{"key": "k", "data": {}}])
    return url


def test_a_refused_batch_option_leads_with_the_users_spelling(spark: Any, log_url: str) -> None:
    with pytest.raises(Exception) as caught:
        spark.read.format("replog").option("maxOffsetsPerTrigger", 5).load(log_url).collect()
    message = str(caught.value)
    assert "unknown option 'maxOffsetsPerTrigger'; maxOffsetsPerTrigger is Kafka's name" in message
    assert lines_before(message, "InvalidOptionError") <= 3, message
    assert 'options.py", line' in message and "check_known" not in message


def test_a_refused_sink_option_leads(spark: Any, tmp_path: Path) -> None:
    frame = spark.createDataFrame([("k", "d")], "key string, data string")
    with pytest.raises(Exception) as caught:
        frame.write.format("replog-sink").mode("append").option("shards", "x").save(
            str(tmp_path / "out")
        )
    message = str(caught.value)
    assert "option 'shards': 'x' is not an integer" in message
    assert lines_before(message, "InvalidOptionError") <= 3, message


def test_a_refused_streaming_option_fails_the_query_with_its_message(
    spark: Any, log_url: str, tmp_path: Path
) -> None:
    query = (
        spark.readStream.format("replog")
        .option("startingOffset", "earliest")
        .load(log_url)
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .start()
    )
    with pytest.raises(Exception) as caught:
        query.awaitTermination()
    message = str(caught.value)
    assert "unknown option 'startingoffset'; did you mean startingOffsets?" in message
    assert "UnboundLocalError" not in message and "During handling" not in message
    assert lines_before(message, "InvalidOptionError") <= 6, message

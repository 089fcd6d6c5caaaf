"""The ``replog`` source's Spark schema: :data:`replog.format.events.EVENT_SCHEMA` as
Spark DDL (a test checks that the two agree column by column)."""

from __future__ import annotations

SPARK_SCHEMA_DDL = (
    "shard INT NOT NULL, sequence BIGINT NOT NULL, event_id STRING NOT NULL, "
    "timestamp TIMESTAMP NOT NULL, operation STRING NOT NULL, collection STRING, "
    "key STRING NOT NULL, data BINARY NOT NULL, before BINARY, metadata STRING"
)

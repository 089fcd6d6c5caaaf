"""The schema registry inside a log: Kafka Connect schemas (Debezium's ``schema`` wrapper)
stored once per collection, content-addressed, and mapped to exact Arrow types.

:mod:`replog.schemas.connect` is the pure mapping (no storage, no pyspark);
:mod:`replog.schemas.registry` keeps the versions under ``_replog/schemas/`` (FORMAT.md).
"""

"""From log to table: a change stream applied to a table keyed by its key columns.

:mod:`replog.tables.changes` holds the pure Arrow logic (the latest change per key, the
position rule, SCD2 history rows, schema alignment); :mod:`replog.tables.delta` applies a
batch of changes to a Delta table through ``deltalake`` (delta-rs), exactly once. Neither
imports Spark: :func:`replog.spark.functions.apply_changes` is the Spark adapter.
"""

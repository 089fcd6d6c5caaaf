"""A batch of changes applied to a Delta table through ``deltalake`` (delta-rs), once.

Each batch is one Delta commit that carries the application transaction
``(app_id, batch_id)``: a batch whose id is at or below the table's recorded version for
``app_id`` was committed before and is skipped. This is Delta's idempotent-writes recipe
(``txnAppId``/``txnVersion``), so a driver killed after the commit and restarted from its
checkpoint replays the batch harmlessly. Rows keep their change's position; a change at or
before a row's position is ignored, so an old batch replayed under another ``app_id`` (a
replaced checkpoint) cannot roll a row back.

``target`` is any location delta-rs opens (a local path, ``file://``, ``s3://``, ...);
``storage_options`` are delta-rs's (``AWS_ENDPOINT_URL``, ...), not fsspec's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from replog.errors import InvalidOptionError
from replog.tables import changes as rows
from replog.tables.changes import (
    ACTION,
    CURRENT,
    DELETE,
    OPERATION,
    POSITION,
    TIMESTAMP,
    VALID_TO,
    quoted,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """What one batch did: skipped as a replay, or committed as ``table_version``."""

    batch_id: int
    skipped: bool
    changes: int
    table_version: int | None
    metrics: dict[str, Any]


def _deltalake() -> Any:
    try:
        import deltalake  # noqa: PLC0415 - an optional extra: the error says how to get it
    except ImportError as exc:  # the optional extra
        raise InvalidOptionError(
            "apply_changes needs the deltalake package: pip install 'pyspark-replog[delta]'"
        ) from exc
    return deltalake


def open_table(target: str, storage_options: dict[str, str] | None) -> DeltaTable | None:
    """The Delta table at ``target``, or None when there is none yet (its log read once)."""
    deltalake = _deltalake()
    try:
        table: DeltaTable = deltalake.DeltaTable(target, storage_options=storage_options)
    except deltalake.exceptions.TableNotFoundError:
        return None
    return table


def _replayed(table: DeltaTable | None, app_id: str, batch_id: int) -> bool:
    """Whether ``table`` holds ``app_id``'s batch ``batch_id`` already (a replay: skipped)."""
    done = None if table is None else table.transaction_version(app_id)
    if done is None or batch_id > done:
        return False
    logger.info(
        "apply_changes %s: batch %d already committed (%d), skipped", app_id, batch_id, done
    )
    return True


def already_applied(
    target: str, app_id: str, batch_id: int, storage_options: dict[str, str] | None = None
) -> bool:
    """Whether ``app_id``'s batch ``batch_id`` is committed to the table at ``target``: a
    caller can skip a replayed batch before it computes the batch's changes."""
    return _replayed(open_table(target, storage_options), app_id, batch_id)


def table_schema(table: DeltaTable) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


def _commit(app_id: str, batch_id: int) -> Any:
    deltalake = _deltalake()
    return deltalake.CommitProperties(
        app_transactions=[deltalake.Transaction(app_id=app_id, version=batch_id)]
    )


def apply_batch(
    target: str,
    changes: pa.Table,
    keys: Sequence[str],
    *,
    app_id: str,
    batch_id: int,
    mode: str = "scd1",
    storage_options: dict[str, str] | None = None,
) -> Applied:
    """Apply one batch of changes (any order; see :mod:`replog.tables.changes`) to the
    Delta table at ``target`` in one commit carrying ``(app_id, batch_id)``, creating the
    table on the first batch. A replayed ``batch_id`` is skipped.

    ``mode="scd1"`` keeps one row per key (deletes remove it); ``"scd2"`` keeps every
    version with ``__valid_from``, ``__valid_to`` and ``__current``. Bad input (keys,
    mode, an incompatible column type) is refused before anything is written.
    """
    keys = rows.check_keys(keys)
    rows.check_mode(mode)
    if not app_id:
        raise InvalidOptionError("apply_changes: app_id must name the writer (non-empty)")
    if batch_id < 0:
        raise InvalidOptionError(f"apply_changes: batch_id {batch_id} is negative")
    rows.check_changes(changes, keys)
    table = open_table(target, storage_options)
    if _replayed(table, app_id, batch_id):
        return Applied(batch_id, True, changes.num_rows, None, {})
    if changes.num_rows == 0:
        return Applied(batch_id, False, 0, None, {})
    if mode == "scd1":
        metrics = _scd1(
            target,
            table,
            changes,
            keys,
            commit=_commit(app_id, batch_id),
            storage_options=storage_options,
        )
    else:
        metrics = _scd2(
            target,
            table,
            changes,
            keys,
            commit=_commit(app_id, batch_id),
            storage_options=storage_options,
        )
    if table is None:  # created by this batch
        table = open_table(target, storage_options)
        assert table is not None
    # else the merge's handle: delta-rs moves it to the version its commit made
    version: int = table.version()
    logger.info("apply_changes %s: batch %d -> table version %d", app_id, batch_id, version)
    return Applied(batch_id, False, changes.num_rows, version, metrics)


def _create(
    target: str, data: pa.Table, commit: Any, storage_options: dict[str, str] | None
) -> dict[str, Any]:
    # Nullable columns, whatever the source said: a later batch (or schema evolution)
    # must not fail a NOT NULL check on columns it lacks, and a merge into NOT NULL
    # columns (as Spark gives shard and sequence) failed delta-rs 1.6's null check on
    # rows it only copied (seen with SCD2's close updates).
    data = data.cast(pa.schema([field.with_nullable(True) for field in data.schema]))
    _deltalake().write_deltalake(
        target, data, mode="error", commit_properties=commit, storage_options=storage_options
    )
    return {"num_target_rows_inserted": data.num_rows}


def _scd1(
    target: str,
    table: DeltaTable | None,
    changes: pa.Table,
    keys: Sequence[str],
    *,
    commit: Any,
    storage_options: dict[str, str] | None,
) -> dict[str, Any]:
    latest = rows.latest_per_key(changes, keys).drop_columns([TIMESTAMP])
    if table is None:
        upserts = latest.filter(pc.not_equal(latest.column(OPERATION), DELETE))
        return _create(target, upserts.drop_columns([OPERATION]), commit, storage_options)
    source = rows.align(latest, table_schema(table))
    columns = [c for c in source.column_names if c != OPERATION]
    values = {quoted(c): f"s.{quoted(c)}" for c in columns}
    on = " AND ".join(f"t.{quoted(k)} = s.{quoted(k)}" for k in keys)
    newer = rows.newer_sql()
    is_delete = f"s.{OPERATION} = '{DELETE}'"
    metrics: dict[str, Any] = (
        table.merge(
            source,
            on,
            source_alias="s",
            target_alias="t",
            merge_schema=True,
            commit_properties=commit,
        )
        .when_matched_delete(f"{is_delete} AND {newer}")
        .when_matched_update(values, f"NOT ({is_delete}) AND {newer}")
        .when_not_matched_insert(values, f"NOT ({is_delete})")
        .execute()
    )
    return metrics


def _positions(table: DeltaTable, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """The newest position per key of ``changes`` among the table's rows."""
    first = keys[0]
    wanted = pc.unique(changes.column(first))
    found = table.to_pyarrow_dataset().to_table(
        columns=[*keys, *POSITION], filter=ds.field(first).isin(wanted)
    )
    return rows.latest_per_key(
        found.append_column(OPERATION, pa.nulls(found.num_rows, pa.string())).append_column(
            TIMESTAMP, pa.nulls(found.num_rows, pa.timestamp("us", tz="UTC"))
        ),
        keys,
    )


def _scd2(
    target: str,
    table: DeltaTable | None,
    changes: pa.Table,
    keys: Sequence[str],
    *,
    commit: Any,
    storage_options: dict[str, str] | None,
) -> dict[str, Any]:
    if table is not None:
        changes = rows.after_positions(changes, _positions(table, changes, keys), keys)
    source = rows.scd2_rows(changes, keys)
    if source.num_rows == 0:
        return {}
    if table is None:
        versions = source.filter(pc.equal(source.column(ACTION), "insert"))
        return _create(target, versions.drop_columns([ACTION]), commit, storage_options)
    source = rows.align(source, table_schema(table))
    columns = [c for c in source.column_names if c != ACTION]
    on = " AND ".join(f"t.{quoted(k)} = s.{quoted(k)}" for k in keys)
    metrics: dict[str, Any] = (
        table.merge(
            source,
            f"{on} AND t.{CURRENT} AND s.{ACTION} = 'close'",
            source_alias="s",
            target_alias="t",
            merge_schema=True,
            commit_properties=commit,
        )
        .when_matched_update({VALID_TO: f"s.{VALID_TO}", CURRENT: "false"})
        .when_not_matched_insert(
            {quoted(c): f"s.{quoted(c)}" for c in columns}, f"s.{ACTION} = 'insert'"
        )
        .execute()
    )
    return metrics

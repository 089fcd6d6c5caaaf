"""Which points a read as of can be given: the log alone (``view=latest`` with
``asOfLsn``/``asOfTimestamp``) and each Delta replica ``apply_changes`` writes from it
(``table_as_of``), shown by ``replog history`` and ``replog status``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replog.errors import InvalidOptionError
from replog.reading import LogReader


def reach(
    log: LogReader, tables: Sequence[str] = (), storage_options: dict[str, str] | None = None
) -> dict[str, Any]:
    """``{"log": reach or None, "replicas": [...]}``: the oldest and newest position (LSN)
    and time one can read as of, from the log alone (None: retention removed its first
    events) and for each Delta table at ``tables`` (``storage_options``: delta-rs's)."""
    from replog.tables import as_of, delta  # noqa: PLC0415 - the delta extra, when asked
    from replog.tables import coverage as covered  # noqa: PLC0415

    found = as_of.log_reach(log)
    replicas = []
    for path in tables:
        table = delta.open_table(path, storage_options)
        if table is None:
            raise InvalidOptionError(f"--table {path}: no Delta table there")
        versions = covered.table_history(table.history())
        if not versions:
            raise InvalidOptionError(
                f"--table {path}: its commits record no log coverage (not written by "
                f"apply_changes of this replog)"
            )
        replicas.append(
            {
                "path": path,
                "collection": versions[-1].coverage.collection,
                "version": versions[-1].version,
                **as_of.table_reach(versions, log).to_json(),
            }
        )
    return {"log": None if found is None else found.to_json(), "replicas": replicas}

"""A captured collection replayed from its log, event by event per key, to compare with
the source table: what any table built from the log holds (TOAST placeholders filled
from the key's previous image, deletes, defaults of columns added later), without Spark.

Kept to the simple types the capture tests use (integers, text, booleans): the values
compare as JSON on both sides.
"""

from __future__ import annotations

import json
from typing import Any

from replog.capture.events import UNAVAILABLE
from replog.log import ReplicationLog
from replog.schemas import registry
from support.capture import query
from support.logcheck import check_log


def log_table(url: str, collection: str) -> dict[str, dict[str, Any]]:
    """Key -> the row the log leaves for it. A placeholder with no earlier image to fill
    it stays in the row (what a table built from the log would then hold); a truncate
    event removes the older rows of the keys of its shard."""
    log = ReplicationLog.open(url)
    rows = sorted(check_log(log), key=lambda r: (r["shard"], r["sequence"]))
    state: dict[str, dict[str, Any]] = {}
    shard_of: dict[str, int] = {}
    for row in rows:
        if row["collection"] != collection:
            continue
        key = row["key"]
        if row["operation"] == "truncate":  # every older row of the keys of its shard
            for gone in [k for k in state if shard_of[k] == row["shard"]]:
                del state[gone]
            continue
        shard_of[key] = row["shard"]
        if row["operation"] == "delete":
            state.pop(key, None)
            continue
        image = json.loads(row["data"])
        previous = state.get(key, {})
        state[key] = {
            name: previous.get(name, value) if value == UNAVAILABLE else value
            for name, value in image.items()
        }
    defaults = _defaults(log, collection)
    for image in state.values():
        for name, value in defaults.items():
            image.setdefault(name, value)
    return state


def _defaults(log: ReplicationLog, collection: str) -> dict[str, Any]:
    """What rows written before a column was added hold in it (the registry's defaults)."""
    return {
        column.name: column.default
        for version in registry.versions(log.storage, collection)
        for column in version.columns()
        if column.default is not None
    }


def source_table(dsn: str, table: str, key: tuple[str, ...] = ("id",)) -> dict[str, Any]:
    """Key (as capture writes it) -> the row as JSON, of ``table`` as the server has it."""
    found = {}
    for (row,) in query(dsn, f"SELECT row_to_json(t) FROM {table} t"):
        text = json.dumps({k: row[k] for k in key}, separators=(",", ":"), ensure_ascii=False)
        found[text] = row
    return found


def differences(
    logged: dict[str, dict[str, Any]], source: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """What differs, on the source's columns (a column the source dropped may stay in a
    table built from the log): keys missing, keys extra, rows unequal (a few of each)."""
    missing = sorted(set(source) - set(logged))
    extra = sorted(set(logged) - set(source))
    unequal = [
        (key, {c: logged[key].get(c, "<absent>") for c in row}, row)
        for key, row in source.items()
        if key in logged and any(logged[key].get(c, "<absent>") != v for c, v in row.items())
    ]
    found: dict[str, Any] = {}
    if missing:
        found["missing"] = (len(missing), missing[:5])
    if extra:
        found["extra"] = (len(extra), extra[:5])
    if unequal:
        found["unequal"] = (len(unequal), unequal[:3])
    return found

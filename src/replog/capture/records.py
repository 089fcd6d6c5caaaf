"""A capture's records in the log (``_replog/captures/``: the snapshot plan, MySQL's
position record): sealed documents, each naming the log it belongs to. This module never
imports psycopg."""

from __future__ import annotations

from typing import Any

from replog.errors import LogIdentityError
from replog.format.sealed import unseal
from replog.storage import Storage


def read_record(
    storage: Storage, path: str, log_id: str, max_version: int
) -> dict[str, Any] | None:
    """The record at ``path`` (None: there is none), refused if it belongs to another log
    than ``log_id`` (a log re-created over a stale record)."""
    data = storage.read_optional(path)
    if data is None:
        return None
    body = unseal(data, storage.path(path), max_version=max_version)
    if body.get("log_id") != log_id:
        raise LogIdentityError(
            f"{storage.path(path)} belongs to log {body.get('log_id')!r}, not to "
            f"{log_id!r}: the log was re-created with a stale capture record in it"
        )
    return body

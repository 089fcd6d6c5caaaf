"""Schema versions kept in the log: ``_replog/schemas/<collection>/<sha256>.json``
(FORMAT.md, "Schema registry").

A version is written put-if-absent before the commit whose events name it (their
``metadata.schema``), so a reader that sees an event can always find its schema. Its
name is the SHA-256 of the schema's canonical JSON, so writers that register one schema
at once agree on the file, and a reader checks the content against the name.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from replog.errors import CorruptionError
from replog.format.commits import META_DIR
from replog.schemas import connect
from replog.storage import Storage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

SCHEMAS_DIR = f"{META_DIR}/schemas"


def folder_name(collection: str) -> str:
    """The collection's folder: its UTF-8 bytes percent-encoded (upper-case hex) except
    ASCII letters, digits and ``.-_~``; the names ``.`` and ``..`` encode their dots too
    (they would name another folder)."""
    encoded = quote(collection, safe=".-_")
    return encoded.replace(".", "%2E") if encoded in (".", "..") else encoded


def schema_path(collection: str, digest: str) -> str:
    return f"{SCHEMAS_DIR}/{folder_name(collection)}/{digest}.json"


@dataclass(frozen=True)
class SchemaVersion:
    """One registered schema of a collection."""

    collection: str
    digest: str
    registered_ms: int
    schema: Mapping[str, Any]

    def columns(self) -> tuple[connect.Column, ...]:
        return connect.row_columns(self.schema)

    def to_bytes(self) -> bytes:
        document = {
            "collection": self.collection,
            "digest": self.digest,
            "registered_ms": self.registered_ms,
            "schema": self.schema,
        }
        return json.dumps(document, sort_keys=True, ensure_ascii=False).encode()

    def to_json(self) -> dict[str, Any]:
        return {
            "collection": self.collection,
            "version": self.digest,
            "registered_ms": self.registered_ms,
            "fields": [c.to_json() for c in self.columns()],
        }

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> SchemaVersion:
        try:
            body = json.loads(data)
            version = cls(
                str(body["collection"]),
                str(body["digest"]),
                int(body["registered_ms"]),
                body["schema"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(path, f"malformed schema version: {exc}") from exc
        if connect.digest(version.schema) != version.digest or not path.endswith(
            schema_path(version.collection, version.digest)[len(SCHEMAS_DIR) :]
        ):
            raise CorruptionError(
                path, "the schema, its digest or its collection does not match its address"
            )
        return version


class _RegistrationClock:
    """Now, but later than any schema this process registered before: versions are
    ordered by it, and one append registers several in the same millisecond."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._last = max(now_ms(), self._last + 1)
            return self._last

    def __reduce__(self) -> tuple[type[_RegistrationClock], tuple[()]]:
        return (_RegistrationClock, ())  # pickled by value with replog: a fresh one


_registration_time = _RegistrationClock()


def register(
    storage: Storage, collection: str, schema: Mapping[str, Any], digest: str | None = None
) -> str:
    """Store ``schema`` for ``collection`` unless it is there; its digest (``digest``: the
    caller's, already computed from ``schema``)."""
    if digest is None:
        digest = connect.digest(schema)
    path = schema_path(collection, digest)
    if storage.exists(path):  # the usual case: cheaper than a put that fails
        return digest
    version = SchemaVersion(collection, digest, _registration_time(), schema)
    try:
        storage.put_if_absent(path, version.to_bytes())
        logger.info("%s: registered schema %s of %s", storage, digest, collection)
    except FileExistsError:
        pass  # another writer registered it meanwhile (same schema, its own time)
    return digest


def versions(storage: Storage, collection: str | None = None) -> list[SchemaVersion]:
    """The registered versions (of one collection, or all), oldest first per collection."""
    if collection is not None:
        folders = [folder_name(collection)]
    else:
        folders = sorted(storage.listdir(SCHEMAS_DIR))
    found: list[SchemaVersion] = []
    for folder in folders:
        where = f"{SCHEMAS_DIR}/{folder}"
        for name in storage.listdir(where):
            if name.endswith(".json"):
                path = f"{where}/{name}"
                found.append(SchemaVersion.from_bytes(storage.read(path), path))
    return sorted(found, key=lambda v: (v.collection, v.registered_ms, v.digest))


def collections(storage: Storage) -> list[str]:
    """The collections that have registered schemas (listing the registry)."""
    return sorted(unquote(folder) for folder in storage.listdir(SCHEMAS_DIR))


def unknown_collection(storage: Storage, collection: str, what: str) -> str:
    """Why ``collection`` has no schemas, for an error of ``what``: the collections that
    have some, closest first (``orders`` for ``public.orders``)."""
    known = collections(storage)
    if not known:
        return (
            f"{what}: no schema is registered in {storage.url} at all ('replog append "
            f"--format debezium' registers the schemas of values sent with them, "
            f"JsonConverter with schemas.enable=true; 'replog capture' those of the tables "
            f"it captures)"
        )
    near = [name for name in known if name.rsplit(".", 1)[-1] == collection.rsplit(".", 1)[-1]]
    hint = f"; did you mean {near[0]!r}?" if near else ""
    shown = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
    return (
        f"{what}: no schema of collection {collection!r} is registered in {storage.url}; "
        f"collections with schemas: {shown}{hint}"
    )

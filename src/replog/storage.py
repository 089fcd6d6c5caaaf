"""Storage access: fsspec URL resolution, put-if-absent, and secret-free descriptions.

Everything replog persists goes through these few functions, so the atomicity rules
of FORMAT.md live in one place:

* local disk: write a temporary file, fsync it, then ``os.link`` it to the final name
  (``link`` fails if the name exists, and readers never see a half-written file);
* S3 (s3fs): ``pipe_file(mode="create")``, which sends ``If-None-Match: *``;
* memory: create-if-absent under a process-wide lock (the store is process-local).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from replog.errors import InvalidOptionError, LogNotFoundError

logger = logging.getLogger(__name__)


class _ProcessLock:
    """A lock that pickles as a fresh one.

    ``replog.register(spark)`` pickles replog's modules by value, globals included, and a
    plain lock cannot be pickled. The lock only guards the process-local memory store,
    so a copy in another process needs a lock of its own anyway.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def __reduce__(self) -> tuple[type[_ProcessLock], tuple[()]]:
        return (_ProcessLock, ())


_MEMORY_LOCK = _ProcessLock()

SECRET_OPTION_WORDS = ("secret", "key", "token", "password", "credential", "session")
"""Storage options whose name contains one of these words are never shown."""


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every secret-looking value replaced by ``'***'`` (for logs and errors)."""
    return {
        name: "***" if any(word in name.lower() for word in SECRET_OPTION_WORDS) else value
        for name, value in options.items()
    }


def coerce_option_value(value: str) -> Any:
    """Turn a textual storage option (``--fs-option``/``fs.*``) into bool/int/float/None/str."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


class Storage:
    """A filesystem plus the root path of one location (a log, a manifest store)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        try:
            fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ValueError, ImportError) as exc:
            raise InvalidOptionError(f"cannot open URL {url!r}: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/")

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the address, not the live client (Spark ships readers to executors).
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Storage({self.url!r}, {redact(self.storage_options)!r})"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def child(self, relative: str) -> Storage:
        """A Storage rooted at ``relative`` below this one (same filesystem and options)."""
        clone = object.__new__(Storage)
        clone.url = f"{self.url.rstrip('/')}/{relative}"
        clone.storage_options = self.storage_options
        clone.fs = self.fs
        clone.root = self.path(relative)
        return clone

    @property
    def is_s3(self) -> bool:
        protocols = self.fs.protocol
        return "s3" in (protocols if isinstance(protocols, tuple | list) else (protocols,))

    def read(self, relative: str) -> bytes:
        """The whole file; ``FileNotFoundError`` if absent."""
        path = self.path(relative)
        if self.is_s3:
            # One GET: by default s3fs sends a HEAD first (to split big reads), and for
            # a missing object a LIST as well, tripling the requests of every probe.
            data: bytes = self.fs.cat_file(path, max_concurrency=1)
        else:
            data = self.fs.cat_file(path)
        return data

    def read_optional(self, relative: str) -> bytes | None:
        try:
            return self.read(relative)
        except FileNotFoundError:
            return None

    def write(self, relative: str, data: bytes) -> None:
        """Create or overwrite (for files no reader relies on atomically: hints, staged data)."""
        path = self.path(relative)
        if self.is_local:
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def put_if_absent(self, relative: str, data: bytes) -> None:
        """Write ``data`` only if nothing exists at ``relative``; else ``FileExistsError``.

        Atomic: concurrent callers for the same name see exactly one success, and no
        reader ever sees partial content.
        """
        path = self.path(relative)
        if self.is_local:
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            finally:
                os.unlink(tmp)
        elif isinstance(self.fs, MemoryFileSystem):
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    raise FileExistsError(path)
                self.fs.pipe_file(path, data)
        else:
            self.fs.pipe_file(path, data, mode="create")

    def exists(self, relative: str) -> bool:
        path = self.path(relative)
        if self.is_s3:
            # One HEAD: s3fs's exists() also LISTs a missing key (it might be a "directory").
            bucket, key, _ = self.fs.split_path(path)
            try:
                self.fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return False
            return True
        return bool(self.fs.exists(path))

    def delete(self, relative: str) -> None:
        """Delete a file; a file that is already gone is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(relative))

    def list(self, relative: str) -> list[str]:
        """Names (not paths) directly below ``relative``; empty if it does not exist.

        For garbage collection, repair and operator views only: readers never find data
        by listing (FORMAT.md).
        """
        path = self.path(relative)
        try:
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        finally:
            # s3fs answers later info/exists/cat calls from a cached listing: a file
            # written after this listing would look missing to this process.
            self.fs.invalidate_cache(path)
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def modified_ms(self, relative: str) -> int | None:
        """Last-modified time in ms, where the backend reports it."""
        try:
            stamp = self.fs.modified(self.path(relative))
        except (NotImplementedError, FileNotFoundError, KeyError):
            return None
        return int(stamp.timestamp() * 1000)


def missing_log_error(url: str) -> LogNotFoundError:
    return LogNotFoundError(f"{url!r} holds no replog log (no _replog/log.json)")

"""What each fsspec backend must do for replog: an atomic create-if-absent, durable writes.

replog commits by creating a file that must not exist yet (put-if-absent). fsspec's
generic ``pipe_file(mode="create")`` checks for the file and then writes it, which two
writers can both pass, so replog implements the create per backend, one class each
(:class:`LocalBackend`, :class:`MemoryBackend`, :class:`S3Backend`), and refuses the rest
(:class:`Backend`: read-only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from enum import Enum

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from replog.errors import UnsupportedStorageError
from replog.processlocal import ProcessLock

logger = logging.getLogger(__name__)

SUPPORTED = (
    "local disk (paths, file://), memory://, and S3 or S3-compatible stores that honour "
    "conditional writes (If-None-Match: *) through s3fs (s3://, s3a://)"
)
"""The backends replog can write to; FORMAT.md and OPERATIONS.md list the same."""


_MEMORY_LOCK = ProcessLock()


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    protocol = fs.protocol
    return str(protocol[0] if isinstance(protocol, tuple | list) else protocol)


class Durability(Enum):
    """How durable a write is when it returns (local disk; object stores always are)."""

    SYNC = "sync"
    """The file and its directory entry are on disk."""
    DEFERRED = "deferred"
    """The file is; its directory entry is made durable by a later
    :meth:`Backend.sync` (writers that create many files before one commit)."""
    BEST_EFFORT = "best_effort"
    """Neither: a crash may lose or tear it. For files readers can do without (snapshot
    headers and changes files, hints): they fall back past a damaged one."""


def fsync_directory(directory: str) -> None:
    """Make a directory's entries (a new link, a rename) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Backend:
    """What replog needs of one kind of fsspec filesystem: one request per call (retries
    and read-back live in :class:`~replog.storage.Storage`). This base reads any backend
    and refuses to write (its create would check, then write)."""

    kind = "other"
    writable = False
    remote = True
    """Whether a request waits on a network (then several are worth sending at once)."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def create(self, path: str, data: bytes, durability: Durability) -> None:
        """Create ``path`` holding ``data`` if nothing is there; else ``FileExistsError``."""
        raise unsupported(self.fs, "write")

    def replace(self, path: str, data: bytes, durability: Durability) -> None:
        """Create or overwrite ``path`` atomically (readers see the old or new bytes)."""
        raise unsupported(self.fs, "write")

    def sync(self, paths: list[str]) -> None:
        """Make the directory entries of files created :attr:`Durability.DEFERRED` durable."""

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def is_file(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def delete(self, path: str) -> None:
        """Delete a file; one already gone is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def delete_many(self, paths: list[str]) -> None:
        for path in paths:
            self.delete(path)

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def list_names(self, path: str) -> list[str]:
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

    def modified_ms(self, path: str) -> int | None:
        try:
            stamp = self.fs.modified(path)
        except (NotImplementedError, KeyError):
            return None
        return int(stamp.timestamp() * 1000)


_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")


def temporary_name(name: str) -> str:
    """Where a local write of ``name`` is staged, beside it, before it takes the name."""
    return f".{name}.{uuid.uuid4().hex}.tmp"


def is_temporary(name: str) -> bool:
    """Whether a listed ``name`` is a local write still being staged (or one a crash
    left): not a file of the log, and possibly half-written."""
    return _TEMPORARY.fullmatch(name) is not None


class LocalBackend(Backend):
    """Local disk: a temporary file, fsynced, hard-linked to its name (``link`` fails if
    the name exists), then the directory fsynced, so a power cut cannot keep a later
    file while losing an earlier one."""

    kind = "local"
    writable = True
    remote = False

    @staticmethod
    def _temporary(path: str, data: bytes, durability: Durability) -> str:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, temporary_name(os.path.basename(path)))
        with open(tmp, "wb") as handle:
            handle.write(data)
            if durability is not Durability.BEST_EFFORT:
                handle.flush()
                os.fsync(handle.fileno())
        return tmp

    def create(self, path: str, data: bytes, durability: Durability) -> None:
        tmp = self._temporary(path, data, durability)
        try:
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
        if durability is Durability.SYNC:
            fsync_directory(os.path.dirname(path))

    def replace(self, path: str, data: bytes, durability: Durability) -> None:
        tmp = self._temporary(path, data, durability)
        os.replace(tmp, path)
        if durability is Durability.SYNC:
            fsync_directory(os.path.dirname(path))

    def sync(self, paths: list[str]) -> None:
        for directory in sorted({os.path.dirname(path) for path in paths}):
            fsync_directory(directory)


class MemoryBackend(Backend):
    """``memory://``: a create under a process-wide lock (the store is process-local)."""

    kind = "memory"
    writable = True
    remote = False

    def create(self, path: str, data: bytes, durability: Durability) -> None:
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def replace(self, path: str, data: bytes, durability: Durability) -> None:
        self.fs.pipe_file(path, data)


class S3Backend(Backend):
    """S3 and compatible stores through s3fs: ``PUT`` with ``If-None-Match: *``; one
    request per read and probe (s3fs would add a HEAD, or a LIST for a missing key)."""

    kind = "s3"
    writable = True

    def create(self, path: str, data: bytes, durability: Durability) -> None:
        self.fs.pipe_file(path, data, mode="create")

    def replace(self, path: str, data: bytes, durability: Durability) -> None:
        self.fs.pipe_file(path, data)

    def read(self, path: str) -> bytes:
        data: bytes = self.fs.cat_file(path, max_concurrency=1)
        return data

    def exists(self, path: str) -> bool:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def delete_many(self, paths: list[str]) -> None:
        self.fs.rm(paths)  # DeleteObjects, 1,000 keys per request; missing keys are no error


def backend_for(fs: fsspec.AbstractFileSystem) -> Backend:
    """The backend of ``fs`` (a subclass with a protocol of its own is "other": replog
    cannot know how it writes)."""
    protocols = set(fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,))
    if isinstance(fs, LocalFileSystem) and protocols & {"file", "local"}:
        return LocalBackend(fs)
    if isinstance(fs, MemoryFileSystem) and "memory" in protocols:
        return MemoryBackend(fs)
    return S3Backend(fs) if "s3" in protocols else Backend(fs)


def unsupported(fs: fsspec.AbstractFileSystem, what: str) -> UnsupportedStorageError:
    return UnsupportedStorageError(
        f"cannot {what} with storage backend {protocol_of(fs)!r} ({type(fs).__name__}): "
        f"replog commits with an atomic create-if-absent, which this fsspec backend does not "
        f"offer (its create checks and then writes, so two writers can both win a commit). "
        f"Supported: {SUPPORTED}. Reading works on any backend."
    )


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` may go away on retry (timeouts, resets, 5xx, throttling).

    A missing or existing file, a permission error and bad input are answers, not faults.
    """
    if isinstance(
        exc,
        FileNotFoundError
        | FileExistsError
        | PermissionError
        | IsADirectoryError
        | NotADirectoryError
        | UnsupportedStorageError,
    ):
        return False
    if isinstance(exc, OSError | TimeoutError | ConnectionError):
        return True
    module = type(exc).__module__ or ""
    # Network errors of the S3 stack that s3fs passes through untranslated.
    return module.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "urllib3")

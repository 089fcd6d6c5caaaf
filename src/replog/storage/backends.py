"""What each fsspec backend must do for replog: an atomic create-if-absent, durable writes.

replog commits by creating a file that must not exist yet (put-if-absent). fsspec's
generic ``pipe_file(mode="create")`` checks for the file and then writes it, which two
writers can both pass, so replog implements the create per backend and refuses the rest:

* local disk: write a temporary file, fsync it, ``os.link`` it to the final name (``link``
  fails if the name exists) and fsync the directory, so a power cut cannot keep a later
  file while losing an earlier one;
* S3 and compatible stores (s3fs): ``PUT`` with ``If-None-Match: *``;
* ``memory://``: create under a process-wide lock (the store is process-local anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from enum import Enum

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from replog.errors import UnsupportedStorageError

logger = logging.getLogger(__name__)

SUPPORTED = (
    "local disk (paths, file://), memory://, and S3 or S3-compatible stores that honour "
    "conditional writes (If-None-Match: *) through s3fs (s3://, s3a://)"
)
"""The backends replog can write to; FORMAT.md and OPERATIONS.md list the same."""


class _ProcessLock:
    """A lock that pickles as a fresh one.

    ``replog.register(spark)`` pickles replog's modules by value, globals included, and a
    plain lock cannot be pickled. The lock only guards the process-local memory store, so
    a copy in another process needs a lock of its own anyway.
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


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    protocol = fs.protocol
    return str(protocol[0] if isinstance(protocol, tuple | list) else protocol)


def kind_of(fs: fsspec.AbstractFileSystem) -> str:
    """``"local"``, ``"memory"``, ``"s3"`` or ``"other"`` (a subclass with a protocol of its
    own is "other": replog cannot know how it writes)."""
    protocols = set(fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,))
    if isinstance(fs, LocalFileSystem) and protocols & {"file", "local"}:
        return "local"
    if isinstance(fs, MemoryFileSystem) and "memory" in protocols:
        return "memory"
    return "s3" if "s3" in protocols else "other"


def fsync_directory(directory: str) -> None:
    """Make a directory's entries (a new link, a rename) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Durability(Enum):
    """How durable a write is when it returns (local disk; object stores always are)."""

    SYNC = "sync"
    """The file and its directory entry are on disk."""
    DEFERRED = "deferred"
    """The file is; its directory entry is made durable by a later :func:`sync_paths`
    (writers that create many files before one commit)."""
    BEST_EFFORT = "best_effort"
    """Neither: a crash may lose or tear it. For files readers can do without (snapshot
    headers and changes files, hints): they fall back past a damaged one."""


def _write_temporary(path: str, data: bytes, durability: Durability) -> str:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        if durability is not Durability.BEST_EFFORT:
            handle.flush()
            os.fsync(handle.fileno())
    return tmp


def create(fs: fsspec.AbstractFileSystem, path: str, data: bytes, durability: Durability) -> None:
    """Create ``path`` holding ``data`` if nothing is there; else ``FileExistsError``."""
    kind = kind_of(fs)
    if kind == "local":
        tmp = _write_temporary(path, data, durability)
        try:
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
        if durability is Durability.SYNC:
            fsync_directory(os.path.dirname(path))
    elif kind == "memory":
        with _MEMORY_LOCK:
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, data)
    elif kind == "s3":
        fs.pipe_file(path, data, mode="create")
    else:
        raise unsupported(fs, "write")


def replace(fs: fsspec.AbstractFileSystem, path: str, data: bytes, durability: Durability) -> None:
    """Create or overwrite ``path`` atomically (readers see the old or the new bytes)."""
    kind = kind_of(fs)
    if kind == "local":
        tmp = _write_temporary(path, data, durability)
        os.replace(tmp, path)
        if durability is Durability.SYNC:
            fsync_directory(os.path.dirname(path))
    elif kind in ("memory", "s3"):
        fs.pipe_file(path, data)
    else:
        raise unsupported(fs, "write")


def sync_paths(fs: fsspec.AbstractFileSystem, paths: list[str]) -> None:
    """Make the directory entries of files created with ``sync=False`` durable."""
    if kind_of(fs) == "local":
        for directory in sorted({os.path.dirname(path) for path in paths}):
            fsync_directory(directory)


def read(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    if kind_of(fs) == "s3":
        # One GET: by default s3fs sends a HEAD first (to split big reads), and for a
        # missing object a LIST as well, tripling the requests of every probe.
        data: bytes = fs.cat_file(path, max_concurrency=1)
        return data
    return bytes(fs.cat_file(path))


def exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    if kind_of(fs) == "s3":
        # One HEAD: s3fs's exists() also LISTs a missing key (it might be a "directory").
        bucket, key, _ = fs.split_path(path)
        try:
            fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True
    return bool(fs.exists(path))


def delete(fs: fsspec.AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def delete_many(fs: fsspec.AbstractFileSystem, paths: list[str]) -> None:
    if kind_of(fs) == "s3":
        fs.rm(paths)  # DeleteObjects, 1,000 keys per request; missing keys are no error
        return
    for path in paths:
        delete(fs, path)


def delete_tree(fs: fsspec.AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def list_names(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    try:
        fs.invalidate_cache(path)
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    finally:
        # s3fs answers later info/exists/cat calls from a cached listing: a file written
        # after this listing would look missing to this process.
        fs.invalidate_cache(path)
    return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)


def modified_ms(fs: fsspec.AbstractFileSystem, path: str) -> int | None:
    try:
        stamp = fs.modified(path)
    except (NotImplementedError, KeyError):
        return None
    return int(stamp.timestamp() * 1000)


def can_create_atomically(fs: fsspec.AbstractFileSystem) -> bool:
    return kind_of(fs) != "other"


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

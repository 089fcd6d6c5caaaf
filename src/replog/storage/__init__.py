"""Storage access: one location on an fsspec filesystem, and the rules for writing to it.

Everything replog persists goes through :class:`Storage`, so the atomicity rules of
FORMAT.md live in one place (:mod:`replog.storage.backends` has the per-backend parts):

* put-if-absent is atomic on every backend replog writes to, and refused on the others;
* transient failures (timeouts, resets, 5xx, throttling) are retried;
* an uncertain write (a timeout, or a retried PUT answered "already exists") is resolved
  by reading the file back: if it holds this writer's bytes, the write landed. Every
  file replog creates is unique to its writer (commit records carry a random token), so
  equal bytes prove authorship;
* storage options are never shown: :func:`redact` hides secrets, nested ones included.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from replog.errors import (
    CommitOutcomeUnknownError,
    InvalidOptionError,
    StorageError,
    StoragePermissionError,
)
from replog.storage import backends
from replog.storage.backends import Durability
from replog.storage.threads import run_all

logger = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")

SECRET_OPTION_WORDS = ("secret", "key", "token", "password", "credential", "session")
"""Storage options whose name contains one of these words are never shown or coerced."""


def is_secret(name: str) -> bool:
    return any(word in name.lower() for word in SECRET_OPTION_WORDS)


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every secret-looking value replaced by ``'***'``, at any depth."""
    shown: dict[str, Any] = {}
    for name, value in options.items():
        if is_secret(str(name)):
            shown[name] = "***"
        elif isinstance(value, Mapping):
            shown[name] = redact(value)
        else:
            shown[name] = value
    return shown


_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)\.[0-9]+")


def coerce_option_value(name: str, value: str) -> Any:
    """A textual storage option (``--fs-option``/``fs.*``) as bool/int/float/None/str.

    Only canonical spellings are converted (``"00123"`` stays a string), and a secret's
    value is never converted: it is passed on exactly as given.
    """
    if is_secret(name):
        return value
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    if _INTEGER.fullmatch(value):
        return int(value)
    if _DECIMAL.fullmatch(value):
        return float(value)
    return value


def _brief(exc: BaseException) -> str:
    """``exc`` in a line: what a backend that cannot start says can run to pages (pyarrow's
    HDFS client lists every libjvm path it tried)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "libjvm" in text or "libhdfs" in text:
        return (
            "HDFS needs a Java runtime and Hadoop's native client on this machine "
            "(pyarrow's HadoopFileSystem: set JAVA_HOME, HADOOP_HOME and CLASSPATH); "
            f"it said: {text[:160]}..."
        )
    return text if len(text) <= 300 else f"{text[:300]}..."


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently transient storage failures are retried."""

    attempts: int = 8
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay_s, self.first_delay_s * 2**attempt))


DEFAULT_RETRY = RetryPolicy()


def _denied(what: str, path: str, url: str, exc: PermissionError) -> StoragePermissionError:
    """A refused request, named by the file it was for (a local write's refusal names its
    temporary file, which means nothing to the user)."""
    if isinstance(exc, StoragePermissionError):
        return exc
    hint = f" (is {url} read-only for this user?)" if what in ("write", "delete", "sync") else ""
    return StoragePermissionError(f"cannot {what} {path}: permission denied{hint}")


_SCHEME_TYPO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/?(?!/)(.*)", re.DOTALL)


def _check_scheme(url: str) -> None:
    """Refuse ``s3:/bucket/x`` and ``s3:bucket/x``: fsspec takes them for local paths
    (a directory named ``s3:`` in the working directory), so a typo would create or read
    a log on local disk."""
    match = _SCHEME_TYPO.fullmatch(url)
    if match is None or "://" in url:
        return
    scheme = match.group(1).lower()
    if scheme != "file" and scheme in fsspec.available_protocols():
        raise InvalidOptionError(
            f"{url!r} is not a {scheme} URL (it would be read as a local path); write "
            f"'{scheme}://{match.group(2)}'"
        )


class Storage:
    """A filesystem plus the root path of one location (a log, a manifest store).

    Picklable (it pickles its address, not its client): Spark ships it to executors.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        if isinstance(url, os.PathLike):
            url = os.fspath(url)
        if not isinstance(url, str):
            raise InvalidOptionError(
                f"a storage URL must be a string, got {type(url).__name__} {url!r} (a Storage "
                f"given where a URL is expected?)"
            )
        _check_scheme(url)
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        try:
            fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ValueError, ImportError, TypeError) as exc:
            raise InvalidOptionError(f"cannot open URL {url!r}: {_brief(exc)}") from exc
        except Exception as exc:  # a backend that connects when created (ftp, hdfs, sftp)
            raise StorageError(f"cannot open URL {url!r}: {_brief(exc)}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self.backend = backends.backend_for(fs)
        self.kind = self.backend.kind

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options, "retry": self.retry}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["url"], state["storage_options"], retry=state.get("retry", DEFAULT_RETRY)
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, {redact(self.storage_options)!r})"

    # -- addressing --------------------------------------------------------------------

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    @property
    def is_remote(self) -> bool:
        """Whether a request waits on a network (then several are worth sending at once)."""
        return self.backend.remote

    def map(self, function: Callable[[T], U], items: Sequence[T], *, threads: int = 8) -> list[U]:
        """``function`` over ``items``, in order: in up to ``threads`` threads on remote
        storage, one by one elsewhere (a thread costs more than a read from local disk)."""
        if not self.is_remote or len(items) < 2:
            return [function(item) for item in items]
        calls = [functools.partial(function, item) for item in items]
        return [future.result() for future in run_all(calls, threads=threads)]

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def child(self, relative: str) -> Storage:
        """The location ``relative`` below this one (same filesystem, options and class)."""
        clone = object.__new__(type(self))  # not copy.copy: pickling state drops subclass fields
        clone.__dict__.update(self.__dict__)
        clone.url = f"{self.url.rstrip('/')}/{relative}"
        clone.root = self.path(relative)
        return clone

    def where(self, relative: str) -> str:
        """``relative``'s full path, with the working directory if the URL was relative."""
        path = self.path(relative)
        if self.is_local and not os.path.isabs(self.url) and "://" not in self.url:
            return f"{path} (relative to working directory {os.getcwd()})"
        return path

    # -- reading -----------------------------------------------------------------------

    def read(self, relative: str) -> bytes:
        """The whole file; ``FileNotFoundError`` if absent."""
        path = self.path(relative)
        return self._retrying("read", path, lambda: self._read_once(path))

    def read_optional(self, relative: str) -> bytes | None:
        try:
            return self.read(relative)
        except FileNotFoundError:
            return None

    def exists(self, relative: str) -> bool:
        path = self.path(relative)
        return self._retrying("probe", path, lambda: self._exists_once(path))

    def is_file(self, relative: str) -> bool:
        """Whether ``relative`` is a file (on object stores: an object of that key, not
        only a prefix of others)."""
        path = self.path(relative)
        return self._retrying("probe", path, lambda: self._is_file_once(path))

    def listdir(self, relative: str) -> list[str]:
        """Names (not paths) directly below ``relative``; empty if it does not exist.

        For garbage collection, repair and operator views only: readers never find data
        by listing (FORMAT.md).
        """
        path = self.path(relative)
        return self._retrying("list", path, lambda: self._list_once(path))

    def modified_ms(self, relative: str) -> int | None:
        """Last-modified time in ms, where the backend reports it (None otherwise)."""
        path = self.path(relative)
        try:
            return self._retrying("stat", path, lambda: self._modified_once(path))
        except FileNotFoundError:
            return None

    # -- writing -----------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether this backend has the atomic create replog commits with."""
        return self.backend.writable

    def require_writable(self) -> None:
        """Raise :class:`~replog.errors.UnsupportedStorageError` naming the backend if
        replog cannot write here; called before anything is written."""
        if not self.writable:
            raise backends.unsupported(self.fs, f"write to {self.url!r}")

    def write(
        self, relative: str, data: bytes, *, durability: Durability = Durability.SYNC
    ) -> None:
        """Create or overwrite atomically (for files read as hints: pointers, GC notes);
        ``Durability.BEST_EFFORT``: without waiting for the disk (a crash may lose or tear
        it)."""
        self.require_writable()
        path = self.path(relative)
        self._retrying("write", path, lambda: self._replace_once(path, data, durability))

    def put_if_absent(
        self, relative: str, data: bytes, *, durability: Durability = Durability.SYNC
    ) -> None:
        """Create ``relative`` holding ``data`` only if nothing is there, else ``FileExistsError``.

        Atomic: of concurrent callers for one name exactly one succeeds, and no reader sees
        partial content. An uncertain outcome is resolved by reading back: the write landed
        if the file holds exactly ``data``. Raises
        :class:`~replog.errors.CommitOutcomeUnknownError` if storage never lets that be
        decided. ``Durability.DEFERRED`` leaves the directory fsync to :meth:`sync`;
        ``Durability.BEST_EFFORT`` does not wait for the disk at all (files readers can do
        without).
        """
        self.require_writable()
        path = self.path(relative)
        failure: BaseException | None = None
        for attempt in range(self.retry.attempts):
            try:
                self._create_once(path, data, durability)
                return
            except FileExistsError:
                if self._holds(path, data):
                    logger.info("%s: an earlier attempt of this write had landed", path)
                    return
                raise
            except PermissionError as exc:
                raise _denied("write", path, self.url, exc) from exc
            except Exception as exc:
                if not backends.transient(exc):
                    raise
                failure = exc
            # The attempt may or may not have landed: look before trying again.
            landed, failure = self._landed(path, data, failure)
            if landed:
                logger.info("%s: the write landed although storage reported %s", path, failure)
                return
            time.sleep(self.retry.delay(attempt))
        raise CommitOutcomeUnknownError(
            f"{path}: could not write it or find out whether the write landed after "
            f"{self.retry.attempts} attempts (last error: {failure!r})"
        ) from failure

    def _landed(
        self, path: str, data: bytes, failure: BaseException | None
    ) -> tuple[bool, BaseException | None]:
        """After a create whose outcome is uncertain: (True, ...) if ``path`` holds
        ``data`` (it landed); (False, the latest failure) if it is absent or storage did
        not answer (try again); ``FileExistsError`` if another writer's bytes are there."""
        try:
            found = self._read_once(path)
        except FileNotFoundError:
            return False, failure
        except Exception as exc:
            if not backends.transient(exc):
                raise
            return False, exc
        if found == data:
            return True, failure
        raise FileExistsError(path)

    def sync(self, relatives: list[str]) -> None:
        """Make files created with ``Durability.DEFERRED`` durable (their directory entries)."""
        paths = [self.path(relative) for relative in relatives]
        self._retrying("sync", self.root, lambda: self.backend.sync(paths))

    def delete(self, relative: str) -> None:
        """Delete a file; a file that is already gone is fine."""
        path = self.path(relative)
        self._retrying("delete", path, lambda: self._delete_once(path))

    def delete_many(self, relatives: Sequence[str]) -> None:
        """Delete files (ones already gone are fine): one request per 1,000 on S3."""
        if relatives:
            paths = [self.path(relative) for relative in relatives]
            self._retrying("delete", paths[0], lambda: self._delete_many_once(paths))

    def delete_tree(self, relative: str) -> None:
        """Delete a directory and everything below it; one that is already gone is fine."""
        path = self.path(relative)
        self._retrying("delete", path, lambda: self.backend.delete_tree(path))

    # -- internals -----------------------------------------------------------------------

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self._retrying("read back", path, lambda: self._read_once(path)) == data
        except StorageError as exc:
            raise CommitOutcomeUnknownError(
                f"{path}: exists, but could not be read back to tell whose it is: {exc}"
            ) from exc

    def _retrying(self, what: str, path: str, operation: Callable[[], T]) -> T:
        failure: Exception | None = None
        for attempt in range(self.retry.attempts):
            try:
                return operation()
            except PermissionError as exc:
                raise _denied(what, path, self.url, exc) from exc
            except Exception as exc:
                if not backends.transient(exc):
                    raise
                failure = exc
                logger.debug("%s %s failed (%r); retrying", what, path, exc)
            time.sleep(self.retry.delay(attempt))
        raise StorageError(
            f"cannot {what} {path}: storage kept failing after {self.retry.attempts} "
            f"attempts (last error: {failure!r})"
        ) from failure

    # The primitives below do one request each; the fault injector overrides them.

    def _read_once(self, path: str) -> bytes:
        return self.backend.read(path)

    def _exists_once(self, path: str) -> bool:
        return self.backend.exists(path)

    def _is_file_once(self, path: str) -> bool:
        return self.backend.is_file(path)

    def _list_once(self, path: str) -> list[str]:
        return self.backend.list_names(path)

    def _modified_once(self, path: str) -> int | None:
        return self.backend.modified_ms(path)

    def _create_once(self, path: str, data: bytes, durability: Durability) -> None:
        self.backend.create(path, data, durability)

    def _replace_once(self, path: str, data: bytes, durability: Durability) -> None:
        self.backend.replace(path, data, durability)

    def _delete_once(self, path: str) -> None:
        self.backend.delete(path)

    def _delete_many_once(self, paths: list[str]) -> None:
        self.backend.delete_many(paths)

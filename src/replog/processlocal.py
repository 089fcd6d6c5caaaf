"""State a process keeps for itself: locks and caches that pickle as fresh, empty ones.

``replog.register(spark)`` run from a checkout or ``--py-files`` pickles replog's modules
by value (cloudpickle), each with all its globals, whenever a task's function reaches one.
A plain lock cannot be pickled, and a cache's entries (open tables, key sets) mean
nothing in another process, which needs its own anyway.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ProcessLock:
    """A lock that pickles as a fresh one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def __reduce__(self) -> tuple[type[ProcessLock], tuple[()]]:
        return (ProcessLock, ())


class ProcessDict(dict[K, V]):
    """A dict of a process's own entries: pickles as an empty one."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (type(self), ())

"""A storage fault injector: every request may fail the way object stores fail.

:class:`FaultyStorage` wraps a :class:`~replog.storage.Storage` and, per request, at
random (seeded, so a failing seed replays exactly):

* fails it before it does anything: a 503 SlowDown or 500 (``OSError``) or a connection
  reset (``ConnectionResetError``);
* lets a write land and then loses the response: a timeout (``TimeoutError``), or the
  "already exists" a client gets when it retries a create that had landed (s3fs does
  this after a timed-out PUT with ``If-None-Match``);
* kills the process at a request boundary (:class:`SimulatedCrash`, a ``BaseException``
  nothing in replog catches as an error); every later request of that process fails too.

For tests and ``benchmarks/`` fault runs only: nothing in replog creates one.
"""

from __future__ import annotations

import copy
import errno
import random
from collections import Counter
from dataclasses import dataclass, field

from replog.storage import Storage
from replog.storage.backends import Durability


class SimulatedCrash(BaseException):
    """The process died at this request (raised by the fault injector only)."""


@dataclass(frozen=True)
class FaultRates:
    """Probability of each fault per request."""

    unavailable: float = 0.04
    reset: float = 0.02
    lost_response: float = 0.04
    retried_create: float = 0.03
    crash: float = 0.0

    @classmethod
    def only(cls, **rates: float) -> FaultRates:
        """The faults named, at the rates given, and no other (for targeted tests)."""
        return cls(**{name: 0.0 for name in cls.__dataclass_fields__} | rates)


@dataclass
class FaultInjector:
    """The random source, rates and counters shared by one simulated process's storages."""

    seed: int
    rates: FaultRates = field(default_factory=FaultRates)
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    crashed: bool = False

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self._random.random() < rate

    def before(self, what: str, path: str) -> None:
        """Maybe fail (or crash) a request before it reaches storage."""
        if self.crashed:
            raise SimulatedCrash(f"request after the process died: {what} {path}")
        self.requests += 1
        if self._roll(self.rates.crash):
            self._crash("crash before request", what, path)
        if self._roll(self.rates.unavailable):
            self.faults["503/500 before request"] += 1
            raise OSError(errno.EIO, f"injected 503 SlowDown: {what} {path}")
        if self._roll(self.rates.reset):
            self.faults["connection reset"] += 1
            raise ConnectionResetError(f"injected connection reset: {what} {path}")

    def after_write(self, what: str, path: str, *, create: bool) -> None:
        """Maybe lose the response of a write that landed (or crash right after it)."""
        if self._roll(self.rates.crash):
            self._crash("crash after a write landed", what, path)
        if self._roll(self.rates.lost_response):
            self.faults["timeout after the write landed"] += 1
            raise TimeoutError(f"injected timeout after the write landed: {what} {path}")
        if create and self._roll(self.rates.retried_create):
            self.faults["retried create answered 412"] += 1
            raise FileExistsError(f"injected 412 to a retried create that had landed: {path}")

    def _crash(self, kind: str, what: str, path: str) -> None:
        self.faults[kind] += 1
        self.crashed = True
        raise SimulatedCrash(f"injected {kind}: {what} {path}")


class FaultyStorage(Storage):
    """A :class:`Storage` whose requests go through a :class:`FaultInjector`."""

    injector: FaultInjector

    @classmethod
    def wrap(cls, storage: Storage, injector: FaultInjector) -> FaultyStorage:
        faulty = copy.copy(storage)
        faulty.__class__ = cls
        assert isinstance(faulty, FaultyStorage)
        faulty.injector = injector
        return faulty

    def _read_once(self, path: str) -> bytes:
        self.injector.before("read", path)
        return super()._read_once(path)

    def _exists_once(self, path: str) -> bool:
        self.injector.before("probe", path)
        return super()._exists_once(path)

    def _is_file_once(self, path: str) -> bool:
        self.injector.before("probe", path)
        return super()._is_file_once(path)

    def _list_once(self, path: str) -> list[str]:
        self.injector.before("list", path)
        return super()._list_once(path)

    def _modified_once(self, path: str) -> int | None:
        self.injector.before("stat", path)
        return super()._modified_once(path)

    def _create_once(self, path: str, data: bytes, durability: Durability) -> None:
        self.injector.before("create", path)
        super()._create_once(path, data, durability)
        self.injector.after_write("create", path, create=True)

    def _replace_once(self, path: str, data: bytes, durability: Durability) -> None:
        self.injector.before("write", path)
        super()._replace_once(path, data, durability)
        self.injector.after_write("write", path, create=False)

    def _delete_once(self, path: str) -> None:
        self.injector.before("delete", path)
        super()._delete_once(path)
        self.injector.after_write("delete", path, create=False)

    def _delete_many_once(self, paths: list[str]) -> None:
        self.injector.before("delete", paths[0])
        super()._delete_many_once(paths)
        self.injector.after_write("delete", paths[0], create=False)

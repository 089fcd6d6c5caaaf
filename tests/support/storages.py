"""Storage backends as tests need them: without file times, with whole-second times."""

from __future__ import annotations

from typing import Any

from replog.storage import Storage
from replog.timeutil import now_ms


class NoTimes(Storage):
    """A backend that reports no modification times (collectors use first-seen stamps)."""

    def _modified_once(self, path: str) -> int | None:
        return None


class WholeSeconds(Storage):
    """A backend whose modification times have whole-second precision (S3's
    ``Last-Modified``, as s3fs's HEAD reports it)."""

    def _modified_once(self, path: str) -> int | None:
        stamp = super()._modified_once(path)
        return None if stamp is None else stamp - stamp % 1000


class ClockTimes(Storage):
    """A backend whose clock is replog's (:func:`~replog.timeutil.now_ms` of the writing
    context): a file created under a stopped clock is stamped with that time, so a test
    that stops a writer's clock stops the age expiry reads from file times too."""

    stamps: dict[str, int] = {}

    def _create_once(self, path: str, data: bytes, durability: Any) -> None:
        super()._create_once(path, data, durability)
        ClockTimes.stamps[path] = now_ms()

    def _modified_once(self, path: str) -> int | None:
        stamp = super()._modified_once(path)
        return None if stamp is None else ClockTimes.stamps.get(path, stamp)


def as_class(storage: Storage, cls: type[Storage]) -> Storage:
    """A copy of ``storage`` (same location and filesystem) behaving as ``cls``."""
    copy = storage.child("")
    copy.__class__ = cls
    return copy

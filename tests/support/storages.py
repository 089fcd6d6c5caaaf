"""Storage backends as tests need them: without file times, with whole-second times."""

from __future__ import annotations

from replog.storage import Storage


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


def as_class(storage: Storage, cls: type[Storage]) -> Storage:
    """A copy of ``storage`` (same location and filesystem) behaving as ``cls``."""
    copy = storage.child("")
    copy.__class__ = cls
    return copy

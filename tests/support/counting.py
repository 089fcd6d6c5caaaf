"""Storage that counts its requests: for tests of what an operation reads and writes."""

from __future__ import annotations

from collections import Counter

from replog.storage import Storage
from replog.storage.backends import Durability


class CountingStorage(Storage):
    """A :class:`Storage` recording every request it sends, as ``(kind, path)``."""

    requests: list[tuple[str, str]]

    @property
    def counts(self) -> Counter[str]:
        """Requests by kind; commit reads are also counted as ``"commit read"``."""
        counts = Counter(kind for kind, _ in self.requests)
        counts["commit read"] = sum(
            1 for kind, path in self.requests if kind == "read" and "/commits/" in path
        )
        return counts

    def matching(self, kind: str, part: str) -> int:
        """How many ``kind`` requests went to paths containing ``part``."""
        return sum(1 for k, path in self.requests if k == kind and part in path)

    def _read_once(self, path: str) -> bytes:
        self.requests.append(("read", path))
        return super()._read_once(path)

    def _exists_once(self, path: str) -> bool:
        self.requests.append(("probe", path))
        return super()._exists_once(path)

    def _list_once(self, path: str) -> list[str]:
        self.requests.append(("list", path))
        return super()._list_once(path)

    def _create_once(self, path: str, data: bytes, sync: bool) -> None:
        self.requests.append(("create", path))
        super()._create_once(path, data, sync)

    def _replace_once(self, path: str, data: bytes, durability: Durability) -> None:
        self.requests.append(("write", path))
        super()._replace_once(path, data, durability)

    def _delete_once(self, path: str) -> None:
        self.requests.append(("delete", path))
        super()._delete_once(path)

    def _delete_many_once(self, paths: list[str]) -> None:
        self.requests.append(("delete", paths[0]))
        super()._delete_many_once(paths)


def counting(storage: Storage) -> CountingStorage:
    """A counting copy of ``storage`` (same location and filesystem)."""
    counted = storage.child("")
    counted.__class__ = CountingStorage
    assert isinstance(counted, CountingStorage)
    counted.requests = []
    return counted

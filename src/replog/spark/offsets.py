"""The ``replog`` source's offsets as Spark stores them in its checkpoint.

A Spark offset is a dict of JSON primitives: keys ``"0"``, ``"1"``, ... hold the last
processed sequence of each shard; ``"log_id"`` names the log the offset belongs to (a
query that resumes against a recreated log fails instead of reading the wrong events);
``"consumer"`` names the consumer whose position it is; ``"url"`` is where the log is (a
sink that writes what this consumer read records its positions there); ``"version"`` is
the log version the offset was taken at (for operators: the commit that made the data
visible).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replog.errors import LogIdentityError
from replog.format.state import LogState
from replog.log import ReplicationLog
from replog.offsets import CONSUMER_KEY, LOG_KEY, URL_KEY, VERSION_KEY, Offsets


@dataclass(frozen=True)
class SparkOffset:
    """A position as Spark stores it in its checkpoint."""

    offsets: Offsets
    version: int
    log_id: str | None = None
    consumer: str | None = None
    url: str | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {str(s): int(seq) for s, seq in sorted(self.offsets.items())}
        document[VERSION_KEY] = int(self.version)
        for key, value in (
            (LOG_KEY, self.log_id),
            (CONSUMER_KEY, self.consumer),
            (URL_KEY, self.url),
        ):
            if value is not None:
                document[key] = value
        return document

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> SparkOffset:
        offsets = {int(key): int(value) for key, value in document.items() if key.isdigit()}

        def text(key: str) -> str | None:
            value = document.get(key)
            return None if value is None else str(value)

        return cls(
            offsets,
            int(document.get(VERSION_KEY, 0)),
            text(LOG_KEY),
            text(CONSUMER_KEY),
            text(URL_KEY),
        )

    def check_log(self, log: ReplicationLog, state: LogState) -> None:
        """Raise :class:`LogIdentityError` if this offset cannot belong to ``log`` as it is:
        another log id (recreated at the URL), or positions past its heads (restored from
        an older copy)."""
        if self.log_id is not None and self.log_id != log.log_id:
            raise LogIdentityError(
                f"{log.url} now holds log {log.log_id}, but this query's checkpoint is for "
                f"log {self.log_id}: the log was recreated at the same URL. Start the query "
                f"from a new checkpoint (choose startingOffsets) to read the new log"
            )
        for shard, sequence in self.offsets.items():
            if shard >= log.shards or sequence > state.heads[shard]:
                raise LogIdentityError(
                    f"{log.url}: this query's checkpoint has read shard {shard} up to sequence "
                    f"{sequence}, past the log's head "
                    f"{state.heads[shard] if shard < log.shards else 'no such shard'}: the log "
                    f"was restored from an older copy, or replaced. Start from a new checkpoint"
                )

"""Committing staged files: the one protocol every writer follows (appends, merges, sink
epochs, batch writes).

A writer stages files (no commit names them yet), then commits them with one
put-if-absent. What it may do with them afterwards depends on what it knows:

* the commit landed: they belong to the log, never delete them;
* it is certain nothing of this attempt landed: delete them (nobody else will);
* it cannot tell (storage never answered, or the process was interrupted mid-put):
  keep them; ``replog recover`` deletes them later if no commit names them.

:func:`committing` wraps a commit call in exactly that rule, so no writer writes it
again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from replog.format.commits import CommitRecord
from replog.format.segments import SegmentInfo, StagedSegment, file_paths
from replog.storage import Storage

logger = logging.getLogger(__name__)


@dataclass
class CommitAttempt:
    """What a caller may safely do with its staged files after a commit call.

    ``landed`` is the record once it is on storage; ``in_doubt`` is set while a write may
    have landed without its writer knowing (interrupted, or storage never answered).
    Staged files may be deleted only when :attr:`safe_to_discard`.
    """

    landed: CommitRecord | None = None
    in_doubt: bool = False

    @property
    def safe_to_discard(self) -> bool:
        return self.landed is None and not self.in_doubt


def discard(storage: Storage, staged: Iterable[StagedSegment | SegmentInfo]) -> None:
    """Delete staged files that no commit names (the caller must know that): each file
    once, however many entries name it."""
    for path in file_paths(staged):
        storage.delete(path)


def discard_after(
    storage: Storage, attempt: CommitAttempt, staged: Sequence[StagedSegment | SegmentInfo]
) -> None:
    """After a failed commit call: delete ``staged`` if it is certain no commit names
    them; otherwise keep them (``replog recover`` collects them if unreferenced)."""
    if attempt.safe_to_discard:
        discard(storage, staged)
    elif staged:
        logger.warning(
            "%s: keeping %d staged files: the commit %s; 'replog recover' deletes them "
            "if no commit names them",
            storage.url,
            len(staged),
            "landed" if attempt.landed else "may have landed",
        )


@contextmanager
def committing(
    storage: Storage, staged: Sequence[StagedSegment | SegmentInfo]
) -> Iterator[CommitAttempt]:
    """Run a commit of ``staged`` in the block, passing it the attempt to record its
    progress in. If the block raises, the files are deleted when that is certain to be
    safe and kept otherwise, and the error goes on."""
    attempt = CommitAttempt()
    try:
        yield attempt
    except BaseException:
        discard_after(storage, attempt, staged)
        raise

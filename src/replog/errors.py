"""The one error hierarchy of replog.

Every error replog raises derives from :class:`ReplogError`, and its class says what kind
of fault it is. Where a built-in exception fits, the error derives from it as well
(``ValueError`` for bad input, ``FileNotFoundError`` for a missing log, ``FileExistsError``
for a lost race), so callers can catch either the package base or the familiar built-in.
"""

from __future__ import annotations


class ReplogError(Exception):
    """Base class of every error raised by replog."""


# -- bad input: nothing was written ------------------------------------------------------


class InvalidEventError(ReplogError, ValueError):
    """A change event (an input row, column or JSON line) is malformed; nothing was written."""


class InvalidOptionError(ReplogError, ValueError):
    """An option, argument or name has a value that is not allowed; nothing was written."""


class SchemaChangeError(ReplogError, ValueError):
    """A change's column cannot be written to the target table's column of that name (an
    incompatible type change); it names the column, and nothing was written."""

    def __init__(self, column: str, message: str) -> None:
        super().__init__(f"column {column!r}: {message}")
        self.column = column


# -- change-data capture from a database ---------------------------------------------------


class IncompatibleSchemaError(ReplogError, ValueError):
    """Two registered schema versions of a collection give one column types that no type
    holds both of (the message names the column and both versions)."""


class CaptureError(ReplogError):
    """Base of the errors of ``replog capture``: the source database cannot be captured
    as asked. Raised before anything is written to the log."""


class SourceConnectionError(CaptureError, ConnectionError):
    """The source database cannot be reached or refuses the credentials."""


class SourceConfigError(CaptureError, ValueError):
    """The source is not set up for capture (``wal_level``, a missing table, publication or
    primary key, a slot of another plug-in)."""


class SourcePrivilegeError(SourceConfigError, PermissionError):
    """The capture's role lacks a privilege a step needs (the message names the step and
    the statement that grants it)."""


class SourcePositionError(CaptureError):
    """The replication slot and the log disagree on how far capture went, so resuming
    would lose changes (the slot is gone, was invalidated, or was advanced past the log
    by someone else)."""


class SlotOwnershipError(SourcePositionError):
    """The replication slot belongs to another log: capture never drops or advances it
    (the message names its owner and the ways on)."""


class CaptureRunningError(CaptureError):
    """Another capture holds the slot, or this log's capture of it (the message names
    who: host, process, since when)."""


# -- what is (not) at a URL ----------------------------------------------------------------


class LogNotFoundError(ReplogError, FileNotFoundError):
    """The URL holds no replog log."""


class LogExistsError(ReplogError, FileExistsError):
    """``create`` was asked for a URL that already holds a log."""


class LogIdentityError(ReplogError):
    """Offsets or a checkpoint belong to another log than the one now at the URL
    (the log was recreated, or restored from an older copy)."""


class LogRecreatedError(LogIdentityError):
    """The log this process opened was deleted and another created at its URL: a commit
    or snapshot names another log id. Nothing was written; reopen the URL."""

    def __init__(self, where: str, found: str, expected: str) -> None:
        super().__init__(
            f"{where}: belongs to log {found}, but this process opened log {expected} at "
            f"that URL: the log was deleted and re-created there. Nothing was written; "
            f"open the URL again (a Spark query: start it from a new checkpoint) to use "
            f"the new log"
        )
        self.found = found
        self.expected = expected


class UnsupportedFormatError(ReplogError):
    """A file was written by a newer format version than this replog reads."""


class UnsupportedStorageError(ReplogError, ValueError):
    """The storage backend cannot do what replog needs (an atomic create-if-absent)."""


# -- damage --------------------------------------------------------------------------------


class CorruptionError(ReplogError):
    """A file's bytes do not match the checksum recorded for it, or cannot be decoded."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class MissingFileError(CorruptionError, FileNotFoundError):
    """A file that a commit references is not on storage."""


class MissingCommitError(CorruptionError):
    """A commit record is missing although a later one exists: the log is damaged (a
    file deleted or lost outside replog), and nothing reads or writes past the gap, since
    the log up to it is not the whole log."""

    def __init__(self, path: str, version: int, later: int) -> None:
        super().__init__(
            path,
            f"commit {version} is missing, but commit {later} exists: the log is damaged "
            f"(a commit file was deleted or lost) and is not read or written past version "
            f"{version - 1}, rather than shown shorter than it is. Restore the file from a "
            f"backup (or a previous version of the object); 'replog verify' lists every "
            f"missing commit",
        )
        self.version = version
        self.later = later


# -- storage and commits -------------------------------------------------------------------


class StorageError(ReplogError, OSError):
    """Storage kept failing (timeouts, 5xx, resets) after every retry."""


class StoragePermissionError(StorageError, PermissionError):
    """Storage refused a read or write for lack of permission (a log read-only for this
    user, S3's AccessDenied): nothing was written."""


class CommitOutcomeUnknownError(StorageError):
    """A write may or may not have landed, and storage failed every attempt to find out.

    The writer's staged files are kept (``replog recover`` collects them if the write
    did not land): deleting them could break a commit that did.
    """


class CommitConflictError(ReplogError, FileExistsError):
    """Other writers kept winning the commit race, or changed what this commit relies on."""


class TransactionOrderError(CommitConflictError):
    """A :class:`~replog.format.commits.Transaction` that must follow a given version of
    its app found another one in the log: another writer of that app committed meanwhile.
    Nothing was committed."""


class StagingCollectedError(ReplogError):
    """A garbage collection that may delete this write's staged files began while it
    staged (a ``replog recover --grace`` shorter than the write): nothing was committed,
    and the write must be run again (a Spark query: restarted)."""


class DataLossError(ReplogError):
    """Requested events are no longer in the log (removed by retention)."""

    def __init__(self, shard: int, requested_from: int, available_from: int) -> None:
        super().__init__(
            f"shard {shard}: events from sequence {requested_from} were requested but the log "
            f"only holds sequences from {available_from} on (removed by retention); read from "
            f"the earliest retained event instead ('replog read --from earliest', Spark "
            f"startingOffsets=earliest), or let a Spark query skip the gap "
            f"(failOnDataLoss=false)"
        )
        self.shard = shard
        self.requested_from = requested_from
        self.available_from = available_from


# -- checkpoints -----------------------------------------------------------------------------


class ManifestError(ReplogError):
    """Base of checkpoint-manifest errors."""


class ManifestConflictError(ManifestError, FileExistsError):
    """Another writer already wrote the checkpoint id this writer tried to write."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """No valid manifest exists in the store, or a named consumer or sink is unknown."""


class SinkProtocolError(ReplogError):
    """The sink's commit protocol met a state it must not paper over."""


class ConsumerResetError(ReplogError):
    """An operator set a consumer's offsets (``replog consumer set``) and a reader that
    resumes from elsewhere (an old Spark checkpoint) would undo it: it stops instead."""


class FencedError(SinkProtocolError):
    """Another query took over this sink id or consumer; this one must stop."""


class RetentionError(ReplogError):
    """A truncation would drop events a known consumer has not committed (nothing changed)."""


class InjectedFaultError(ReplogError):
    """Raised by the test-only crash points and storage fault injector."""


class AsOfError(ReplogError):
    """A table cannot be read as of the point asked: outside what its versions and the
    log's retained events can show (the message names the reachable range), or a table
    whose commits record no log coverage."""

"""The one error hierarchy of replog.

Every error derives from :class:`ReplogError`; where a built-in exception fits, the
error derives from it as well (``ValueError`` for bad input, ``FileNotFoundError``
for a missing log, ``FileExistsError`` for a lost put-if-absent race), so callers can
catch either the package base or the familiar built-in.
"""

from __future__ import annotations


class ReplogError(Exception):
    """Base class of every error raised by replog."""


class InvalidEventError(ReplogError, ValueError):
    """A change event (or an input row/column) is malformed; nothing was written."""


class InvalidOptionError(ReplogError, ValueError):
    """A source/sink/CLI option has a value that is not allowed."""


class LogNotFoundError(ReplogError, FileNotFoundError):
    """The URL holds no replog log."""


class LogExistsError(ReplogError, FileExistsError):
    """``create`` was asked for a URL that already holds a log."""


class UnsupportedFormatError(ReplogError):
    """The log (or manifest) was written by a newer format version than this reader knows."""


class CorruptionError(ReplogError):
    """A file's bytes do not match the checksum recorded for it, or it cannot be decoded."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class CommitConflictError(ReplogError, FileExistsError):
    """Another writer won a put-if-absent race and retries were exhausted."""


class DataLossError(ReplogError):
    """Requested events are no longer in the log (removed by retention)."""

    def __init__(self, shard: int, requested_from: int, available_from: int) -> None:
        super().__init__(
            f"shard {shard}: events from sequence {requested_from} were requested but the log "
            f"only holds sequences from {available_from} on (removed by retention); set "
            f"failOnDataLoss=false to skip ahead"
        )
        self.shard = shard
        self.requested_from = requested_from
        self.available_from = available_from


class ManifestError(ReplogError):
    """Base of checkpoint-manifest errors."""


class ManifestConflictError(ManifestError, FileExistsError):
    """Another writer already wrote the checkpoint id this writer tried to write."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """No valid manifest exists in the store."""


class SinkProtocolError(ReplogError):
    """The sink's commit protocol found a state it must not paper over (e.g. a reset checkpoint)."""


class InjectedCrashError(ReplogError):
    """Raised by the fault-injection hook in-process mode (tests only)."""


class RetentionError(ReplogError):
    """A truncation would drop events a known consumer has not committed (nothing changed)."""

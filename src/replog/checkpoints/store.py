"""A store of checkpoint manifests at one fsspec URL.

Layout: ``manifests/<checkpoint id, 20 digits>.json`` (written create-if-absent, never
modified), ``latest`` (a forward-only pointer to the newest id) and ``quarantine/``
(copies of corrupt manifests, kept for inspection).

* Saving writes the manifest with put-if-absent: of two writers racing for one
  checkpoint id exactly one wins; the other gets :class:`ManifestConflictError`. The
  store does not retry for it: the caller decides (a fenced writer must stop).
* Loading reads the pointer, probes forward past it (the pointer is written after the
  manifest, so it may lag), and falls back from a corrupt or missing manifest to the
  previous valid one with a warning naming the file. A missing or unreadable pointer is
  repaired by listing the store (the only listing outside operator commands). The
  pointer carries no copy of the manifest (the snapshot hint does): a pointer moved back
  by a slow writer may name a pruned manifest, and only reading that file tells.
* The next id is always past every manifest file, corrupt ones included, so a corrupt
  newest manifest never wedges the store.
* The newest ``keep`` manifests are kept: saving id N deletes ids N - keep - 1 and
  N - keep, in one request. A *provisional* save (a sink's Pending status, always
  followed by a final save) neither moves the pointer nor prunes: readers probe past the
  pointer, and the final save prunes for both.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from replog.checkpoints.manifest import MANIFEST_VERSION, CheckpointManifest
from replog.errors import (
    CorruptionError,
    InvalidOptionError,
    ManifestConflictError,
    ManifestNotFoundError,
    UnsupportedFormatError,
)
from replog.format.sealed import seal, unseal
from replog.names import is_valid_name, listed_versions
from replog.storage import Storage
from replog.storage.pointer import ForwardPointer, probe_forward

logger = logging.getLogger(__name__)

MANIFESTS_DIR = "manifests"
QUARANTINE_DIR = "quarantine"
LATEST_POINTER = "latest"
DEFAULT_KEEP = 10


def manifest_name(checkpoint_id: int) -> str:
    return f"{MANIFESTS_DIR}/{checkpoint_id:020d}.json"


class ManifestStore:
    """Manifests of one consumer or sink. Picklable; opens its filesystem lazily."""

    def __init__(
        self,
        url_or_storage: str | Storage,
        *,
        storage_options: Mapping[str, Any] | None = None,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        if keep < 1:
            raise InvalidOptionError(f"keep must be >= 1, got {keep}")
        # A URL is a str; anything else is taken for a Storage. Not isinstance(.., Storage):
        # replog.register(spark) pickles replog by value, so one Python process can hold two
        # copies of the Storage class (one per pickle or import), and a Storage of the other
        # copy would be taken for a URL ("cannot open URL Storage(...)").
        self.storage: Storage = (
            Storage(url_or_storage, storage_options)
            if isinstance(url_or_storage, str)
            else url_or_storage
        )
        self.keep = keep
        self._pointer = ForwardPointer(self.storage, LATEST_POINTER, "checkpoint_id")
        self._newest_seen = 0
        self._corrupt: dict[int, bytes] = {}
        self._last: CheckpointManifest | None = None
        """The newest manifest this store saved or loaded: a warm reader only probes past
        it (manifests are immutable once written)."""

    @property
    def url(self) -> str:
        return self.storage.url

    # -- reading ----------------------------------------------------------------------

    def load(self, checkpoint_id: int) -> CheckpointManifest:
        """The manifest with ``checkpoint_id``, checksum-verified."""
        relative = manifest_name(checkpoint_id)
        path = self.storage.path(relative)
        data = self.storage.read(relative)
        try:
            if not data:
                raise CorruptionError(path, "empty file (truncated)")
            body = unseal(data, path, version_field="version", max_version=MANIFEST_VERSION)
            manifest = CheckpointManifest.from_json(body, path)
            if manifest.checkpoint_id != checkpoint_id:
                raise CorruptionError(
                    path, f"holds checkpoint_id {manifest.checkpoint_id}, expected {checkpoint_id}"
                )
        except CorruptionError:
            self._corrupt[checkpoint_id] = data
            raise
        return manifest

    def latest_id(self) -> int:
        """The newest checkpoint id on storage (valid or not); 0 if there is none."""
        start = self._pointer.read()
        if start is None:
            # Missing or unreadable: maybe a new store, maybe a damaged one whose old ids
            # were pruned. Probing from 0 would find nothing and lose its position.
            ids = self.list_ids()
            start = ids[-1] if ids else 0
            if ids:
                logger.warning(
                    "%s: pointer %r is missing or unreadable; found the newest manifest (%d) "
                    "by listing",
                    self.url,
                    LATEST_POINTER,
                    start,
                )
        newest = probe_forward(start, 1, lambda i: self.storage.exists(manifest_name(i)))
        self._newest_seen = max(self._newest_seen, newest)
        return newest

    def load_latest(self) -> CheckpointManifest | None:
        """The newest valid manifest, or None for an empty store.

        A corrupt or missing newest manifest falls back to older ones with a warning;
        :class:`ManifestNotFoundError` if manifests exist but none is valid.
        """
        if self._last is not None:
            known = self._last.checkpoint_id
            if not self.storage.exists(manifest_name(known + 1)):
                return copy.deepcopy(self._last)
        manifest = self._load_latest()
        self._last = copy.deepcopy(manifest)
        return manifest

    def _load_latest(self) -> CheckpointManifest | None:
        newest = self.latest_id()
        if newest == 0:
            return None
        failures: list[str] = []
        candidates = list(range(newest, max(newest - self.keep, 0), -1))
        tried: set[int] = set()
        while candidates:
            checkpoint_id = candidates.pop(0)
            tried.add(checkpoint_id)
            try:
                manifest = self.load(checkpoint_id)
            except FileNotFoundError:
                failures.append(f"{self.storage.path(manifest_name(checkpoint_id))}: missing")
            except UnsupportedFormatError:
                raise
            except CorruptionError as exc:
                logger.warning("skipping corrupt checkpoint manifest: %s", exc)
                failures.append(str(exc))
            else:
                if checkpoint_id != newest:
                    logger.warning(
                        "%s: newest manifest %d is unusable; fell back to checkpoint %d",
                        self.url,
                        newest,
                        checkpoint_id,
                    )
                return manifest
            if not candidates:  # the window is exhausted: look at what is really there
                candidates = [i for i in reversed(self.list_ids()) if i not in tried]
        raise ManifestNotFoundError(
            f"no valid checkpoint manifest in {self.url}: " + "; ".join(failures)
        )

    # -- writing ----------------------------------------------------------------------

    def next_manifest(self, base: CheckpointManifest | None) -> CheckpointManifest:
        """A copy of ``base`` (or a new manifest) to change and :meth:`save`, with an id past
        every manifest this store has seen on storage, corrupt ones included."""
        newest = max(self._newest_seen, base.checkpoint_id if base else 0)
        return (base or CheckpointManifest()).successor(newest + 1)

    def save(self, manifest: CheckpointManifest, *, provisional: bool = False) -> None:
        """Write ``manifest`` under its checkpoint id, create-if-absent, then move the pointer
        and prune (unless ``provisional``: a final save must follow, as Committed or Failed
        follows Pending).

        Raises :class:`ManifestConflictError` if that id is already taken.
        """
        if manifest.checkpoint_id < 1:
            raise InvalidOptionError(f"checkpoint_id must be >= 1, got {manifest.checkpoint_id}")
        self._quarantine()
        relative = manifest_name(manifest.checkpoint_id)
        try:
            self.storage.put_if_absent(relative, seal(manifest.to_json()))
        except FileExistsError as exc:
            self._newest_seen = max(self._newest_seen, manifest.checkpoint_id)
            raise ManifestConflictError(
                f"{self.storage.path(relative)}: checkpoint {manifest.checkpoint_id} was already "
                f"written by another writer"
            ) from exc
        self._newest_seen = max(self._newest_seen, manifest.checkpoint_id)
        self._last = copy.deepcopy(manifest)
        if provisional:
            return
        self._pointer.advance(manifest.checkpoint_id)
        stale = manifest.checkpoint_id - self.keep
        # Two ids: the one a provisional save before this one left behind.
        self.storage.delete_many([manifest_name(i) for i in (stale - 1, stale) if i >= 1])

    def _quarantine(self) -> None:
        """Copy corrupt manifests met while loading to ``quarantine/`` before pruning can
        delete them (once each), for whoever investigates."""
        while self._corrupt:
            checkpoint_id, data = self._corrupt.popitem()
            relative = f"{QUARANTINE_DIR}/{checkpoint_id:020d}.json"
            try:
                self.storage.put_if_absent(relative, data)
            except FileExistsError:
                continue
            logger.warning(
                "kept a copy of corrupt manifest %s as %s",
                self.storage.path(manifest_name(checkpoint_id)),
                self.storage.path(relative),
            )

    # -- operators --------------------------------------------------------------------

    def list_ids(self) -> list[int]:
        """Checkpoint ids present (lists the directory: for operators and repair)."""
        return listed_versions(self.storage.listdir(MANIFESTS_DIR))

    def prune(self) -> list[int]:
        """Delete every manifest older than the newest ``keep``; returns the deleted ids."""
        ids = self.list_ids()
        doomed = ids[: max(len(ids) - self.keep, 0)]
        self.storage.delete_many([manifest_name(checkpoint_id) for checkpoint_id in doomed])
        return doomed


def named_stores(storage: Storage, directory: str) -> tuple[list[str], list[str]]:
    """The names of the manifest stores (consumers, sinks) under ``directory``, and the
    entries there that cannot be one (``.DS_Store``, ``my consumer (copy)``): those are
    warned about, naming the path, and skipped, so one stray file stops no operator
    command. ``verify`` reports them."""
    names, stray = [], []
    for name in sorted(storage.listdir(directory)):
        relative = f"{directory}/{name}"
        if not is_valid_name(name):
            problem = "is not a replog name (letters, digits, '.', '_', '-')"
        elif storage.is_file(relative):
            problem = "is a file, not a manifest store"
        else:
            names.append(name)
            continue
        logger.warning("%s %s; skipped: remove it", storage.path(relative), problem)
        stray.append(relative)
    return names, stray

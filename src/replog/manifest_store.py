"""A store of checkpoint manifests at one fsspec URL.

Layout: ``manifests/<checkpoint id, 20 digits>.json`` (written create-if-absent, never
modified) and ``latest`` (a pointer holding the newest id, moved forward only).

* Saving writes the manifest with put-if-absent: of two writers racing for one
  checkpoint id exactly one wins; the other gets :class:`ManifestConflictError`. The
  store does not retry for it: two live writers for one consumer or sink is a
  misconfiguration (two queries sharing an id), and failing loudly is the safe answer.
* Loading reads the pointer, probes forward past it (the pointer is written after the
  manifest, so a crash in between leaves it one behind), and falls back from a corrupt or
  truncated manifest to the previous valid one with a warning naming the file.
* The newest ``keep`` manifests are kept; saving id N deletes id N - keep.

Requests per save or load are constant: nothing lists the directory except
``list()``/``prune()``, which are for operators.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from replog.errors import (
    CorruptionError,
    ManifestConflictError,
    ManifestNotFoundError,
    UnsupportedFormatError,
)
from replog.manifest import MANIFEST_VERSION, CheckpointManifest
from replog.records import seal, unseal
from replog.storage import Storage

logger = logging.getLogger(__name__)

MANIFESTS_DIR = "manifests"
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
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.storage = (
            url_or_storage
            if isinstance(url_or_storage, Storage)
            else Storage(url_or_storage, storage_options)
        )
        self.keep = keep

    @property
    def url(self) -> str:
        return self.storage.url

    # -- reading ----------------------------------------------------------------------

    def _pointer(self) -> int:
        data = self.storage.read_optional(LATEST_POINTER)
        if data is None:
            return 0
        try:
            return int(json.loads(data)["checkpoint_id"])
        except (ValueError, KeyError, TypeError):
            logger.warning(
                "unreadable latest pointer %s; probing manifests", self.storage.path(LATEST_POINTER)
            )
            return 0

    def load(self, checkpoint_id: int) -> CheckpointManifest:
        """The manifest with ``checkpoint_id``, checksum-verified."""
        relative = manifest_name(checkpoint_id)
        path = self.storage.path(relative)
        data = self.storage.read(relative)
        if not data:
            raise CorruptionError(path, "empty file (truncated)")
        body = unseal(data, path, version_field="version", max_version=MANIFEST_VERSION)
        manifest = CheckpointManifest.from_json(body, path)
        if manifest.checkpoint_id != checkpoint_id:
            raise CorruptionError(
                path, f"holds checkpoint_id {manifest.checkpoint_id}, expected {checkpoint_id}"
            )
        return manifest

    def latest_id(self) -> int:
        """The newest checkpoint id written (valid or not); 0 if none."""
        newest = self._pointer()
        while self.storage.exists(manifest_name(newest + 1)):
            newest += 1
        return newest

    def load_latest(self) -> CheckpointManifest | None:
        """The newest valid manifest, or None for an empty store.

        A corrupt newest manifest falls back to older ones (within the kept window) with
        a warning; :class:`ManifestNotFoundError` if none of them is valid.
        """
        newest = self.latest_id()
        if newest == 0:
            return None
        failures = []
        for checkpoint_id in range(newest, max(newest - self.keep, 0), -1):
            try:
                manifest = self.load(checkpoint_id)
            except FileNotFoundError:
                failures.append(f"{self.storage.path(manifest_name(checkpoint_id))}: missing")
                continue
            except UnsupportedFormatError:
                raise
            except CorruptionError as exc:
                logger.warning("skipping corrupt checkpoint manifest %s", exc)
                failures.append(str(exc))
                continue
            if checkpoint_id != newest:
                logger.warning(
                    "latest manifest of %s is unusable; fell back to checkpoint %d",
                    self.url,
                    checkpoint_id,
                )
            return manifest
        raise ManifestNotFoundError(
            f"no valid checkpoint manifest in {self.url}: " + "; ".join(failures)
        )

    # -- writing ----------------------------------------------------------------------

    def save(self, manifest: CheckpointManifest) -> None:
        """Write ``manifest`` under its checkpoint id, create-if-absent, then move the pointer.

        Raises :class:`ManifestConflictError` if that id is already taken.
        """
        if manifest.checkpoint_id < 1:
            raise ValueError(f"checkpoint_id must be >= 1, got {manifest.checkpoint_id}")
        relative = manifest_name(manifest.checkpoint_id)
        try:
            self.storage.put_if_absent(relative, seal(manifest.to_json()))
        except FileExistsError as exc:
            raise ManifestConflictError(
                f"{self.storage.path(relative)}: checkpoint {manifest.checkpoint_id} was already "
                f"written by another writer (are two queries using the same consumer/sink id?)"
            ) from exc
        # Forward only: a slower writer never moves the pointer back past a newer id.
        if self._pointer() < manifest.checkpoint_id:
            self.storage.write(
                LATEST_POINTER, json.dumps({"checkpoint_id": manifest.checkpoint_id}).encode()
            )
        stale = manifest.checkpoint_id - self.keep
        if stale >= 1:
            self.storage.delete(manifest_name(stale))

    # -- operators --------------------------------------------------------------------

    def list_ids(self) -> list[int]:
        """Checkpoint ids present (lists the directory: for operators, not hot paths)."""
        ids = []
        for name in self.storage.list(MANIFESTS_DIR):
            stem = name.removesuffix(".json")
            if stem.isdigit() and name.endswith(".json"):
                ids.append(int(stem))
        return sorted(ids)

    def prune(self) -> list[int]:
        """Delete every manifest older than the newest ``keep``; returns the deleted ids."""
        ids = self.list_ids()
        doomed = ids[: max(len(ids) - self.keep, 0)]
        for checkpoint_id in doomed:
            self.storage.delete(manifest_name(checkpoint_id))
        return doomed

"""Delta deletion vectors (DVs): a data file's deleted rows as a roaring bitmap, in bytes.

The Delta protocol's "Deletion Vectors" section, to the letter (PROTOCOL.md; Delta Spark's
``DeletionVectorStore`` and Trino's ``DeletionVectors`` write the same bytes):

* a DV is a set of row indexes (0-based positions in the Parquet file) serialised as a
  ``RoaringBitmapArray``: the magic number 1681511377 (little endian), then the 64-bit
  roaring bitmap in the portable format of the RoaringFormatSpec, which ``pyroaring``'s
  ``BitMap64.serialize`` writes;
* a DV file (``deletion_vector_<uuid>.bin`` in the table's folder) holds one format
  version byte (1), then per DV: its size (4 bytes, big endian), its bytes, and the CRC-32
  of its bytes (4 bytes, big endian);
* an ``add`` action names its DV with a descriptor: ``storageType`` ``u`` (a file named by
  a UUID, Z85-encoded in ``pathOrInlineDv`` after an optional random prefix), ``i``
  (inline, Z85 of the bytes) or ``p`` (an absolute path); ``offset`` (where the DV's size
  starts in the file), ``sizeInBytes`` and ``cardinality`` (rows deleted).

Pure bytes, no I/O: :mod:`replog.tables.merge_on_read` reads and writes the files.
"""

from __future__ import annotations

import base64
import struct
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pyroaring import BitMap64

from replog.errors import CorruptionError

MAGIC = 1681511377
"""The portable RoaringBitmapArray's magic number (PROTOCOL.md, "Deletion Vector Format")."""
FILE_FORMAT_VERSION = 1

_B85 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_TO_Z85 = str.maketrans(_B85, _Z85)
_FROM_Z85 = str.maketrans(_Z85, _B85)
"""Z85 (the protocol's Base85) and Python's RFC 1924 Base85 are the same base-85 numbers
over 4-byte groups, with other digits: one is the other's text translated."""

ENCODED_UUID_LENGTH = 20


def z85encode(data: bytes) -> str:
    """``data`` (a multiple of 4 bytes) as Z85 text."""
    if len(data) % 4:
        raise ValueError(f"Z85 encodes groups of 4 bytes, not {len(data)} bytes")
    return base64.b85encode(data).decode("ascii").translate(_TO_Z85)


def z85decode(text: str) -> bytes:
    if len(text) % 5:
        raise ValueError(f"Z85 text comes in groups of 5 characters, not {len(text)}")
    return base64.b85decode(text.translate(_FROM_Z85))


def serialize(rows: BitMap64) -> bytes:
    """A DV's bytes: the magic number, then the portable 64-bit roaring bitmap."""
    return struct.pack("<i", MAGIC) + rows.serialize()


def deserialize(data: bytes) -> BitMap64:
    (magic,) = struct.unpack_from("<i", data)
    if magic != MAGIC:
        raise CorruptionError(
            "deletion vector",
            f"starts with magic number {magic}, not {MAGIC} (the portable RoaringBitmapArray "
            f"format)",
        )
    return BitMap64.deserialize(data[4:])


@dataclass(frozen=True)
class Descriptor:
    """An ``add``/``remove`` action's ``deletionVector`` (PROTOCOL.md)."""

    storage_type: str
    path_or_inline_dv: str
    offset: int | None
    size_in_bytes: int
    cardinality: int

    @property
    def unique_id(self) -> str:
        """What tells two DVs of one file apart (the protocol's derived ``uniqueId``)."""
        base = f"{self.storage_type}{self.path_or_inline_dv}"
        return base if self.offset is None else f"{base}@{self.offset}"

    def relative_file(self) -> str:
        """The DV file of a ``u`` descriptor, relative to the table's folder."""
        if self.storage_type != "u":
            raise ValueError(f"a {self.storage_type!r} deletion vector has no relative file")
        prefix = self.path_or_inline_dv[:-ENCODED_UUID_LENGTH]
        if not prefix.isalnum() and prefix:
            raise CorruptionError(self.path_or_inline_dv, "a DV file's prefix is not alphanumeric")
        name = uuid.UUID(bytes=z85decode(self.path_or_inline_dv[-ENCODED_UUID_LENGTH:]))
        return f"{prefix + '/' if prefix else ''}deletion_vector_{name}.bin"

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "storageType": self.storage_type,
            "pathOrInlineDv": self.path_or_inline_dv,
        }
        if self.offset is not None:
            found["offset"] = self.offset
        found["sizeInBytes"] = self.size_in_bytes
        found["cardinality"] = self.cardinality
        return found

    @classmethod
    def from_json(cls, found: Mapping[str, Any]) -> Descriptor:
        offset = found.get("offset")
        return cls(
            str(found["storageType"]),
            str(found["pathOrInlineDv"]),
            None if offset is None else int(offset),
            int(found["sizeInBytes"]),
            int(found["cardinality"]),
        )


def from_file(descriptor: Descriptor, content: bytes) -> BitMap64:
    """The rows of ``descriptor``'s DV, given its file's ``content`` (``u``/``p``) or
    nothing (``i``); its size, checksum and cardinality checked."""
    if descriptor.storage_type == "i":
        rows = deserialize(z85decode(descriptor.path_or_inline_dv)[: descriptor.size_in_bytes])
    else:
        start = descriptor.offset or 0
        (size,) = struct.unpack_from(">i", content, start)
        if size != descriptor.size_in_bytes:
            raise CorruptionError(
                descriptor.unique_id,
                f"{size} bytes in its file, {descriptor.size_in_bytes} in the log",
            )
        data = content[start + 4 : start + 4 + size]
        (checksum,) = struct.unpack_from(">I", content, start + 4 + size)
        if zlib.crc32(data) != checksum:
            raise CorruptionError(descriptor.unique_id, "the deletion vector fails its CRC-32")
        rows = deserialize(data)
    if len(rows) != descriptor.cardinality:
        raise CorruptionError(
            descriptor.unique_id,
            f"the deletion vector holds {len(rows)} rows, the log says {descriptor.cardinality}",
        )
    return rows


def pack(bitmaps: Iterable[BitMap64], name: uuid.UUID) -> tuple[bytes, list[Descriptor]]:
    """One DV file holding ``bitmaps`` one after another, and each one's descriptor (a
    ``u`` descriptor naming the file ``deletion_vector_<name>.bin``)."""
    content = bytearray([FILE_FORMAT_VERSION])
    encoded = z85encode(name.bytes)
    found = []
    for rows in bitmaps:
        data = serialize(rows)
        offset = len(content)
        content += struct.pack(">i", len(data)) + data + struct.pack(">I", zlib.crc32(data))
        found.append(Descriptor("u", encoded, offset, len(data), len(rows)))
    return bytes(content), found


def file_name(name: uuid.UUID) -> str:
    return f"deletion_vector_{name}.bin"


def bitmap_of(rows: np.ndarray) -> BitMap64:
    """Row indexes as a bitmap."""
    return BitMap64(rows.astype(np.uint64, copy=False).tolist())


def keep_mask(deleted: BitMap64 | None, num_rows: int) -> np.ndarray:
    """Per row of a file of ``num_rows`` rows: whether ``deleted`` leaves it in the table."""
    keep = np.ones(num_rows, dtype=bool)
    if deleted is not None and len(deleted):
        gone = np.fromiter(deleted, dtype=np.int64, count=len(deleted))
        keep[gone[gone < num_rows]] = False
    return keep

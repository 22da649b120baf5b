"""The checkpoint manifest: the structure, the plain values, checksums, and the commit marker.

A checkpoint directory is complete exactly when its manifest exists: the daemon writes it
last, after every data file is durable under its final name. The manifest records, per
tensor, the file and byte range holding it and the CRC-32C of those bytes as they were
written, so a reader can prove that what it loads is what was staged.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from shmstage.document import parse, render
from shmstage.layout import Layout

MANIFEST_NAME: Final = "shmstage-manifest.json"
FORMAT: Final = "shmstage-checkpoint"
VERSION: Final = 1
MAX_MANIFEST_BYTES: Final = 512 * 1024 * 1024


class ManifestError(ValueError):
    """The manifest is missing, unreadable or inconsistent."""


@dataclass(frozen=True, slots=True)
class TensorRecord:
    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...] | None
    crc32c: int


@dataclass(frozen=True, slots=True)
class Manifest:
    files: dict[str, int]  # data file name -> size in bytes
    tensors: dict[str, TensorRecord]
    tree: Any
    metadata: dict[str, Any]
    save: dict[str, Any]

    def to_bytes(self) -> bytes:
        document = {
            "format": FORMAT,
            "version": VERSION,
            "files": [{"name": name, "bytes": size} for name, size in self.files.items()],
            "tensors": {
                record.key: {
                    "file": record.file,
                    "dtype": record.dtype,
                    "shape": list(record.shape),
                    "offsets": None if record.offsets is None else list(record.offsets),
                    "crc32c": record.crc32c,
                }
                for record in self.tensors.values()
            },
            "tree": self.tree,
            "metadata": self.metadata,
            "save": self.save,
        }
        return render(document)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        document = parse(
            data,
            fmt=FORMAT,
            version=VERSION,
            where=MANIFEST_NAME,
            kind="shmstage manifest",
            error=ManifestError,
        )
        try:
            files = {entry["name"]: int(entry["bytes"]) for entry in document["files"]}
            tensors = {
                key: TensorRecord(
                    key=key,
                    file=info["file"],
                    dtype=info["dtype"],
                    shape=tuple(info["shape"]),
                    offsets=None if info["offsets"] is None else tuple(info["offsets"]),
                    crc32c=int(info["crc32c"]),
                )
                for key, info in document["tensors"].items()
            }
            return cls(files, tensors, document["tree"], document["metadata"], document["save"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"{MANIFEST_NAME} is missing or mangles a field: {exc!r}") from exc


def digest(document: bytes) -> str:
    """What identifies a committed checkpoint's contents: the SHA-256 of its manifest's
    bytes (which hold every tensor's checksum, the structure and the save's metadata).

    The daemon remembers the digest of the manifest it wrote; a reader hashes the manifest
    it reads from disk, and only when both agree does it restore from the daemon's memory.
    """
    return hashlib.sha256(document).hexdigest()


def build(
    layout: Layout,
    data_file: str,
    file_size: int,
    checksums: Sequence[int],
    tree: Any,
    metadata: Mapping[str, Any],
    save: Mapping[str, Any],
) -> Manifest:
    """The manifest for one layout written to one data file."""
    tensors = {
        spec.key: TensorRecord(spec.key, data_file, spec.dtype, spec.shape, spec.offsets, crc)
        for spec, crc in zip(layout.tensors, checksums, strict=True)
    }
    return Manifest(
        files={data_file: file_size},
        tensors=tensors,
        tree=tree,
        metadata=dict(metadata),
        save={"committed_unix": time.time(), **save},
    )

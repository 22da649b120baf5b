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

from shmstage.document import Entries, entry, parse, render
from shmstage.layout import Layout, LayoutError, TensorSpec

MANIFEST_NAME: Final = "shmstage-manifest.json"
FORMAT: Final = "shmstage-checkpoint"
VERSION: Final = 1
MAX_MANIFEST_BYTES: Final = 512 * 1024 * 1024
#: Decoding JSON builds objects far larger than their text: a manifest of tiny objects
#: (``{},`` repeated) takes 25-29x its size, so a 64 MiB one cost 1.9 GiB. A manifest whose
#: ``decode_cost`` is over this many times its size is refused before it is decoded; the
#: manifests shmstage writes estimate at 7-12x (short keys cost the most).
MAX_EXPANSION: Final = 16
#: Below this a manifest is decoded unchecked: it cannot cost more than ~30 MiB.
_CHECKED_ABOVE: Final = 1024 * 1024
_CRC_LIMIT: Final = 1 << 32


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
        tensors = Entries(
            _head(r.key, r.file, r.dtype, r.shape, r.offsets) + _tail(r.crc32c)
            for r in self.tensors.values()
        )
        return _document(self.files, tensors, self.tree, self.metadata, self.save)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """The manifest in ``data``, held to the format's rules: every reader (``load``,
        ``shmstage verify`` and ``ls``) refuses exactly the same documents, each with a
        ManifestError that names the tensor or field at fault."""
        if len(data) > _CHECKED_ABOVE:
            cost = decode_cost(data)
            if cost > MAX_EXPANSION * len(data):
                raise ManifestError(
                    f"{len(data)} bytes of JSON that would take about "
                    f"{cost >> 20} MiB to decode, over {MAX_EXPANSION}x their size: not a "
                    "manifest shmstage wrote (restore the checkpoint from a copy or remove it)"
                )
        try:
            document = parse(
                data,
                fmt=FORMAT,
                version=VERSION,
                where=MANIFEST_NAME,
                kind="shmstage manifest",
                error=ManifestError,
            )
        except ManifestError:
            raise
        except ValueError as exc:  # an int past Python's digit limit, say
            raise ManifestError(f"{MANIFEST_NAME} cannot be decoded: {exc}") from None
        try:
            files = {entry["name"]: _file_size(entry) for entry in document["files"]}
            tensors = {key: _record(key, info) for key, info in document["tensors"].items()}
            return cls(files, tensors, document["tree"], document["metadata"], document["save"])
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"{MANIFEST_NAME} is missing or mangles a field: {exc!r}") from exc


def _file_size(entry: dict[str, Any]) -> int:
    name, size = entry["name"], entry["bytes"]
    if type(name) is not str or type(size) is not int or size < 0:
        raise ManifestError(f"data file entry {entry!r:.100} is not a name and size")
    return size


def _record(key: str, info: dict[str, Any]) -> TensorRecord:
    """One tensor's entry, by the rules a daemon applies to a layout it is asked to stage
    (dtype, shape and offsets: ``TensorSpec``), so nothing a reader accepts can fail later
    in torch with a RuntimeError or TypeError."""
    try:
        spec = TensorSpec.from_wire([key, info["dtype"], info["shape"], info["offsets"]])
    except LayoutError as exc:
        raise ManifestError(str(exc)) from None
    file, crc = info["file"], info["crc32c"]
    if type(file) is not str:
        raise ManifestError(f"tensor {key!r}: file {file!r:.80} is not a name")
    if type(crc) is not int or not 0 <= crc < _CRC_LIMIT:
        raise ManifestError(f"tensor {key!r}: crc32c {crc!r:.40} is not a CRC-32C")
    return TensorRecord(key, file, spec.dtype, spec.shape, spec.offsets, crc)


def decode_cost(data: bytes) -> int:
    """An upper bound, in bytes, on what decoding the JSON ``data`` takes, from counting its
    structural characters (a pass at memory speed): json.loads first decodes the whole
    text (up to 4 bytes a character), then builds each map, list, entry, string and number.

    The weights are CPython 3.11's measured cost of the worst patterns (tiny maps and lists,
    one-entry maps, huge maps of distinct keys, short strings, floats, ints, astral text),
    rounded up: a character inside a string counts too, which only overestimates.
    """
    text = len(data) * (2 if data.isascii() else 8)
    containers = data.count(b"{") + data.count(b"[")
    return (
        text
        + 72 * (containers + data.count(b":"))
        + 36 * data.count(b",")
        + 14 * data.count(b'"')
    )


class TensorEntries:
    """A layout's manifest entries for one data file, all but each tensor's checksum
    rendered once: the daemon keeps them with the staged layout, and a save renders its
    manifest from them (at 10,000 tensors, building and rendering the manifest from scratch
    took 0.09 s of every save on the H100 host, after the data file was written)."""

    def __init__(self, layout: Layout, data_file: str) -> None:
        self.layout = layout
        self.data_file = data_file
        self._heads = [
            _head(spec.key, data_file, spec.dtype, spec.shape, spec.offsets)
            for spec in layout.tensors
        ]

    def render(
        self,
        file_size: int,
        checksums: Sequence[int],
        tree: Any,
        metadata: Mapping[str, Any],
        save: Mapping[str, Any],
    ) -> bytes:
        """The manifest's bytes, exactly as ``build(...).to_bytes()`` writes them."""
        pairs = zip(self._heads, checksums, strict=True)
        tensors = Entries(head + _tail(crc) for head, crc in pairs)
        return _document({self.data_file: file_size}, tensors, tree, metadata, _save(save))


def _head(
    key: str, file: str, dtype: str, shape: tuple[int, ...], offsets: tuple[int, ...] | None
) -> str:
    """A tensor's entry up to its checksum: ``"key": {"file": ..., ..., "crc32c": ``."""
    fields = {
        "file": file,
        "dtype": dtype,
        "shape": list(shape),
        "offsets": None if offsets is None else list(offsets),
    }
    return entry(key, fields)[:-1] + ', "crc32c": '


def _tail(crc: int) -> str:
    return f"{int(crc)}}}"


def _save(save: Mapping[str, Any]) -> dict[str, Any]:
    return {"committed_unix": time.time(), **save}


def _document(
    files: Mapping[str, int],
    tensors: Entries,
    tree: Any,
    metadata: Mapping[str, Any],
    save: Mapping[str, Any],
) -> bytes:
    return render(
        {
            "format": FORMAT,
            "version": VERSION,
            "files": [{"name": name, "bytes": size} for name, size in files.items()],
            "tensors": tensors,
            "tree": tree,
            "metadata": dict(metadata),
            "save": dict(save),
        }
    )


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
        save=_save(save),
    )

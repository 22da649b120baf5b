"""Reading a committed checkpoint directory: manifest first, then verified tensor bytes.

Shared by ``load`` in the client (which turns bytes into tensors) and ``shmstage verify``
(which only checks), so both apply exactly the same rules. No torch here.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import crc32c

from shmstage import datafile, tree
from shmstage.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    TensorRecord,
)

_CRC_CHUNK: Final = 64 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint cannot be read; names the checkpoint, file or key at fault."""


class ChecksumError(CheckpointError):
    pass


def checksum(view: memoryview | bytes, value: int = 0) -> int:
    """CRC-32C in chunks so the GIL is released for each and huge tensors stay interruptible."""
    view = memoryview(view).cast("B")
    for start in range(0, len(view), _CRC_CHUNK):
        value = crc32c.crc32c(view[start : start + _CRC_CHUNK], value)
    return value


def is_complete(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


# The rules every reader of a checkpoint's files applies (``Checkpoint`` here, for verify
# and ls; the client's ``CheckpointFiles``, for load), beyond the manifest's own
# (``Manifest.from_bytes``): which names may be data files, how a data file's header is read,
# and how a tensor's record and its header entry must agree.


def check_data_name(directory: Path, name: str) -> None:
    """A data file lies in the checkpoint's own directory and has the safetensors suffix."""
    if "/" in name or name in ("", ".", "..") or not name.endswith(datafile.SUFFIX):
        raise CheckpointError(f"{directory}: manifest names an invalid data file {name!r}")


def read_header(read: Callable[[int], bytes], size: int, where: Path) -> datafile.Header:
    """A data file's safetensors header; ``read(n)``: the file's first ``n`` bytes."""
    try:
        length = datafile.header_length(read(min(8, size)))
        return datafile.parse_header(read(min(length, size)), size)
    except ValueError as exc:  # DataFileError, or an int past Python's digit limit
        raise CheckpointError(f"{where}: {exc}") from exc


def locate(
    record: TensorRecord, header: datafile.Header | None, where: str
) -> datafile.TensorEntry:
    """Where ``record``'s bytes lie in its data file, whose header must agree with the
    manifest (``where``: the tensor and file, for the message)."""
    entry = header.tensors.get(record.key) if header else None
    if entry is None:
        raise CheckpointError(f"{where}: missing from the file's safetensors header")
    if entry.dtype != record.dtype or entry.shape != record.shape:
        raise CheckpointError(
            f"{where}: header says {entry.dtype}{list(entry.shape)}, manifest says "
            f"{record.dtype}{list(record.shape)}"
        )
    if type(entry.begin) is not int or type(entry.end) is not int:
        raise CheckpointError(
            f"{where}: data_offsets {[entry.begin, entry.end]!r:.80} are not byte offsets"
        )
    return entry


class Checkpoint:
    """An open checkpoint: its manifest and a read-only mapping of each data file.

    ``manifest_name``: the manifest to read instead of ``MANIFEST_NAME`` — a directory can
    hold several single-file checkpoints side by side (a DCP checkpoint keeps one manifest
    per rank file), each opened and verified with exactly these rules.
    """

    def __init__(self, path: str | os.PathLike[str], manifest_name: str = MANIFEST_NAME) -> None:
        self.path = Path(path)
        manifest_path = self.path / manifest_name
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise CheckpointError(f"{self.path} {what}: a checkpoint is a directory")
        try:
            size = manifest_path.stat().st_size
            if size > MAX_MANIFEST_BYTES:
                raise CheckpointError(f"{manifest_path}: {size} bytes is not a plausible manifest")
            self.manifest = Manifest.from_bytes(manifest_path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.path} is not a complete shmstage checkpoint: {manifest_name} is "
                "missing (the save never committed, or this is not a checkpoint directory)"
            ) from None
        except (OSError, ManifestError) as exc:
            raise CheckpointError(f"{manifest_path}: {exc}") from exc
        self._manifest_name = manifest_name
        self._maps: dict[str, mmap.mmap] = {}
        self._headers: dict[str, datafile.Header] = {}
        try:
            for name, size in self.manifest.files.items():
                self._open_file(name, size)
        except BaseException:
            self.close()
            raise

    def _open_file(self, name: str, size: int) -> None:
        check_data_name(self.path, name)
        file_path = self.path / name
        try:
            fd = os.open(file_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise CheckpointError(f"{file_path}: {exc.strerror}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise CheckpointError(
                    f"{file_path}: {actual} bytes, but the manifest recorded {size} (truncated "
                    "or replaced after the checkpoint was committed)"
                )
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        if mapping is None:
            raise CheckpointError(f"{file_path}: empty data file")
        self._maps[name] = mapping
        self._headers[name] = read_header(lambda n: mapping[:n], size, file_path)

    def close(self) -> None:
        for mapping in self._maps.values():
            try:
                mapping.close()
            except BufferError:  # a caller still holds a view; the GC unmaps it later
                pass
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def keys(self) -> list[str]:
        return list(self.manifest.tensors)

    def record(self, key: str) -> TensorRecord:
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in this checkpoint") from None

    def tensor_bytes(self, key: str, *, verify: bool = True) -> memoryview:
        """The stored bytes of one tensor, checked against header and checksum."""
        record = self.record(key)
        where = f"tensor {key!r} in {self.path / record.file}"
        entry = locate(record, self._headers.get(record.file), where)
        view = memoryview(self._maps[record.file])[entry.begin : entry.end]
        if verify:
            actual = checksum(view)
            if actual != record.crc32c:
                view.release()
                raise ChecksumError(
                    f"{where}: checksum mismatch (crc32c {actual:#010x}, manifest "
                    f"{record.crc32c:#010x}); the file is corrupt"
                )
        return view

    def problems(self) -> Iterator[str]:
        """Every inconsistency found by reading the whole checkpoint (empty when sound)."""
        try:
            referenced = tree.tensor_keys(self.manifest.tree)
        except tree.TreeError as exc:
            yield f"{self.path / self._manifest_name}: {exc}"
            referenced = list(self.manifest.tensors)
        missing = set(referenced) - set(self.manifest.tensors)
        for key in sorted(missing):
            yield f"{self.path / self._manifest_name}: structure refers to unknown tensor {key!r}"
        for key in self.manifest.tensors:
            try:
                self.tensor_bytes(key).release()
            except CheckpointError as exc:
                yield str(exc)
        for name, header in self._headers.items():
            extra = set(header.tensors) - set(self.manifest.tensors)
            if extra:
                yield f"{self.path / name}: tensors not in the manifest: {sorted(extra)[:5]}"


def verify(path: str | os.PathLike[str]) -> list[str]:
    """All problems with the checkpoint at ``path``; an empty list means it verifies."""
    try:
        with Checkpoint(path) as checkpoint:
            return list(checkpoint.problems())
    except CheckpointError as exc:
        return [str(exc)]

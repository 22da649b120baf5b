"""A checkpoint's files opened for reading: its manifest, and its data files' tensors.

What ``load`` and ``restore`` read when the daemon's memory cannot serve (and what names a
checkpoint to the daemon when it can: the manifest's digest and a data file's descriptor).
The directory is opened once and every file relative to it, never following a symlink;
each data file's header is held to the manifest by the core's own rules
(``shmstage.checkpoint.locate``), the ones ``shmstage verify`` applies. Each data file is
read in large parallel chunks, through pinned buffers and pipelined copies for a GPU
(``transfer``), and every tensor's bytes are checked against the CRC-32C recorded when
they were written: a mismatch raises naming the key and file rather than handing corrupt
weights to a run.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch

from shmstage import tree
from shmstage.checkpoint import CheckpointError, check_data_name, locate, read_header
from shmstage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError
from shmstage_client.dtypes import FROM_SAFETENSORS
from shmstage_client.restore.sources import FileSource
from shmstage_client.restore.transfer import Placement, transfer

_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW


class CheckpointFiles:
    """A checkpoint directory opened for reading: the manifest's bytes (their digest names
    the checkpoint to the daemon) and its parsed form; data files opened relative to the
    directory, never following a symlink.

    ``manifest_name``: another manifest than ``MANIFEST_NAME`` (a DCP rank's).
    """

    def __init__(self, path: str | os.PathLike[str], manifest_name: str = MANIFEST_NAME) -> None:
        self.path = Path(path)
        try:
            self.dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise CheckpointError(f"{self.path} {what}: a checkpoint is a directory") from None
        except OSError as exc:
            raise CheckpointError(f"{self.path}: {exc.strerror}") from None
        try:
            self.document = self._read_manifest(manifest_name)
            self.manifest = Manifest.from_bytes(self.document)
        except ManifestError as exc:
            os.close(self.dir_fd)
            raise CheckpointError(f"{self.path / manifest_name}: {exc}") from exc
        except BaseException:
            os.close(self.dir_fd)
            raise

    def _read_manifest(self, name: str) -> bytes:
        where = self.path / name
        try:
            fd = os.open(name, _OPEN | os.O_NONBLOCK, dir_fd=self.dir_fd)
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.path} is not a complete shmstage checkpoint: {name} is missing (the "
                "save never committed, or this is not a checkpoint directory)"
            ) from None
        except OSError as exc:
            raise CheckpointError(f"{where}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                raise CheckpointError(f"{where}: not a plausible manifest")
            return _read_exactly(fd, st.st_size, 0, where)
        finally:
            os.close(fd)

    def open_data(self, name: str) -> tuple[int, int]:
        """A read descriptor on one of the manifest's data files and its size (checked)."""
        check_data_name(self.path, name)
        where = self.path / name
        try:
            fd = os.open(name, _OPEN | os.O_NONBLOCK, dir_fd=self.dir_fd)
        except OSError as exc:
            raise CheckpointError(f"{where}: {exc.strerror}") from exc
        st = os.fstat(fd)
        expected = self.manifest.files.get(name)
        if not stat.S_ISREG(st.st_mode) or st.st_size != expected:
            os.close(fd)
            raise CheckpointError(
                f"{where}: {st.st_size} bytes, but the manifest recorded {expected} (truncated "
                "or replaced after the checkpoint was committed)"
            )
        return fd, st.st_size

    def records(self, name: str) -> list[Any]:
        return [r for r in self.manifest.tensors.values() if r.file == name]

    def read(self, device: torch.device, *, verify: bool) -> tuple[dict[str, torch.Tensor], int]:
        """Every tensor of every data file, on ``device``; and the bytes read."""
        tensors: dict[str, torch.Tensor] = {}
        total = 0
        for name in self.manifest.files:
            fd, size = self.open_data(name)
            try:
                source, placements = self._placements(fd, size, name)
                tensors.update(transfer(source, placements, device, verify=verify))
                total += source.size
            finally:
                os.close(fd)
        return tensors, total

    def _placements(self, fd: int, size: int, name: str) -> tuple[FileSource, list[Placement]]:
        where = self.path / name
        header = read_header(lambda n: _read_exactly(fd, n, 0, where), size, where)
        placements = []
        for record in self.records(name):
            entry = locate(record, header, f"tensor {record.key!r} in {where}")
            placements.append(
                Placement(
                    record.key,
                    torch_dtype(record.key, record.dtype),
                    record.shape,
                    entry.begin - header.data_start,
                    entry.end - entry.begin,
                    record.crc32c,
                )
            )
        source = FileSource(fd, header.data_start, size - header.data_start, str(where))
        return source, placements

    def state(self, tensors: dict[str, torch.Tensor]) -> Any:
        """The saved structure with ``tensors`` in place."""
        return unflatten(self.manifest.tree, tensors, self.path)

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def torch_dtype(key: str, name: str) -> torch.dtype:
    dtype = FROM_SAFETENSORS.get(name)
    if dtype is None:
        raise CheckpointError(f"tensor {key!r}: dtype {name} has no torch equivalent here")
    return dtype


def unflatten(encoded: Any, tensors: dict[str, torch.Tensor], where: object) -> Any:
    def tensor(key: str) -> torch.Tensor:
        try:
            return tensors[key]
        except KeyError:
            raise CheckpointError(f"{where}: no tensor {key!r} in this checkpoint") from None

    try:
        return tree.unflatten(encoded, tensor)
    except tree.TreeError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


def _read_exactly(fd: int, size: int, offset: int, where: object) -> bytes:
    parts = []
    done = 0
    while done < size:
        part = os.pread(fd, size - done, offset + done)
        if not part:
            raise CheckpointError(f"{where}: the file ended {size - done} bytes early")
        parts.append(part)
        done += len(part)
    return b"".join(parts)

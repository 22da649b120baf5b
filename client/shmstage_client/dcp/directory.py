"""A shmstage DCP checkpoint on disk: its files, its commit marker, and how it is published.

A finished checkpoint directory holds, for each rank that wrote anything::

    rank-00003-of-00004.safetensors     the rank's shards, written by its node's daemon; the
                                        header's __metadata__ carries DCP_SHARDING_INFO, so the
                                        stock HuggingFaceStorageReader can load and reshard it
    rank-00003-of-00004.manifest.json   the daemon's manifest for that file (CRC-32C per tensor)
    rank-00003-of-00004.bytes           the rank's non-tensor items (DCP BYTE_IO), if it had any

and one ``shmstage-dcp.json``, the commit marker: where every chunk and object lives.

Why a pending directory: the stock reader loads every ``*.safetensors`` it finds and knows no
commit marker, so a directory holding some ranks' files must never carry the final name. Ranks
write into ``.NAME.SAVE_ID.shmstage-pending/`` beside the destination (each rank's daemon into
its own subdirectory, because every daemon commit names its manifest the same); once every
rank is durable the coordinator moves each rank's files up, writes the marker and renames the
directory to NAME. A reader sees the whole checkpoint or nothing; a failed save leaves only the
hidden pending directory, and earlier checkpoints are never touched.

Nothing here knows DCP's classes: the writer and reader translate to and from them, so this
module alone defines (and checks) the format.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shmstage import names
from shmstage.checkpoint import Checkpoint, CheckpointError, checksum
from shmstage.document import parse, render
from shmstage.manifest import MANIFEST_NAME
from shmstage_client.errors import CheckpointExists, SaveError

MARKER_NAME: Final = "shmstage-dcp.json"
FORMAT: Final = "shmstage-dcp"
VERSION: Final = 1
PENDING_SUFFIX: Final = ".shmstage-pending"
DATA_SUFFIX: Final = ".safetensors"
MANIFEST_SUFFIX: Final = ".manifest.json"
OBJECTS_SUFFIX: Final = ".bytes"
MAX_MARKER_BYTES: Final = 512 * 1024 * 1024
#: The header entries the stock HuggingFaceStorageReader reads: per key, where the shard
#: starts in the global tensor (torch.distributed.checkpoint._hf_utils spells them so).
SHARDING_INFO_KEY: Final = "DCP_SHARDING_INFO"
SAVED_OFFSETS_KEY: Final = "saved_offsets"


def rank_stem(rank: int, world_size: int) -> str:
    """How a rank's files are named: sortable, and telling the world size they came from."""
    return f"rank-{rank:05d}-of-{world_size:05d}"


@dataclass(frozen=True)
class RankFiles:
    """The files one rank contributes; ``data``/``objects`` are None when it had none."""

    rank: int
    data: str | None
    objects: str | None

    @property
    def manifest(self) -> str | None:
        """The daemon's manifest for ``data``, renamed beside it when published."""
        if self.data is None:
            return None
        return self.data.removesuffix(DATA_SUFFIX) + MANIFEST_SUFFIX


def pending_dir(final: Path, save_id: str) -> Path:
    """Where a save is assembled, hidden beside its destination and unique to the save."""
    return final.parent / f".{final.name}.{save_id}{PENDING_SUFFIX}"


def rank_dir(pending: Path, rank: int) -> Path:
    """The directory one rank's daemon commits into (its manifest name is fixed)."""
    return pending / f"rank-{rank:05d}"


def sharding_header(offsets: Mapping[str, list[int]]) -> dict[str, str]:
    """``__metadata__`` for a rank file: where each of its shards sits in the global tensor."""
    info = {key: {SAVED_OFFSETS_KEY: list(value)} for key, value in offsets.items()}
    return {SHARDING_INFO_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # a rank's data file; the chunk is stored under the tensor's key


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # torch's name without "torch.", e.g. "bfloat16"
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class ObjectEntry:
    """One DCP BYTE_IO item: ``length`` bytes at ``offset`` of a rank's objects file."""

    file: str
    offset: int
    length: int
    crc32c: int


@dataclass(frozen=True)
class Marker:
    save_id: str
    world_size: int
    ranks: tuple[RankFiles, ...]
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    planner_data: dict[str, list[str | int]] | None
    committed_unix: float = 0.0

    def to_bytes(self) -> bytes:
        document = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "committed_unix": self.committed_unix or time.time(),
            "ranks": [
                {"rank": r.rank, "data": r.data, "manifest": r.manifest, "objects": r.objects}
                for r in self.ranks
            ],
            "tensors": {
                key: {
                    "dtype": entry.dtype,
                    "size": list(entry.size),
                    "chunks": [
                        {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file}
                        for c in entry.chunks
                    ],
                }
                for key, entry in self.tensors.items()
            },
            "objects": {
                key: {
                    "file": entry.file,
                    "offset": entry.offset,
                    "length": entry.length,
                    "crc32c": entry.crc32c,
                }
                for key, entry in self.objects.items()
            },
            "planner_data": self.planner_data,
        }
        return render(document)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = MARKER_NAME) -> Marker:
        """Parse and check a marker; every file it names must be one a rank contributes."""
        document = parse(
            data,
            fmt=FORMAT,
            version=VERSION,
            where=where,
            kind="shmstage DCP commit marker",
            error=CheckpointError,
        )
        try:
            world_size = int(document["world_size"])
            ranks = tuple(
                RankFiles(
                    int(r["rank"]),
                    _plain(r["data"], DATA_SUFFIX),
                    _plain(r["objects"], OBJECTS_SUFFIX),
                )
                for r in document["ranks"]
            )
            data_files = {r.data for r in ranks if r.data}
            object_files = {r.objects for r in ranks if r.objects}
            tensors = {
                str(key): TensorEntry(
                    str(entry["dtype"]),
                    _ints(entry["size"]),
                    tuple(
                        Chunk(_ints(c["offsets"]), _ints(c["sizes"]), _known(c["file"], data_files))
                        for c in entry["chunks"]
                    ),
                )
                for key, entry in document["tensors"].items()
            }
            objects = {
                str(key): ObjectEntry(
                    _known(entry["file"], object_files),
                    int(entry["offset"]),
                    int(entry["length"]),
                    int(entry["crc32c"]),
                )
                for key, entry in document["objects"].items()
            }
            planner_data = document["planner_data"]
            if planner_data is not None and not isinstance(planner_data, dict):
                raise TypeError("planner_data must be an object or null")
            return cls(
                str(document["save_id"]),
                world_size,
                ranks,
                tensors,
                objects,
                planner_data,
                float(document["committed_unix"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{where}: missing or malformed field: {exc!r}") from exc


def _plain(name: object, suffix: str) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not name.endswith(suffix):
        raise ValueError(f"file name {name!r:.80} does not end in {suffix}")
    try:
        return names.check_plain_name(name, what="file")
    except names.NameError_ as exc:
        raise ValueError(str(exc)) from None


def _known(name: object, files: set[str]) -> str:
    if name not in files:
        raise ValueError(f"{name!r:.80} is not a file any rank contributed")
    assert isinstance(name, str)
    return name


def _ints(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{value!r:.80} is not a list of non-negative ints")
    return tuple(value)


def read_marker(path: Path) -> Marker:
    marker_path = path / MARKER_NAME
    try:
        size = marker_path.stat().st_size
        if size > MAX_MARKER_BYTES:
            raise CheckpointError(f"{marker_path}: {size} bytes is not a plausible marker")
        data = marker_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete shmstage DCP checkpoint: {MARKER_NAME} is missing (the "
            "save never committed — look for a hidden .NAME.*.shmstage-pending directory beside "
            "it — or this is not a DCP checkpoint made by shmstage)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{marker_path}: {exc.strerror or exc}") from exc
    return Marker.from_bytes(data, str(marker_path))


# -- writing --------------------------------------------------------------------------


def write_objects(path: Path, payloads: list[bytes], *, fsync: bool = True) -> list[ObjectEntry]:
    """Write one rank's BYTE_IO payloads back to back, durably; where each one landed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    entries = []
    try:
        offset = 0
        for payload in payloads:
            _write_all(fd, payload, offset)
            entries.append(ObjectEntry(path.name, offset, len(payload), checksum(payload)))
            offset += len(payload)
        if fsync:
            os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    return entries


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def occupied(final: Path) -> bool:
    """Whether ``final`` holds anything a save would replace (an empty directory does not)."""
    try:
        return any(final.iterdir())
    except NotADirectoryError:
        return True
    except FileNotFoundError:
        return False


def publish(final: Path, pending: Path, marker: Marker, *, fsync: bool = True) -> None:
    """Make a pending save the checkpoint ``final``: the coordinator's last step.

    Runs only when every rank reported its files durable. Each rank's manifest proves its
    daemon committed; a missing one stops the publish with the rank named.
    """
    if occupied(final):
        raise CheckpointExists(
            f"{final} already exists and is not empty: shmstage never overwrites a checkpoint; "
            f"this save stays in {pending}"
        )
    for rank in marker.ranks:
        if rank.data is None or rank.manifest is None:
            continue
        source = rank_dir(pending, rank.rank)
        try:
            os.rename(source / MANIFEST_NAME, pending / rank.manifest)
            os.rename(source / rank.data, pending / rank.data)
        except FileNotFoundError:
            raise SaveError(
                f"rank {rank.rank}'s data is not committed in {source} (its daemon reported it "
                "durable, but its manifest or data file is gone); nothing was published"
            ) from None
        with contextlib.suppress(OSError):  # leftovers only cost a directory entry
            os.rmdir(source)
    marker_fd = os.open(
        pending / MARKER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
    )
    try:
        _write_all(marker_fd, marker.to_bytes(), 0)
        if fsync:
            os.fsync(marker_fd)
    finally:
        os.close(marker_fd)
    if fsync:
        _fsync_dir(pending)
    try:
        os.rename(pending, final)  # replaces only an empty directory: atomic publish
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise CheckpointExists(
                f"{final} appeared while the save was being written; it stays in {pending}"
            ) from None
        raise
    if fsync:
        _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------------


def open_rank(path: Path, rank: RankFiles) -> Checkpoint:
    """A rank file with its manifest, opened with the core checkpoint's checks."""
    assert rank.manifest is not None
    return Checkpoint(path, manifest_name=rank.manifest)


def read_object(path: Path, entry: ObjectEntry, *, verify: bool = True) -> bytes:
    """One BYTE_IO payload, checked against the CRC-32C recorded when it was written."""
    where = path / entry.file
    with open(where, "rb") as f:
        f.seek(entry.offset)
        data = f.read(entry.length)
    if len(data) != entry.length:
        raise CheckpointError(f"{where}: truncated (object at {entry.offset} runs past the end)")
    if verify and checksum(data) != entry.crc32c:
        raise CheckpointError(f"{where}: checksum mismatch at offset {entry.offset}; corrupt")
    return data


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Every problem with the DCP checkpoint at ``path``; an empty list means it verifies."""
    return list(_problems(Path(path)))


def _problems(path: Path) -> Iterator[str]:
    try:
        marker = read_marker(path)
    except CheckpointError as exc:
        yield str(exc)
        return
    stored: dict[str, dict[str, tuple[int, ...]]] = {}
    for rank in marker.ranks:
        if rank.data is None:
            continue
        try:
            with open_rank(path, rank) as checkpoint:
                yield from checkpoint.problems()
                stored[rank.data] = {
                    key: record.shape for key, record in checkpoint.manifest.tensors.items()
                }
        except CheckpointError as exc:
            yield str(exc)
    for key, entry in marker.tensors.items():
        for chunk in entry.chunks:
            shape = stored.get(chunk.file, {}).get(key)
            if chunk.file in stored and shape != chunk.sizes:
                yield (
                    f"{path / chunk.file}: chunk {list(chunk.offsets)} of {key!r} should have "
                    f"shape {list(chunk.sizes)}, found {None if shape is None else list(shape)}"
                )
    for key, entry in marker.objects.items():
        try:
            read_object(path, entry)
        except (OSError, CheckpointError) as exc:
            yield f"object {key!r}: {exc}"


def plain_paths(planner_data: Any, keys: Mapping[str, Any]) -> dict[str, list[str | int]] | None:
    """DCP's planner data if it is the default planner's key -> path mapping, else None."""
    if not isinstance(planner_data, Mapping):
        return None
    result: dict[str, list[str | int]] = {}
    for key, path in planner_data.items():
        if key not in keys:
            continue
        if not isinstance(path, list | tuple) or not all(
            isinstance(part, str | int) and not isinstance(part, bool) for part in path
        ):
            return None
        result[str(key)] = list(path)
    return result

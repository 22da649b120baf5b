"""``ShmStageReader``: load a shmstage DCP checkpoint — tensors and objects — at any world size.

DCP's load planner decides which parts of which saved chunks each rank needs (resharding);
this reader serves them from the rank files, after checking each chunk's bytes against the
CRC-32C its daemon recorded, and serves non-tensor items from the rank's objects file. The
stock ``HuggingFaceStorageReader`` reads the same rank files too, but not the objects.

A rank file the node's daemon still holds in memory (its trainer died, the daemon kept the
slot: see ``restore``) is served from there instead, through a read-only lease — the same
bytes, identified by the data file's identity and its manifest's digest; any other rank
file, and any rank whose memory read fails, comes from the files. ``sources`` says which.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shmstage.checkpoint import Checkpoint, CheckpointError, ChecksumError
from shmstage.checksums import checksums
from shmstage_client.connection import DaemonConnection
from shmstage_client.dcp import directory
from shmstage_client.dtypes import FROM_SAFETENSORS
from shmstage_client.restore import restoring
from shmstage_client.restore.files import CheckpointFiles
from shmstage_client.restore.sources import MappedSource
from shmstage_client.restore.transfer import Placement

log = logging.getLogger("shmstage.client")


@dataclass(frozen=True)
class _ChunkSource:
    """Where one saved chunk is read from: a rank file, under the tensor's key."""

    rank: directory.RankFiles
    key: str
    dtype: torch.dtype


class ShmStageReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by ``ShmStageWriter``.

    ``path``: the checkpoint directory (or pass ``checkpoint_id=`` to ``dcp.load``).
    ``verify``: check every chunk and object read against its recorded CRC-32C (on by
    default: a corrupt checkpoint raises naming the file and key, never loads).
    ``source``: "auto" (a rank file from the daemon's memory when it holds it, else from
    disk), "files", or "memory" (raise if a rank file is not in memory); ``socket``: the
    daemon's. After a load, ``sources`` maps each rank read to "memory" or "files".
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        verify: bool = True,
        source: str = "auto",
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        restoring.check_source(source)
        self.path = None if path is None else Path(path)
        self.verify = verify
        self.source = source
        self.socket = socket
        self.sources: dict[int, str] = {}
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def _root(self) -> Path:
        if self.path is None:
            raise CheckpointError("ShmStageReader has no checkpoint: pass path= or checkpoint_id=")
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        marker = directory.read_marker(self._root())
        by_data = {rank.data: rank for rank in marker.ranks if rank.data}
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        for key, tensor in marker.tensors.items():
            dtype = getattr(torch, tensor.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{key!r}: dtype {tensor.dtype!r} is unknown to this torch")
            entries[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(tensor.size),
                chunks=[
                    ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                    for c in tensor.chunks
                ],
            )
            for chunk in tensor.chunks:
                source = _ChunkSource(by_data[chunk.file], key, dtype)
                storage[MetadataIndex(key, chunk.offsets)] = source
        for key, entry in marker.objects.items():
            entries[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = entry
        planner_data = None
        if marker.planner_data is not None:
            planner_data = {key: tuple(path) for key, path in marker.planner_data.items()}
        return Metadata(
            state_dict_metadata=entries,
            planner_data=planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(self._root()), load_id=self.load_id),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        root = self._root()
        by_rank: dict[directory.RankFiles, list[ReadItem]] = {}
        for item in plan.items:
            source = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                data = directory.read_object(root, source, verify=self.verify)
                planner.load_bytes(item, io.BytesIO(data))
            else:
                by_rank.setdefault(source.rank, []).append(item)
        with _Daemon(self.socket, self.source) as daemon:
            for rank, items in by_rank.items():
                if not self._read_from_memory(daemon, root, rank, items, planner):
                    with directory.open_rank(root, rank) as checkpoint:
                        self._read_chunks(checkpoint, items, planner)
                    self.sources[rank.rank] = "files"
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_chunks(
        self, checkpoint: Checkpoint, items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        verified: set[str] = set()
        for item in items:
            source: _ChunkSource = self.storage_data[item.storage_index]
            record = checkpoint.record(source.key)
            if FROM_SAFETENSORS.get(record.dtype) != source.dtype:
                raise CheckpointError(
                    f"{checkpoint.path / record.file}: {source.key!r} is stored as {record.dtype}, "
                    f"the marker says {source.dtype}"
                )
            verify = self.verify and source.key not in verified
            with checkpoint.tensor_bytes(source.key, verify=verify) as view:
                verified.add(source.key)
                target = planner.resolve_tensor(item).detach()
                _copy_region(view, source.dtype, record.shape, item, target)
            planner.commit_tensor(item, target)

    def _read_from_memory(
        self,
        daemon: _Daemon,
        root: Path,
        rank: directory.RankFiles,
        items: list[ReadItem],
        planner: LoadPlanner,
    ) -> bool:
        """Serve one rank file's items from the daemon's memory; False (nothing committed
        to the planner) when it cannot, and the files must."""
        if daemon.connection is None or rank.data is None or rank.manifest is None:
            return False
        try:
            with CheckpointFiles(root, rank.manifest) as files:
                specs = restoring.specs_of(files, rank.data)
                lease = restoring.lease_exact(daemon.connection, files, rank.data)
            try:
                placed = {p.key: p for p in restoring.placements_of(lease, specs)}
                where = f"shmstaged's memory ({root / rank.data})"
                host = MappedSource(lease.address, lease.region.size, where)
                copied = self._copy_items(host, placed, items, planner)
                if not lease.end():
                    raise restoring.NotInMemory("the lease expired before the copy was done")
            finally:
                lease.close()
        except (*restoring.FALLBACK, restoring.NotInMemory) as exc:
            if self.source == "memory":
                raise CheckpointError(
                    f"{root / rank.data}: cannot read it from shmstaged's memory: {exc}"
                ) from None
            log.debug("%s from its file: %s", root / rank.data, exc)
            return False
        for item, target in copied:
            planner.commit_tensor(item, target)
        self.sources[rank.rank] = "memory"
        return True

    def _copy_items(
        self,
        host: MappedSource,
        placed: dict[str, Placement],
        items: list[ReadItem],
        planner: LoadPlanner,
    ) -> list[tuple[ReadItem, torch.Tensor]]:
        """Verify the chunks the items read (in parallel), then copy each item's region."""
        views: dict[str, memoryview] = {}
        for item in items:
            key = self.storage_data[item.storage_index].key
            p = placed[key]
            views[key] = host.view(p.offset, p.offset + p.nbytes)
        if self.verify:
            keys = list(views)
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                actual = checksums([views[key] for key in keys], pool)
            for key, value in zip(keys, actual, strict=True):
                if value != placed[key].crc32c:
                    raise ChecksumError(f"tensor {key!r} in {host.where}: checksum mismatch")
        copied = []
        for item in items:
            source: _ChunkSource = self.storage_data[item.storage_index]
            p = placed[source.key]
            if p.dtype != source.dtype:
                raise CheckpointError(f"{source.key!r}: stored as {p.dtype}, not {source.dtype}")
            target = planner.resolve_tensor(item).detach()
            _copy_region(views[source.key], source.dtype, p.shape, item, target)
            copied.append((item, target))
        return copied

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / directory.MARKER_NAME).is_file()


def _copy_region(
    view: memoryview,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    item: ReadItem,
    target: torch.Tensor,
) -> None:
    """Copy the part of a stored chunk that ``item`` asks for straight from the mapping."""
    if len(view) == 0:
        return  # an empty chunk has no region to copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping; we only read from it
        stored = torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)
    region = stored
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        region = region.narrow(dim, start, length)
    if region.shape != target.shape:
        raise CheckpointError(
            f"{item.storage_index.fqn!r}: asked for {list(target.shape)}, the stored region is "
            f"{list(region.shape)}"
        )
    target.copy_(region)
    del stored, region  # release the buffer export before the mapping's view is released


class _Daemon:
    """The daemon connection one ``read_data`` shares across its rank files (none when the
    source is "files" or no daemon answers, unless "memory" was required)."""

    def __init__(self, socket: str | os.PathLike[str] | None, source: str) -> None:
        self.connection: DaemonConnection | None = None
        if source == "files":
            return
        try:
            self.connection = restoring.connect(socket)
        except restoring.FALLBACK as exc:
            if source == "memory":
                raise CheckpointError(f"cannot read from shmstaged's memory: {exc}") from None

    def __enter__(self) -> _Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.close()

"""``ShmStageWriter``: PyTorch DCP saves whose bytes go through each node's shmstaged.

DCP does the global coordination (planning, deduplication, the all-ranks-succeeded check);
each rank's node daemon does the staging and the writing. A save, in DCP's order of calls:

``stage`` (trainer thread; ``async_save`` only)
    Flatten the state dict exactly as DCP's default planner does and copy every local shard
    into a slot of this node's daemon — the only part that stalls training. Return a stand-in
    state dict that replays the same write items but holds no tensor, so nothing the trainer
    does afterwards can reach the checkpoint. With ``guard=`` optimizers, the copy of their
    parameters and state only starts here (``Stager.save(..., block=False)``): ``stage``
    returns a future of the stand-in, done when the copy has landed, and the checkpoint
    thread waits for it before planning.
``set_up_storage_writer``, ``prepare_local_plan`` (checkpoint thread, every rank)
    Find this save's staged slot. A staging failure is raised here, inside DCP's collective
    error handling, so every rank fails together — raising in ``stage`` would leave the other
    ranks waiting forever in the planning collective.
``prepare_global_plan`` (coordinator)
    A save id, each rank's number, the world size and the destination, sent to every rank.
``write_data`` (every rank)
    Commit the slot as this rank's ``.safetensors`` file, write non-tensor items to a sidecar,
    wait until both are durable. ``dcp.save`` has no ``stage``: it stages here.
``finish`` (coordinator; DCP calls it only when every rank's ``write_data`` succeeded)
    Publish the checkpoint atomically (see ``directory``).

A save armed by ``publish_next`` also hands readers on the node the bytes it checkpoints:
right after its commit, each rank's ``write_data`` publishes the committed slot as its part
of version ``step`` of a channel, as ``ShmStagePublisher`` would have published that
rank's shards (the daemon's *Saved parts*): one copy serves the checkpoint and the
readers, and the version is visible once every rank of the node published its part,
while the daemon still writes the files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from shmstage_client.dcp import directory
from shmstage_client.errors import CheckpointExists, SaveError, UnsupportedValue
from shmstage_client.save.handle import SaveHandle, SaveResult, SaveTimings, TimingViews
from shmstage_client.save.publish import Part, Published, check_step, publish_saved, share_gids
from shmstage_client.save.staged import Staged
from shmstage_client.save.stager import Stager

log = logging.getLogger("shmstage.dcp")

#: The staged state dict's extra entry, through which the checkpoint thread finds its slot.
_TICKET_KEY: Final = "__shmstage_staged__"

PROCESS_MODE_REFUSED: Final = (
    "ShmStageWriter cannot be sent to another process, as async_save(async_checkpointer_type="
    "AsyncCheckpointerType.PROCESS) does: stage() copied this rank's tensors into a shared-memory "
    "slot that shmstaged granted to this process's connection, and the daemon accepts that slot's "
    "commit from no one else. Use AsyncCheckpointerType.THREAD (the default): the checkpoint "
    "thread only waits on the daemon, so it takes no GIL time from training."
)


@dataclass(frozen=True)
class ChunkLocation:
    """``WriteResult.storage_data`` of a tensor chunk: the rank file holding it."""

    rank: int
    file: str


@dataclass(frozen=True)
class ObjectLocation:
    """``WriteResult.storage_data`` of a BYTE_IO item."""

    rank: int
    entry: directory.ObjectEntry


@dataclass(frozen=True)
class _RankPlan:
    """``SavePlan.storage_data`` from the coordinator: what every rank must agree on."""

    save_id: str
    rank: int
    world_size: int
    path: str


@dataclass(frozen=True)
class StageStats(TimingViews):
    """What this rank's last staging cost (``ShmStageWriter.last_stage``): ``timings`` of
    the ``stage()`` call, whose ``stall_seconds`` is what the training thread paid;
    ``deferred_bytes``, what a guarded writer copied after ``stage()`` returned."""

    layout_id: int
    bytes: int
    timings: SaveTimings
    deferred_bytes: int = 0


@dataclass(frozen=True)
class _Publish:
    """What ``publish_next`` armed the next save with: its rank's part of version ``step``
    of channel ``name``."""

    name: str
    step: int
    metadata: Mapping[str, Any]
    share: tuple[int, ...]
    part: int
    parts: int
    within: float


def node_part(stager: Stager, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's part number among the ranks of ``group`` that share its daemon, and how
    many they are: one exchange of daemon instance ids (a collective: every rank calls it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    instance = stager.daemon_info["instance"]
    instances: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(instances, instance, group=group)
    rank = dist.get_rank(group)
    mine = [other for other, seen in enumerate(instances) if seen == instance]
    return mine.index(rank), len(mine)


def plan_local(state_dict: dict[str, Any]) -> tuple[DefaultSavePlanner, SavePlan]:
    """DCP's own flattening of one rank's state dict into write items (DefaultSavePlanner's:
    a DTensor's local shard with its offsets, a plain tensor whole), with its planner."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=False)
    return planner, planner.create_local_plan()


class _Collected:
    """One rank's items, resolved: tensors to stage, their shard offsets and global shapes,
    object payloads."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], Any]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, list[int]] = {}
        self.shapes: dict[str, list[int]] = {}
        self.objects: dict[str, bytes] = {}
        for item in items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                self.objects[fqn] = resolve(item).getvalue()
                continue
            chunk = item.tensor_data.chunk
            if fqn in self.tensors:
                raise UnsupportedValue(
                    f"{fqn!r} has several local shards on this rank (a ShardedTensor); a rank "
                    "file stores one shard per key — use DTensor (FSDP2) state dicts"
                )
            tensor = resolve(item).detach()
            if tuple(tensor.shape) != tuple(chunk.sizes):
                raise UnsupportedValue(
                    f"{fqn!r}: the local shard has shape {list(tensor.shape)} but DCP planned "
                    f"{list(chunk.sizes)}"
                )
            self.tensors[fqn] = tensor
            self.offsets[fqn] = [int(offset) for offset in chunk.offsets]
            self.shapes[fqn] = [int(size) for size in item.tensor_data.size]


class _Ticket:
    """One save's staged data, from ``stage`` until ``write_data`` takes it.

    A ticket is taken at most once. A newer ``stage`` supersedes a ticket nobody took (its
    save failed before ``write_data``, or the caller started a save before the previous one
    reached it) and hands its slot back, so a failed save never holds a slot for good.
    """

    def __init__(self) -> None:
        self.staged: Staged | None = None
        self.chunks: set[tuple[str, tuple[int, ...]]] = set()
        self.offsets: dict[str, list[int]] = {}
        self.objects: dict[str, bytes] = {}
        self.mappings: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.state = "staged"  # -> "taken" | "superseded"
        #: The part of a channel's version this save publishes (``publish_next``), and the
        #: global shape of each staged shard, for it.
        self.publish: _Publish | None = None
        self.shapes: dict[str, list[int]] = {}

    def fill(
        self, collected: _Collected, stager: Callable[[], Stager], *, block: bool = True
    ) -> None:
        self.offsets, self.objects = collected.offsets, collected.objects
        self.shapes = collected.shapes
        self.chunks = {(fqn, tuple(off)) for fqn, off in collected.offsets.items()}
        if collected.tensors:
            self.staged = stager().stage(
                collected.tensors, offsets=collected.offsets, block=block
            )

    def release(self) -> None:
        if self.staged is not None:
            self.staged.cancel()  # nothing to do once committed


class _Replay:
    """Stands in for one entry of the staged state dict: replays its planned write items."""

    __slots__ = ("items",)

    def __init__(self, items: list[WriteItem]) -> None:
        self.items = items

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return list(self.items)


class _TicketEntry:
    """Tells the writer, on the thread that plans this save, which staged data is its own."""

    __slots__ = ("ticket",)

    def __init__(self, ticket: _Ticket) -> None:
        self.ticket = ticket

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        _planning.ticket = self.ticket
        return []

    def __reduce__(self) -> Any:
        raise TypeError(PROCESS_MODE_REFUSED)


#: What one save knows on the thread running it (DCP runs a save's steps on one thread; with
#: async_save each save gets its own): ``ticket``, whose stand-ins this save planned (None for
#: dcp.save); ``path``, its destination; ``plan``, the coordinator's plan for ``finish``.
_planning = threading.local()


class ShmStageWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` and ``AsyncStager`` writing through the node's shmstaged.

    ``path``: the checkpoint directory (or pass ``checkpoint_id=`` to each save); it must not
    exist yet, or be empty. ``socket``: this node's daemon (default: ``$SHMSTAGE_SOCKET`` or
    the system socket). ``slots``, ``pin``, ``slot_timeout``, ``request_timeout``: as for
    ``Stager``. ``timeout``: how long ``write_data`` waits for this rank's file to be durable.

    ``guard``: an optimizer (or several) whose parameters and state ``async_save`` may copy
    behind the next forward and backward (``Stager.guard``): their ``step()`` waits for the
    copy. ``async_save`` then returns DCP's ``AsyncSaveResponse``: ``staging_completion``
    is done when the copy has landed (no need to wait for it: the guard does),
    ``upload_completion`` when the checkpoint is published — wait for that one before the
    next save, where a plain ``async_save`` returns that future alone.

    Keep one writer for the whole run — its layout (and so its shared memory) is reused by
    every save with the same structure — and wait for each ``async_save`` future before the
    next one. Connects on first use, so it can be made before the daemon is reachable.
    """

    # stage() returns after the copy, or a future of it (guard=): nothing to wait for.
    _synchronize_after_execute = False

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        socket: str | os.PathLike[str] | None = None,
        *,
        slots: int | None = None,
        pin: bool | str = "auto",
        slot_timeout: float | None = None,
        request_timeout: float = 600.0,
        timeout: float = 3600.0,
        guard: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(guard, torch.optim.Optimizer):
            guard = [guard]
        self._guarded = tuple(guard or ())
        self.path = None if path is None else Path(path)
        self.socket = socket
        self.timeout = timeout
        self._stager_options: dict[str, Any] = {
            "slots": slots,
            "pin": pin,
            "slot_timeout": slot_timeout,
            "request_timeout": request_timeout,
        }
        self._stager: Stager | None = None
        self._lock = threading.Lock()
        self._unclaimed: list[_Ticket] = []
        self.rank = 0
        self.is_coordinator = False
        self.last_stage: StageStats | None = None
        self.last_result: SaveResult | None = None
        #: What this rank's part of the last save armed by ``publish_next`` did.
        self.last_published: Published | None = None
        #: The next save's part (``publish_next``), and this rank's part number among the
        #: ranks on its daemon and their count, agreed at the first ``publish_next``.
        self._publish_next: _Publish | None = None
        self._node_part: tuple[int, int] | None = None

    def __reduce__(self) -> Any:
        raise TypeError(PROCESS_MODE_REFUSED)

    # -- lifecycle --------------------------------------------------------------------

    def _get_stager(self) -> Stager:
        with self._lock:
            if self._stager is None:
                self._stager = Stager(self.socket, **self._stager_options)
                if self._guarded:
                    self._stager.guard(*self._guarded)
            return self._stager

    def close(self) -> None:
        """Hand back slots no save claimed, wait (bounded) for writes, disconnect."""
        with self._lock:
            unclaimed, self._unclaimed = self._unclaimed, []
            stager, self._stager = self._stager, None
        for ticket in unclaimed:
            ticket.release()
        if stager is not None:
            stager.close()

    # -- publishing -------------------------------------------------------------------

    def publish_next(
        self,
        name: str,
        *,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        share: Sequence[int | str] = (),
        within: float = 60.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Make the next save through this writer (``async_save``'s ``stage`` or
        ``dcp.save``) also version ``step`` of channel ``name``, as ``ShmStagePublisher``
        would publish it: right after each rank's commit, its staged slot — the bytes
        going to its file, not a second copy — becomes its part of the version, visible
        to subscribers once every rank of the node published its part (within ``within``
        seconds of the first, or that step is dropped). The checkpoint is the same as
        without it.

        Call it on every rank before the save, with the same ``step`` (it must grow from
        one version to the next); ``metadata``: JSON values readers get with the version
        (part 0's); ``share``: as for ``ShmStagePublisher``. The first call agrees each
        rank's part number over ``process_group`` (a collective: not while a save of this
        writer is in flight). A refused publish fails that save on every rank, as any
        failure of ``write_data`` does; ``last_published`` says what the rank's part did.
        """
        check_step(step)
        gids = tuple(share_gids(share))
        if self._node_part is None:
            self._node_part = node_part(self._get_stager(), process_group)
        part, parts = self._node_part
        with self._lock:
            self._publish_next = _Publish(
                name, step, dict(metadata or {}), gids, part, parts, within
            )

    def _take_publish(self) -> _Publish | None:
        with self._lock:
            armed, self._publish_next = self._publish_next, None
        return armed

    def _publish_part(self, ticket: _Ticket, staged: Staged, handle: SaveHandle) -> None:
        """Publish the slot that ``handle``'s commit just handed to the daemon as this
        rank's part of the armed version (see ``publish_next``)."""
        armed = ticket.publish
        assert armed is not None and handle.job is not None
        part = Part(armed.part, armed.parts, ticket.shapes, armed.within)
        self.last_published = None
        subscribers, visible = publish_saved(
            staged.connection, staged.layout_id, staged.slot, handle.job, armed.name,
            armed.step, armed.share, staged.request_timeout, part=part,
            metadata=armed.metadata,
        )  # fmt: skip
        self.last_published = Published(
            armed.name, armed.step, subscribers, staged.timings, complete=visible
        )

    # -- AsyncStager --------------------------------------------------------------------

    def stage(
        self, state_dict: dict[str, Any]
    ) -> dict[str, Any] | concurrent.futures.Future[dict[str, Any]]:
        """Copy this rank's shards into the daemon's shared memory; the training stall.

        With ``guard=``, returns a future of the staged state dict, done once the copy has
        landed (``async_save`` hands it to its checkpoint thread). Failures are not raised
        here, nor through that future, but by this save's planning step on every rank (see
        the module docstring); ``async_save``'s future reports them.
        """
        ticket = _Ticket()
        ticket.publish = self._take_publish()
        staged_dict: dict[str, Any] = {_TICKET_KEY: _TicketEntry(ticket)}
        try:
            self._supersede_unclaimed()  # a failed earlier save must not keep its slot
            planner, plan = plan_local(state_dict)
            ticket.mappings = dict(planner.mappings)
            for item in plan.items:
                replay = staged_dict.setdefault(item.index.fqn, _Replay([]))
                replay.items.append(item)
            collected = _Collected(plan.items, planner.resolve_data)
            ticket.fill(collected, self._get_stager, block=not self._guarded)
            self._record_stage(ticket.staged)
        except Exception as exc:
            log.warning("shmstage: staging failed on rank %d: %s", self.rank, exc)
            ticket.error = exc
            ticket.release()
        with self._lock:
            self._unclaimed.append(ticket)
        if not self._guarded:
            return staged_dict
        staging: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        landing = ticket.staged.landing if ticket.staged is not None else None
        if landing is None:
            staging.set_result(staged_dict)
        else:
            def landed(_: object) -> None:
                self._record_stage(ticket.staged)  # now with the deferred copy's figures
                staging.set_result(staged_dict)  # a failed copy fails write_data, on every rank

            landing.done.add_done_callback(landed)
        return staging

    def synchronize_staging(self) -> None:
        """Wait until the last ``stage`` has copied everything (bounded by the Stager's
        ``request_timeout``); ``async_save`` never calls it for this writer."""
        with self._lock:
            tickets = list(self._unclaimed)
        for ticket in tickets:
            if ticket.staged is not None and ticket.staged.landing is not None:
                ticket.staged.landing.settled(ticket.staged.request_timeout)

    def _supersede_unclaimed(self) -> None:
        with self._lock:
            stale, self._unclaimed = self._unclaimed, []
            for ticket in stale:
                ticket.state = "superseded"
        for ticket in stale:
            if ticket.staged is not None and ticket.staged.open:
                log.warning(
                    "shmstage: a staged save never reached write_data (it failed, or a new "
                    "save started first); its slot is handed back"
                )
            ticket.release()

    def _claim(self) -> _Ticket | None:
        """This save's ticket, if ``stage`` made one; raises if a newer save took its slot."""
        ticket: _Ticket | None = getattr(_planning, "ticket", None)
        if ticket is None:
            return None
        with self._lock:
            if ticket.state == "superseded":
                raise SaveError(
                    "this save's staged data was handed back because a newer async_save "
                    "started before this one reached write_data; wait for each async_save's "
                    "future before starting the next"
                )
            ticket.state = "taken"
            if ticket in self._unclaimed:
                self._unclaimed.remove(ticket)
        return ticket

    def _record_stage(self, staged: Staged | None) -> None:
        if staged is not None:
            deferred = staged.landing.copy.nbytes if staged.landing is not None else 0
            self.last_stage = StageStats(
                staged.layout_id, staged.nbytes, staged.timings, deferred
            )

    # -- StorageWriter ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
            _planning.reset_path = self.path  # this thread's save goes there, whatever
            # another save's thread sets meanwhile

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise SaveError(
                "ShmStageWriter needs use_collectives=True: the checkpoint is published only "
                "once every rank reports its file durable"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))
        _planning.ticket = None  # set again while the planner walks the staged state dict
        _planning.path = getattr(_planning, "reset_path", None) or self.path
        _planning.reset_path = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.path is None else str(self.path))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        ticket: _Ticket | None = getattr(_planning, "ticket", None)
        if ticket is None:
            return plan
        if ticket.error is not None:
            raise ticket.error
        if isinstance(plan.planner_data, dict) and ticket.mappings is not None:
            # The planner saw the flat stand-ins; give DCP the original nesting back.
            keys = {item.index.fqn for item in plan.items}
            paths = {fqn: path for fqn, path in ticket.mappings.items() if fqn in keys}
            plan = dataclasses.replace(plan, planner_data=paths)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        path: Path | None = getattr(_planning, "path", None) or self.path
        if path is None:
            raise SaveError(
                "ShmStageWriter has no checkpoint directory: pass path= or checkpoint_id="
            )
        if directory.occupied(path):
            raise CheckpointExists(
                f"{path} already exists and is not empty: shmstage never overwrites a "
                "checkpoint; save to a new directory"
            )
        save_id = secrets.token_hex(8)
        plans = [
            dataclasses.replace(plan, storage_data=_RankPlan(save_id, rank, len(plans), str(path)))
            for rank, plan in enumerate(plans)
        ]
        _planning.plan = plans[0].storage_data
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Commit this rank's file and objects; returns once both are durable."""
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise SaveError("the save plan did not come from ShmStageWriter.prepare_global_plan")
        ticket = self._claim()
        try:
            if ticket is None:  # dcp.save: nothing was staged before planning
                ticket = _Ticket()
                ticket.publish = self._take_publish()
                ticket.fill(_Collected(plan.items, planner.resolve_data), self._get_stager)
                self._record_stage(ticket.staged)
            results = self._write_rank(ticket, plan.items, info)
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_rank(
        self, ticket: _Ticket, items: list[WriteItem], info: _RankPlan
    ) -> list[WriteResult]:
        chunks = [item for item in items if item.type != WriteItemType.BYTE_IO]
        objects = [item for item in items if item.type == WriteItemType.BYTE_IO]
        unstaged = [
            item.index.fqn
            for item in chunks
            if (item.index.fqn, tuple(int(o) for o in item.tensor_data.chunk.offsets))
            not in ticket.chunks
        ]
        unstaged += [item.index.fqn for item in objects if item.index.fqn not in ticket.objects]
        if unstaged:
            raise SaveError(
                f"DCP planned items this rank did not stage: {unstaged[:5]}; ShmStageWriter "
                "stages with DefaultSavePlanner's flattening — a planner that renames or adds "
                "items cannot be used with async_save"
            )
        if ticket.publish is not None and not (chunks and ticket.staged is not None):
            raise SaveError(
                f"rank {info.rank} cannot publish its part of version {ticket.publish.step} "
                f"of channel {ticket.publish.name!r}: DCP gave every tensor it holds to other "
                "ranks' files, so it commits no slot to publish; publish this state with "
                "ShmStagePublisher instead"
            )
        pending = directory.pending_dir(Path(info.path), info.save_id)
        pending.mkdir(parents=True, exist_ok=True)
        stem = directory.rank_stem(info.rank, info.world_size)
        handle = None
        published: BaseException | None = None
        if chunks and ticket.staged is not None:
            handle = ticket.staged.commit(
                directory.rank_dir(pending, info.rank),
                data_file=stem + directory.DATA_SUFFIX,
                file_metadata=directory.sharding_header(ticket.offsets),
                metadata={"dcp": {"save_id": info.save_id, "rank": info.rank}},
            )
            if ticket.publish is not None:
                try:  # while the daemon writes the file: readers need not wait for it
                    self._publish_part(ticket, ticket.staged, handle)
                except Exception as exc:  # raised once the file is durable (below)
                    published = exc
        else:
            ticket.release()  # every local tensor was deduplicated to other ranks
        results = []
        if objects:
            entries = directory.write_objects(
                pending / (stem + directory.OBJECTS_SUFFIX),
                [ticket.objects[item.index.fqn] for item in objects],
            )
            results += [
                WriteResult(item.index, entry.length, ObjectLocation(info.rank, entry))
                for item, entry in zip(objects, entries, strict=True)
            ]
        if handle is not None:
            self.last_result = handle.wait(self.timeout)
            location = ChunkLocation(info.rank, stem + directory.DATA_SUFFIX)
            results += [WriteResult(item.index, _nbytes(item), location) for item in chunks]
        if published is not None:
            raise published
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish: called by DCP on the coordinator only after every rank wrote durably."""
        info: _RankPlan = _planning.plan
        directory.publish(
            Path(info.path),
            directory.pending_dir(Path(info.path), info.save_id),
            _marker(metadata, results, info),
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id)


def _nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize


def _marker(
    metadata: Metadata, results: list[list[WriteResult]], info: _RankPlan
) -> directory.Marker:
    """The commit marker: every chunk and object DCP planned, and the file holding it."""
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    data_files: dict[int, str] = {}
    object_files: dict[int, str] = {}
    for rank_results in results:
        for result in rank_results:
            location = result.storage_data
            offset = result.index.offset
            where[(result.index.fqn, None if offset is None else tuple(offset))] = location
            if isinstance(location, ChunkLocation):
                data_files[location.rank] = location.file
            else:
                object_files[location.rank] = location.entry.file
    tensors: dict[str, directory.TensorEntry] = {}
    objects: dict[str, directory.ObjectEntry] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = []
            for chunk in entry.chunks:
                offsets = tuple(int(o) for o in chunk.offsets)
                location = _located(where, fqn, offsets)
                chunks.append(
                    directory.Chunk(offsets, tuple(int(s) for s in chunk.sizes), location.file)
                )
            dtype = str(entry.properties.dtype).removeprefix("torch.")
            tensors[fqn] = directory.TensorEntry(dtype, tuple(entry.size), tuple(chunks))
        else:
            objects[fqn] = _located(where, fqn, None).entry
    ranks = tuple(
        directory.RankFiles(rank, data_files.get(rank), object_files.get(rank))
        for rank in sorted(data_files.keys() | object_files.keys())
    )
    return directory.Marker(
        info.save_id,
        info.world_size,
        ranks,
        tensors,
        objects,
        directory.plain_paths(metadata.planner_data, metadata.state_dict_metadata),
    )


def _located(where: Mapping[Any, Any], fqn: str, offsets: tuple[int, ...] | None) -> Any:
    try:
        return where[(fqn, offsets)]
    except KeyError:
        raise SaveError(
            f"no rank reported writing {fqn!r}" + ("" if offsets is None else f" at {offsets}")
        ) from None

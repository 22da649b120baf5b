"""``Stager``: save a state dict through shmstaged; ``SaveHandle``: follow it to disk.

``save()`` blocks only while tensors are copied into shared memory. It then commits the slot
to the daemon, which owns the data from that moment: the trainer may modify or free its
tensors, or even exit, and the checkpoint still completes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shmstage import names, tree
from shmstage.datafile import SUFFIX
from shmstage.layout import Layout, LayoutError, TensorSpec
from shmstage.manifest import MANIFEST_NAME
from shmstage_client.connection import DaemonConnection, RequestHandle
from shmstage_client.dtypes import safetensors_name, supported
from shmstage_client.errors import (
    CheckpointExists,
    DaemonLost,
    PersistError,
    SaveError,
    SaveTimeout,
    UnsupportedValue,
)
from shmstage_client.staging import CopyEngine, MappedLayout, device_groups

log = logging.getLogger("shmstage.client")

DEFAULT_DATA_FILE = "model.safetensors"


@dataclass(frozen=True)
class SaveResult:
    """What a finished save cost. ``stage_seconds`` is the training stall for the copy;
    ``slot_wait_seconds`` and ``setup_seconds`` (first save of a structure) are separate."""

    path: Path
    bytes: int
    stage_seconds: float
    slot_wait_seconds: float
    setup_seconds: float
    persist_seconds: float
    files: tuple[str, ...]


@dataclass(frozen=True)
class SaveEvent:
    """What ``Stager(progress=...)`` is told: a save was staged, became durable, or failed.

    ``phase`` is "staged" (``save()`` is returning; training may go on), "durable" (with
    ``result``) or "failed" (with ``error``).
    """

    path: Path
    phase: str
    stage_seconds: float
    slot_wait_seconds: float
    result: SaveResult | None = None
    error: SaveError | None = None


ProgressCallback = Callable[[SaveEvent], None]


class SaveHandle:
    """A committed save being written by the daemon.

    Its outcome is settled once, when the daemon's answer (or the loss of the daemon)
    arrives: that is when the save's log line is written and the progress callback runs,
    whether or not anybody calls ``wait()``.
    """

    def __init__(
        self,
        stager: Stager,
        job: int,
        path: Path,
        future: concurrent.futures.Future,
        stage: float,
        slot_wait: float,
        setup: float,
    ) -> None:
        self._stager = stager
        # Job ids are per connection: forget this one on the connection that knows it,
        # not on a newer one the Stager made after a daemon restart.
        self._connection = stager._connection
        self.job = job
        self.path = path
        self._future = future
        self._stage, self._slot_wait, self._setup = stage, slot_wait, setup
        self._result: SaveResult | None = None
        self._error: SaveError | None = None
        self._settled = threading.Event()
        stager._notify(SaveEvent(path, "staged", stage, slot_wait))
        future.add_done_callback(self._settle)

    def done(self) -> bool:
        return self._settled.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the checkpoint is durable (or failed); raises a SaveError subclass."""
        if not self._settled.wait(timeout):
            raise SaveTimeout(
                f"checkpoint {self.path} was not durable within {timeout} s; it is still "
                "being written (call wait() again)"
            )
        self._stager._forget(self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _settle(self, future: concurrent.futures.Future) -> None:
        """Runs once, in the connection's reader thread (or here, if already done)."""
        try:
            message = future.result()
            result = message["result"]
            if not message["ok"]:
                raise PersistError(result.get("code", "?"), result.get("message", "unknown"))
            self._result = SaveResult(
                path=self.path,
                bytes=int(result["bytes"]),
                stage_seconds=self._stage,
                slot_wait_seconds=self._slot_wait,
                setup_seconds=self._setup,
                persist_seconds=float(result["persist_seconds"]),
                files=tuple(result["files"]),
            )
        except DaemonLost as exc:
            self._error = DaemonLost(
                f"checkpoint {self.path} has no confirmed result: {exc}. It may be incomplete "
                "(`shmstage ls` shows it as partial); this Stager reconnects on its next save"
            )
        except SaveError as exc:
            self._error = exc
        except Exception as exc:  # a malformed answer must still settle the handle
            self._error = SaveError(f"checkpoint {self.path}: unexpected answer: {exc!r}")
        if self._result is not None:
            r = self._result
            log.info(
                "shmstage save %s: %s durable; stage %.3f s (%.2f GB/s), slot wait %.3f s, "
                "setup %.3f s, persist %.3f s (%.2f GB/s)",
                self.path,
                _gib(r.bytes),
                r.stage_seconds,
                _gbps(r.bytes, r.stage_seconds),
                r.slot_wait_seconds,
                r.setup_seconds,
                r.persist_seconds,
                _gbps(r.bytes, r.persist_seconds),
            )
            event = SaveEvent(self.path, "durable", self._stage, self._slot_wait, result=r)
        else:
            log.warning("shmstage save %s failed: %s", self.path, self._error)
            event = SaveEvent(self.path, "failed", self._stage, self._slot_wait, error=self._error)
        self._stager._notify(event)  # before wait() returns: events arrive in order
        self._settled.set()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


class Stager:
    """A trainer's connection to shmstaged, and the staging layouts it registered.

    ``slots``: staging buffers per layout; with 2, a save can fill one while the previous
    checkpoint still streams from the other. ``wait_for_slot``: when every slot is busy,
    wait (True, the default) or raise SlotUnavailable at once. ``pin``: page-lock the
    segments for CUDA when a layout is registered — "auto" does so when the state dict
    holds CUDA tensors. ``slots=None`` takes the daemon's ``default_slots``.
    ``progress``: called with a SaveEvent when a save is staged, durable or failed; the
    last two come from the connection's reader thread, so keep it quick and do not call
    the Stager from it. Not thread-safe: one Stager per training process.

    If shmstaged restarts, saves in flight fail with DaemonLost naming the checkpoint, and
    the next ``save()`` reconnects and registers its layout again by itself.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        slots: int | None = None,
        wait_for_slot: bool = True,
        slot_timeout: float | None = None,
        request_timeout: float = 600.0,
        data_file: str = DEFAULT_DATA_FILE,
        pin: bool | str = "auto",
        progress: ProgressCallback | None = None,
    ) -> None:
        if pin not in (True, False, "auto"):
            raise ValueError(f"pin={pin!r}: use True, False or 'auto'")
        self.pin = pin
        self._copier = CopyEngine()
        check_data_file(data_file)
        self.slots = slots
        self.wait_for_slot = wait_for_slot
        self.slot_timeout = slot_timeout
        self.request_timeout = request_timeout
        self.data_file = data_file
        self._connection = DaemonConnection(
            socket, client_name=f"shmstage-client pid {os.getpid()}"
        )
        self._layout: MappedLayout | None = None
        self._pending: set[SaveHandle] = set()
        self._lock = threading.Lock()
        self._progress = progress

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = 600.0) -> None:
        """Wait (bounded) for saves still being written, then release everything."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in list(self._pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(remaining)
            except SaveError as exc:
                log.warning("save %s did not complete: %s", handle.path, exc)
        if self._layout is not None and self._connection.alive:
            with contextlib.suppress(SaveError):
                self._connection.call("release", {"layout": self._layout.id}, timeout=30)
        if self._layout is not None:
            self._layout.close()
            self._layout = None
        self._connection.close()

    @property
    def daemon_info(self) -> Mapping[str, Any]:
        return self._connection.welcome

    # -- saving ------------------------------------------------------------------

    def save(
        self,
        state_dict: Any,
        path: str | os.PathLike[str],
        *,
        metadata: Mapping[str, Any] | None = None,
        offsets: Mapping[str, Sequence[int]] | None = None,
    ) -> SaveHandle:
        """Stage ``state_dict`` and commit it to be written to the new directory ``path``.

        Returns once every tensor is copied: the caller may then change its tensors. The
        daemon then writes the checkpoint; ``SaveHandle.wait()`` reports the outcome.
        ``metadata``: JSON values stored in the manifest (step, run id, ...). ``offsets``:
        for tensors that are shards of a larger one, flat key -> offset of the shard in the
        global tensor; part of the structure, so a changed offset never reuses buffers.

        The same as ``stage(...).commit(path, metadata=...)``, except that the destination
        is checked and opened before the copy, so a refused destination costs no copy, and
        the commit travels while the copy runs: the daemon checks and journals it
        meanwhile, and starts nothing until the client reports the copy complete.
        """
        with _collection_paused():
            prepared = _Prepared.of(state_dict, offsets)
            prepared.check(self._layout)  # refuse bad tensors before touching ``path``
            destination = _Destination.create(path, self.data_file, None, metadata)
            try:
                staged = self._claim(prepared)
            except BaseException:
                destination.abort()
                raise
            early = staged._send_commit(destination, ready=False)
            try:
                self._copy(staged, prepared, early)
            except BaseException:
                destination.abort()
                raise
            return staged._complete(destination, early)

    def stage(
        self, state_dict: Any, *, offsets: Mapping[str, Sequence[int]] | None = None
    ) -> Staged:
        """Copy ``state_dict`` into a staging slot now; name its destination later.

        Why two phases: some callers learn where a save goes only after the copy that
        stalls training — PyTorch DCP stages first and plans each rank's file afterwards.
        Returns once every tensor is copied, as ``save()`` does; the slot then stays this
        client's until ``Staged.commit()`` or ``Staged.cancel()``. ``offsets`` as in
        ``save()``.
        """
        with _collection_paused():
            prepared = _Prepared.of(state_dict, offsets)
            staged = self._claim(prepared)
            self._copy(staged, prepared, None)
            return staged

    def _claim(self, prepared: _Prepared) -> Staged:
        """Reuse or register the layout and take a slot: the stall before the copy."""
        started = time.perf_counter()
        mapped = self._mapped(prepared)
        setup = time.perf_counter() - started
        slot, slot_wait = self._acquire(mapped)
        return Staged(self, mapped, slot, prepared.encoded, slot_wait, setup)

    def _copy(self, staged: Staged, prepared: _Prepared, early: RequestHandle | None) -> None:
        """Copy into the staged slot; on failure hand it back, with the commit sent ahead of
        the copy (``early``) if there is one."""
        mapped = staged.mapped
        copy_started = time.perf_counter()
        try:
            sources = [tensor for _, tensor in prepared.items]
            self._copier.copy(mapped.slots[staged.slot], sources, mapped.groups)
        except BaseException:
            staged._abandon(early)
            raise
        staged.stage_seconds = time.perf_counter() - copy_started

    def _track(self, handle: SaveHandle) -> None:
        with self._lock:
            self._pending.add(handle)

    def _forget(self, handle: SaveHandle) -> None:
        with self._lock:
            self._pending.discard(handle)
        handle._connection.forget_job(handle.job)

    def _notify(self, event: SaveEvent) -> None:
        if self._progress is None:
            return
        try:
            self._progress(event)
        except Exception:  # a broken callback must not fail the save or kill the reader
            log.exception("shmstage progress callback raised; ignored")

    def _reconnect_if_lost(self) -> None:
        """After a daemon restart: a new connection, and no layout (the next save registers).

        Saves that were in flight on the old connection already failed with DaemonLost; the
        old daemon's segments are unmapped here and were reaped by the new daemon.
        """
        if self._connection.alive:
            return
        log.warning("shmstaged connection was lost; reconnecting to %s", self._connection.path)
        if self._layout is not None:
            self._layout.close()
            self._layout = None
        self._connection.close()
        self._connection = DaemonConnection(
            self._connection.path, client_name=f"shmstage-client pid {os.getpid()}"
        )

    def _wants_pin(self, items: list[tuple[str, torch.Tensor]]) -> bool:
        if self.pin == "auto":
            return any(tensor.device.type == "cuda" for _, tensor in items)
        return bool(self.pin)

    @property
    def pinned(self) -> bool:
        """Whether the current layout's segments are registered with CUDA."""
        return self._layout is not None and self._layout.pinned is not None

    def _mapped(self, prepared: _Prepared) -> MappedLayout:
        """Reuse the registered layout when the structure is identical, else replace it.

        The steady-state check compares the tensors' own properties with those the layout
        was built from, so an unchanged structure costs neither a new Layout nor its
        validation (milliseconds at 10,000 tensors).
        """
        self._reconnect_if_lost()
        current = self._layout
        if current is not None and current.signature == prepared.signature:
            return current
        layout = prepared.layout()
        if current is None or current.layout != layout:
            current = self._register(layout, self._wants_pin(prepared.items))
            self._layout = current
        current.signature = prepared.signature
        current.groups = device_groups([tensor.device for _, tensor in prepared.items])
        return current

    def _register(self, layout: Layout, pin: bool) -> MappedLayout:
        """Release the old layout, register ``layout`` and map its segments."""
        if self._layout is not None:
            old, self._layout = self._layout, None
            self._connection.call("release", {"layout": old.id}, timeout=self.request_timeout)
            old.close()
        request: dict[str, Any] = {"tensors": layout.to_wire()}
        if self.slots is not None:
            request["slots"] = self.slots
        handle = self._connection.start("register", request)
        mapped: MappedLayout | None = None
        try:
            reply = handle.next(self.request_timeout)
            mapped = MappedLayout.receiving(reply.body["layout"], layout, reply.body["slots"])
            if reply.body["segments"] != mapped.expected_segments:
                raise DaemonLost(
                    f"daemon announced {reply.body['segments']} segments for "
                    f"{mapped.expected_segments} tensors x slots"
                )
            while mapped.received_segments < mapped.expected_segments:
                frame = handle.next(self.request_timeout)
                if frame.op != "segment_fds" or frame.body["first"] != mapped.received_segments:
                    for fd in frame.fds:
                        os.close(fd)
                    raise DaemonLost(f"unexpected {frame.op} while receiving segments")
                mapped.add_segments(frame.fds)  # map and close each batch as it arrives
            mapped.complete(pin=pin)
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        finally:
            handle.finish()
        return mapped

    def _acquire(self, mapped: MappedLayout) -> tuple[int, float]:
        started = time.perf_counter()
        reply = self._connection.call(
            "acquire",
            {"layout": mapped.id, "wait": self.wait_for_slot, "timeout": self.slot_timeout},
            timeout=None if self.slot_timeout is None else self.slot_timeout + 30,
        )
        return reply.body["slot"], time.perf_counter() - started


class Staged:
    """A filled slot waiting for its destination (``Stager.stage``).

    ``commit()`` hands it to the daemon to write; ``cancel()`` hands it back unwritten.
    Exactly one of them happens, once. Until then the slot is this client's, and later
    saves needing it wait — so resolve every Staged (as a context manager, leaving it
    uncommitted cancels). ``commit()`` may run on another thread than ``stage()`` did (DCP
    commits from its checkpoint thread), never concurrently with another call on it.
    """

    def __init__(
        self,
        stager: Stager,
        mapped: MappedLayout,
        slot: int,
        encoded: Any,
        slot_wait: float,
        setup: float,
    ) -> None:
        self._stager = stager
        self._connection = stager._connection  # the daemon gave the slot to this session
        self.mapped = mapped
        self.layout_id = mapped.id
        self.slot = slot
        self.nbytes = mapped.layout.nbytes
        self._encoded = encoded
        self.stage_seconds = 0.0
        self.slot_wait_seconds = slot_wait
        self.setup_seconds = setup
        self._lock = threading.Lock()
        self._state = "staged"  # -> "committing" -> "committed" | "cancelled"

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    @property
    def open(self) -> bool:
        """Neither committed nor cancelled yet."""
        return self._state == "staged"

    def commit(
        self,
        path: str | os.PathLike[str],
        *,
        data_file: str | None = None,
        file_metadata: Mapping[str, str] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Have the daemon write the staged tensors to the new directory ``path``.

        ``data_file``: the data file's name (default: the Stager's ``data_file``).
        ``file_metadata``: strings for the safetensors header's ``__metadata__`` (default
        ``{"format": "pt"}``). ``metadata``: JSON values kept in the manifest. If the
        destination or the commit is refused, the slot is handed back and this raises.
        """
        try:
            destination = _Destination.create(
                path, data_file or self._stager.data_file, file_metadata, metadata
            )
        except BaseException:
            self.cancel()
            raise
        return self._commit(destination)

    def cancel(self) -> None:
        """Hand the slot back unwritten; nothing to do once committed or cancelled."""
        with self._lock:
            if self._state != "staged":
                return
            self._state = "cancelled"
        self._hand_back()

    def _commit(self, destination: _Destination) -> SaveHandle:
        return self._complete(destination, self._send_commit(destination, ready=True))

    def _timings(self) -> dict[str, float]:
        return {"stage_seconds": self.stage_seconds, "slot_wait_seconds": self.slot_wait_seconds}

    def _send_commit(self, destination: _Destination, *, ready: bool) -> RequestHandle:
        """Send the commit; ``ready=False`` before the copy is complete (see ``save``)."""
        with self._lock:
            if self._state != "staged":
                destination.abort()
                raise SaveError(f"this staged save was already {self._state}; stage again")
            self._state = "committing"
        target = destination.target
        body = {
            "layout": self.layout_id,
            "slot": self.slot,
            "data_file": destination.data_file,
            "data_tmp": target.data_tmp,
            "manifest_tmp": target.manifest_tmp,
            "tree": self._encoded,
            "metadata": destination.metadata,
            "file_metadata": destination.file_metadata,
            **(self._timings() if ready else {"ready": False}),
        }
        try:
            return self._connection.start("commit", body, target.fds())
        except BaseException:
            self._give_up(destination)
            raise

    def _complete(self, destination: _Destination, request: RequestHandle) -> SaveHandle:
        """Wait for the commit's answer; after a prepared one, report the copy complete.

        Whatever fails, the temporary files go and the slot is handed back (the daemon
        drops a prepared commit with it), then this raises.
        """
        timeout = self._stager.request_timeout
        try:
            try:
                reply = request.next(timeout)
            finally:
                request.finish()
            if reply.op == "prepared":
                ready = {"layout": self.layout_id, "slot": self.slot, "job": reply.body["job"]}
                reply = self._connection.call(
                    "ready", {**ready, **self._timings()}, timeout=timeout
                )
        except BaseException as exc:
            self._give_up(destination)
            if isinstance(exc, SaveError) and "unknown fields ['ready']" in str(exc):
                raise SaveError(
                    f"shmstaged at {self._connection.path} is older than this client (it "
                    "lacks the two-step commit); upgrade shmstaged to the client's version"
                ) from exc
            raise
        finally:
            destination.close_fds()
        self._state = "committed"
        job = reply.body["job"]
        handle = SaveHandle(
            self._stager,
            job,
            destination.target.path,
            self._connection.job_future(job),
            self.stage_seconds,
            self.slot_wait_seconds,
            self.setup_seconds,
        )
        self._stager._track(handle)
        return handle

    def _give_up(self, destination: _Destination) -> None:
        """The commit will not happen: remove its temporary files, hand the slot back (the
        daemon refused or never saw the commit, or drops the prepared one with it)."""
        destination.abort()  # also closes its descriptors
        self._state = "cancelled"
        self._hand_back()

    def _abandon(self, early: RequestHandle | None) -> None:
        """The copy failed: hand the slot back, dropping a commit sent ahead of it."""
        if early is None:
            self.cancel()
            return
        with contextlib.suppress(SaveError):
            early.next(30)  # "prepared" or a refusal: either way the slot is ours
        early.finish()
        self._state = "cancelled"
        self._hand_back()

    def _hand_back(self) -> None:
        try:
            self._connection.call(
                "cancel", {"layout": self.layout_id, "slot": self.slot}, timeout=30
            )
        except SaveError as exc:
            log.warning("could not hand slot %d back to shmstaged: %s", self.slot, exc)


@dataclass
class _Prepared:
    """A state dict flattened, before anything touches the daemon.

    ``signature`` is every tensor property the layout depends on, and the device, read
    straight from the tensors; equal signatures mean an equal (already validated) layout
    and the same copy plan.
    """

    encoded: Any
    items: list[tuple[str, torch.Tensor]]
    offsets: dict[str, tuple[int, ...]]
    signature: list[tuple[Any, ...]]
    _layout: Layout | None = None

    @classmethod
    def of(cls, state_dict: Any, offsets: Mapping[str, Sequence[int]] | None) -> _Prepared:
        encoded, items = _flatten(state_dict)
        shards = {key: tuple(shard) for key, shard in (offsets or {}).items()}
        unknown = shards.keys() - {key for key, _ in items} if shards else ()
        if unknown:
            raise UnsupportedValue(
                f"offsets given for keys not in the state dict: {sorted(unknown)}"
            )
        shard = shards.get
        signature = [
            (key, type(t), t.dtype, t.shape, t.layout, t.device, shard(key)) for key, t in items
        ]
        return cls(encoded, items, shards, signature)

    def layout(self) -> Layout:
        """The validated layout (only needed when the signature is new)."""
        if self._layout is None:
            self._layout = _layout_of(self.items, self.offsets)
        return self._layout

    def check(self, current: MappedLayout | None) -> None:
        """Raise UnsupportedValue now unless the tensors match the ``current`` layout."""
        if current is None or current.signature != self.signature:
            self.layout()


@dataclass
class _Destination:
    """Everything a commit names, checked, with its directory and files already opened."""

    target: _Target
    data_file: str
    file_metadata: dict[str, str]
    metadata: dict[str, Any]

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        data_file: str,
        file_metadata: Mapping[str, str] | None,
        metadata: Mapping[str, Any] | None,
    ) -> _Destination:
        data_file = check_data_file(data_file)
        header = _check_file_metadata(file_metadata)
        plain = _check_metadata(metadata)
        return cls(_Target.create(Path(path), data_file), data_file, header, plain)

    def abort(self) -> None:
        """Remove the temporary files and close everything: this commit will not happen."""
        self.target.abort()
        self.target.close_fds()

    def close_fds(self) -> None:
        self.target.close_fds()


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector for the duration of a save.

    A 10,000-tensor save allocates tens of thousands of short-lived containers (the
    encoded tree, the copy lists); with the collector on they trip full collections,
    each a traversal of every object in a torch process (~100 ms measured), inside the
    training stall. They are acyclic and freed by reference counting when the save
    returns, so pausing loses nothing; a collector the caller disabled stays disabled.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_data_file(name: str) -> str:
    """A data file name the daemon will accept: a plain name ending in ``.safetensors``."""
    names.check_plain_name(name, what="data file")
    if not name.endswith(SUFFIX):
        raise ValueError(f"data_file {name!r} must end in {SUFFIX}")
    return name


def _flatten(state_dict: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    try:
        return tree.flatten(state_dict, lambda value: isinstance(value, torch.Tensor))
    except tree.TreeError as exc:
        raise UnsupportedValue(f"{exc}; nothing was written") from None


def _layout_of(
    items: list[tuple[str, torch.Tensor]], offsets: Mapping[str, tuple[int, ...]]
) -> Layout:
    specs = []
    for key, tensor in items:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise UnsupportedValue(
                f"tensor {key!r} is a {type(tensor).__name__}; plain tensors only (for DTensor "
                "use shmstage_client.dcp); nothing was written"
            )
        if (
            tensor.layout is not torch.strided
            or tensor.is_quantized
            or tensor.device.type == "meta"
        ):
            raise UnsupportedValue(
                f"tensor {key!r} ({tensor.layout}, {tensor.device}) is not a dense tensor with "
                "data; nothing was written"
            )
        dtype = safetensors_name(tensor.dtype)
        if dtype is None:
            raise UnsupportedValue(
                f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store "
                f"(supported: {supported()}); convert it first — nothing was written"
            )
        shard = offsets.get(key)
        specs.append(TensorSpec(key, dtype, tuple(tensor.shape), shard))
    try:
        return Layout.of(specs)
    except LayoutError as exc:
        raise UnsupportedValue(f"{exc}; nothing was written") from None


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise UnsupportedValue(f"metadata must be plain JSON values: {exc}") from None


def _check_file_metadata(file_metadata: Mapping[str, str] | None) -> dict[str, str]:
    if file_metadata is None:
        return {"format": "pt"}
    bad = [
        key
        for key, value in file_metadata.items()
        if not isinstance(key, str) or not isinstance(value, str)
    ]
    if bad:
        raise UnsupportedValue(
            f"file_metadata must map str to str (safetensors header rule); bad entries: {bad[:5]}"
        )
    return dict(file_metadata)


class _Target:
    """The destination as the *client* opens it: the daemon gets descriptors, not paths.

    Creating the temporary files here proves this user may write the directory; the daemon
    then only writes through these descriptors and links names inside this directory.
    """

    def __init__(self, path: Path, dir_fd: int, data_file: str) -> None:
        self.path = path
        self.dir_fd = dir_fd
        self.data_tmp = names.temp_name(data_file)
        self.manifest_tmp = names.temp_name(MANIFEST_NAME)
        self.data_fd = -1
        self.manifest_fd = -1

    @classmethod
    def create(cls, path: Path, data_file: str) -> _Target:
        try:
            path.mkdir(parents=True, exist_ok=True)
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SaveError(f"cannot use checkpoint directory {path}: {exc.strerror}") from None
        target = cls(path.resolve(), dir_fd, data_file)
        try:
            for existing in (MANIFEST_NAME, data_file):
                if _exists(existing, dir_fd):
                    raise CheckpointExists(
                        f"{path / existing} already exists: shmstage never overwrites a "
                        "checkpoint; save to a new directory"
                    )
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
            target.data_fd = os.open(target.data_tmp, flags, 0o644, dir_fd=dir_fd)
            target.manifest_fd = os.open(target.manifest_tmp, flags, 0o644, dir_fd=dir_fd)
        except BaseException as exc:
            target.abort()
            target.close_fds()
            if isinstance(exc, OSError) and not isinstance(exc, SaveError):
                raise SaveError(f"cannot create files in {path}: {exc.strerror}") from None
            raise
        return target

    def fds(self) -> list[int]:
        return [self.dir_fd, self.data_fd, self.manifest_fd]

    def abort(self) -> None:
        for name in (self.data_tmp, self.manifest_tmp):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.dir_fd)

    def close_fds(self) -> None:
        for fd in (self.data_fd, self.manifest_fd, self.dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.data_fd = self.manifest_fd = self.dir_fd = -1


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True

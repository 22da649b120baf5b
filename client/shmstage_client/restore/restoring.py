"""Restoring a checkpoint: from the daemon's memory when it can, from its files otherwise.

A trainer that died while its node and daemon lived on left its newest checkpoint in a
staging slot (``shmstaged``'s retention). ``restore(path)`` (and ``load``) first asks the
daemon whether it holds exactly that checkpoint — it passes the data file it opened and
the digest of the manifest it read, so the daemon compares identities and never resolves
a path — and if so reads the slot's segments through a read-only lease at memory speed.
``latest()`` needs no path: the daemon names the caller's newest acknowledged checkpoint,
which it restores even while it is still being written (the slot's bytes are complete
once the save was acknowledged; it has no checksums yet, so ``verified`` is False).

``latest()`` takes the structure and the checksums from the daemon's own record of the
checkpoint, never from a manifest found at a path: whoever may write in a directory may
have moved, replaced or rewritten what is there since (another user in ``/tmp`` or in a
shared group root). It looks at the disk only to say, in ``Restored.reason``, what changed
there. Where it reads files instead — no daemon, the memory read failed, ``under=``'s
directory scan — it takes only checkpoints written for the caller
(``listing.not_written_for``: directory, manifest and data files owned by the caller's
uid, nobody else able to change the directory, the manifest recording a save by that
uid) and, for the files the daemon named, only the manifest the daemon wrote (same
digest). ``load(path)``/``restore(path)`` read what the caller named: any readable
checkpoint, someone else's included.

Anything else — no daemon, another node, given back, a changed file, a checksum that fails
in memory, a lease that expired or ended with the daemon — falls back to the files without
a word, and the result says where it came from (``Restored.source``) and why
(``Restored.reason``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from shmstage import listing
from shmstage.checkpoint import CheckpointError
from shmstage.layout import Layout, LayoutError
from shmstage.manifest import digest
from shmstage.packing import Packing
from shmstage_client.collection import collection_paused
from shmstage_client.connection import DaemonConnection, expect_fds
from shmstage_client.errors import DaemonRefused, SaveError
from shmstage_client.restore import adoption, host_staging
from shmstage_client.restore.files import CheckpointFiles, torch_dtype, unflatten
from shmstage_client.restore.lease import LeaseBroken, MemoryLease
from shmstage_client.restore.sources import MappedSource
from shmstage_client.restore.transfer import (
    Placement,
    transfer,
    transfer_pinned,
    verify_in_place,
)
from shmstage_client.statedict import Flattened

log = logging.getLogger("shmstage.client")

SOURCES: Final = ("auto", "memory", "files")
#: A daemon that does not answer this fast is not worth waiting for: the files are there.
CONNECT_TIMEOUT: Final = 2.0
#: Segments a lease is expected to bring at most: the descriptor table is grown for them
#: (16 KiB) before they come (``connect``); a slot of more grows it again as they arrive.
LEASE_SEGMENTS: Final = 1024

#: How long staging made by ``prepare_restore`` waits for its restore: a restart script's
#: start-up (initialising CUDA and the process group, building the model) takes a while.
KEEP_AHEAD_S: Final = 600.0


@dataclass
class Restored:
    """A restored checkpoint and how it came back."""

    state: Any
    #: "memory" (the daemon's staging slot) or "files".
    source: str
    #: The checkpoint's directory (for ``latest``, as the daemon saw it).
    path: Path | None
    #: Wall-clock seconds of the whole restore, device copies included.
    seconds: float
    #: Tensor bytes moved.
    bytes: int
    #: Every tensor was checked against a recorded checksum.
    verified: bool
    #: The checkpoint is complete on disk (False: restored while still being written).
    durable: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The daemon's job id of the save (from memory).
    job: int | None = None
    #: Why not from memory, when from the files; from memory, what changed on disk since
    #: the save (its directory moved, replaced or deleted, its manifest changed), if anything.
    reason: str = ""
    #: Seconds of each part of a restore from memory: ``lease`` (asking the daemon and
    #: receiving its descriptors) and ``transfer`` (to the device, verified).
    phases: dict[str, float] = field(default_factory=dict)


class NotInMemory(Exception):
    """Why the daemon's memory cannot serve this restore; ``path`` and ``digest``: the
    checkpoint the daemon named (its directory, its manifest's digest), when durable."""

    def __init__(self, why: str, path: Path | None = None, digest: str = "") -> None:
        super().__init__(why)
        self.path = path
        self.digest = digest


#: What makes a restore from memory give way to the files.
FALLBACK = (SaveError, CheckpointError, OSError, ValueError, LayoutError)


@collection_paused()  # see ``collection``
def restore(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    source: str = "auto",
    verify: bool = True,
    socket: str | os.PathLike[str] | None = None,
) -> Restored:
    """The checkpoint at ``path`` on ``device`` (see ``load``, which returns its state)."""
    check_source(source)
    device = torch.device(device)
    started = time.perf_counter()
    connection: DaemonConnection | None = None
    reason = "source='files'"
    try:
        with CheckpointFiles(path) as files:
            host_staging.prepare(device, sum(files.manifest.files.values()))
            prepared = adoption.take(socket)
            if prepared is not None and source != "files" and _prepared_holds(prepared, files):
                read = _read_prepared(prepared, device, files.path)
                if read is not None:
                    tensors, nbytes, phases = read
                    restored = Restored(
                        files.state(tensors), "memory", files.path, 0.0, nbytes,
                        prepared.verified, True, files.manifest.metadata, prepared.info["job"],
                        phases=phases,
                    )
                    return _handed_over(prepared, started, restored)
            elif prepared is not None:
                prepared.drop()  # not this checkpoint: the daemon retains its layout again
            if source != "files":
                try:
                    connection = connect(socket)
                    phases: dict[str, float] = {}
                    state, nbytes, job = _exact(connection, files, device, verify, phases)
                    return _report(
                        connection,
                        started,
                        Restored(
                            state, "memory", files.path, 0.0, nbytes, verify, True,
                            files.manifest.metadata, job, phases=phases,
                        ),
                    )
                except (*FALLBACK, NotInMemory) as exc:  # a lease may end mid-copy
                    reason = _why(exc)
                    if source == "memory":
                        raise CheckpointError(
                            f"{path}: cannot restore from shmstaged's memory: {reason}"
                        ) from None
                    log.debug("restoring %s from its files: %s", path, reason)
            tensors, nbytes = files.read(device, verify=verify)
            state = files.state(tensors)
            return _report(
                connection,
                started,
                Restored(
                    state, "files", files.path, 0.0, nbytes, verify, True,
                    files.manifest.metadata, reason=reason,
                ),
            )
    finally:
        if connection is not None:
            connection.close()


def load(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    verify: bool = True,
    source: str = "auto",
    with_info: bool = False,
    socket: str | os.PathLike[str] | None = None,
) -> Any:
    """The state dict saved at ``path``, bit-exact, with tensors on ``device``.

    ``source``: "auto" (the daemon's memory when it holds exactly this checkpoint, else
    the files, silently), "memory" (only memory: CheckpointError saying why not) or
    "files". ``verify=False`` skips the checksums (for those who trust their storage and
    daemon). ``with_info=True`` returns a ``Restored`` (``.state``, ``.source``,
    ``.seconds``, ``.path``, ...) instead of the bare state dict. ``socket``: the daemon's,
    when not the default.
    """
    restored: Restored = restore(path, device, verify=verify, source=source, socket=socket)
    return restored if with_info else restored.state



@collection_paused()
def latest(
    device: str | torch.device = "cpu",
    *,
    under: str | os.PathLike[str] | None = None,
    like: Any = None,
    verify: bool = True,
    source: str = "auto",
    socket: str | os.PathLike[str] | None = None,
) -> Restored:
    """This user's newest acknowledged checkpoint, restored to ``device``.

    The daemon knows it, so a restart script lists no directories: from memory (even
    while it is still being written, and after its directory was moved or deleted), else
    from its files. ``under``: only checkpoints whose directory is in this one (e.g.
    ``/ckpt/run7`` for ``/ckpt/run7/step-500``; matched by the directory itself, or by
    path once it was moved or replaced) — also where to look, newest complete first, when
    memory cannot serve. Files are read only when written for this user (see the module's
    docstring); others are skipped, and the error says which and why when none is left.
    ``like``: only checkpoints of this state dict's structure (keys, dtypes, shapes), e.g.
    the fresh model's ``state_dict()``. With several trainers of one user on a node, pass
    one of them, or ``load`` each trainer's own path.
    """
    check_source(source)
    device = torch.device(device)
    started = time.perf_counter()
    connection: DaemonConnection | None = None
    reason, named = "source='files'", None
    host_staging.prepare(device)
    prepared = adoption.take(socket)
    try:
        if prepared is not None and source != "files":
            restored = _latest_prepared(prepared, device, like, under, started)
            if restored is not None:
                return restored
        elif prepared is not None:
            prepared.drop()
        if source != "files":
            try:
                connection = connect(socket)
                restored = _latest(connection, device, verify, like, under)
                return _report(connection, started, restored)
            except NotInMemory as exc:
                reason, named = str(exc), exc
            except FALLBACK as exc:
                reason = _why(exc)
            if source == "memory":
                raise CheckpointError(f"cannot restore from shmstaged's memory: {reason}")
        try:
            files = _callers_files(named, under, reason)
        except CheckpointError:
            host_staging.release()  # nothing to restore: a fresh start needs no staging
            raise
        with files:
            tensors, nbytes = files.read(device, verify=verify)
            return _report(
                connection,
                started,
                Restored(
                    files.state(tensors), "files", files.path, 0.0, nbytes, verify, True,
                    files.manifest.metadata, reason=reason,
                ),
            )
    finally:
        if connection is not None:
            connection.close()


def prepare_restore(
    device: str | torch.device = "cuda",
    *,
    keep: float = KEEP_AHEAD_S,
    under: str | os.PathLike[str] | None = None,
    socket: str | os.PathLike[str] | None = None,
) -> None:
    """Get ready to restore to ``device`` while the process does other things: call it in
    a restart script once the device is chosen (``torch.cuda.set_device``, or any first
    CUDA call), before building the model, the optimizer and the process group; it
    returns at once.

    On threads of its own, while the model is built, it adopts the layout this user's
    previous trainer left retained in the daemon (``socket``) — the one holding the
    user's newest checkpoint (whose directory is in ``under``, when given: with several
    trainers of one user on a node, each rank's), unless a reader leases it — maps its
    slots, pins them with CUDA and checks the checkpoint's tensors against their recorded
    checksums (``restore.adoption``). ``latest()`` (or ``load``/``restore`` of that
    checkpoint) within ``keep`` seconds then only copies it to the device, straight from
    the pinned slot, and the process's next ``Stager`` made after that restore takes the
    adopted layout over: its first save maps, pins and creates nothing (a Stager made
    before it gives the adoption back, and its first save adopts the layout as it always
    did). Whatever no restore or Stager takes is given back after ``keep`` seconds (the
    daemon retains the layout again).

    Where nothing can be adopted (a first start, no daemon, a reader's lease), the restore
    leases as it would unprepared, with its pinned staging made here (256 MiB faulted in
    and registered: ~60 ms on the GPU VMs) and the descriptor table grown for the lease;
    that staging is freed after ``keep``, and at once when ``latest()`` finds no
    checkpoint to restore (a first start). A restore needs no ``prepare_restore``. Not
    before CUDA is initialised: the staging's faults then ran 5x slower and made the
    initialisation 30-50 ms longer on an H200 VM.

    On a node of several GPUs pass the rank's device ("cuda:3"), or call it after
    ``torch.cuda.set_device``: for a bare "cuda" before any CUDA call the device is not
    known, so the memory is only faulted in here and registered by the restore, and the
    adopted slot is read through that staging rather than pinned.
    """
    device = torch.device(device)
    if not (isinstance(keep, int | float) and 0 < keep < math.inf):
        raise ValueError(f"prepare_restore(keep={keep!r}): give seconds, a positive number")
    threading.Thread(
        target=expect_fds, args=(LEASE_SEGMENTS,), name="shmstage-descriptors", daemon=True
    ).start()
    host_staging.prepare(device, keep=keep)
    pinning = None
    if device.type == "cuda" and torch.cuda.is_available():
        pinning = host_staging.registering(device)
    adoption.prepare(pinning, socket, _check_ahead, keep, under)


def check_source(source: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: use one of {', '.join(SOURCES)}")


def connect(socket: str | os.PathLike[str] | None) -> DaemonConnection:
    """A connection for leasing checkpoints, the descriptor table grown for the lease's
    segments first (``expect_fds``)."""
    expect_fds(LEASE_SEGMENTS)
    return DaemonConnection(
        socket, connect_timeout=CONNECT_TIMEOUT, client_name=f"shmstage-restore pid {os.getpid()}"
    )


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _report(
    connection: DaemonConnection | None, started: float, restored: Restored
) -> Restored:
    """Finish the timing, and tell the daemon (its metrics count memory against files)."""
    restored.seconds = time.perf_counter() - started
    if connection is not None and connection.alive:
        try:
            connection.post(
                "restored",
                {"source": restored.source, "seconds": restored.seconds, "bytes": restored.bytes},
            )
        except (SaveError, OSError):
            pass
    return restored


def _exact(
    connection: DaemonConnection,
    files: CheckpointFiles,
    device: torch.device,
    verify: bool,
    phases: dict[str, float],
) -> tuple[Any, int, int]:
    """The checkpoint whose manifest ``files`` read, from the daemon's memory."""
    names = list(files.manifest.files)
    if len(names) != 1:
        raise NotInMemory(f"{len(names)} data files; the daemon holds single-file checkpoints")
    begun = time.perf_counter()
    lease = lease_exact(connection, files, names[0], keep_fds=True)
    phases["lease"] = time.perf_counter() - begun
    try:
        tensors = _read(lease, specs_of(files, names[0]), device, verify, phases)
    finally:
        lease.close()
    return files.state(tensors), sum(lease.sizes), lease.body["job"]


def lease_exact(
    connection: DaemonConnection, files: CheckpointFiles, name: str, *, keep_fds: bool = False
) -> MemoryLease:
    """Lease the checkpoint ``files`` opened, by its data file ``name`` (the descriptor
    proves this process may read it) and its manifest's digest; ``keep_fds`` as in
    ``MemoryLease.take``."""
    fd, _ = files.open_data(name)
    try:
        return MemoryLease.take(
            connection, "lease", {"digest": digest(files.document)}, [fd], keep_fds=keep_fds
        )
    finally:
        os.close(fd)


Spec = tuple[str, torch.dtype, tuple[int, ...], "int | None"]


def specs_of(files: CheckpointFiles, name: str) -> list[Spec]:
    """Key, dtype, shape and checksum of each tensor of a data file, in its order."""
    return [(r.key, torch_dtype(r.key, r.dtype), r.shape, r.crc32c) for r in files.records(name)]


def placements_of(lease: MemoryLease, specs: list[Spec]) -> list[Placement]:
    """Where each tensor is in a leased slot's mapped range: the daemon packs a layout's
    segments as ``Packing`` says, which the tensors' sizes alone decide."""
    return _placed(specs, lease.offsets(), lease.sizes)


def _placed(specs: list[Spec], offsets: list[int], sizes: list[int]) -> list[Placement]:
    """``placements_of`` segments mapped at ``offsets``, of ``sizes``."""
    nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in specs]
    packing = Packing.of(nbytes)
    if list(packing.sizes) != list(sizes):
        raise NotInMemory("the daemon's segments do not match the checkpoint's tensors")
    return [
        Placement(key, dtype, shape, offsets[which] + offset, size, crc)
        for (key, dtype, shape, crc), (which, offset), size in zip(
            specs, packing.places, nbytes, strict=True
        )
    ]


def _read(
    lease: MemoryLease,
    specs: list[Spec],
    device: torch.device,
    verify: bool,
    phases: dict[str, float],
) -> dict[str, torch.Tensor]:
    """Copy a leased slot's tensors to ``device``, verified, and end the lease; raises
    NotInMemory when the lease expired before the copy was done (it may be torn)."""
    placements = placements_of(lease, specs)
    where = f"shmstaged's memory (job {lease.body['job']}, {lease.body['directory']})"
    begun = time.perf_counter()
    tensors = transfer(lease.source(where), placements, device, verify=verify)
    phases["transfer"] = time.perf_counter() - begun
    if not lease.end():
        raise NotInMemory(
            "the lease on the daemon's memory ended before the copy was done (it expired, "
            "or the daemon stopped): what was copied may be torn"
        )
    return tensors


def _check_ahead(source: MappedSource, info: dict[str, Any], offsets: list[int]) -> None:
    """A prepared restore's check of its adopted slot against the daemon's record, on the
    host while the model is built (``adoption``); raises ChecksumError."""
    placements = _placed(_recorded_specs(info), offsets, info["sizes"])
    if any(p.crc32c is not None for p in placements):
        verify_in_place(source, placements, threads=adoption.CHECK_THREADS)


def _from_prepared(
    prepared: adoption.PreparedRestore, device: torch.device, directory: Path
) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
    """The prepared checkpoint's tensors on ``device``, its bytes and the seconds of the
    copy: straight from the pinned slot to a CUDA device, else through ``transfer`` (its
    checksums were checked ahead)."""
    adopted, info = prepared.adopted, prepared.info
    assert adopted is not None
    region = adopted.regions[adopted.held]
    placements = _placed(_recorded_specs(info), list(region.offsets), info["sizes"])
    where = f"shmstaged's memory (job {info['job']}, {directory}, adopted)"
    source = MappedSource(region.address, region.size, where)
    begun = time.perf_counter()
    if device.type == "cuda" and prepared.held_pieces:
        tensors = transfer_pinned(source, prepared.held_pieces, placements, device)
    else:
        tensors = transfer(source, placements, device, verify=False)
    phases = {**prepared.seconds, "transfer": time.perf_counter() - begun}
    return tensors, sum(info["sizes"]), phases


def _read_prepared(
    prepared: adoption.PreparedRestore, device: torch.device, directory: Path
) -> tuple[dict[str, torch.Tensor], int, dict[str, float]] | None:
    """``_from_prepared``, or None (the prepare given back) where it cannot be read: the
    daemon is asked as usual then. Anything else is raised, the prepare given back too."""
    try:
        return _from_prepared(prepared, device, directory)
    except FALLBACK as exc:
        log.debug("the prepared restore could not be read (%s); asking the daemon", exc)
        prepared.drop()
        return None
    except BaseException:
        prepared.drop()
        raise


def _prepared_holds(prepared: adoption.PreparedRestore, files: CheckpointFiles) -> bool:
    """Whether the prepared checkpoint is the one ``files`` opened (its manifest, durable)."""
    info = prepared.info
    return bool(info.get("durable")) and info.get("digest") == digest(files.document)


def _latest_prepared(
    prepared: adoption.PreparedRestore,
    device: torch.device,
    like: Any,
    under: str | os.PathLike[str] | None,
    started: float,
) -> Restored | None:
    """``latest()`` from what ``prepare_restore`` adopted, when it is what was asked for
    (``like``'s structure, in ``under``); None (and it is given back) otherwise, or when
    it cannot be read: the daemon is asked as usual."""
    info = prepared.info
    directory = Path(info["directory"])
    adopted = prepared.adopted
    assert adopted is not None
    if (like is not None and _structure(like) != adopted.layout.digest()) or (
        under is not None and directory.parent != _absolute(under)
    ):
        prepared.drop()
        return None
    read = _read_prepared(prepared, device, directory)
    if read is None:
        return None
    tensors, nbytes, phases = read
    try:
        state = unflatten(info.get("tree"), tensors, directory)
    except BaseException as exc:
        prepared.drop()
        if isinstance(exc, FALLBACK):
            return None
        raise
    restored = Restored(
        state, "memory", directory, 0.0, nbytes, prepared.verified, info["durable"],
        info.get("metadata") or {}, info["job"], reason=_changed_on_disk(info), phases=phases,
    )
    return _handed_over(prepared, started, restored)


def _handed_over(
    prepared: adoption.PreparedRestore, started: float, restored: Restored
) -> Restored:
    """A restore from a prepared adoption is done: reported on the connection that owns
    the layout, which then goes to the next Stager (``handoff``); the staging made beside
    it is not needed."""
    assert prepared.adopted is not None
    _report(prepared.adopted.connection, started, restored)
    prepared.finish()
    host_staging.release()
    return restored


def _latest(
    connection: DaemonConnection,
    device: torch.device,
    verify: bool,
    like: Any,
    under: str | os.PathLike[str] | None,
) -> Restored:
    """The newest checkpoint the daemon holds for this user, read from its memory with
    the daemon's own record of its structure and checksums; raises NotInMemory naming
    the checkpoint's files where they exist."""
    body: dict[str, Any] = {}
    if like is not None:
        body["structure"] = _structure(like)
    begun = time.perf_counter()
    try:
        lease, moved = _lease_latest(connection, body, under)
    except LeaseBroken as exc:
        raise NotInMemory(_why(exc), *_named(exc.body)) from None
    info = lease.body
    try:
        specs = _recorded_specs(info)
        phases = {"lease": time.perf_counter() - begun}
        tensors = _read(lease, specs, device, verify, phases)
        directory = Path(info["directory"])
        state = unflatten(info.get("tree"), tensors, directory)
    except NotInMemory as exc:
        exc.path, exc.digest = _named(info)
        raise
    except FALLBACK as exc:  # e.g. a checksum that failed in memory: the files may not
        raise NotInMemory(_why(exc), *_named(info)) from None
    finally:
        lease.close()
    changed = "; ".join(why for why in (moved, _changed_on_disk(info)) if why)
    return Restored(
        state,
        "memory",
        directory,
        0.0,
        sum(lease.sizes),
        verify and info.get("checksums") is not None,
        info["durable"],
        info.get("metadata") or {},
        info["job"],
        reason=changed,
        phases=phases,
    )


def _lease_latest(
    connection: DaemonConnection, body: dict[str, Any], under: str | os.PathLike[str] | None
) -> tuple[MemoryLease, str]:
    """Lease this user's newest checkpoint (in ``under``: the directory, by its identity);
    and what is to be said when ``under`` had to be matched by path instead, because the
    directory at that path is not (or no longer) the one the checkpoint was saved in."""
    if under is None:
        return MemoryLease.take(connection, "latest", body, keep_fds=True), ""
    try:
        fd = os.open(under, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        gone = f"{under}: {exc.strerror}"
    else:
        try:
            return MemoryLease.take(connection, "latest", body, [fd], keep_fds=True), ""
        except DaemonRefused as exc:
            if exc.code != "not_retained":
                raise
            gone = f"{under} is not the directory the checkpoint was saved in"
        finally:
            os.close(fd)
    lease = MemoryLease.take(connection, "latest", body, keep_fds=True)
    if Path(lease.body["directory"]).parent != _absolute(under):
        lease.close()
        raise NotInMemory(f"shmstaged holds no checkpoint of this user in {under} ({gone})")
    return lease, f"{gone} (moved, replaced or deleted)"


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(path))


def _named(info: dict[str, Any]) -> tuple[Path | None, str]:
    """The files a lease's answer names (directory, manifest digest), once durable: only
    a manifest of that digest will be read there."""
    directory, digest_ = info.get("directory"), info.get("digest")
    if not (info.get("durable") and isinstance(directory, str) and isinstance(digest_, str)):
        return None, ""
    return (Path(directory), digest_) if digest_ else (None, "")


def _recorded_specs(info: dict[str, Any]) -> list[Spec]:
    """Key, dtype, shape and checksum of each tensor, in layout order, as the daemon
    recorded them (no checksums while the checkpoint is still being written)."""
    layout = Layout.from_wire(info.get("tensors"), max_tensors=1 << 30)
    checksums = info.get("checksums")
    if checksums is None:
        checksums = [None] * len(layout.tensors)
    elif len(checksums) != len(layout.tensors) or not all(
        isinstance(crc, int) and not isinstance(crc, bool) for crc in checksums
    ):
        raise NotInMemory("shmstaged's checksums do not match the checkpoint's tensors")
    return [
        (spec.key, torch_dtype(spec.key, spec.dtype), spec.shape, crc)
        for spec, crc in zip(layout.tensors, checksums, strict=True)
    ]


def _changed_on_disk(info: dict[str, Any]) -> str:
    """What became of a durable checkpoint's directory since the daemon wrote it: "" when
    it still holds that checkpoint. Only said, never read from: another user's directory
    is not even opened past its owner."""
    if not info["durable"]:
        return ""  # its files are still being written
    directory = Path(info["directory"])
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"{directory} no longer exists (moved or deleted)"
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    try:
        foreign = listing.not_written_for(os.geteuid(), dir_fd)
    finally:
        os.close(dir_fd)
    if foreign:
        return f"{directory} was replaced: {foreign}"
    try:
        with CheckpointFiles(directory) as files:
            same = digest(files.document) == info["digest"]
    except CheckpointError as exc:
        return f"{directory} no longer holds the checkpoint: {exc}"
    return "" if same else f"{directory}'s manifest changed since shmstaged wrote it"


def _callers_files(
    named: NotInMemory | None, under: str | os.PathLike[str] | None, reason: str
) -> CheckpointFiles:
    """The files to restore when memory cannot: those the daemon named, if still the
    checkpoint it wrote and written for this user; else the newest complete checkpoint of
    this user directly in ``under``."""
    skipped: list[str] = []
    if (
        named is not None
        and named.path is not None
        and (under is None or named.path.parent == _absolute(under))
    ):
        files, why = _open_callers(named.path, named.digest)
        if files is not None:
            return files
        skipped.append(why)
    if under is None:
        raise CheckpointError(
            f"no checkpoint to restore: {reason}"
            + "".join(f"; {why}" for why in skipped)
            + "; pass under= (the directory holding the checkpoints) to look there, or "
            "load(path)"
        )
    found = [
        info
        for info in listing.scan(Path(under), max_depth=1, uid=os.geteuid())
        if info.path != Path(under)
    ]
    skipped += [f"{info.path}: {info.problem}" for info in found if info.state == listing.FOREIGN]
    complete = [info for info in found if info.state == listing.COMPLETE]
    for info in sorted(complete, key=_newest_first):
        files, why = _open_callers(info.path)
        if files is not None:
            return files
        skipped.append(why)
    raise CheckpointError(
        f"no complete checkpoint of uid {os.geteuid()} in {under} ({reason})"
        + "".join(f"; skipped {why}" for why in skipped)
    )


def _newest_first(info: listing.CheckpointInfo) -> tuple[float, str]:
    return (-(info.committed_unix or 0.0), str(info.path))


def _open_callers(path: Path, expected: str = "") -> tuple[CheckpointFiles | None, str]:
    """The checkpoint at ``path`` opened, if written for this user (and its manifest's
    digest is ``expected``, when given); else None and why not. Its manifest is not read
    unless the directory and the manifest file are this user's."""
    uid = os.geteuid()
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"{path}: {exc.strerror}"
    try:
        foreign = listing.not_written_for(uid, dir_fd)
    finally:
        os.close(dir_fd)
    if foreign:
        return None, f"{path} is not this user's checkpoint: {foreign}"
    try:
        files = CheckpointFiles(path)
    except CheckpointError as exc:
        return None, str(exc)
    foreign = listing.not_written_for(uid, files.dir_fd, files.manifest)  # what is read
    if not foreign and expected and digest(files.document) != expected:
        foreign = "its manifest is not the one shmstaged wrote (changed or replaced since)"
    if foreign:
        files.close()
        return None, f"{path} is not this user's checkpoint: {foreign}"
    return files, ""


def _structure(like: Any) -> str:
    """The digest of a state dict's layout, as the daemon computes it for a registration."""
    return Flattened.of(like, None).layout().digest()

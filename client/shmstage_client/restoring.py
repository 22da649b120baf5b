"""Restoring a checkpoint: from the daemon's memory when it can, from its files otherwise.

A trainer that died while its node and daemon lived on left its newest checkpoint in a
staging slot (``shmstaged``'s retention). ``restore(path)`` (and ``load``) first asks the
daemon whether it holds exactly that checkpoint — it passes the data file it opened and
the digest of the manifest it read, so the daemon compares identities and never resolves
a path — and if so reads the slot's segments through a read-only lease at memory speed.
``latest()`` needs no path: the daemon names the caller's newest acknowledged checkpoint,
which it restores even while it is still being written (the slot's bytes are complete
once the save was acknowledged; it has no checksums yet, so ``verified`` is False).

Anything else — no daemon, another node, given back, a changed file, a checksum that fails
in memory, a lease that expired — falls back to the files without a word, and the result
says where it came from (``Restored.source``) and why (``Restored.reason``).
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
from shmstage_client import reading
from shmstage_client.collection import collection_paused
from shmstage_client.connection import DaemonConnection, expect_fds
from shmstage_client.errors import SaveError
from shmstage_client.lease import MemoryLease
from shmstage_client.loading import CheckpointFiles, torch_dtype, unflatten
from shmstage_client.reading import Placement, transfer

log = logging.getLogger("shmstage.client")

SOURCES: Final = ("auto", "memory", "files")
#: A daemon that does not answer this fast is not worth waiting for: the files are there.
CONNECT_TIMEOUT: Final = 2.0
#: Segments a lease is expected to bring at most: the descriptor table is grown for them
#: (16 KiB) before they come (``connect``); a slot of more grows it again as they arrive.
LEASE_SEGMENTS: Final = 1024

#: How long staging made by ``prepare_restore`` waits for its restore: a restart script's
#: start-up (initialising CUDA and the process group, building the model) takes a while.
PREPARED_KEEP_S: Final = 600.0


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
    #: Why not from memory, when from the files.
    reason: str = ""
    #: Seconds of each part of a restore from memory: ``lease`` (asking the daemon and
    #: receiving its descriptors; for ``latest``, also reading the manifest it names) and
    #: ``transfer`` (to the device, verified).
    phases: dict[str, float] = field(default_factory=dict)


class NotInMemory(Exception):
    """Why the daemon's memory cannot serve this restore; ``path``: the files to read
    instead, where known."""

    def __init__(self, why: str, path: Path | None = None) -> None:
        super().__init__(why)
        self.path = path


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
            reading.prepare(device, sum(files.manifest.files.values()))
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
                except FALLBACK as exc:
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
    while it is still being written), else from its files. ``under``: only checkpoints
    whose directory is in this one (e.g. ``/ckpt/run7`` for ``/ckpt/run7/step-500``) —
    also where to look, newest complete first, when no daemon can answer. ``like``: only
    checkpoints of this state dict's structure (keys, dtypes, shapes), e.g. the fresh
    model's ``state_dict()``. With several trainers of one user on a node, pass one of
    them, or ``load`` each trainer's own path.
    """
    check_source(source)
    device = torch.device(device)
    started = time.perf_counter()
    connection: DaemonConnection | None = None
    reason, hint = "source='files'", None
    reading.prepare(device)
    try:
        if source != "files":
            try:
                connection = connect(socket)
                restored = _latest(connection, device, verify, like, under)
                return _report(connection, started, restored)
            except NotInMemory as exc:
                reason, hint = str(exc), exc.path
            except FALLBACK as exc:
                reason = _why(exc)
            if source == "memory":
                raise CheckpointError(f"cannot restore from shmstaged's memory: {reason}")
        try:
            path = hint if hint is not None else _newest_under(under, reason)
        except CheckpointError:
            reading.release_staging()  # nothing to restore: a fresh start needs no staging
            raise
        with CheckpointFiles(path) as files:
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


def prepare_restore(device: str | torch.device = "cuda", *, keep: float = PREPARED_KEEP_S) -> None:
    """Get ready to restore to ``device`` while the process does other things: call it in
    a restart script once the device is chosen (``torch.cuda.set_device``, or any first
    CUDA call), before building the model, the optimizer and the process group; it
    returns at once.

    A new process's first restore otherwise starts by making its pinned staging (256 MiB
    faulted in and registered with CUDA: ~60 ms on the GPU VMs, which fault fresh memory
    in at ~5 GB/s) and by growing its descriptor table for the lease's segments. Here
    threads of its own do both while the model is built. The next restore (``latest``,
    ``load``, ``restore``, the DCP reader) within ``keep`` seconds takes them; after that
    they are freed, and at once when ``latest()`` finds no checkpoint to restore (a first
    start). Nothing is asked of the daemon, and a restore needs no ``prepare_restore``.
    Not before CUDA is initialised: the staging's faults then ran 5x slower and made the
    initialisation 30-50 ms longer on an H200 VM, a wash.

    On a node of several GPUs pass the rank's device ("cuda:3"), or call it after
    ``torch.cuda.set_device``: for a bare "cuda" before any CUDA call the device is not
    known, so the memory is only faulted in here and registered by the restore.
    """
    device = torch.device(device)
    if not (isinstance(keep, int | float) and 0 < keep < math.inf):
        raise ValueError(f"prepare_restore(keep={keep!r}): give seconds, a positive number")
    threading.Thread(
        target=expect_fds, args=(LEASE_SEGMENTS,), name="shmstage-descriptors", daemon=True
    ).start()
    reading.prepare(device, keep=keep)


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
    nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in specs]
    packing = Packing.of(nbytes)
    if list(packing.sizes) != lease.sizes:
        raise NotInMemory("the daemon's segments do not match the checkpoint's tensors")
    offsets = lease.offsets()
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
        raise NotInMemory("the lease on the daemon's memory expired before the copy was done")
    return tensors


def _latest(
    connection: DaemonConnection,
    device: torch.device,
    verify: bool,
    like: Any,
    under: str | os.PathLike[str] | None,
) -> Restored:
    body: dict[str, Any] = {}
    if like is not None:
        body["structure"] = _structure(like)
    begun = time.perf_counter()
    fds = []
    if under is not None:
        try:
            fds.append(os.open(under, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError as exc:
            raise CheckpointError(f"latest(under={str(under)!r}): {exc.strerror}") from None
    try:
        lease = MemoryLease.take(connection, "latest", body, fds, keep_fds=True)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        info = lease.body
        directory = Path(info["directory"])
        durable = info["durable"]
        if durable:
            encoded, metadata, specs = _durable_structure(directory, info)
        else:  # still being written: no manifest, no checksums yet
            encoded, metadata = info.get("tree"), info.get("metadata") or {}
            layout = Layout.from_wire(info.get("tensors"), max_tensors=1 << 30)
            specs = [
                (spec.key, torch_dtype(spec.key, spec.dtype), spec.shape, None)
                for spec in layout.tensors
            ]
        phases = {"lease": time.perf_counter() - begun}
        tensors = _read(lease, specs, device, verify, phases)
    except NotInMemory as exc:
        exc.path = exc.path or _files_of(lease)
        raise
    except FALLBACK as exc:  # e.g. a checksum that failed in memory: the files may not
        raise NotInMemory(_why(exc), _files_of(lease)) from None
    finally:
        lease.close()
    return Restored(
        unflatten(encoded, tensors, directory),
        "memory",
        directory,
        0.0,
        sum(lease.sizes),
        verify and durable,
        durable,
        metadata,
        info["job"],
        phases=phases,
    )


def _files_of(lease: MemoryLease) -> Path | None:
    """Where a leased checkpoint's files are, if it has any yet."""
    return Path(lease.body["directory"]) if lease.body["durable"] else None


def _durable_structure(
    directory: Path, info: dict[str, Any]
) -> tuple[Any, dict[str, Any], list[Spec]]:
    """The structure and checksums from the checkpoint's own manifest on disk, which must
    be the one the daemon wrote (same digest)."""
    try:
        files = CheckpointFiles(directory)
    except CheckpointError as exc:
        raise NotInMemory(f"its manifest cannot be read to check it: {exc}", directory) from None
    with files:
        if digest(files.document) != info["digest"]:
            raise NotInMemory(
                f"{directory} no longer holds the checkpoint in memory (its manifest changed)",
                directory,
            )
        return files.manifest.tree, files.manifest.metadata, specs_of(files, info["data_file"])


def _structure(like: Any) -> str:
    """The digest of a state dict's layout, as the daemon computes it for a registration."""
    from shmstage_client.prepared import Prepared

    return Prepared.of(like, None).layout().digest()


def _newest_under(under: str | os.PathLike[str] | None, reason: str) -> Path:
    """Without the daemon: the newest complete checkpoint directly in ``under``."""
    if under is None:
        raise CheckpointError(
            f"no checkpoint to restore: {reason}; pass under= (the directory holding the "
            "checkpoints) to look there, or load(path)"
        )
    complete = [
        info
        for info in listing.scan(Path(under), max_depth=1)
        if info.state == listing.COMPLETE and info.path != Path(under)
    ]
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {under} ({reason})")
    return max(complete, key=lambda info: (info.committed_unix or 0.0, str(info.path))).path

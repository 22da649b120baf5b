"""A restart's restore, made ready while the model is built: the caller's own retained
layout adopted, mapped, pinned and checked ahead.

A trainer that died left its newest checkpoint in a layout the daemon retains, and its
restarted process will both read that checkpoint (``latest``) and save into the same
layout (its first save adopts it). ``prepare_restore`` does the work of both on a thread
of its own, before the model exists:

1. lease the caller's newest checkpoint (``latest``) for the daemon's record of it — its
   structure, checksums, directory — and the identities of its segments, then end the
   lease (a retained layout with a leased slot is never adopted);
2. register that structure ``adopt_only``: the daemon hands over a retained layout only to
   its own user, never one that a reader leases, and creates nothing otherwise;
3. map every slot writable and find the one holding the leased checkpoint by its
   segments' identities (st_dev, st_ino) — the bytes the lease named, nobody else's;
4. with CUDA, pin that slot (``cudaHostRegister``, a few large ranges) while checking its
   tensors against the recorded checksums on the host; then the other slots, for the
   first save.

``latest()`` then copies the checkpoint straight out of the pinned slot (one pass over
host memory, ``transfer.transfer_pinned``), and offers the layout to the process's next
Stager (``handoff``): its first save copies into pinned slots it neither maps nor pins.
Nothing can change the slot meanwhile: this process's connection owns the layout and
asks for no slot before that Stager does. A prepare whose restore never comes gives
everything back after ``keep`` seconds (the daemon retains the layout again); one that
cannot adopt (a first start, another reader's lease, no daemon) prepares nothing, and
``latest()`` leases as it always did.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch

from shmstage import segment
from shmstage.layout import Layout
from shmstage.paths import default_socket_path
from shmstage_client import handoff
from shmstage_client.connection import DaemonConnection, receivable_fds
from shmstage_client.handoff import AdoptedLayout
from shmstage_client.pinning import PIN_FAILURES, PinnedRanges, region_pieces
from shmstage_client.restore.lease import REQUEST_TIMEOUT, MemoryLease
from shmstage_client.restore.sources import MappedSource

log = logging.getLogger("shmstage.client")

#: How long ``latest()`` waits for a prepared restore still under way before it leases
#: as if nothing were prepared (pinning 16 GiB takes a few seconds).
READY_TIMEOUT: Final = 120.0
#: Pieces a slot is pinned in, at least: each registration holds up the process's other
#: CUDA calls while it runs, and the model is being built meanwhile.
MIN_PIECES: Final = 8
#: Bytes per registration at most, for the same reason (~35 ms each at ~30 GB/s).
PIECE_BYTES: Final = 1 << 30
#: Threads that check the checksums ahead, beside the model's build.
CHECK_THREADS: Final = 8

FileId = tuple[int, int]
#: Checks a slot's bytes against the daemon's record (``restoring`` supplies it): raises.
Check = Callable[[MappedSource, dict[str, Any], list[int]], None]


class NotPrepared(Exception):
    """Why nothing was prepared (said in the debug log; the restore leases as usual)."""


class PreparedRestore:
    """One prepare's adoption, made on its own thread (``ready`` once the checkpoint's
    slot is pinned and checked); ``take`` hands it to one restore."""

    def __init__(
        self,
        device: torch.device | None,
        socket: str | os.PathLike[str] | None,
        check: Check,
        keep: float,
        under: str | os.PathLike[str] | None = None,
    ) -> None:
        #: The device whose context pins (None: no pinning — no CUDA, or not known yet).
        self.device = device
        self.socket = socket
        #: Only a checkpoint whose directory is in this one (as ``latest(under=...)``).
        self.under = under
        self.keep = keep
        self._check = check
        self.ready = threading.Event()
        #: The daemon's record of the checkpoint (the lease's answer) and where it is.
        self.info: dict[str, Any] = {}
        self.adopted: AdoptedLayout | None = None
        #: The pinned pieces of the checkpoint's slot ((start, end) offsets), if pinned.
        self.held_pieces: list[tuple[int, int]] = []
        #: Whether its tensors matched the recorded checksums (False: none recorded yet).
        self.verified = False
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._taken = False
        self._dropped = False
        self.seconds: dict[str, float] = {}

    def start(self) -> None:
        threading.Thread(target=self._run, name="shmstage-prepare", daemon=True).start()

    # -- the background work ------------------------------------------------------

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            self._adopt()
            self.seconds["adopt"] = time.perf_counter() - began
            self._pin_and_check()
            self.seconds["ready"] = time.perf_counter() - began
        except BaseException as exc:  # a fresh start, a lease, no daemon: nothing prepared
            self.failure = exc
            log.debug("nothing prepared for a restore: %s", exc)
            if self.adopted is not None:
                self.adopted.settled.set()  # this thread maps and pins nothing more
            self._close_adopted()
        finally:
            self.ready.set()
        if self.failure is None:
            self._pin_others()
        if self._dropped_now():
            self._close_adopted()

    def _adopt(self) -> None:
        connection = DaemonConnection(
            self.socket, connect_timeout=2.0, client_name=f"shmstage-client pid {os.getpid()}"
        )
        try:
            leased: list[FileId] = []
            lease = self._lease(connection, leased)
            try:
                self.info = lease.body
                lease.end()  # before adopting: a leased layout is never adopted
            finally:
                lease.close()
            self.adopted = _register_adopting(connection, self.info, leased)
        except BaseException:
            connection.close()
            raise

    def _lease(self, connection: DaemonConnection, identities: list[FileId]) -> MemoryLease:
        """Lease the newest checkpoint (in ``under``: that directory, by its identity),
        its segments' identities into ``identities``; nothing is read through the lease."""
        fds = []
        if self.under is not None:
            fds.append(os.open(self.under, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        try:
            return MemoryLease.take(
                connection, "latest", {}, fds, keep_fds=True, identities=identities
            )
        finally:
            for fd in fds:
                os.close(fd)

    def _pin_and_check(self) -> None:
        """Pin the checkpoint's slot while its tensors are checked against the record."""
        adopted = self.adopted
        assert adopted is not None
        region = adopted.regions[adopted.held]
        source = MappedSource(region.address, region.size, _where(self.info))
        checked: list[BaseException] = []

        def check() -> None:
            try:
                self._check(source, self.info, list(region.offsets))
            except BaseException as exc:
                checked.append(exc)

        checking = threading.Thread(target=check, name="shmstage-prepare-check", daemon=True)
        checking.start()
        begun = time.perf_counter()
        self.held_pieces = self._pin(adopted, adopted.held)
        self.seconds["pin"] = time.perf_counter() - begun
        checking.join()  # no bound: it only reads memory, and the slot must outlive it
        if checked:
            raise checked[0]
        self.verified = self.info.get("checksums") is not None

    def _pin(self, adopted: AdoptedLayout, index: int) -> list[tuple[int, int]]:
        """Register slot ``index`` in pieces; its pieces, or [] where it cannot be pinned."""
        if self.device is None:
            return []
        region = adopted.regions[index]
        pieces = region_pieces(region, max(MIN_PIECES, -(-region.size // PIECE_BYTES)))
        whole = _bytes(region)
        ranges = PinnedRanges()
        try:
            ranges.register([whole[start:end] for start, end in pieces], self.device)
        except PIN_FAILURES as exc:
            log.info("slot %d of an adopted layout stays unpinned: %s", index, exc)
            return []
        adopted.pinned[index] = ranges
        return pieces

    def _pin_others(self) -> None:
        """The slots the restarted trainer's first saves fill, pinned before they come
        (the restore may have offered the layout meanwhile: a Stager waits for this)."""
        adopted = self.adopted
        if adopted is None:
            return
        try:
            if self.device is not None:
                for index in range(len(adopted.regions)):
                    if index != adopted.held and not self._dropped_now():
                        self._pin(adopted, index)
        except BaseException as exc:  # the Stager pins what is left, before its first copy
            log.debug("pinning an adopted layout's other slots failed: %s", exc)
        finally:
            adopted.settled.set()

    # -- handing over, giving back -------------------------------------------------

    def take(self, timeout: float) -> bool:
        """Whether this prepare is ready for a restore (waiting at most ``timeout``): then
        it is the caller's, to ``finish`` or ``drop``; else it is dropped."""
        with self._lock:
            if self._taken or self._dropped:
                return False
            self._taken = True
        began = time.perf_counter()
        ready = self.ready.wait(timeout)
        self.seconds["waited"] = time.perf_counter() - began
        if ready and self.failure is None and self.adopted is not None:
            return True
        self.drop()
        return False

    def finish(self) -> None:
        """The restore read the checkpoint: the layout is the next Stager's to claim, for
        ``keep`` seconds (it waits for the other slots' pinning, ``AdoptedLayout.settled``)."""
        handoff.expected_no_more(self.drop)
        with self._lock:
            adopted, self.adopted = self.adopted, None
        if adopted is not None:
            handoff.offer(adopted, self.keep)

    def drop(self) -> None:
        """Give everything back: now if the background work ended, else when it does."""
        handoff.expected_no_more(self.drop)
        with self._lock:
            self._dropped = True
            adopted = self.adopted
        if adopted is not None and adopted.settled.is_set():
            self._close_adopted()

    def expire(self) -> None:
        """``keep`` ran out: give back what no restore took."""
        with self._lock:
            taken = self._taken
        if not taken:
            self.drop()

    def _dropped_now(self) -> bool:
        with self._lock:
            return self._dropped

    def _close_adopted(self) -> None:
        with self._lock:
            adopted, self.adopted = self.adopted, None
        if adopted is not None:
            adopted.close()


def _register_adopting(
    connection: DaemonConnection, info: dict[str, Any], leased: list[FileId]
) -> AdoptedLayout:
    """Adopt the retained layout of the leased checkpoint's structure (``adopt_only``),
    every slot mapped writable; the slot holding the checkpoint is the one whose segments
    are the leased ones."""
    tensors = info.get("tensors")
    layout = Layout.from_wire(tensors, max_tensors=1 << 30)
    sizes = layout.packing().sizes
    target = max(1, int(connection.welcome.get("default_slots", 2)))
    limits = connection.welcome.get("limits") or {}
    handle = connection.start(
        "register",
        {
            "tensors": tensors,
            "slots": 1,  # none created: the adopted layout's own slots, every one of them
            "planned_slots": max(target, int(limits.get("max_slots", target))),
            "max_fds": receivable_fds(),
            "adopt_only": True,
        },
    )
    regions: list[segment.Region] = []
    identities: list[FileId] = []
    try:
        reply = handle.next(REQUEST_TIMEOUT)
        slots, count = reply.body["slots"], reply.body["segments"]
        if not reply.body.get("adopted") or count != slots * len(sizes):
            raise NotPrepared(f"shmstaged sent {count} segments for {slots} slot(s), none adopted")
        regions.extend(segment.Region(sizes) for _ in range(slots))
        while len(identities) < count:
            frame = handle.next(REQUEST_TIMEOUT)
            try:
                if frame.op != "segment_fds" or frame.body["first"] != len(identities):
                    raise NotPrepared(f"unexpected {frame.op} while receiving segments")
                if len(identities) + len(frame.fds) > count:
                    raise NotPrepared("shmstaged sent more segments than it announced")
                for fd in frame.fds:
                    which, index = divmod(len(identities), len(sizes))
                    regions[which].map(index, fd, writable=True)
                    identities.append(_identity(fd))
            finally:
                for fd in frame.fds:
                    os.close(fd)
        per_slot = [identities[i * len(sizes) : (i + 1) * len(sizes)] for i in range(slots)]
        if leased not in per_slot:
            raise NotPrepared("the adopted layout does not hold the leased checkpoint")
        held = per_slot.index(leased)
    except BaseException:
        for region in regions:
            region.close()
        raise
    finally:
        handle.finish()
    log.info(
        "prepared a restore: adopted layout %d (%d slot(s)), job %s in slot %d",
        reply.body["layout"],
        slots,
        info.get("job"),
        held,
    )
    return AdoptedLayout(connection, reply.body["layout"], layout, regions, held, target)


def _identity(fd: int) -> FileId:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _where(info: dict[str, Any]) -> str:
    return f"shmstaged's memory (job {info.get('job')}, {info.get('directory')}, adopted)"


def _bytes(region: segment.Region) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that the buffer is writable
        return torch.frombuffer(region.buffer(), dtype=torch.uint8, count=region.size)


_lock = threading.Lock()
_prepared: PreparedRestore | None = None


def prepare(
    device: torch.device | None,
    socket: str | os.PathLike[str] | None,
    check: Check,
    keep: float,
    under: str | os.PathLike[str] | None = None,
) -> None:
    """Start adopting the caller's retained layout on a thread (see the module), kept for
    a restore for ``keep`` seconds; an earlier prepare not taken yet is given back."""
    global _prepared
    prepared = PreparedRestore(device, socket, check, keep, under)
    with _lock:
        earlier, _prepared = _prepared, prepared
    if earlier is not None:
        earlier.expire()
    timer = threading.Timer(keep, prepared.expire)
    timer.daemon = True
    timer.start()
    handoff.expect(_socket_path(socket), prepared.drop)  # a Stager made first gives it back
    prepared.start()


def take(socket: str | os.PathLike[str] | None) -> PreparedRestore | None:
    """The prepared restore for daemon ``socket``, ready (waiting for it, bounded), now
    the caller's; None when there is none or it came to nothing."""
    global _prepared
    with _lock:
        prepared, _prepared = _prepared, None
    if prepared is None:
        return None
    if _socket_path(prepared.socket) != _socket_path(socket):
        prepared.drop()
        return None
    return prepared if prepared.take(READY_TIMEOUT) else None


def _socket_path(socket: str | os.PathLike[str] | None) -> Path:
    return default_socket_path() if socket is None else Path(socket)

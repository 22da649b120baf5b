"""``Stager``: save a state dict through shmstaged, top to bottom.

``save()`` blocks only while tensors are copied into shared memory. In order:

1. prepare — flatten and check the state dict (``prepared``); a refused one costs nothing;
2. destination — open where it goes (``destination``): usually a spare pending directory
   made in the background after the previous save, so no filesystem round trip here;
3. layout and slot — reuse the registered layout (or register one) and take a slot;
4. commit, sent ahead of the copy — the daemon checks and journals it meanwhile;
5. copy — into the slot (``staging``);
6. ready — the daemon answers ``committed`` and owns the data: the trainer may modify or
   free its tensors, or even exit, and the checkpoint still completes (``staged``).

``save()`` then returns a ``SaveHandle`` (``handle``) whose ``timings`` say what each step
cost; in the background it tells the daemon the stall and prepares the next spare.

``save(..., block=False)`` returns after step 5 has only *started* for the tensors that a
guard covers (``guard``: the optimizers' parameters and state): their copy runs behind the
caller's next forward and backward (``pending``), the guarded optimizer's ``step()`` waits
for it, and the Stager's handover thread does step 6 once it has landed (``handover``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shmstage.layout import Layout
from shmstage_client.collection import collection_paused
from shmstage_client.connection import DaemonConnection, RequestHandle, receivable_fds
from shmstage_client.destination import (
    DEFAULT_DATA_FILE,
    Fields,
    Spares,
    check_data_file,
    open_target,
)
from shmstage_client.errors import DaemonLost, SaveError, SaveTimeout
from shmstage_client.guard import Coverage, Guard
from shmstage_client.handle import Clock, ProgressCallback, SaveHandle, SaveTimings, Tracker
from shmstage_client.handover import FollowUp, Handover, Landing
from shmstage_client.pending import PendingCopy
from shmstage_client.staged import Destination, Staged
from shmstage_client.staging import CopyEngine, MappedLayout, device_groups
from shmstage_client.statedict import Flattened, check_fits

log = logging.getLogger("shmstage.client")

__all__ = ["DEFAULT_DATA_FILE", "Stager", "check_data_file"]

#: Threads that fault in slots added after a first save: they compete with training for
#: memory bandwidth (on an H100 host, 8 threads slowed a training step ~1.1x while they
#: ran; page faults never wait for the GPU), so fewer than a first save's own setup.
BACKGROUND_SETUP_THREADS = 4


class Stager:
    """A trainer's connection to shmstaged, and the staging layouts it registered.

    ``slots``: staging buffers per layout; with 2, a save can fill one while the previous
    checkpoint still streams from the other. ``slots=None`` takes the daemon's
    ``default_slots``. A new layout's first save sets up only the slot it fills; the others
    are created and faulted in on a background thread once that save is on its way, and
    each is pinned just before its first copy. ``wait_for_slot``: when every slot is busy,
    wait (True, the default) or raise SlotUnavailable at once. ``pin``: page-lock the
    segments for CUDA — "auto" does so when the state dict holds CUDA tensors.
    ``progress``: called with a SaveEvent when a save is staged, durable or failed; the
    last two come from the connection's reader thread (and "staged", for a non-blocking
    save, from the handover thread), so keep it quick and do not call the Stager from it.
    Not thread-safe: one Stager per training process.

    If shmstaged restarts, saves in flight fail with DaemonLost naming the checkpoint, and
    the next ``save()`` reconnects and registers its layout again by itself.

    ``guard(optimizer)`` lets ``save(..., block=False)`` copy that optimizer's parameters and
    state behind the next forward and backward (see ``save``).
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
        self._tracker = Tracker(progress)
        #: After each save: its report to the daemon, then the next spare, in that order.
        self._background = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="shmstage-background"
        )
        self._spares = Spares(self._background, data_file)
        self._guards: list[Guard] = []
        #: The last non-blocking save's copy until it has landed and been handed over; the
        #: guards hold optimizer steps back on it, the next save waits for it.
        self._in_flight: Landing | None = None
        self._handover = Handover()
        self._warned_unguarded = False
        self._warned_slots = False
        self._growth_lock = threading.Lock()  # the handover thread may ask too

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(retain=kind is not None)

    def close(self, timeout: float | None = 600.0, *, retain: bool = False) -> None:
        """Wait (bounded) for saves still being written, then release everything: the
        layout, the spare pending directory, the connection.

        ``retain=True`` (and leaving a ``with Stager()`` block by an exception) leaves the
        layout to the daemon instead of releasing it, as a trainer that dies does: the
        daemon keeps the newest checkpoint in memory for a restart to restore
        (``latest``) and the segments for it to adopt."""
        deadline = None if timeout is None else time.monotonic() + timeout
        landed = self._in_flight is None or self._in_flight.settled(timeout)
        for guard in list(self._guards):
            guard._unhook()
        for handle in self._tracker.pending():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(remaining)
            except SaveError as exc:
                log.warning("save %s did not complete: %s", handle.path, exc)
        self._handover.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._copier.close(wait=landed)
        self._spares.close()
        self._background.shutdown(wait=True)  # reports still queued go out first
        if self._layout is not None and self._connection.alive and not retain:
            with contextlib.suppress(SaveError):
                self._connection.call("release", {"layout": self._layout.id}, timeout=30)
        if self._layout is not None and landed:
            self._layout.close()
        elif self._layout is not None:  # never unmap what a copy may still write into
            log.warning("a save's copy had not landed at close(); its mapping is left in place")
        self._layout = None
        self._connection.close()

    @property
    def daemon_info(self) -> Mapping[str, Any]:
        return self._connection.welcome

    # -- saving ------------------------------------------------------------------

    def guard(self, *optimizers: torch.optim.Optimizer) -> Guard:
        """Let non-blocking saves copy these optimizers' parameters and state late.

        Registers a step pre-hook on each optimizer: before it mutates anything, its step
        waits for the copy of a ``save(..., block=False)`` still in flight — on a CUDA
        device the step's stream waits for the copy's event, with no host wait. Which
        tensors that covers, and which are still copied before ``save()`` returns, is in
        ``shmstage_client.guard``. Call once per optimizer (several at once, or several
        calls); ``Guard.remove()`` takes the hooks off, ``close()`` removes every guard.
        """
        guard = Guard(self, optimizers)
        self._guards.append(guard)
        return guard

    def _forget_guard(self, guard: Guard) -> None:
        with contextlib.suppress(ValueError):
            self._guards.remove(guard)

    def save(
        self,
        state_dict: Any,
        path: str | os.PathLike[str],
        *,
        metadata: Mapping[str, Any] | None = None,
        offsets: Mapping[str, Sequence[int]] | None = None,
        block: bool = True,
    ) -> SaveHandle:
        """Stage ``state_dict`` and commit it to be written to the new directory ``path``.

        Returns once every tensor is copied: the caller may then change its tensors. The
        daemon then writes the checkpoint; ``SaveHandle.wait()`` reports the outcome, and
        ``SaveHandle.timings`` what the call cost. ``metadata``: JSON values stored in the
        manifest (step, run id, ...). ``offsets``: for tensors that are shards of a larger
        one, flat key -> offset of the shard in the global tensor; part of the structure,
        so a changed offset never reuses buffers. ``path`` is a new directory (it appears
        only once complete), or an existing directory without a checkpoint in it.

        ``block=False``: return as soon as the copy of the tensors that a ``guard()`` covers
        has started (on CUDA, queued on the side stream behind the caller's stream); every
        other tensor is still copied before returning, and plain values are taken now. The
        guarded optimizers' next ``step()`` waits for the copy; the Stager reports it to the
        daemon when it lands, and ``SaveHandle.staged()`` waits for that. Until then the
        caller must not change a covered tensor any other way. A refusal by the daemon
        then surfaces on the handle, and a trainer that dies before the copy landed leaves
        no checkpoint. The next save (or ``stage()``) first waits for this copy.

        The same as ``stage(...).commit(path, metadata=...)``, except that the destination
        is checked and opened before the copy, so a refused destination costs no copy, and
        the commit travels while the copy runs: the daemon checks and journals it
        meanwhile, and starts nothing until the client reports the copy complete.
        """
        clock = Clock()
        with collection_paused():
            self._await_landing(clock)
            prepared = Flattened.of(state_dict, offsets)
            prepared.check(self._layout.signature if self._layout is not None else None)
            fields = Fields.check(self.data_file, None, metadata)
            check_fits(prepared.encoded, prepared.packed_tree, fields.packed_metadata)
            clock.lap("prepare")
            destination = Destination(open_target(path, self.data_file, self._spares), fields)
            clock.lap("setup")
            try:
                staged = self._claim(prepared, clock)
            except BaseException:
                destination.abort()
                raise
            early = staged.send_commit(destination, ready=False)
            clock.lap("commit")
            try:
                pending = self._copy(staged, prepared, early, block)
            except BaseException:
                destination.abort()
                raise
            clock.lap("copy")
            if pending is not None:
                return self._defer(staged, destination, early, pending, clock)
            handle = staged.complete(destination, early)
            clock.lap("commit")
        self._staged(handle, clock.timings(), destination)
        self._add_slots_soon()
        return handle

    def stage(
        self,
        state_dict: Any,
        *,
        offsets: Mapping[str, Sequence[int]] | None = None,
        block: bool = True,
    ) -> Staged:
        """Copy ``state_dict`` into a staging slot now; name its destination later.

        Why two phases: some callers learn where a save goes only after the copy that
        stalls training — PyTorch DCP stages first and plans each rank's file afterwards.
        Returns once every tensor is copied, as ``save()`` does; the slot then stays this
        client's until ``Staged.commit()`` or ``Staged.cancel()``. ``offsets`` as in
        ``save()``; ``Staged.timings`` says what this call cost. ``block=False`` as in
        ``save()``: ``Staged.landing`` follows the copy, and ``commit()`` waits for it.
        """
        clock = Clock()
        with collection_paused():
            self._await_landing(clock)
            prepared = Flattened.of(state_dict, offsets)
            clock.lap("prepare")
            staged = self._claim(prepared, clock)
            pending = self._copy(staged, prepared, None, block)
            clock.lap("copy")
        staged.timings = clock.timings()
        self._add_slots_soon()
        if pending is not None:

            def note_timings(landing: Landing, error: BaseException | None) -> None:
                staged.timings = _landed(staged.timings, landing, clock)
                if error is not None:
                    raise error

            staged.landing = self._start_landing(pending, "a staged save", note_timings)
        return staged

    def _await_landing(self, clock: Clock) -> None:
        """Wait for the previous non-blocking save's copy and handover: it shares the
        layout, which this save may replace, and the connection's order of slots."""
        landing = self._in_flight
        if landing is None:
            return
        if not landing.settled(self.request_timeout):
            raise SaveTimeout(
                f"the previous save's copy ({landing.what}) did not land within "
                f"{self.request_timeout} s; this save was not started"
            )
        self._in_flight = None
        clock.lap("copy_wait")

    def _claim(self, prepared: Flattened, clock: Clock) -> Staged:
        """Reuse or register the layout and take a slot: the stall before the copy."""
        mapped = self._mapped(prepared)
        clock.lap("setup")
        slot = self._acquire(mapped)
        clock.lap("slot_wait")
        self._make_ready(mapped, slot)
        clock.lap("setup")
        return Staged(self, mapped, slot, prepared.encoded, prepared.packed_tree)

    def _copy(
        self, staged: Staged, prepared: Flattened, early: RequestHandle | None, block: bool
    ) -> PendingCopy | None:
        """Copy into the staged slot — the guarded tensors of a non-blocking save only
        started (returned) — and on failure hand it back, with the commit sent ahead of the
        copy (``early``) if there is one."""
        try:
            sources = [tensor for _, tensor in prepared.items]
            slot, groups = staged.mapped.slots[staged.slot], staged.mapped.groups
            deferred = None if block else self._deferrable(sources)
            if deferred is None:
                self._copier.copy(slot, sources, groups)
                return None
            return self._copier.start(slot, sources, groups, deferred)
        except BaseException:
            staged.abandon(early)
            raise

    def _deferrable(self, sources: list[torch.Tensor]) -> list[bool] | None:
        """Which tensors a guard covers (None: none, so nothing is deferred)."""
        if not self._guards:
            if not self._warned_unguarded:
                self._warned_unguarded = True
                log.warning(
                    "save(block=False) without a guard copies every tensor before returning: "
                    "call stager.guard(optimizer) so that the optimizer's parameters and "
                    "state are copied behind the next forward and backward"
                )
            return None
        coverage = Coverage(t for guard in self._guards for t in guard.tensors())
        return coverage.mask(sources)

    def _defer(
        self,
        staged: Staged,
        destination: Destination,
        early: RequestHandle,
        pending: PendingCopy,
        clock: Clock,
    ) -> SaveHandle:
        """A non-blocking save returns: its handle, and the handover to come."""
        path = destination.target.path
        assert path is not None
        handle = SaveHandle(self._tracker, staged._connection, None, path)
        # What save() cost, before the handover can add to it; staged: not yet.
        handle.timings = dataclasses.replace(clock.timings(), staged_seconds=0.0)
        self._tracker.track(handle)

        def hand_over(landing: Landing, error: BaseException | None) -> None:
            try:
                if error is not None:
                    staged.abandon(early)
                    destination.abort()
                    raise error
                handle.job = staged.hand_over(destination, early)
            except BaseException as exc:
                handle._failed_before_handover(exc)
                if handle._error is exc:
                    raise
                raise handle._error from exc  # what wait() raises, staged() raises too
            timings = _landed(handle.timings, landing, clock)
            self._background.submit(_report, handle, timings)
            handle._staged(timings)
            self._add_slots_soon()

        handle._landing = self._start_landing(pending, str(path), hand_over)
        if destination.target.pending:
            self._spares.prepare(path.parent)
        return handle

    def _start_landing(self, pending: PendingCopy, what: str, follow_up: FollowUp) -> Landing:
        """Follow a deferred copy until it lands, then run ``follow_up`` on the handover
        thread; until then it is the copy in flight that guards and the next save wait for."""
        landing = Landing(pending, what)
        self._in_flight = landing
        self._handover.submit(landing, follow_up)
        return landing

    def _staged(
        self, handle: SaveHandle, timings: SaveTimings, destination: Destination | None = None
    ) -> None:
        """A save is committed and its stall measured: track it, and off the caller's
        critical path tell the daemon the stall and make the next save's spare."""
        self._tracker.track(handle)
        self._background.submit(_report, handle, timings)
        target = destination.target if destination is not None else None
        if target is not None and target.pending:
            assert target.path is not None
            self._spares.prepare(target.path.parent)
        handle._staged(timings)

    def _reconnect_if_lost(self) -> None:
        """After a daemon restart: a new connection, and no layout (the next save registers).

        Saves that were in flight on the old connection already failed with DaemonLost; the
        old daemon's segments are unmapped here and were reaped by the new daemon.
        """
        if self._connection.alive:
            return
        log.warning("shmstaged connection was lost; reconnecting to %s", self._connection.path)
        if self._layout is not None:
            self._layout.settle(self.request_timeout)
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
        """Whether the current layout's slots used so far are registered with CUDA."""
        return self._layout is not None and bool(self._layout.pinned)

    def _mapped(self, prepared: Flattened) -> MappedLayout:
        """Reuse the registered layout when the structure is identical, else replace it.

        The steady-state check compares the tensors' own properties with those the layout
        was built from, so an unchanged structure costs neither a new Layout nor its
        validation (milliseconds at 10,000 tensors).
        """
        self._reconnect_if_lost()
        current = self._layout
        if current is not None and current.whole and current.signature == prepared.signature:
            return current
        layout = prepared.layout()
        if current is None or current.layout != layout or not current.whole:
            current = self._register(layout, self._wants_pin(prepared.items))
            self._layout = current
        current.signature = prepared.signature
        current.groups = device_groups([tensor.device for _, tensor in prepared.items])
        return current

    def _register(self, layout: Layout, pin: bool) -> MappedLayout:
        """Release the old layout, register ``layout`` and map its segments.

        Registers one slot when more are wanted: the first save sets up only the slot it
        fills (create, fault in, pin: ~0.13 s/GiB on an H100 host), and ``_add_slots``
        brings the others once that save is on its way. A retained layout the daemon
        hands back (adoption) comes with all the slots it kept.

        The segments' descriptors arrive in batches no larger than this process can hold
        (``receivable_fds``), each mapped and closed before the next is read.
        """
        if self._layout is not None:
            old, self._layout = self._layout, None
            old.retire()  # before the release frees its pages
            self._connection.call("release", {"layout": old.id}, timeout=self.request_timeout)
            old.settle(self.request_timeout)
            old.close()
        target = self.slots
        if target is None:
            target = self._connection.welcome.get("default_slots", 2)
        request: dict[str, Any] = {"tensors": layout.to_wire(), "max_fds": receivable_fds()}
        request["slots"], request["planned_slots"] = min(target, 1), target
        handle = self._connection.start("register", request)
        mapped: MappedLayout | None = None
        try:
            reply = handle.next(self.request_timeout)
            mapped = MappedLayout.receiving(reply.body["layout"], layout, reply.body["slots"])
            mapped.pin, mapped.target_slots = pin, target
            self._receive_segments(handle, mapped, reply.body["segments"])
            mapped.mark_ready()
            if reply.body.get("adopted"):
                log.info(
                    "layout %d: adopted %d segments the daemon retained (no new segment for them)",
                    mapped.id,
                    reply.body["adopted"],
                )
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        finally:
            handle.finish()
        return mapped

    def _receive_segments(self, handle: RequestHandle, mapped: MappedLayout, count: int) -> None:
        """Map the ``count`` segments announced (the slots the layout expects, no more), as
        their "segment_fds" frames arrive."""
        first = mapped.received_segments
        if first + count != mapped.expected_segments:
            raise DaemonLost(
                f"daemon announced {count} segments for {mapped.expected_segments - first} "
                f"(tensors x new slots) of layout {mapped.id}"
            )
        while mapped.received_segments < mapped.expected_segments:
            frame = handle.next(self.request_timeout)
            if frame.op != "segment_fds" or frame.body["first"] != (
                mapped.received_segments - first
            ):
                for fd in frame.fds:
                    os.close(fd)
                raise DaemonLost(f"unexpected {frame.op} while receiving segments")
            mapped.add_segments(frame.fds)  # map and close each batch as it arrives
        mapped.complete()

    def _add_slots_soon(self) -> None:
        """After a layout's first save: ask for the slots it still lacks, on the background
        thread, behind that save's report and spare directory."""
        with self._growth_lock:
            mapped = self._layout
            if mapped is None or mapped.growth is not None:
                return
            if mapped.slot_count < mapped.target_slots:
                mapped.grow(self._background, self._add_slots)

    def _add_slots(self, mapped: MappedLayout) -> None:
        """The daemon creates the slots; they are mapped, then faulted in on a few threads
        (page faults do not hold up the trainer's CUDA calls; pinning would, so it waits
        for each slot's first save, ``_make_ready``). A refusal (a limit, a full /dev/shm)
        leaves the layout with the slots it has: saves then wait for the previous write."""
        first = mapped.slot_count
        try:
            handle = self._connection.start(
                "add_slots",
                {"layout": mapped.id, "slots": mapped.target_slots, "max_fds": receivable_fds()},
            )
            try:
                reply = handle.next(self.request_timeout)
                announced = reply.body["slots"] - first
                try:
                    mapped.expect(announced)
                    self._receive_segments(handle, mapped, reply.body["segments"])
                except BaseException:
                    mapped.whole = False  # the daemon has slots this process lacks
                    raise
            finally:
                handle.finish()
            for index in range(first, mapped.slot_count):
                mapped.prefault_slot(index, BACKGROUND_SETUP_THREADS)
                mapped.mark_ready(index + 1)  # a save may take it already
        except (SaveError, OSError, ValueError) as exc:
            if self._layout is not mapped:  # released on purpose (the structure changed)
                log.debug("layout %d was released before its slots were added: %s", mapped.id, exc)
                return
            if not self._warned_slots:
                self._warned_slots = True
                log.warning(
                    "layout %d keeps %d of its %d slots: adding the others failed (%s); "
                    "each save waits for the previous checkpoint to be written%s",
                    mapped.id,
                    len(mapped.slots),
                    mapped.target_slots,
                    exc,
                    "" if mapped.whole else " (the next save registers the layout again)",
                )

    def _make_ready(self, mapped: MappedLayout, slot: int) -> None:
        """The granted slot mapped (it may be one still arriving) and, before its first
        copy, pinned: registering blocks the process's CUDA calls, so it is done here,
        inside the measured stall, and never behind the trainer's back."""
        if not mapped.wait_ready(slot, self.request_timeout):  # arriving, or faulted in
            with contextlib.suppress(SaveError):
                self._connection.call("cancel", {"layout": mapped.id, "slot": slot}, timeout=30)
            raise DaemonLost(
                f"slot {slot} of layout {mapped.id} was granted but its segments did not "
                f"arrive and get set up within {self.request_timeout} s"
            )
        mapped.pin_slot(slot)

    def _acquire(self, mapped: MappedLayout) -> int:
        if not self.wait_for_slot:  # not refused for a slot that is about to exist
            mapped.settle(self.request_timeout)
        reply = self._connection.call(
            "acquire",
            {"layout": mapped.id, "wait": self.wait_for_slot, "timeout": self.slot_timeout},
            timeout=None if self.slot_timeout is None else self.slot_timeout + 30,
        )
        if reply.body.get("leased"):
            log.warning(
                "save waited %.3f s for a slot leased by a reader restoring from it",
                reply.body["waited"],
            )
        return reply.body["slot"]


def _landed(timings: SaveTimings, landing: Landing, clock: Clock) -> SaveTimings:
    """``timings`` with a deferred copy's figures, once it has landed."""
    return dataclasses.replace(
        timings,
        deferred_copy_seconds=landing.copy_seconds,
        staged_seconds=time.perf_counter() - clock.started,
    )


def _report(handle: SaveHandle, timings: SaveTimings) -> None:
    """Tell the daemon what the save cost the trainer (for its log line and metrics)."""
    with contextlib.suppress(SaveError, OSError):
        handle._connection.post("report", {"job": handle.job, **timings.wire()})

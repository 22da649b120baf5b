"""``Stager``: save a state dict through shmstaged, top to bottom.

``save()`` blocks only while tensors are copied into shared memory. In order:

1. prepare — flatten and check the state dict (``statedict``); a refused one costs nothing;
2. destination — open where it goes (``destination``): usually a spare pending directory
   made in the background after the previous save, so no filesystem round trip here;
3. layout and slot — reuse the registered layout (or register one) and take a slot
   (``layouts``);
4. commit, sent ahead of the copy — the daemon checks and journals it meanwhile (a
   *prepared* commit);
5. copy — into the slot (``slots``);
6. ready — the daemon answers ``committed`` and owns the data: the trainer may modify or
   free its tensors, or even exit, and the checkpoint still completes (``staged``).

``reserve(state_dict)``, called once before the training loop, does step 3 ahead of time
for every slot (registered, added, faulted in, pinned), so that a save of that structure
starts at step 4 after a lookup.

``save()`` then returns a ``SaveHandle`` (``handle``) whose ``timings`` say what each step
cost; in the background it tells the daemon the stall and makes the next spare.

``save(..., block=False)`` returns after step 5 has only *started* for the tensors that a
guard covers (``guard``: the optimizers' parameters and state): their copy runs behind the
caller's next forward and backward (``deferred_copy``), the guarded optimizer's ``step()``
waits for it, and the Stager's handover thread does step 6 once it has landed
(``handover``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shmstage_client import handoff
from shmstage_client.collection import collection_paused
from shmstage_client.connection import DaemonConnection, RequestHandle, receivable_fds
from shmstage_client.errors import SaveError, SaveTimeout
from shmstage_client.save.deferred_copy import DeferredCopy
from shmstage_client.save.destination import (
    DEFAULT_DATA_FILE,
    Fields,
    Spares,
    check_data_file,
    open_target,
)
from shmstage_client.save.guard import Coverage, Guard
from shmstage_client.save.handle import Clock, ProgressCallback, SaveHandle, SaveTimings, Tracker
from shmstage_client.save.handover import FollowUp, Handover, Landing
from shmstage_client.save.layouts import Layouts
from shmstage_client.save.publish import Published, check_step, publish_saved
from shmstage_client.save.publish import offer as _offer
from shmstage_client.save.publish import publish as _publish
from shmstage_client.save.slots import CopyEngine
from shmstage_client.save.staged import Destination, Staged
from shmstage_client.statedict import Flattened, check_fits

log = logging.getLogger("shmstage.client")

__all__ = ["DEFAULT_DATA_FILE", "ReserveInfo", "Stager", "check_data_file"]


@dataclasses.dataclass(frozen=True)
class ReserveInfo:
    """What ``Stager.reserve`` set up: the layout, its slots (``pinned`` of them registered
    with CUDA), their bytes in /dev/shm, the seconds it took, and whether it did anything
    (False: the structure was already set up)."""

    layout: int
    slots: int
    pinned: int
    bytes: int
    seconds: float
    changed: bool


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

    ``reserve(state_dict)`` before the training loop sets up every slot at once — and
    pins each for CUDA — so that no save in the loop pays for setup (see ``reserve``).

    ``guard(optimizer)`` lets ``save(..., block=False)`` copy that optimizer's parameters and
    state behind the next forward and backward (see ``save``).

    ``gather_bytes``: the most device memory per CUDA device that gathering small tensors
    before their copy to the host may hold (None: ``SHMSTAGE_GATHER_BYTES``, default 64 MiB;
    0 copies every tensor on its own; see ``save.gather``).
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
        gather_bytes: int | None = None,
    ) -> None:
        if pin not in (True, False, "auto"):
            raise ValueError(f"pin={pin!r}: use True, False or 'auto'")
        self.pin = pin
        self._copier = CopyEngine(gather_bytes)
        check_data_file(data_file)
        self.slots = slots
        self.wait_for_slot = wait_for_slot
        self.slot_timeout = slot_timeout
        self.request_timeout = request_timeout
        self.data_file = data_file
        adopted = handoff.claim(socket)  # a restarted trainer's layout, from its restore
        self._connection = adopted.connection if adopted is not None else DaemonConnection(
            socket, client_name=f"shmstage-client pid {os.getpid()}"
        )
        # The descriptor table grown now for the batches of segments a first save receives:
        # growing it waits for an RCU grace period (``shmstage.descriptors``: 5-8 ms), which
        # the first save's stall would pay. Too few descriptors: that save says so.
        with contextlib.suppress(SaveError):
            receivable_fds()
        #: After each save: its report to the daemon, then the next spare, in that order.
        self._background = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="shmstage-background"
        )
        self._layouts = Layouts(self._connection, self._background, adopted)
        self._tracker = Tracker(progress, self._background)
        self._spares = Spares(self._background, data_file)
        self._guards: list[Guard] = []
        #: The last non-blocking save's copy until it has landed and been handed over; the
        #: guards hold optimizer steps back on it, the next save waits for it.
        self._in_flight: Landing | None = None
        self._handover = Handover()
        self._warned_unguarded = False

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
            guard.detach()
        for handle in self._tracker.unsettled():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(remaining)
            except SaveError as exc:
                log.warning("save %s did not complete: %s", handle.path, exc)
        self._handover.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._copier.close(wait=landed)
        self._spares.close()
        self._background.shutdown(wait=True)  # reports still queued go out first
        if not retain:
            self._layouts.release()
        self._layouts.close(landed=landed)
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
        ``shmstage_client.save.guard``. Call once per optimizer (several at once, or several
        calls); ``Guard.remove()`` takes the hooks off, ``close()`` removes every guard.
        """
        guard = Guard(
            optimizers,
            in_flight=lambda: self._in_flight,
            timeout=self.request_timeout,
            forget=self._forget_guard,
        )
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
        publish: str | None = None,
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

        ``publish``: also make the staged copy the newest version of this channel (see
        ``publish``), at step ``metadata["step"]``, once the daemon owns it — the same
        bytes, no second copy. Only with ``block=True``.
        """
        if publish is not None and not block:
            raise ValueError("save(..., publish=) needs block=True; publish() after it")
        step = None if publish is None else check_step((metadata or {}).get("step"))
        clock = Clock()
        with collection_paused():
            self._await_landing(clock)
            flat = Flattened.of(state_dict, offsets, structures=self._layouts.structures)
            flat.check(self._layouts.signature)
            fields = Fields.check(self.data_file, None, metadata)
            check_fits(flat.encoded_or_unset, flat.packed_tree, fields.packed_metadata)
            clock.lap("prepare")
            destination = Destination(open_target(path, self.data_file, self._spares), fields)
            clock.lap("setup")
            try:
                staged = self._claim(flat, clock)
            except BaseException:
                destination.abort()
                raise
            early = staged.send_commit(destination, ready=False)
            clock.lap("commit")
            try:
                deferred = self._copy(staged, flat, early, block)
            except BaseException:
                destination.abort()
                raise
            clock.lap("copy")
            if deferred is not None:
                return self._defer(staged, destination, early, deferred, clock)
            handle = staged.complete(destination, early)
            if publish is not None and step is not None and handle.job is not None:
                publish_saved(
                    self._connection, staged.layout_id, staged.slot, handle.job, publish, step,
                    (), self.request_timeout,
                )  # fmt: skip
            clock.lap("commit")
        self._staged(handle, clock.timings(), destination)
        self._layouts.add_slots_soon(self.request_timeout)
        return handle

    def publish(
        self,
        state_dict: Any,
        name: str,
        *,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        block: bool = True,
        share: Sequence[int | str] = (),
    ) -> Published:
        """Stage ``state_dict`` as ``save()`` does, but for readers on this node instead of
        a disk: its copy becomes version ``step`` of channel ``name`` (this user's), visible
        to subscribers (``shmstage_client.subscribe``) at once and whole, never torn.
        Returns once the version is visible. ``step`` must grow from one publish to the
        next; ``metadata``: JSON values the readers get with it; ``share``: groups whose
        members may subscribe too (allowed by shmstaged's ``[server] publish_groups``).
        The slots are the channel's ring; when every free one is pinned by readers, this
        waits for a pin to end (pins are bounded in time), or with ``wait_for_slot=False``
        raises SlotUnavailable. A Stager holds one layout: publishing (or saving) another
        structure releases the previous one, and the versions in it.

        ``block=False`` as in ``save()``: returns once the copy of the tensors a guard
        covers has started; the version becomes visible when it has landed (the handover
        thread publishes it), and ``Published.visible()`` waits for that."""
        return _publish(
            self, state_dict, name, step=step, metadata=metadata, share=share, block=block
        )

    def offer(self, name: str, *, share: Sequence[int | str] = ()) -> int:
        """Make the layout ``reserve()`` set up the ring of channel ``name`` now, before
        its first version: subscribers that ``prepare()`` map and register its slots while
        the first step trains, and read the first version at the ring's speed. ``share``
        as in ``publish()`` (other users may follow the channel from now). Returns how many
        subscribers were told. Publishing another structure makes a new ring as usual."""
        current = self._layouts.current
        return _offer(
            self._layouts.connection,
            None if current is None else current.id,
            name,
            share,
            self.request_timeout,
        )

    def reserve(
        self,
        state_dict: Any,
        *,
        offsets: Mapping[str, Sequence[int]] | None = None,
        timeout: float | None = None,
    ) -> ReserveInfo:
        """Set up, now, everything a save of ``state_dict``'s structure needs, so that no
        save in the training loop stalls for more than its copy.

        A new layout's first save otherwise registers it and sets up the slot it fills, and
        each later slot is pinned inside the first save that fills it (1.63 s, then 1.01 s,
        then 0.15 s for a 7.4 GiB state on an H100). Here the structure is flattened and
        checked as ``save()`` does it, the layout registered with every slot the Stager
        wants, each slot faulted in and, for CUDA tensors (``pin``), pinned — on this
        thread, because pinning holds up the process's other CUDA calls and the caller
        asked for it now. Nothing is copied to the slots: the tensors may be uninitialised.
        Small CUDA tensors are gathered once into the device's scratch, so that the first
        save does not pay for loading the gathers' kernels (CUDA loads them lazily), and the
        state dict's structure is remembered, so that no save of it flattens it again.

        Call it with the state dict the loop will save (the same keys, dtypes, shapes,
        devices and ``offsets``); a save of another structure then registers its own layout
        as usual, releasing this one. Calling it again for the same structure does nothing.
        Raises what ``save()`` would: UnsupportedValue naming the key, DaemonRefused for a
        limit or a full /dev/shm. ``timeout``: for each request (default
        ``request_timeout``).
        """
        started = time.perf_counter()
        timeout = self.request_timeout if timeout is None else timeout
        with collection_paused():
            self._await_landing(Clock())  # a copy in flight may still use the layout
            self._layouts.structures.expect_repeats()  # remembered here, not in save 1
            flat = Flattened.of(state_dict, offsets, structures=self._layouts.structures)
            flat.check(self._layouts.signature)
            self._reconnect_if_lost()
            mapped, changed = self._layouts.reserve(
                flat, slots=self.slots, pin=self.pin, timeout=timeout
            )
            # The gathers' plans and scratch (save.gather), for blocking saves and guarded
            # non-blocking ones: made here, they cost the loop's first save nothing.
            masks = [None, self._deferrable(flat.tensors)] if self._guards else [None]
            for deferred in masks:
                self._copier.prepare(
                    mapped.slots[0], flat.tensors, mapped.groups, deferred, mapped.layout
                )
        return ReserveInfo(
            layout=mapped.id,
            slots=len(mapped.slots),
            pinned=len(mapped.pinned),
            bytes=len(mapped.slots) * sum(mapped.layout.packing().sizes),
            seconds=time.perf_counter() - started,
            changed=changed,
        )

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
            flat = Flattened.of(state_dict, offsets, structures=self._layouts.structures)
            clock.lap("prepare")
            staged = self._claim(flat, clock)
            deferred = self._copy(staged, flat, None, block)
            clock.lap("copy")
        staged.timings = clock.timings()
        self._layouts.add_slots_soon(self.request_timeout)
        if deferred is not None:

            def note_timings(landing: Landing, error: BaseException | None) -> None:
                staged.timings = _landed(staged.timings, landing, clock)
                if error is not None:
                    raise error

            staged.landing = self._start_landing(deferred, "a staged save", note_timings)
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

    def _claim(self, flat: Flattened, clock: Clock) -> Staged:
        """Reuse or register the layout and take a slot: the stall before the copy."""
        self._reconnect_if_lost()
        timeout = self.request_timeout

        def plan_copy(views: Any, groups: Any, layout: Any) -> None:
            """A new layout's first copy planned while the daemon makes its segments."""
            self._copier.prepare(views, flat.tensors, groups, None, layout)

        mapped = self._layouts.mapped(
            flat, slots=self.slots, pin=self.pin, timeout=timeout, meanwhile=plan_copy
        )
        clock.lap("setup")
        slot = self._layouts.acquire(
            mapped, wait=self.wait_for_slot, slot_timeout=self.slot_timeout, timeout=timeout
        )
        clock.lap("slot_wait")
        self._layouts.make_ready(mapped, slot, timeout)
        clock.lap("setup")
        return Staged(
            mapped,
            slot,
            flat.encoded_or_unset,
            flat.packed_tree,
            connection=self._connection,  # the daemon gives the slot to this session
            tracker=self._tracker,
            request_timeout=timeout,
            data_file=self.data_file,
        )

    def _copy(
        self, staged: Staged, flat: Flattened, early: RequestHandle | None, block: bool
    ) -> DeferredCopy | None:
        """Copy into the staged slot — the guarded tensors of a non-blocking save only
        started (returned) — and on failure hand it back, with the commit sent ahead of the
        copy (``early``) if there is one."""
        try:
            sources = flat.tensors
            slot, groups = staged.mapped.slots[staged.slot], staged.mapped.groups
            layout = staged.mapped.layout
            deferred = None if block else self._deferrable(sources)
            if deferred is None:
                self._copier.copy(slot, sources, groups, layout)
                return None
            return self._copier.start(slot, sources, groups, deferred, layout)
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
        deferred: DeferredCopy,
        clock: Clock,
    ) -> SaveHandle:
        """A non-blocking save returns: its handle, and the handover to come."""
        path = destination.target.path
        assert path is not None
        handle = SaveHandle(self._tracker, staged.connection, None, path)
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
                settled = handle.failed_before_handover(exc)
                if settled is exc:
                    raise
                raise settled from exc  # what wait() raises, staged() raises too
            self._tracker.staged(handle, _landed(handle.timings, landing, clock))
            self._layouts.add_slots_soon(self.request_timeout)

        handle.follow(self._start_landing(deferred, str(path), hand_over))
        if destination.target.pending:
            self._spares.prepare(path.parent)
        return handle

    def _start_landing(self, deferred: DeferredCopy, what: str, follow_up: FollowUp) -> Landing:
        """Follow a deferred copy until it lands, then run ``follow_up`` on the handover
        thread; until then it is the copy in flight that guards and the next save wait for."""
        landing = Landing(deferred, what)
        self._in_flight = landing
        self._handover.submit(landing, follow_up)
        return landing

    def _staged(
        self, handle: SaveHandle, timings: SaveTimings, destination: Destination | None = None
    ) -> None:
        """A save is committed and its stall measured: track it, and off the caller's
        critical path tell the daemon the stall and make the next save's spare."""
        self._tracker.staged(handle, timings)
        target = destination.target if destination is not None else None
        if target is not None and target.pending:
            assert target.path is not None
            self._spares.prepare(target.path.parent)

    def _reconnect_if_lost(self) -> None:
        """After a daemon restart: a new connection, and no layout (the next save registers).

        Saves that were in flight on the old connection already failed with DaemonLost; the
        old daemon's segments are unmapped here and were reaped by the new daemon.
        """
        if self._connection.alive:
            return
        log.warning("shmstaged connection was lost; reconnecting to %s", self._connection.path)
        self._layouts.drop(self.request_timeout)
        self._connection.close()
        self._connection = DaemonConnection(
            self._connection.path, client_name=f"shmstage-client pid {os.getpid()}"
        )
        self._layouts.connection = self._connection

    @property
    def pinned(self) -> bool:
        """Whether the current layout's slots used so far are registered with CUDA."""
        return self._layouts.pinned

def _landed(timings: SaveTimings, landing: Landing, clock: Clock) -> SaveTimings:
    """``timings`` with a deferred copy's figures, once it has landed."""
    return dataclasses.replace(
        timings,
        deferred_copy_seconds=landing.copy_seconds,
        staged_seconds=time.perf_counter() - clock.started,
    )


"""The layout a Stager registered, as this process holds it, and the requests that keep it.

A save's structure is registered once (``register``) and reused while it holds: the
steady-state check compares the tensors' own properties with those the layout was built
from, so an unchanged structure costs neither a new Layout nor its validation. A new
structure releases the old layout and registers its own.

A new layout's first save sets up only the slot it fills (create, fault in, pin: ~0.13
s/GiB on an H100 host); the others come on a background thread once that save is on its
way (``add_slots``), mapped and faulted in, each pinned just before its first copy. Every
save then takes a slot (``acquire``), waits until it has arrived and pinned it
(``make_ready``). ``reserve``, before the training loop, does all of that at once on the
caller's thread: every slot added, faulted in and pinned, so no save sets anything up.
``slots`` (``MappedLayout``) maps the segments and copies into them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from shmstage import segment
from shmstage.collection import collect_young
from shmstage.layout import Layout
from shmstage_client.connection import DaemonConnection, RequestHandle, receivable_fds
from shmstage_client.errors import DaemonLost, SaveError
from shmstage_client.handoff import AdoptedLayout
from shmstage_client.save.slots import MappedLayout, device_groups
from shmstage_client.statedict import Flattened, Signature
from shmstage_client.structure import Structures

log = logging.getLogger("shmstage.client")

#: Threads that fault in slots added after a first save: they compete with training for
#: memory bandwidth (on an H100 host, 8 threads slowed a training step ~1.1x while they
#: ran; page faults never wait for the GPU), so fewer than a first save's own setup.
BACKGROUND_SETUP_THREADS = 4


class Layouts:
    """A Stager's registered layout (``current``): reused, registered, grown, released.

    Built with the Stager's connection (a new one after a daemon restart, once ``drop``
    unmapped the old daemon's layout) and its background thread, which adds slots behind
    each save's report and spare directory. The Stager's settings (``slots``, ``pin``,
    ``wait_for_slot``, ``slot_timeout``, ``request_timeout``) come with each call, as they
    are at that call.
    """

    def __init__(
        self,
        connection: DaemonConnection,
        background: concurrent.futures.Executor,
        adopted: AdoptedLayout | None = None,
    ) -> None:
        self.connection = connection
        self._background = background
        self.current: MappedLayout | None = None
        #: The structure of the state dict saved last, for the next save to find in bulk.
        self.structures = Structures()
        if adopted is not None:  # a restore's, mapped and pinned (``connection`` owns it)
            self.current = MappedLayout.of_regions(
                adopted.layout_id, adopted.layout, adopted.regions, adopted.pinned
            )
            self.current.target_slots = adopted.target_slots
        self._warned_slots = False
        self._growth_lock = threading.Lock()  # the handover thread may ask too

    @property
    def signature(self) -> Signature | None:
        """The tensor properties the current layout was last matched against."""
        return self.current.signature if self.current is not None else None

    @property
    def pinned(self) -> bool:
        """Whether the current layout's slots used so far are registered with CUDA."""
        return self.current is not None and bool(self.current.pinned)

    def mapped(
        self,
        flat: Flattened,
        *,
        slots: int | None,
        pin: bool | str,
        timeout: float,
        meanwhile: Meanwhile | None = None,
    ) -> MappedLayout:
        """Reuse the registered layout when the structure is identical, else replace it.

        The steady-state check compares the tensors' own properties with those the layout
        was built from, so an unchanged structure costs neither a new Layout nor its
        validation (milliseconds at 10,000 tensors). ``meanwhile``: work a registration
        does while the daemon makes the segments (see ``Meanwhile``).
        """
        current = self.current
        if current is not None and current.whole and flat.matches(current.signature):
            return current
        layout = flat.layout()
        groups = device_groups([device for _, _, _, device in flat.signature.properties])
        if current is None or current.layout != layout or not current.whole:
            wants = _wants_pin(pin, groups)
            current = self._register(layout, slots, wants, timeout, meanwhile, groups)
            self.current = current
        current.signature = flat.signature
        current.groups = groups
        return current

    def acquire(
        self, mapped: MappedLayout, *, wait: bool, slot_timeout: float | None, timeout: float
    ) -> int:
        """Take one of the layout's slots (waiting for one, with ``wait``)."""
        if not wait:  # not refused for a slot that is about to exist
            mapped.settle(timeout)
        reply = self.connection.call(
            "acquire",
            {"layout": mapped.id, "wait": wait, "timeout": slot_timeout},
            timeout=None if slot_timeout is None else slot_timeout + 30,
        )
        if reply.body.get("leased"):
            log.warning(
                "save waited %.3f s for a slot leased by a reader restoring from it",
                reply.body["waited"],
            )
        return reply.body["slot"]

    def make_ready(self, mapped: MappedLayout, slot: int, timeout: float) -> None:
        """The granted slot mapped (it may be one still arriving) and, before its first
        copy, pinned: registering blocks the process's CUDA calls, so it is done here,
        inside the measured stall, and never behind the trainer's back. A slot that is not
        pinned has its pages mapped in instead (``touch_slot``)."""
        if not mapped.wait_ready(slot, timeout):  # arriving, or faulted in
            with contextlib.suppress(SaveError):
                self.connection.call("cancel", {"layout": mapped.id, "slot": slot}, timeout=30)
            raise DaemonLost(
                f"slot {slot} of layout {mapped.id} was granted but its segments did not "
                f"arrive and get set up within {timeout} s"
            )
        mapped.pin_slot(slot)
        if slot not in mapped.pinned:  # an unpinned copy would fault each page in
            mapped.touch_slot(slot)

    def add_slots_soon(self, timeout: float) -> None:
        """After a layout's first save: ask for the slots it still lacks, on the background
        thread, behind that save's report and spare directory."""
        with self._growth_lock:
            mapped = self.current
            if mapped is None or mapped.growth is not None:
                return
            if mapped.slot_count < mapped.target_slots:
                mapped.grow(self._background, lambda grown: self._add_slots(grown, timeout))

    def drop(self, timeout: float) -> None:
        """After a daemon restart: unmap the layout, whose segments were the old daemon's
        (the new one reaped them); the next save registers it again."""
        if self.current is not None:
            self.current.settle(timeout)
            self.current.close()
            self.current = None

    def release(self) -> None:
        """Give the layout back to the daemon (a close that does not retain it)."""
        if self.current is not None and self.connection.alive:
            with contextlib.suppress(SaveError):
                self.connection.call("release", {"layout": self.current.id}, timeout=30)

    def close(self, *, landed: bool) -> None:
        """Unmap the layout, unless a copy may still write into it (``landed`` False)."""
        if self.current is not None and landed:
            self.current.close()
        elif self.current is not None:  # never unmap what a copy may still write into
            log.warning("a save's copy had not landed at close(); its mapping is left in place")
        self.current = None

    def _register(
        self,
        layout: Layout,
        slots: int | None,
        pin: bool,
        timeout: float,
        meanwhile: Meanwhile | None = None,
        groups: dict[torch.device, list[int]] | None = None,
    ) -> MappedLayout:
        """Release the old layout, register ``layout`` and map its segments.

        Registers one slot when more are wanted: the first save sets up only the slot it
        fills, and ``_add_slots`` brings the others once that save is on its way. A
        retained layout the daemon hands back (adoption) comes with all the slots it kept.

        The segments' descriptors arrive in batches no larger than this process can hold
        (``receivable_fds``), each mapped and closed before the next is read. While the
        daemon makes them, this process reserves the slot's address space, builds its views
        and runs ``meanwhile`` (the first copy's plan).
        """
        if self.current is not None:
            old, self.current = self.current, None
            old.retire()  # before the release frees its pages
            self.connection.call("release", {"layout": old.id}, timeout=timeout)
            old.settle(timeout)
            old.close()
        target = slots
        if target is None:
            target = self.connection.welcome.get("default_slots", 2)
        request: dict[str, Any] = {"tensors": layout.to_wire(), "max_fds": receivable_fds()}
        request["slots"], request["planned_slots"] = min(target, 1), target
        handle = self.connection.start("register", request)
        mapped: MappedLayout | None = None
        try:
            # The slot's address space and views while the daemon makes its segments; the
            # layout's number once it answered.
            mapped = MappedLayout.receiving(0, layout, request["slots"])
            if meanwhile is not None and groups is not None and mapped.slot_count:
                _while_waiting(meanwhile, mapped.announced_views(0), groups, layout)
            collect_young()  # what the save made so far, not when it returns (``collection``)
            reply = handle.next(timeout)
            mapped.id = reply.body["layout"]
            if reply.body["slots"] < mapped.slot_count:
                raise DaemonLost(
                    f"daemon registered layout {mapped.id} with {reply.body['slots']} slots "
                    f"for the {mapped.slot_count} asked for"
                )
            mapped.expect(reply.body["slots"] - mapped.slot_count)  # an adopted layout's
            mapped.pin, mapped.target_slots = pin, target
            self._receive_segments(handle, mapped, reply.body["segments"], timeout)
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

    def _receive_segments(
        self, handle: RequestHandle, mapped: MappedLayout, count: int, timeout: float
    ) -> None:
        """Map the ``count`` segments announced (the slots the layout expects, no more), as
        their "segment_fds" frames arrive."""
        first = mapped.received_segments
        if first + count != mapped.expected_segments:
            raise DaemonLost(
                f"daemon announced {count} segments for {mapped.expected_segments - first} "
                f"(tensors x new slots) of layout {mapped.id}"
            )
        while mapped.received_segments < mapped.expected_segments:
            frame = handle.next(timeout)
            if frame.op != "segment_fds" or frame.body["first"] != (
                mapped.received_segments - first
            ):
                for fd in frame.fds:
                    os.close(fd)
                raise DaemonLost(f"unexpected {frame.op} while receiving segments")
            mapped.add_segments(frame.fds)  # map and close each batch as it arrives
        mapped.complete()

    def reserve(
        self, flat: Flattened, *, slots: int | None, pin: bool | str, timeout: float
    ) -> tuple[MappedLayout, bool]:
        """Everything a first save of ``flat``'s structure would set up, now, on the
        caller's thread: the layout registered (unless it already is), every slot it wants
        added, each faulted in and, with ``pin``, pinned. Returns the layout and whether
        anything was set up; a refusal raises, as the save would. A slot already set up
        (by an earlier save or reserve) is left alone: it may hold a checkpoint."""
        if self.current is not None:
            self.current.settle(timeout)  # a background add_slots under way ends first
        before = self.current
        mapped = self.mapped(flat, slots=slots, pin=pin, timeout=timeout)
        fresh = mapped is not before
        if fresh:  # the registration's slots: nothing has copied into them yet
            for index in range(mapped.slot_count):
                mapped.prefault_slot(index, segment.MAX_SETUP_THREADS)
        if mapped.slot_count < mapped.target_slots:
            fresh = True
            self._grow_now(mapped, timeout, segment.MAX_SETUP_THREADS)
        pinned_before = len(mapped.pinned)
        for index in range(mapped.slot_count):
            mapped.pin_slot(index)  # once per slot: a pinned one returns at once
        return mapped, fresh or len(mapped.pinned) > pinned_before

    def _add_slots(self, mapped: MappedLayout, timeout: float) -> None:
        """The background request for the slots a layout's first save did not set up:
        faulted in on a few threads (page faults do not hold up the trainer's CUDA calls;
        pinning would, so it waits for each slot's first save, ``make_ready``). A refusal
        (a limit, a full /dev/shm) leaves the layout with the slots it has: saves then wait
        for the previous write."""
        try:
            self._grow_now(mapped, timeout, BACKGROUND_SETUP_THREADS)
        except (SaveError, OSError, ValueError) as exc:
            if self.current is not mapped:  # released on purpose (the structure changed)
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

    def _grow_now(self, mapped: MappedLayout, timeout: float, threads: int) -> None:
        """The daemon creates the slots the layout still lacks; they are mapped, then
        faulted in on ``threads`` threads, each marked ready as it is. Raises a refusal."""
        first = mapped.slot_count
        handle = self.connection.start(
            "add_slots",
            {"layout": mapped.id, "slots": mapped.target_slots, "max_fds": receivable_fds()},
        )
        try:
            reply = handle.next(timeout)
            announced = reply.body["slots"] - first
            try:
                mapped.expect(announced)
                self._receive_segments(handle, mapped, reply.body["segments"], timeout)
            except BaseException:
                mapped.whole = False  # the daemon has slots this process lacks
                raise
        finally:
            handle.finish()
        for index in range(first, mapped.slot_count):
            mapped.prefault_slot(index, threads)
            mapped.mark_ready(index + 1)  # a save may take it already


#: What a registration may do while the daemon makes the segments, given the first slot's
#: views (shapes, strides and dtypes only: their memory is not mapped yet, and touching it
#: faults), the tensors' places by device and the layout: the Stager plans the first save's
#: copy there (``CopyEngine.prepare``), which it would otherwise do inside the copy.
Meanwhile = Callable[[Sequence[torch.Tensor], Mapping[torch.device, Sequence[int]], Layout], None]


def _while_waiting(
    meanwhile: Meanwhile,
    views: Sequence[torch.Tensor],
    groups: Mapping[torch.device, Sequence[int]],
    layout: Layout,
) -> None:
    """Run ``meanwhile``; a failure there costs nothing but its head start (the copy does
    the same work again, and reports what fails then)."""
    try:
        meanwhile(views, groups, layout)
    except Exception as exc:  # never a registration's failure
        log.debug("work ahead of the first copy failed (%s); the copy does it instead", exc)


def _wants_pin(pin: bool | str, devices: Iterable[torch.device]) -> bool:
    """Whether to page-lock the segments for CUDA: ``pin="auto"`` does so when the state
    dict holds CUDA tensors (``devices``: where its tensors are, each device once)."""
    if pin == "auto":
        return any(device.type == "cuda" for device in devices)
    return bool(pin)

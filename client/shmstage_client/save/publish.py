"""Publishing: a state dict staged exactly as a save stages it, handed to readers on this
node instead of to a disk (``Stager.publish``; the daemon's side is ``channels``).

The steps are a save's first ones — prepare, layout and slot, copy (``stager``) — and then,
instead of a commit, one "publish": the daemon makes the filled slot version ``step`` of the
channel, visible to its subscribers at once (``shmstage_client.subscribe``). Nothing goes to
disk. The layout's slots are the channel's ring, which readers map once and keep.
``save(..., publish=name)`` publishes the slot its commit just handed over (``publish_saved``):
the same bytes, no second copy.

A sharded publisher's rank (``shmstage_client.dcp.ShmStagePublisher``) publishes its
``Part`` of each version: its local shards with their offsets and global shapes; the
daemon shows the version once every rank's part of that step arrived. A sharded trainer's
DCP checkpoint (``ShmStageWriter.publish_next``) publishes each rank's committed slot as
its part the same way (``publish_saved`` with a ``Part``): no second copy either.

The Stager is not thread-safe, and neither is this: it runs on the caller's thread, with
the Stager's own steps (``Staging``: ``_claim``, ``_copy``), as ``save`` does. ``Staging``
names the few steps it takes, so that this module needs nothing else of the Stager (the
Stager imports it, not the other way round).
"""

from __future__ import annotations

import dataclasses
import grp
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from shmstage_client.collection import collection_paused
from shmstage_client.connection import DaemonConnection, RequestHandle
from shmstage_client.errors import SaveError
from shmstage_client.save.deferred_copy import DeferredCopy
from shmstage_client.save.destination import Fields
from shmstage_client.save.handle import Clock, SaveTimings
from shmstage_client.save.handover import FollowUp, Landing
from shmstage_client.save.layouts import Layouts
from shmstage_client.save.staged import Staged
from shmstage_client.statedict import Flattened, check_fits


class Staging(Protocol):
    """The steps of a save that a publish takes (the Stager's): wait for a copy in flight,
    claim a slot of the layout, copy into it, follow a deferred copy until it lands."""

    data_file: str
    request_timeout: float
    _layouts: Layouts

    def _await_landing(self, clock: Clock) -> None: ...

    def _claim(self, flat: Flattened, clock: Clock) -> Staged: ...

    def _copy(
        self, staged: Staged, flat: Flattened, early: RequestHandle | None, block: bool
    ) -> DeferredCopy | None: ...

    def _start_landing(
        self, deferred: DeferredCopy, what: str, follow_up: FollowUp
    ) -> Landing: ...


@dataclasses.dataclass(frozen=True)
class Part:
    """A rank's part of a sharded version: which of how many (the ranks publishing on
    this node), each shard's global shape (by flat key; its offsets are the flattened
    state's), and how long the step's first part waits for the others in the daemon."""

    index: int
    count: int
    shapes: Mapping[str, Sequence[int]]
    within: float = 60.0


@dataclasses.dataclass(frozen=True)
class Published:
    """A version made visible: its channel, its step, how many subscribers were told at
    once (None until a non-blocking publish's copy has landed), and what the call cost the
    caller (``timings.stall_seconds``)."""

    name: str
    step: int
    subscribers: int | None
    timings: SaveTimings
    #: A non-blocking publish's copy, until it landed and the version became visible.
    landing: Landing | None = None
    #: For a sharded version's part: whether this part completed the version (False: it
    #: waits in the daemon for other ranks' parts of the step, and ``subscribers`` is 0).
    #: None for a part whose copy was still in flight at return: ``visible()`` returns it.
    complete: bool | None = True
    #: Filled by a non-blocking publish's hand-over: whether its part completed the version.
    _handed: list[bool] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def visible(self, timeout: float | None = None) -> bool:
        """Until the part is handed over (at once for a blocking publish), then whether it
        completed the version — True for a one-part version, which is then visible; a part
        that did not waits in the daemon for the other ranks' parts. Raises the error that
        kept it from the daemon, or SaveTimeout."""
        if self.landing is None:
            return bool(self.complete)
        self.landing.wait(timeout)
        return self._handed[0]


def share_gids(share: Iterable[int | str]) -> list[int]:
    """Group names or gids to share a channel with, as gids."""
    gids = []
    for group in share:
        if isinstance(group, int) and not isinstance(group, bool):
            gids.append(group)
        elif isinstance(group, str):
            gids.append(grp.getgrnam(group).gr_gid)
        else:
            raise TypeError(f"share={group!r}: give group names or gids")
    return gids


def check_step(step: Any) -> int:
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step={step!r}: a version's step is an int")
    return step


def publish(
    stager: Staging,
    state_dict: Any,
    name: str,
    *,
    step: int,
    metadata: Mapping[str, Any] | None,
    share: Iterable[int | str],
    block: bool = True,
) -> Published:
    """``Stager.publish``'s work (see there)."""
    return publish_flat(
        stager, lambda: Flattened.of(state_dict, None), name, step=step, metadata=metadata,
        share=share, block=block,
    )  # fmt: skip


def publish_flat(
    stager: Staging,
    flatten: Callable[[], Flattened],
    name: str,
    *,
    step: int,
    metadata: Mapping[str, Any] | None,
    share: Iterable[int | str],
    block: bool = True,
    part: Part | None = None,
) -> Published:
    """``publish`` of the state that ``flatten`` flattens (once a copy in flight landed);
    with ``part``, one rank's part of a sharded version, its shards' offsets in the
    flattened state (``Published.complete`` says whether it was the last to arrive)."""
    check_step(step)
    gids = share_gids(share)
    clock = Clock()
    with collection_paused():
        stager._await_landing(clock)
        flat = flatten()
        flat.check(stager._layouts.signature)
        fields = Fields.check(stager.data_file, None, metadata)
        check_fits(flat.encoded, flat.packed_tree, fields.packed_metadata)
        clock.lap("prepare")
        staged = stager._claim(flat, clock)
        deferred = stager._copy(staged, flat, None, block)
        clock.lap("copy")
        body = {
            "layout": staged.layout_id,
            "slot": staged.slot,
            "name": name,
            "step": step,
            "share": gids,
        }
        if part is not None:
            body.update(part=part.index, parts=part.count, within=part.within)
            body["shapes"] = {key: list(shape) for key, shape in part.shapes.items()}
        prepacked = {"tree": flat.packed_tree, "metadata": fields.packed_metadata}
        visible = True

        def make_visible() -> int:
            nonlocal visible
            try:
                reply = _call(staged.connection, body, prepacked, stager.request_timeout)
            except BaseException:
                staged.cancel()  # refused or lost: the slot goes back, nothing is visible
                raise
            visible = bool(reply.get("visible", True))
            return int(reply["subscribers"])

        if deferred is not None:  # the version becomes visible once the copy has landed

            handed: list[bool] = []

            def hand_over(landing: Landing, error: BaseException | None) -> None:
                if error is not None:
                    staged.cancel()
                    raise error
                make_visible()
                handed.append(visible)
                stager._layouts.add_slots_soon(stager.request_timeout)

            what = f"version {step} of channel {name!r}"
            landing = stager._start_landing(deferred, what, hand_over)
            return Published(
                name, step, None, clock.timings(), landing,
                complete=None if part is not None else True, _handed=handed,
            )  # fmt: skip
        subscribers = make_visible()
        clock.lap("commit")
    stager._layouts.add_slots_soon(stager.request_timeout)
    return Published(name, step, subscribers, clock.timings(), complete=visible)


def offer(
    connection: DaemonConnection, layout: int | None, name: str, share: Iterable[int | str],
    timeout: float,
) -> int:
    """``Stager.offer``'s work (see there): the subscribers told."""
    if layout is None:
        raise SaveError(
            f"offer({name!r}) names the layout this Stager will publish from: call "
            "reserve(state_dict) first"
        )
    body = {"layout": layout, "name": name, "share": share_gids(share)}
    return int(connection.call("offer", body, timeout=timeout).body["subscribers"])


def publish_saved(
    connection: DaemonConnection,
    layout: int,
    slot: int,
    job: int,
    name: str,
    step: int,
    share: Iterable[int | str],
    timeout: float,
    *,
    part: Part | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[int, bool]:
    """Publish the slot a save's commit ``job`` just handed to the daemon: its tree is the
    commit's, and so is its metadata unless ``metadata`` gives the readers' own. With
    ``part``, one rank's part of a sharded version (a DCP rank's checkpoint, see
    ``ShmStageWriter.publish_next``). Returns how many subscribers were told, and whether
    the version is visible (False: a part waiting for the other ranks' parts)."""
    body: dict[str, Any] = {"layout": layout, "slot": slot, "job": job, "name": name}
    body.update(step=check_step(step), share=share_gids(share))
    if part is not None:
        body.update(part=part.index, parts=part.count, within=part.within)
        body["shapes"] = {key: list(shape) for key, shape in part.shapes.items()}
    if metadata is not None:
        body["metadata"] = dict(metadata)
    reply = _call(connection, body, None, timeout)
    return int(reply["subscribers"]), bool(reply.get("visible", True))


def _call(
    connection: DaemonConnection,
    body: dict[str, Any],
    prepacked: Mapping[str, bytes] | None,
    timeout: float,
) -> dict[str, Any]:
    handle = connection.start("publish", body, prepacked=prepacked)
    try:
        return handle.next(timeout).body
    finally:
        handle.finish()

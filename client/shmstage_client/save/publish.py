"""Publishing: a state dict staged exactly as a save stages it, handed to readers on this
node instead of to a disk (``Stager.publish``; the daemon's side is ``channels``).

The steps are a save's first ones — prepare, layout and slot, copy (``stager``) — and then,
instead of a commit, one "publish": the daemon makes the filled slot version ``step`` of the
channel, visible to its subscribers at once (``shmstage_client.subscribe``). Nothing goes to
disk. The layout's slots are the channel's ring, which readers map once and keep.
``save(..., publish=name)`` publishes the slot its commit just handed over (``publish_saved``):
the same bytes, no second copy.

The Stager is not thread-safe, and neither is this: it runs on the caller's thread, with
the Stager's own steps (``_claim``, ``_copy``), as ``save`` does.
"""

from __future__ import annotations

import dataclasses
import grp
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from shmstage_client.collection import collection_paused
from shmstage_client.connection import DaemonConnection
from shmstage_client.save.destination import Fields
from shmstage_client.save.handle import Clock, SaveTimings
from shmstage_client.statedict import Flattened, check_fits

if TYPE_CHECKING:
    from shmstage_client.save.handover import Landing
    from shmstage_client.save.stager import Stager


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

    def visible(self, timeout: float | None = None) -> None:
        """Until the version is visible (at once for a blocking publish); raises the error
        that kept it from becoming visible, or SaveTimeout."""
        if self.landing is not None:
            self.landing.wait(timeout)


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
    stager: Stager,
    state_dict: Any,
    name: str,
    *,
    step: int,
    metadata: Mapping[str, Any] | None,
    share: Iterable[int | str],
    block: bool = True,
) -> Published:
    """``Stager.publish``'s work (see there)."""
    check_step(step)
    gids = share_gids(share)
    clock = Clock()
    with collection_paused():
        stager._await_landing(clock)
        flat = Flattened.of(state_dict, None)
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
        prepacked = {"tree": flat.packed_tree, "metadata": fields.packed_metadata}

        def make_visible() -> int:
            try:
                reply = _call(staged.connection, body, prepacked, stager.request_timeout)
            except BaseException:
                staged.cancel()  # refused or lost: the slot goes back, nothing is visible
                raise
            return int(reply["subscribers"])

        if deferred is not None:  # the version becomes visible once the copy has landed

            def hand_over(landing: Landing, error: BaseException | None) -> None:
                if error is not None:
                    staged.cancel()
                    raise error
                make_visible()
                stager._layouts.add_slots_soon(stager.request_timeout)

            what = f"version {step} of channel {name!r}"
            landing = stager._start_landing(deferred, what, hand_over)
            return Published(name, step, None, clock.timings(), landing)
        subscribers = make_visible()
        clock.lap("commit")
    stager._layouts.add_slots_soon(stager.request_timeout)
    return Published(name, step, subscribers, clock.timings())


def publish_saved(
    connection: DaemonConnection,
    layout: int,
    slot: int,
    job: int,
    name: str,
    step: int,
    share: Iterable[int | str],
    timeout: float,
) -> int:
    """Publish the slot a save's commit ``job`` just handed to the daemon: its tree and
    metadata are the commit's. Returns how many subscribers were told."""
    body = {"layout": layout, "slot": slot, "job": job, "name": name, "step": step}
    body["share"] = share_gids(share)
    return int(_call(connection, body, None, timeout)["subscribers"])


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

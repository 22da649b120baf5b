"""Descriptors the daemon passed to clients that they have not read yet, charged per user.

The kernel charges a descriptor sent with SCM_RIGHTS to the *sending* user until the
receiver reads it or its socket is gone (``unix_inflight``); once the daemon user's count
passes its RLIMIT_NOFILE, every send of descriptors fails with ETOOMANYREFS — every user's
registration and lease alike — unless the daemon holds CAP_SYS_RESOURCE, which the
packaged unit does not grant. When a peer reads is the peer's choice, and closing the
daemon's end frees nothing (what was sent stays queued at the peer). So the daemon bounds
what it sends, whatever the peer does:

- each connection has at most one batch unread (``Transport.drained``), and its
  descriptors stay charged to the connection's user from the send until ``SIOCOUTQ`` says
  the peer has read everything — or its socket is gone, which frees the queue;
- a session that ends while its peer has not read everything keeps its socket open, shut
  down both ways ("lingering"), still one of its user's connections (``max_connections``),
  and still charged, until then;
- a user may hold at most ``USER_SHARE`` of the budget in flight, all users together the
  budget: half the soft RLIMIT_NOFILE (read at each batch, as the kernel reads it), the
  other half left to whatever else the daemon's user sends;
- a batch goes out only within both (smaller if need be); one that finds no room within
  ``ROOM_WAIT_S`` is refused to its requester alone, as ``limit_exceeded``.

One user can thus hold at most an eighth of the budget, and all of it only with
``USER_SHARE`` users doing their worst at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Callable
from typing import Final

from shmstage_daemon.transport import Transport

log = logging.getLogger("shmstaged.inflight")

#: The part of the budget one user may hold unread.
USER_SHARE: Final = 8
#: How long a batch waits for room before its request is refused.
ROOM_WAIT_S: Final = 10.0
#: How often charged connections are asked whether their peer has read everything.
SETTLE_INTERVAL_S: Final = 0.05


class NoRoom(Exception):
    """No descriptor can go out now without passing a bound; the message names it."""


def budget() -> int:
    """Descriptors all clients together may hold unread: half the soft RLIMIT_NOFILE."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(soft // 2, 1)


def user_share() -> int:
    return max(budget() // USER_SHARE, 1)


class InFlight:
    """The ledger; the event loop's alone."""

    def __init__(self) -> None:
        #: Connections with descriptors possibly unread: transport -> (uid, descriptors).
        self._charged: dict[Transport, tuple[int, int]] = {}
        self._users: dict[int, int] = {}
        self.total = 0
        #: Closed sessions' sockets still open until their peer has read everything, with
        #: what to do once it has (give the connection back to its user).
        self._lingering: dict[Transport, Callable[[], None]] = {}
        self._watcher: asyncio.Task[None] | None = None

    def of(self, uid: int) -> int:
        """Descriptors this user's peers may not have read yet."""
        return self._users.get(uid, 0)

    async def take(self, transport: Transport, uid: int, wanted: int) -> int:
        """Charge the next batch of up to ``wanted`` descriptors on ``transport`` to ``uid``:
        returns how many may go out now (at least one), waiting up to ``ROOM_WAIT_S`` for
        room; raises NoRoom. The caller sends them before it next yields to the loop (the
        charge ends once ``transport`` is not sending and its peer has read everything)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROOM_WAIT_S
        while True:
            self.settle()
            total, share = budget(), user_share()
            room = min(wanted, share - self.of(uid), total - self.total)
            if room > 0:
                break
            if loop.time() >= deadline:
                raise NoRoom(self._why(uid, share, total))
            await asyncio.sleep(SETTLE_INTERVAL_S)
        held_uid, held = self._charged.get(transport, (uid, 0))
        self._charged[transport] = (held_uid, held + room)
        self._users[held_uid] = self.of(held_uid) + room
        self.total += room
        self._watch()
        return room

    def _why(self, uid: int, share: int, total: int) -> str:
        if self.of(uid) >= share:
            return (
                f"uid {uid} already has {self.of(uid)} segment descriptors that shmstaged sent "
                f"and its processes have not read (limit {share}: 1/{USER_SHARE} of half of "
                "shmstaged's RLIMIT_NOFILE, LimitNOFILE=); retry once they are read — a "
                "process that asks for segments must read them or close its connection"
            )
        return (
            f"shmstaged has {self.total} segment descriptors sent and not yet read by its "
            f"clients (limit {total}: half of its RLIMIT_NOFILE, LimitNOFILE=); retry shortly, "
            "or raise LimitNOFILE= in shmstaged's unit"
        )

    def linger(self, transport: Transport, gone: Callable[[], None]) -> None:
        """Watch a closed session's lingering socket; ``gone`` once its peer has read all
        or closed (the socket is then closed here)."""
        self._lingering[transport] = gone
        self._watch()

    def settle(self) -> None:
        """End the charges of connections whose peers have read everything, and close the
        lingering sockets among them."""
        for transport in [t for t in self._charged if not t.sending and t.unread() == 0]:
            uid, count = self._charged.pop(transport)
            self.total -= count
            left = self._users[uid] - count
            if left:
                self._users[uid] = left
            else:
                del self._users[uid]
        for transport in [t for t in self._lingering if t.unread() == 0]:
            gone = self._lingering.pop(transport)
            transport.release()
            gone()

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._settling())

    async def _settling(self) -> None:
        while self._charged or self._lingering:
            await asyncio.sleep(SETTLE_INTERVAL_S)
            try:
                self.settle()
            except Exception:  # a bug here must not leave charges forever
                log.exception("settling descriptors in flight failed")

    def close(self) -> None:
        """At exit: close the lingering sockets (the kernel frees their queues with the
        peers' ends, or with this process)."""
        if self._watcher is not None:
            self._watcher.cancel()
        for transport, gone in list(self._lingering.items()):
            with contextlib.suppress(OSError):
                transport.release()
            gone()
        self._lingering.clear()

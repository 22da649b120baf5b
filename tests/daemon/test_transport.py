"""The daemon's transport: closing a connection from another task than its reader."""

from __future__ import annotations

import asyncio
import socket

from shmstage_daemon.transport import Transport


def test_a_connection_closed_under_its_reader_leaves_the_next_one_with_its_number_served() -> (
    None
):
    """A reload ends a session from outside its read loop. The descriptor number is freed at
    once and the kernel hands it to the next connection: the old reader's registration must
    not survive to unregister the new connection (which would then never be read)."""

    async def scenario() -> bytes:
        ours, theirs = socket.socketpair()
        first = Transport(ours)
        reading = asyncio.ensure_future(first.recv())
        await asyncio.sleep(0.01)  # the reader now waits for readability
        number = ours.fileno()
        first.close()  # from this task, not the reader's
        assert await asyncio.wait_for(reading, 5) == (b"", [])
        theirs.close()
        again, peer = socket.socketpair()
        assert number in (again.fileno(), peer.fileno())  # the number is reused
        if again.fileno() != number:
            again, peer = peer, again
        second = Transport(again)
        peer.sendall(b"hello")
        data, _fds = await asyncio.wait_for(second.recv(), 5)
        second.close()
        peer.close()
        return data

    assert asyncio.run(scenario()) == b"hello"

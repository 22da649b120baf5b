"""Who may talk to the daemon, and where the daemon may write on a peer's behalf."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass
from typing import Final

_UCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    def describe(self) -> str:
        return f"pid {self.pid} uid {self.uid}"


def peer_of(sock: socket.socket) -> Peer:
    """The kernel's word on who is at the other end, as it was when the peer connected.

    uid, gid and pid from SO_PEERCRED, supplementary groups from SO_PEERGROUPS: both are
    the socket's credentials, fixed at connect time. Reading the groups from
    ``/proc/<pid>`` instead would trust a pid that may by then name another process.
    """
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return Peer(pid, uid, gid, frozenset({gid, *peer_groups(sock)}))


#: SO_PEERGROUPS (Linux 4.13); Python's socket module does not name it.
SO_PEERGROUPS: Final = 59
_GID = struct.Struct("I")


def peer_groups(sock: socket.socket) -> list[int]:
    """The peer's supplementary groups from the socket (empty where the kernel lacks it)."""
    size = 64 * _GID.size
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE and size < 65536 * _GID.size:
                size *= 16  # NGROUPS_MAX is 65536
                continue
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                return []
            raise
        return [value for (value,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size])]


@dataclass(frozen=True, slots=True)
class Allowlist:
    uids: frozenset[int]
    gids: frozenset[int] = frozenset()

    @classmethod
    def default(cls) -> Allowlist:
        return cls(frozenset({os.getuid(), 0}))

    def admits(self, peer: Peer) -> bool:
        return peer.uid in self.uids or bool(peer.groups & self.gids)

    def describe(self) -> str:
        parts = [f"uids {sorted(self.uids)}"]
        if self.gids:
            parts.append(f"gids {sorted(self.gids)}")
        return " and ".join(parts)


def may_write_dir(st: os.stat_result, peer: Peer) -> bool:
    """Could ``peer`` itself create entries in a directory with this status?

    Mode bits only: a directory writable solely through an ACL is refused, erring towards
    never writing where the user could not.
    """
    if not stat.S_ISDIR(st.st_mode):
        return False
    if peer.uid == 0:
        return True
    need = stat.S_IWOTH | stat.S_IXOTH
    if st.st_uid == peer.uid:
        need = stat.S_IWUSR | stat.S_IXUSR
    elif st.st_gid in peer.groups:
        need = stat.S_IWGRP | stat.S_IXGRP
    return st.st_mode & need == need

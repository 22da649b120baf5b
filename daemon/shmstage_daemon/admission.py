"""Who may talk to the daemon, and where the daemon may write on a peer's behalf."""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

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
    """The kernel's word on who is at the other end (SO_PEERCRED), not the peer's."""
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return Peer(pid, uid, gid, frozenset({gid, *supplementary_groups(pid)}))


def supplementary_groups(pid: int) -> list[int]:
    """Not in SO_PEERCRED, so read from /proc; empty when the process is gone or hidden."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return [int(g) for g in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


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

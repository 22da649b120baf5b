"""Acting on a user's files with exactly that user's filesystem rights.

The daemon links, renames and removes names in a trainer's checkpoint directory, and after
a crash reopens the trainer's temporary files by name. If it did so with its own rights,
the packaged deployment (the daemon as the ``shmstage`` system user) could only publish
into directories it may write itself — group-writable ones, where every trainer can then
delete every other trainer's checkpoints — and ``fs.protected_hardlinks`` refuses it links
to files it does not own. So the thread doing such work switches its *filesystem*
credentials to the job owner's for the length of it: ``setfsuid``/``setfsgid`` and the
supplementary groups, all per thread on Linux (the raw system calls, not glibc's
``setgroups``, which would change every thread). The kernel then checks every path
operation exactly as if the user made it, the way kernel NFS servers act for a client.

It needs CAP_SETUID and CAP_SETGID (the unit grants them, nothing more). Without them —
a developer's own unprivileged daemon — a job of the daemon's own uid needs no switch, and
any other is done with the daemon's rights as before (``may_write_dir`` still refuses
directories the user could not write).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import threading
from collections.abc import Iterator
from typing import ClassVar, Final

from shmstage_daemon.admission import Peer

log = logging.getLogger("shmstaged.credentials")

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_SETGROUPS: Final = {"x86_64": 116, "aarch64": 159}.get(platform.machine())
_MAX_GROUPS: Final = 65536


class CredentialError(OSError):
    """The thread could not take (or give back) a user's filesystem credentials."""


def _setfsuid(uid: int) -> int:
    return _libc.setfsuid(ctypes.c_uint(uid))


def _setfsgid(gid: int) -> int:
    return _libc.setfsgid(ctypes.c_uint(gid))


def _thread_setgroups(groups: list[int]) -> None:
    if _SYS_SETGROUPS is None:
        raise CredentialError(0, f"per-thread setgroups is not known on {platform.machine()}")
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _libc.syscall(_SYS_SETGROUPS, len(groups), array) != 0:
        err = ctypes.get_errno()
        raise CredentialError(err, f"setgroups: {os.strerror(err)}")


def _current_fsuid() -> int:
    return _setfsuid(0xFFFFFFFF)  # an invalid id changes nothing and returns the current one


def _current_fsgid() -> int:
    return _setfsgid(0xFFFFFFFF)


class _Own:
    """The daemon's own credentials, to go back to: read when first needed (after any
    privilege drop at start), not at import."""

    uid = gid = -1
    groups: ClassVar[list[int]] = []

    @classmethod
    def read(cls) -> None:
        if cls.uid == -1:
            cls.uid, cls.gid, cls.groups = os.geteuid(), os.getegid(), os.getgroups()


_probe_lock = threading.Lock()
_can_switch: bool | None = None


def can_switch() -> bool:
    """Whether this process may take another user's filesystem credentials (checked once,
    on a throwaway thread, so that a failure leaves no thread half switched)."""
    global _can_switch
    with _probe_lock:
        if _can_switch is None:
            result: list[bool] = []
            _Own.read()

            def probe() -> None:
                target = 65534 if _Own.uid != 65534 else 65533
                _setfsuid(target)
                switched = _current_fsuid() == target
                _setfsuid(_Own.uid)
                result.append(switched and _current_fsuid() == _Own.uid)

            thread = threading.Thread(target=probe, name="shmstage-cred-probe")
            thread.start()
            thread.join()
            _can_switch = bool(result and result[0])
            if not _can_switch:
                log.info(
                    "shmstaged cannot act with other users' filesystem rights (no CAP_SETUID/"
                    "CAP_SETGID): it writes their checkpoints with its own rights"
                )
        return _can_switch


def _switch(uid: int, gid: int, groups: list[int]) -> None:
    _thread_setgroups(groups[:_MAX_GROUPS])
    _setfsgid(gid)
    _setfsuid(uid)
    if _current_fsuid() != uid or _current_fsgid() != gid:
        raise CredentialError(0, f"could not take the filesystem credentials of uid {uid}")


@contextlib.contextmanager
def acting_as(peer: Peer | None) -> Iterator[None]:
    """Run the block with ``peer``'s filesystem rights (in this thread only), then go back
    to whatever the thread had (so that it nests).

    A no-op for the daemon's own uid, for None (tests of a job alone), and where the
    daemon may not switch (see ``can_switch``). A failure to go back ends the process
    rather than leave a thread acting as a user.
    """
    if peer is None or not can_switch():
        yield
        return
    with _as(peer.uid, peer.gid, sorted(peer.groups)):
        yield


@contextlib.contextmanager
def as_daemon() -> Iterator[None]:
    """Inside ``acting_as``: the daemon's own rights again for a moment (its segments)."""
    if not can_switch():
        yield
        return
    with _as(_Own.uid, _Own.gid, list(_Own.groups)):
        yield


@contextlib.contextmanager
def _as(uid: int, gid: int, groups: list[int]) -> Iterator[None]:
    before = (_current_fsuid(), _current_fsgid(), os.getgroups())  # this thread's own
    if before == (uid, gid, groups):
        yield
        return
    _switch(uid, gid, groups)
    try:
        yield
    finally:
        try:
            _switch(*before)
        except CredentialError:  # pragma: no cover - the kernel refused to give them back
            log.critical("could not restore a writer thread's credentials; exiting")
            os._exit(70)

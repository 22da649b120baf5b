"""POSIX shared-memory segments: one per staged tensor, owned and named by the daemon.

Names carry the daemon instance's prefix, ``/shmstage.<instance>.<random>``, so a restarted
daemon can tell its own leftovers from a live instance's and nobody can guess a name. Space
is reserved with ``posix_fallocate``: ``ftruncate`` on tmpfs reserves nothing and a full
/dev/shm would later kill the writer with SIGBUS, whereas fallocate reports ENOSPC now. Then
zeros are written over it (``_write_zeros``), so that the trainer's first touch of a page
only maps it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import mmap
import os
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import posix_ipc

from shmstage.mapping import failed, libc

NAME_PREFIX: Final = "shmstage."
SHM_DIR: Final = "/dev/shm"
_NAME = re.compile(r"^/shmstage\.([0-9a-f]{16})\.([0-9a-f]{24})$")


class SegmentError(OSError):
    """Creating or mapping a segment failed; the message says which and why."""


def new_instance_id() -> str:
    return secrets.token_hex(8)


def segment_name(instance: str) -> str:
    return f"/{NAME_PREFIX}{instance}.{secrets.token_hex(12)}"


def instance_of(name: str) -> str | None:
    """The daemon instance a segment name belongs to, or None if it is not ours."""
    match = _NAME.match(name if name.startswith("/") else "/" + name)
    return match.group(1) if match else None


def mapping_size(nbytes: int) -> int:
    """Zero-byte tensors still get a one-byte segment: mmap cannot map nothing."""
    return max(nbytes, 1)


#: Setting up less than this per thread costs more in thread overhead and kernel/driver
#: locks than it saves: on the H200 host 10,000 segments of 128 KiB took 0.30 s to create
#: and 0.56 s to register on 8 threads, against 0.13 s and 0.33 s on one (small segments
#: now stay on one thread anyway: ``SMALL_SEGMENT_BYTES``). Large pieces are set up at
#: about 2 GiB/s per thread on the H100 host, so a 1 GiB slot is pinned on 8 threads.
PARALLEL_MIN_BYTES: Final = 128 << 20
#: 16 threads did no better on the H100 host (16 cores) for 8 GiB in 500 segments.
MAX_SETUP_THREADS: Final = 8
#: Segments below this are made on one thread of their own: their cost is the name's
#: creation in /dev/shm, which the directory's lock serialises (H100 host, 1 GiB in 10,000
#: segments, mostly small: created in 0.27 s on one thread, 0.41 s on four).
SMALL_SEGMENT_BYTES: Final = 1 << 20
#: The daemon makes a new layout's segments (fallocate, then zeros: ``create``) on up to
#: this many threads, each with at least ``CREATE_MIN_BYTES``: page allocation in a
#: Firecracker guest is bounded per thread by the host backing fresh guest memory (~2 GiB/s
#: per thread on the H100 host), so a 1 GiB slot in 17 segments was made in 0.062-0.065 s
#: on 8 threads, 0.046-0.052 on 16 (2026-11-27); in the daemon, on 7 unequal groups after
#: its first segment alone, it took 0.11-0.13 s.
MAX_CREATE_THREADS: Final = 16
CREATE_MIN_BYTES: Final = 32 << 20


def setup_groups(
    sizes: Sequence[int],
    max_threads: int = MAX_SETUP_THREADS,
    min_bytes: int = PARALLEL_MIN_BYTES,
) -> list[list[int]]:
    """Indices of ``sizes`` split into groups of about equal bytes, one per setup thread.

    Reserving, faulting in and pinning pages is per-page kernel and driver work that
    scales with threads for large segments (H200 host, 4 GiB in 8 segments: fallocate
    0.32 -> 0.05 s, first touch 0.37 -> 0.11 s, cudaHostRegister 0.26 -> 0.11 s on 8
    threads), so large layouts are set up in parallel and small ones are not; within a
    large layout, the segments under SMALL_SEGMENT_BYTES all go to the first group.
    """
    count = min(max_threads, os.cpu_count() or 1, len(sizes), sum(sizes) // min_bytes)
    count = max(count, 1)
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    if count > 1:
        small = [i for i in order if sizes[i] < SMALL_SEGMENT_BYTES]
        groups[0], loads[0] = small, sum(sizes[i] for i in small)
        order = order[: len(order) - len(small)]
    for index in order:
        lightest = loads.index(min(loads))
        groups[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(group) for group in groups if group]


def in_parallel(
    sizes: Sequence[int],
    work: Callable[[int], None],
    max_threads: int = MAX_SETUP_THREADS,
    min_bytes: int = PARALLEL_MIN_BYTES,
) -> None:
    """Call ``work(i)`` for every index, one thread per ``setup_groups`` group.

    After a failure every group stops at its next item, and once all threads have
    stopped the error of the first group (in order) that failed is raised; ``work`` must
    record what it made so that the caller can undo it. With one group everything runs in
    the calling thread.
    """
    groups = setup_groups(sizes, max_threads, min_bytes)
    if len(groups) <= 1:
        for group in groups:
            for index in group:
                work(index)
        return
    failed = threading.Event()

    def run(group: list[int]) -> None:
        for index in group:
            if failed.is_set():
                return
            try:
                work(index)
            except BaseException:
                failed.set()
                raise

    with concurrent.futures.ThreadPoolExecutor(len(groups), "shmstage-setup") as pool:
        futures = [pool.submit(run, group) for group in groups]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """What the daemon keeps per segment: a name and a size, never a mapping it doesn't use."""

    name: str
    size: int


def create(instance: str, nbytes: int) -> SegmentRef:
    """Create and reserve a 0600 segment; on failure nothing is left behind."""
    name = segment_name(instance)
    size = mapping_size(nbytes)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    except posix_ipc.ExistentialError as exc:  # a 96-bit random collision: not in practice
        raise SegmentError(errno.EEXIST, f"shared-memory segment {name} exists: {exc}") from exc
    except OSError as exc:
        raise SegmentError(exc.errno, f"cannot create shared memory in {SHM_DIR}: {exc}") from exc
    try:
        os.posix_fallocate(shm.fd, 0, size)
        _write_zeros(shm.fd, size)
    except OSError as exc:
        shm.close_fd()
        _unlink_quietly(name)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SegmentError(
                exc.errno,
                f"{SHM_DIR} is full: cannot reserve {size} bytes for a staging segment "
                f"({_free_hint()}); free space there or lower the checkpoint's size",
            ) from exc
        raise SegmentError(exc.errno, f"cannot reserve {size} bytes in {SHM_DIR}: {exc}") from exc
    shm.close_fd()
    return SegmentRef(name, size)


#: What ``_write_zeros`` writes per call.
_ZEROS: Final = bytes(1 << 20)


def _write_zeros(fd: int, size: int) -> None:
    """Write zeros over a segment just reserved, on the daemon's setup threads.

    fallocate on tmpfs allocates pages but leaves them "not up to date": each is zeroed
    by the first access to it, in a page fault of its own — in the trainer, whose prefault
    before pinning (``pinning.prefault``) then took 0.087 s per GiB on 8 threads on the
    H100 host. Written here, they cost the daemon ~0.03 s per GiB more to make, and the
    trainer's first touch maps 16 resident pages a fault (0.009 s per GiB); a copy into
    an unpinned slot on a CPU-only host faults less as well. The bytes are the same
    (zeros), as is the memory taken (fallocate took it already).
    """
    zeros = memoryview(_ZEROS)
    offset = 0
    while offset < size:
        written = os.pwrite(fd, zeros[: min(len(zeros), size - offset)], offset)
        if not written:  # not seen on tmpfs; never a loop without end
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += written


def open_fd(ref: SegmentRef, *, writable: bool) -> int:
    """A fresh descriptor on an existing segment (the caller closes it)."""
    try:
        shm = posix_ipc.SharedMemory(ref.name, 0, read_only=not writable)
    except posix_ipc.ExistentialError as exc:
        raise SegmentError(errno.ENOENT, f"segment {ref.name} vanished: {exc}") from exc
    except OSError as exc:
        if exc.errno is None and "maximum number of files" in str(exc):
            # posix_ipc reports EMFILE without an errno: give callers one to act on.
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE)) from None
        raise
    return shm.fd


_PROT_NONE: Final = 0
_MAP_FIXED: Final = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_NORESERVE: Final = getattr(mmap, "MAP_NORESERVE", 0x4000)


class Region:
    """Segments mapped back to back, each at the next page boundary of one address range.

    A slot's segments mapped here form one contiguous range, so CUDA can pin the slot with
    a few ``cudaHostRegister`` calls instead of one per tensor (20,000 calls took 2.4 s for
    a 10,000-tensor layout with two slots on the H200 host), and one ``munmap`` undoes it.
    The range is reserved up front (no access, no memory). Mapping goes through libc's
    mmap(2), not ``mmap.mmap``, which keeps a dup of the descriptor for the mapping's life
    (until 3.13's ``trackfd=False``): 20,000 staged segments would pin 20,000 descriptors
    and run a trainer out of RLIMIT_NOFILE. A region holds none.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        page = mmap.PAGESIZE
        self.sizes = [mapping_size(size) for size in sizes]
        self.offsets: list[int] = []
        position = 0
        for size in self.sizes:
            self.offsets.append(position)
            position += -(-size // page) * page
        self.size = max(position, page)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        address = libc.mmap(None, self.size, _PROT_NONE, flags, -1, 0)
        if failed(address):
            err = ctypes.get_errno()
            raise SegmentError(
                err, f"cannot reserve {self.size} bytes of address space: {os.strerror(err)}"
            )
        self.address: int = address

    def map(self, index: int, fd: int, *, writable: bool) -> None:
        """Map segment ``index`` from ``fd`` at its place; the descriptor may be closed."""
        if not self.address:  # MAP_FIXED at an offset from 0 would clobber whatever is there
            raise SegmentError(errno.EBADF, "cannot map a segment into a closed region")
        size = self.sizes[index]
        actual = os.fstat(fd).st_size
        if actual < size:
            raise SegmentError(errno.EINVAL, f"segment is {actual} bytes but {size} were expected")
        want = self.address + self.offsets[index]
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        got = libc.mmap(want, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if failed(got) or got != want:
            err = ctypes.get_errno()
            raise SegmentError(err, f"cannot map a {size}-byte segment: {os.strerror(err)}")

    def buffer(self, index: int | None = None) -> ctypes.Array[ctypes.c_char]:
        """The bytes of segment ``index`` (or of the whole range), for torch.frombuffer."""
        if index is None:
            return (ctypes.c_char * self.size).from_address(self.address)
        return (ctypes.c_char * self.sizes[index]).from_address(self.address + self.offsets[index])

    def close(self) -> None:
        """Unmap every segment and the reservation. Views must never be touched again."""
        if self.address:
            libc.munmap(self.address, self.size)
            self.address = 0


def unlink(name: str) -> bool:
    """Remove a segment's name; memory is freed once the last mapping goes."""
    return _unlink_quietly(name)


def give_back(name: str) -> bool:
    """Free a segment's memory now, then remove its name.

    Unlinking alone frees nothing while a process maps the segment or holds a descriptor
    on it: a client that kept its descriptors after releasing its layout would hold the
    memory, charged to nobody, as long as it likes. Truncating to 0 frees the pages
    whoever holds them; a process still mapping it then faults (SIGBUS) if it touches
    them, so only segments nobody may use any more are given back this way.
    """
    try:
        shm = posix_ipc.SharedMemory(name, 0)
    except (posix_ipc.ExistentialError, OSError):
        return _unlink_quietly(name)  # out of descriptors: at least the name goes
    try:
        os.ftruncate(shm.fd, 0)
    except OSError:
        pass
    finally:
        shm.close_fd()
    return _unlink_quietly(name)


def check_size(fd: int, ref: SegmentRef) -> None:
    """Raise SegmentError unless the segment behind ``fd`` has the size shmstaged made it."""
    found = os.fstat(fd).st_size
    if found != ref.size:
        raise SegmentError(
            errno.EINVAL,
            f"segment {ref.name} is {found} bytes, not the {ref.size} shmstaged made it: a "
            "process holding a writable descriptor on it resized it, and its bytes are not "
            "what was saved",
        )


#: Pages past a segment's size are counted only beyond this (a huge page may back the end
#: of a segment where tmpfs uses them).
_HUGE_PAGE: Final = 2 << 20


def fix_size(ref: SegmentRef, *, grow: bool = True) -> tuple[int, int] | None:
    """Put back a segment a descriptor's holder resized, to the size shmstaged made it.

    Any holder of a writable descriptor can ftruncate it: larger (memory nobody is charged
    for, also allocated past the end without changing the size: fallocate KEEP_SIZE) or
    smaller (a reader mapping it would fault past the new end). Truncating to the size
    frees every page past it; a shrunk one is grown back (zeros) and reserved again —
    unless not ``grow``: a segment a job is reading must stay short, for the job to fail
    rather than write zeros. Returns the (size, bytes allocated) it found when it acted,
    else None (also for a segment that is gone). A stat by name first: no descriptor.
    """
    try:
        st = os.stat(SHM_DIR + ref.name, follow_symlinks=False)
    except OSError:
        return None
    allocated = st.st_blocks * 512
    if st.st_size == ref.size and allocated <= -(-ref.size // _HUGE_PAGE) * _HUGE_PAGE:
        return None
    if st.st_size < ref.size and not grow:
        return None
    try:
        shm = posix_ipc.SharedMemory(ref.name, 0)
    except (posix_ipc.ExistentialError, OSError):
        return None
    try:
        os.ftruncate(shm.fd, ref.size)
        with contextlib.suppress(OSError):  # a full /dev/shm: the size is what matters
            os.posix_fallocate(shm.fd, 0, ref.size)
    finally:
        shm.close_fd()
    return st.st_size, allocated


def _unlink_quietly(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def list_names(instance: str | None = None) -> list[str]:
    """Segment names in /dev/shm that belong to shmstage (optionally to one instance)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        owner = instance_of(entry)
        if owner is not None and (instance is None or owner == instance):
            names.append("/" + entry)
    return names


def _free_hint() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free"

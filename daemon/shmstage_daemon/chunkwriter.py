"""How a data file's chunks reach the disk: direct I/O, or the page cache kept in check.

A checkpoint is written once and not read back by this node soon, so passing it through the
page cache only costs: gigabytes of dirty pages that the kernel throttles writers on and that
compete with the trainers' own memory and I/O, and buffered writes reach about half of what
the disk takes (H200 host: 1.6-2.0 GB/s buffered + fsync against 3.1 GB/s with ``O_DIRECT``
from aligned buffers). So the data file is written with ``O_DIRECT``, set on the client's
descriptor with ``fcntl(F_SETFL)`` (the client opened it; the daemon resolves no path).

Where a filesystem refuses direct I/O (ramfs, tmpfs before Linux 6.6, some FUSE and network
filesystems: EINVAL at the fcntl or at the first write), chunks go through the page cache
instead, and each window of them is written out (``sync_file_range``) and dropped
(``posix_fadvise(DONTNEED)``) while later ones are written, so the cache never holds more
than a few chunks of a checkpoint. That is said once per filesystem in the log.

Both writers take chunks from several I/O threads at once, at any offset, in any order.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import fcntl
import logging
import os
import threading
from typing import Final

log = logging.getLogger("shmstaged")

#: Offsets, lengths and buffer addresses of direct writes are multiples of this. 4096 is
#: the page size and the largest logical block size of common devices (512 or 4096).
BLOCK: Final = 4096

#: How many chunk lengths behind the newest write the buffered fallback waits for writeback
#: and drops pages; dirty pages per job stay around this many chunks.
WRITEBACK_LAG_CHUNKS: Final = 4

_SYNC_FILE_RANGE_WAIT_BEFORE: Final = 1
_SYNC_FILE_RANGE_WRITE: Final = 2
_SYNC_FILE_RANGE_WAIT_AFTER: Final = 4
_SETTLE: Final = (
    _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
)
#: Errors meaning "this filesystem or sandbox does not do that", never "the data is lost"
#: (a seccomp filter answers EPERM; pipes ESPIPE; some filesystems EINVAL or ENOSYS).
_UNSUPPORTED: Final = (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.EPERM)

_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int


def round_up(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """sync_file_range(2), which Python's os module lacks (ctypes releases the GIL)."""
    if _sync_file_range is None:
        raise OSError(errno.ENOSYS, "sync_file_range is not available")
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class ChunkWriter(abc.ABC):
    """Writes the chunks of one data file at their offsets, from any number of threads."""

    #: Whether chunks bypass the page cache (for logs, tests and the benchmark).
    direct: bool

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @abc.abstractmethod
    def write(self, buffer: memoryview, offset: int, length: int) -> None:
        """Write ``buffer[:length]`` at ``offset``.

        ``buffer`` starts on a BLOCK boundary and holds at least ``round_up(length)``
        bytes; ``offset`` is a multiple of BLOCK. Only the last chunk of a file may have a
        ``length`` that is not a multiple of BLOCK. Raises OSError (the job names the file).
        """

    @abc.abstractmethod
    def finish(self, size: int) -> None:
        """Every chunk is written: leave the file exactly ``size`` bytes long and none of
        it in the page cache as dirty pages (the job fsyncs next)."""


class DirectChunkWriter(ChunkWriter):
    """``O_DIRECT`` writes; the last block is padded with zeros and cut off by ``finish``.

    If the filesystem accepted the flag but refuses the first write (EINVAL), the writer
    clears the flag and goes on through the page cache, so nothing written is lost.
    """

    direct = True

    def __init__(self, fd: int, chunk_bytes: int, refused: RefusalLog, where: str) -> None:
        super().__init__(fd)
        self._chunk_bytes = chunk_bytes
        self._refused = refused
        self._where = where
        self._lock = threading.Lock()
        self._fallback: BufferedChunkWriter | None = None

    def write(self, buffer: memoryview, offset: int, length: int) -> None:
        if self._fallback is not None:
            self._fallback.write(buffer, offset, length)
            return
        padded = round_up(length)
        if padded != length:
            buffer[length:padded] = bytes(padded - length)
        try:
            write_all(self.fd, buffer[:padded], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._fall_back(exc).write(buffer, offset, length)

    def _fall_back(self, exc: OSError) -> BufferedChunkWriter:
        with self._lock:
            if self._fallback is None:
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                self._refused.report(self.fd, self._where, "at the first write", exc)
                self._fallback = BufferedChunkWriter(self.fd, self._chunk_bytes)
                self.direct = False
            return self._fallback

    def finish(self, size: int) -> None:
        if self._fallback is not None:
            self._fallback.finish(size)
            return
        os.ftruncate(self.fd, size)  # the padding of the last block goes


class BufferedChunkWriter(ChunkWriter):
    """Writes through the page cache, pushing each chunk out as soon as it is written and
    dropping it once written out, a few chunks behind (``WRITEBACK_LAG_CHUNKS``)."""

    direct = False

    def __init__(self, fd: int, chunk_bytes: int) -> None:
        super().__init__(fd)
        self.lag = WRITEBACK_LAG_CHUNKS * chunk_bytes
        #: Off once the filesystem or a seccomp filter refuses either call: writes still
        #: land, only the cache is left to the kernel (the final fsync writes it out).
        self.managing = True

    def write(self, buffer: memoryview, offset: int, length: int) -> None:
        write_all(self.fd, buffer[:length], offset)
        if not self.managing:
            return
        try:
            sync_file_range(self.fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # start it now
            behind = offset - self.lag
            if behind >= 0:  # an earlier chunk: written out by now, or wait until it is
                sync_file_range(self.fd, behind, length, _SETTLE)
                os.posix_fadvise(self.fd, behind, length, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            self.managing = False

    def finish(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        if not self.managing:
            return
        try:
            sync_file_range(self.fd, 0, 0, _SETTLE)  # 0 bytes: to the end of the file
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise


class RefusalLog:
    """Says once per filesystem (device number) that it refuses direct I/O.

    Thread-safe: I/O threads report refusals; nothing else reads this but the log.
    """

    def __init__(self) -> None:
        self._told: set[int] = set()
        self._lock = threading.Lock()

    def report(self, fd: int, where: str, when: str, exc: OSError) -> None:
        try:
            device = os.fstat(fd).st_dev
        except OSError:
            device = -1
        with self._lock:
            if device in self._told:
                return
            self._told.add(device)
        log.warning(
            "the filesystem of %s (device %d:%d) refuses direct I/O (%s %s): checkpoints on it "
            "are written through the page cache, written out and dropped chunk by chunk; "
            "said once per filesystem",
            where,
            os.major(device) if device >= 0 else -1,
            os.minor(device) if device >= 0 else -1,
            errno.errorcode.get(exc.errno or 0, exc.errno),
            when,
        )


def open_writer(
    fd: int, *, chunk_bytes: int, refused: RefusalLog, where: str, direct: bool = True
) -> ChunkWriter:
    """The writer for a client's data descriptor, direct where the filesystem allows it.

    ``O_APPEND`` is cleared on the way: with it, Linux appends every ``pwrite`` whatever its
    offset, which would publish a file that does not verify. A descriptor whose inode is
    append-only (chattr +a) cannot lose the flag, and is refused.
    """
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_APPEND:
        flags &= ~os.O_APPEND
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        except PermissionError:
            raise OSError(
                errno.EPERM,
                "the data file is append-only (chattr +a), so it cannot be written at "
                "offsets; save to a directory without the append-only attribute",
            ) from None
    if direct:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            refused.report(fd, where, "when asked for it", exc)
        else:
            return DirectChunkWriter(fd, chunk_bytes, refused, where)
    if flags & os.O_DIRECT:  # the client's own flag: the buffered writer's tail is unaligned
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return BufferedChunkWriter(fd, chunk_bytes)


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[written:]
        offset += written


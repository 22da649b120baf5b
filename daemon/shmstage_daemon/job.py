"""A persist job: stream one committed slot into its checkpoint directory.

Runs in a writer thread. It receives everything it needs up front (segment names, the
destination's descriptors, the header, the tree) and returns a result; it never touches the
daemon's shared state, so the event loop remains the only thing that mutates it.

Order of durability, which is what makes a checkpoint never torn:
  1. data written to a hidden temporary file, fsynced;
  2. linked to its final ``.safetensors`` name (refusing to replace anything);
  3. manifest written to its own temporary file, fsynced, linked to its final name —
     this is the commit marker;
  4. directory fsynced.
Any failure removes what this job created, so no partial file keeps a final name.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Any, Final

from shmstage import manifest, segment
from shmstage.checkpoint import checksum
from shmstage.layout import Layout
from shmstage.manifest import MANIFEST_NAME
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef

WRITE_CHUNK: Final = 64 * 1024 * 1024


@dataclass
class Destination:
    """Descriptors the client opened (the daemon resolves no user path) and plain names."""

    dir_fd: int
    data_fd: int
    manifest_fd: int
    data_file: str
    data_tmp: str
    manifest_tmp: str

    def close(self) -> None:
        for fd in (self.data_fd, self.manifest_fd, self.dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class Progress:
    """How far a job has got, for ``shmstage status``.

    Only the job's writer thread assigns these attributes and the event loop only reads them
    (single attribute stores are atomic in CPython), so progress reaches the loop without the
    thread touching any state the loop owns.
    """

    __slots__ = ("phase", "written")

    def __init__(self) -> None:
        self.written = 0
        self.phase = "queued"


@dataclass
class PersistJob:
    id: int
    layout: Layout
    segments: list[SegmentRef]
    header: bytes
    destination: Destination
    tree: Any
    metadata: dict[str, Any]
    save_info: dict[str, Any]
    fsync: bool = True
    progress: Progress = field(default_factory=Progress)


@dataclass
class JobResult:
    job: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    code: str = ""
    message: str = ""
    files: list[str] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        if self.ok:
            return {"bytes": self.bytes, "persist_seconds": self.seconds, "files": self.files}
        return {"code": self.code, "message": self.message, "persist_seconds": self.seconds}


class JobFailed(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def run(job: PersistJob) -> JobResult:
    """Persist the job; always returns (never raises) and always closes its descriptors."""
    started = time.perf_counter()
    dest = job.destination
    created: list[str] = [dest.data_tmp, dest.manifest_tmp]
    try:
        total = _write_data(job)
        _publish(dest, dest.data_tmp, dest.data_file, job.fsync)
        created.append(dest.data_file)
        checksums = total[1]
        document = manifest.build(
            job.layout,
            dest.data_file,
            total[0],
            checksums,
            job.tree,
            job.metadata,
            job.save_info,
        ).to_bytes()
        _write_all(dest.manifest_fd, document, 0)
        if job.fsync:
            os.fsync(dest.manifest_fd)
        _publish(dest, dest.manifest_tmp, MANIFEST_NAME, job.fsync)
        if job.fsync:
            os.fsync(dest.dir_fd)
        return JobResult(
            job.id,
            True,
            bytes=total[0],
            seconds=time.perf_counter() - started,
            files=[dest.data_file, MANIFEST_NAME],
        )
    except JobFailed as exc:
        _remove(dest, created)
        return JobResult(
            job.id,
            False,
            seconds=time.perf_counter() - started,
            code=str(exc.code),
            message=exc.message,
        )
    except OSError as exc:
        _remove(dest, created)
        return JobResult(
            job.id,
            False,
            seconds=time.perf_counter() - started,
            code=str(ErrorCode.STORAGE),
            message=f"writing the checkpoint failed: {exc.strerror or exc} "
            f"({errno.errorcode.get(exc.errno or 0, 'unknown errno')})",
        )
    except Exception as exc:  # a bug must fail this job, not the writer thread pool
        _remove(dest, created)
        return JobResult(
            job.id,
            False,
            seconds=time.perf_counter() - started,
            code=str(ErrorCode.INTERNAL),
            message=f"internal error: {exc!r}",
        )
    finally:
        dest.close()


def _write_data(job: PersistJob) -> tuple[int, list[int]]:
    fd = job.destination.data_fd
    size = len(job.header) + job.layout.nbytes
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than halfway through
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    _write_all(fd, job.header, 0)
    position = len(job.header)
    checksums = []
    job.progress.phase = "writing"
    for spec, ref in zip(job.layout.tensors, job.segments, strict=True):
        checksums.append(_stream_segment(ref, spec.nbytes, fd, position, job.progress))
        position += spec.nbytes
    os.ftruncate(fd, size)
    job.progress.phase = "syncing"
    if job.fsync:
        os.fsync(fd)
    return size, checksums


def _stream_segment(
    ref: SegmentRef, nbytes: int, fd: int, position: int, progress: Progress
) -> int:
    """Checksum and write one tensor straight from its mapping, chunk by chunk."""
    if nbytes == 0:
        return 0
    seg_fd = segment.open_fd(ref, writable=False)
    try:
        mapping = mmap.mmap(seg_fd, ref.size, prot=mmap.PROT_READ)
    finally:
        os.close(seg_fd)
    crc = 0
    try:
        with memoryview(mapping) as view:
            for start in range(0, nbytes, WRITE_CHUNK):
                chunk = view[start : min(start + WRITE_CHUNK, nbytes)]
                crc = checksum(chunk, crc)
                _write_all(fd, chunk, position + start)
                progress.written += len(chunk)
                chunk.release()
    finally:
        mapping.close()
    return crc


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[written:]
        offset += written


def _publish(dest: Destination, tmp: str, final: str, fsync: bool) -> None:
    """Give a finished file its final name without ever replacing an existing one."""
    try:
        os.link(tmp, final, src_dir_fd=dest.dir_fd, dst_dir_fd=dest.dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise JobFailed(
            ErrorCode.EXISTS,
            f"{final} already exists in the checkpoint directory; shmstage never replaces a "
            "checkpoint — save to a new directory",
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # Filesystems without hard links: check, then rename (a race only with ourselves).
        try:
            os.stat(final, dir_fd=dest.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(tmp, final, src_dir_fd=dest.dir_fd, dst_dir_fd=dest.dir_fd)
            return
        raise JobFailed(
            ErrorCode.EXISTS, f"{final} already exists in the checkpoint directory"
        ) from None
    os.unlink(tmp, dir_fd=dest.dir_fd)


def _remove(dest: Destination, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dest.dir_fd)

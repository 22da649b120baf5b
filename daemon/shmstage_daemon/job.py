"""A persist job: stream one committed slot into its checkpoint directory.

Runs in a writer thread. It receives everything it needs up front (segment names, the
destination's descriptors, the header, the tree) and returns a result; it never touches the
daemon's shared state, so the event loop remains the only thing that mutates it.

Order of durability, which is what makes a checkpoint never torn:
  1. data written to a hidden temporary file, fsynced;
  2. linked to its final ``.safetensors`` name (refusing to replace anything);
  3. manifest written to its own temporary file, fsynced, linked to its final name —
     this is the commit marker;
  4. directory fsynced;
  5. for a new directory (the client made it as a hidden pending directory in the
     destination's parent): renamed to its final name, never replacing anything
     (``rename_noreplace``), and the parent fsynced.
Any failure removes what this job created, manifest first, so no partial file keeps a final
name, then the pending directory; names are removed only when they are this job's own
files or directory (same inode).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from shmstage import manifest
from shmstage.layout import Layout
from shmstage.manifest import MANIFEST_NAME
from shmstage.protocol import ErrorCode
from shmstage.segment import SegmentRef
from shmstage_daemon import credentials, faults, gather, scheduler
from shmstage_daemon.admission import Peer, may_write_dir
from shmstage_daemon.chunkwriter import write_all


@dataclass
class Destination:
    """Descriptors the client opened (the daemon resolves no user path) and plain names.

    ``dir_fd`` is the directory the files are written in: an existing checkpoint
    directory, or — for a new one — the hidden pending directory ``pending_dir`` that the
    client made in the directory ``parent_fd``, published by renaming it to ``final_dir``.
    """

    dir_fd: int
    data_fd: int
    manifest_fd: int
    data_file: str
    data_tmp: str
    manifest_tmp: str
    #: Where ``dir_fd`` is (as the journal located it), for messages only: the job writes
    #: through descriptors.
    path: str = "the checkpoint directory"
    parent_fd: int = -1
    pending_dir: str = ""
    final_dir: str = ""

    @property
    def pending(self) -> bool:
        """A new directory, published by renaming the pending one."""
        return bool(self.final_dir)

    def shown(self, located: str | None = None) -> str:
        """Where the checkpoint goes, for messages: its final path where known.
        ``located``: where ``dir_fd`` is, if not ``path``."""
        where = self.path if located is None else located
        if self.pending:
            if os.path.isabs(where):
                return os.path.join(os.path.dirname(where), self.final_dir)
            return f"the checkpoint directory {self.final_dir}"
        return where

    def close(self) -> None:
        for fd in (self.data_fd, self.manifest_fd, self.dir_fd, self.parent_fd):
            if fd >= 0:
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
    #: Whose checkpoint this is: names are published only while this peer may still write
    #: the directory (None: no check, for tests of the job alone).
    peer: Peer | None = None
    #: What the save cost the trainer (``stall_seconds`` and its parts), once its client
    #: reported it; set by the event loop, for the job's log line.
    client_timings: dict[str, float] = field(default_factory=dict)
    #: Set by a daemon that is stopping and can wait no longer: the job stops at its next
    #: write and leaves every file in place for the journal (see ``JobInterrupted``).
    stop: threading.Event = field(default_factory=threading.Event)
    #: The layout's manifest entries for this data file, from an earlier save of it; the
    #: job renders them when there are none and hands them back with its result.
    entries: manifest.TensorEntries | None = None
    #: ``tree`` as it came in its commit, for the journal to store as is.
    packed_tree: bytes | None = None


@dataclass
class JobResult:
    job: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    code: str = ""
    message: str = ""
    files: list[str] = field(default_factory=list)
    #: Stopped by the daemon's shutdown, not failed: nothing was removed, and the journal
    #: entry (if any) must stay so the next start finishes the job.
    interrupted: bool = False
    #: ``manifest.digest`` of the manifest written: what names this checkpoint's contents
    #: when a reader asks for it from memory (empty when the job did not write it).
    digest: str = ""
    #: Where ``seconds`` went, for a job that wrote its data file.
    phases: WritePhases | None = None
    #: The manifest entries it rendered from, for the layout's next save (never sent).
    entries: manifest.TensorEntries | None = None
    #: Each tensor's CRC-32C, in the layout's order, as the manifest records them (never
    #: sent with the result): a restore from memory checks against the daemon's own copy,
    #: not against whatever manifest sits at the checkpoint's path later.
    checksums: list[int] | None = None

    def to_wire(self) -> dict[str, Any]:
        if self.ok:
            return {
                "bytes": self.bytes,
                "persist_seconds": self.seconds,
                "files": self.files,
                "phases": self.phases.wire() if self.phases is not None else {},
            }
        return {"code": self.code, "message": self.message, "persist_seconds": self.seconds}


@dataclass
class WritePhases:
    """Where a job's time went, in seconds: ``gather`` — its thread reading and
    checksumming the segments into chunks (its own work: at 10,000 tensors, what limits
    the write); ``disk_wait`` — that thread waiting on the disk (all its buffers in flight,
    or its last writes; with several gatherers, their average); ``sync`` — finishing the
    data file and its fsync; ``publish`` —
    manifest, renames and the directory's sync. Reported with the result (the client's
    ``SaveResult``), logged, and shown by the bench."""

    gather: float = 0.0
    disk_wait: float = 0.0
    sync: float = 0.0
    publish: float = 0.0

    def wire(self) -> dict[str, float]:
        return {f"{name}_seconds": value for name, value in vars(self).items()}

    def describe(self) -> str:
        parts = (f"{name.replace('_', ' ')} {value:.3f} s" for name, value in vars(self).items())
        return ", ".join(parts)


class JobFailed(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class JobInterrupted(Exception):
    """The daemon is stopping and asked the job to stop now.

    Not a failure: the checkpoint was acknowledged and its journal entry still vouches for
    the temporary files and the staged segments, so the job must leave all of them exactly
    where they are — removing them (as a failure does) would lose the checkpoint.
    """


def check_stop(job: PersistJob) -> None:
    """Raise JobInterrupted if the daemon asked running jobs to stop."""
    if job.stop.is_set():
        raise JobInterrupted


def run(job: PersistJob) -> JobResult:
    """Persist the job; always returns (never raises) and always closes its descriptors.

    Also finishes a job that a killed daemon left half done (see ``journal``): a file that
    already carries its final name is recognised by its inode, and a job whose commit
    marker is already ours only needs the directory synced.
    """
    try:
        try:
            # Names in the user's directory are made and removed with the user's own
            # filesystem rights (see ``credentials``); segments are read with the daemon's.
            with credentials.acting_as(job.peer):
                return _run(job)
        except credentials.CredentialError as exc:
            return JobResult(
                job.id,
                False,
                code=str(ErrorCode.INTERNAL),
                message=f"cannot act with the saving user's filesystem rights: {exc}",
            )
    finally:
        job.destination.close()


def _published(
    job: PersistJob, size: int, started: float, digest: str = "", phases: WritePhases | None = None
) -> JobResult:
    now = time.perf_counter()
    if phases is not None:
        phases.publish = max(0.0, now - started - phases.gather - phases.disk_wait - phases.sync)
    return JobResult(
        job.id,
        True,
        bytes=size,
        seconds=now - started,
        phases=phases,
        files=[job.destination.data_file, MANIFEST_NAME],
        digest=digest,
    )


def _run(job: PersistJob) -> JobResult:
    started = time.perf_counter()
    dest = job.destination
    step = Step(f"writing {dest.data_file}")
    try:
        check_stop(job)  # queued behind other jobs while the daemon began to stop
        if is_committed(dest):  # finishing the job of a daemon killed after its commit
            step.now = "syncing the checkpoint directory"
            size = os.fstat(dest.data_fd).st_size
            _sync_dir(dest, job.fsync)
            _remove_temps(dest)
            _publish_directory(job, step)
            return _published(job, size, started)
        phases = WritePhases()
        with credentials.as_daemon():  # the staged segments are the daemon's own
            total, checksums = _write_data(job, step, phases)
        step.now = f"publishing {dest.data_file}"
        check_stop(job)
        _check_writable(job)
        _publish(dest, dest.data_tmp, dest.data_file, dest.data_fd)
        faults.pause("before-manifest")
        step.now = f"writing {MANIFEST_NAME}"
        job.progress.phase = "committing"
        entries = job.entries
        if (
            entries is None
            or entries.data_file != dest.data_file
            or entries.layout is not job.layout
        ):
            entries = manifest.TensorEntries(job.layout, dest.data_file)
        document = entries.render(total, checksums, job.tree, job.metadata, job.save_info)
        write_all(dest.manifest_fd, document, 0)
        os.ftruncate(dest.manifest_fd, len(document))  # a resumed job's longer first try
        if job.fsync:
            os.fsync(dest.manifest_fd)
        step.now = f"publishing {MANIFEST_NAME}"
        check_stop(job)
        _check_writable(job)
        _publish(dest, dest.manifest_tmp, MANIFEST_NAME, dest.manifest_fd)
        step.now = "syncing the checkpoint directory"
        if not dest.pending:
            faults.maybe_eio("sync-dir")
        _sync_dir(dest, job.fsync)
        _publish_directory(job, step)
        result = _published(job, total, started, manifest.digest(document), phases)
        result.entries, result.checksums = entries, checksums
        return result
    except JobInterrupted:
        return _interrupted(job, step, started)
    except JobFailed as exc:
        code, message = exc.code, exc.message
    except gather.SegmentResized as exc:
        code, message = ErrorCode.BAD_REQUEST, _resized_message(job, exc)
    except OSError as exc:
        code, message = ErrorCode.STORAGE, _storage_message(dest, step.now, exc)
    except Exception as exc:  # a bug must fail this job, not the writer thread pool
        if job.stop.is_set():  # e.g. a pool refusing work as the interpreter exits
            return _interrupted(job, step, started)
        code, message = ErrorCode.INTERNAL, f"internal error while {step.now}: {exc!r}"
    _undo(dest)
    return JobResult(
        job.id, False, seconds=time.perf_counter() - started, code=str(code), message=message
    )


def _interrupted(job: PersistJob, step: Step, started: float) -> JobResult:
    """Stopped on the daemon's request: every file stays for the next start (no ``_undo``)."""
    return JobResult(
        job.id,
        False,
        seconds=time.perf_counter() - started,
        code=str(ErrorCode.SHUTTING_DOWN),
        message=f"shmstaged stopped while {step.now}; the next start finishes the checkpoint",
        interrupted=True,
    )


class Step:
    """What the job is doing now, so a failure names the step and the file."""

    __slots__ = ("now",)

    def __init__(self, now: str) -> None:
        self.now = now


def _resized_message(job: PersistJob, exc: gather.SegmentResized) -> str:
    index = next((i for i, ref in enumerate(job.segments) if ref == exc.ref), -1)
    return (
        f"staged segment {index + 1} of {len(job.segments)} of job {job.id} ({exc.ref.name}) "
        f"was resized by a process holding its descriptor (expected {exc.ref.size} bytes, "
        f"found {exc.found}); this checkpoint is not written — a staged segment keeps the "
        "size shmstaged made it: never ftruncate one"
    )


def _storage_message(dest: Destination, step: str, exc: OSError) -> str:
    """The cause in words an operator acts on: which file, which step, what to do."""
    code = errno.errorcode.get(exc.errno or 0, "unknown errno")
    where = dest.shown()
    try:
        removed = os.fstat(dest.dir_fd).st_nlink == 0
    except OSError:
        removed = False
    if removed:
        return (
            f"the checkpoint directory {where} was removed while {step}; nothing was "
            f"published — save to a directory that stays ({exc.strerror or exc}, {code})"
        )
    advice = {
        errno.ENOSPC: "the filesystem is full; free space there or save elsewhere",
        errno.EDQUOT: "the disk quota is exhausted; free space or raise the quota",
        errno.EROFS: "the filesystem is read-only; remount it read-write or save elsewhere",
        errno.EPERM: "the directory does not permit it (read-only, immutable or sealed); "
        "make it writable or save elsewhere",
        errno.EACCES: "the directory is not writable; make it writable or save elsewhere",
        errno.EIO: "the storage device reported an I/O error; check the device and the "
        "kernel log (dmesg) before trusting this filesystem",
    }.get(exc.errno or 0, "partial files were removed")
    return f"{step} in {where} failed: {exc.strerror or exc} ({code}); {advice}"


def _write_data(job: PersistJob, step: Step, phases: WritePhases) -> tuple[int, list[int]]:
    """Stream the data file (header, then every tensor), and fsync it.

    The bytes go through the process's write scheduler: this thread — or, for a file of
    large tensors, up to four while the pool has buffers to spare — gathers them into
    aligned chunks and checksums each tensor as it goes, the scheduler's I/O threads write
    the chunks, direct where the filesystem allows it (see ``gather``, ``scheduler``).
    """
    dest = job.destination
    fd = dest.data_fd
    size = len(job.header) + job.layout.nbytes
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than halfway through
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    disk = scheduler.shared()
    writer = disk.writer_for(fd, dest.path)
    owner = job.peer.uid if job.peer is not None else None
    job.progress.phase = "writing"
    began = time.perf_counter()
    starts = [0]
    sizes = job.layout.sizes
    if not faults.armed("mid-stream"):  # the hook's promise needs the file written in order
        starts = gather.regions(len(job.header), sizes, disk.chunk_bytes)
    try:
        with disk.open(
            writer, owner=owner, stop=job.stop, progress=job.progress, gatherers=len(starts)
        ) as writes:
            if writes.gatherers < len(starts):  # other users are writing: fewer threads
                starts = gather.regions(len(job.header), sizes, disk.chunk_bytes, writes.gatherers)
            checksums = gather.whole_file(writes, job.header, job.layout, job.segments, starts)
            phases.disk_wait = writes.disk_wait(len(starts))
            phases.gather = time.perf_counter() - began - phases.disk_wait
    except scheduler.Stopped:
        raise JobInterrupted from None
    except scheduler.CorruptChunk as exc:
        raise JobFailed(ErrorCode.INTERNAL, str(exc)) from None
    began = time.perf_counter()
    writer.finish(size)
    job.progress.phase = "syncing"
    step.now = f"syncing {dest.data_file}"
    if job.fsync:
        os.fsync(fd)
    phases.sync = time.perf_counter() - began
    return size, checksums


def _is_ours(dest: Destination, name: str, fd: int) -> bool:
    """Does ``name`` in the checkpoint directory name the very file behind ``fd``?

    The job only ever removes or accepts names that pass this: a file the user put there
    under the same name is never ours, whatever it contains.
    """
    try:
        named = os.stat(name, dir_fd=dest.dir_fd, follow_symlinks=False)
        st = os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)


def _publish(dest: Destination, tmp: str, final: str, fd: int) -> None:
    """Give a finished file its final name without ever replacing an existing one."""
    if _is_ours(dest, final, fd):  # published by an earlier, interrupted run of this job
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dest.dir_fd)
        return
    try:
        os.link(tmp, final, src_dir_fd=dest.dir_fd, dst_dir_fd=dest.dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise JobFailed(
            ErrorCode.EXISTS,
            f"{final} already exists in {dest.shown()}; shmstage never replaces a checkpoint "
            "— save to a new directory",
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
        raise JobFailed(ErrorCode.EXISTS, f"{final} already exists in {dest.shown()}") from None
    os.unlink(tmp, dir_fd=dest.dir_fd)


def _publish_directory(job: PersistJob, step: Step) -> None:
    """A new checkpoint directory gets its final name, never replacing anything, and the
    parent is synced; nothing to do for an existing directory (or one already published
    by an earlier, interrupted run of this job)."""
    dest = job.destination
    if not dest.pending:
        return
    step.now = f"publishing {dest.shown()}"
    if not _names_directory(dest, dest.final_dir):
        if not _names_directory(dest, dest.pending_dir):
            raise JobFailed(
                ErrorCode.STORAGE,
                f"the pending directory {dest.pending_dir} of {dest.shown()} was renamed or "
                "removed while the checkpoint was written; nothing was published",
            )
        check_stop(job)
        _check_writable(job, dest.parent_fd)
        try:
            rename_noreplace(dest.parent_fd, dest.pending_dir, dest.final_dir)
        except FileExistsError:
            raise JobFailed(
                ErrorCode.EXISTS,
                f"{dest.shown()} appeared while the checkpoint was written; shmstage never "
                "replaces anything — save to a new directory",
            ) from None
    step.now = "syncing the checkpoint directory's parent"
    faults.maybe_eio("sync-dir")
    if job.fsync:
        os.fsync(dest.parent_fd)


def _names_directory(dest: Destination, name: str) -> bool:
    """Does ``name`` in the parent name the very directory behind ``dest.dir_fd``?"""
    try:
        named = os.stat(name, dir_fd=dest.parent_fd, follow_symlinks=False)
        st = os.fstat(dest.dir_fd)
    except OSError:
        return False
    return stat.S_ISDIR(named.st_mode) and (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)


RENAME_NOREPLACE: Final = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 and later


def rename_noreplace(dir_fd: int, old: str, new: str) -> None:
    """Rename ``old`` to ``new`` in ``dir_fd``; FileExistsError if ``new`` exists.

    ``renameat2(RENAME_NOREPLACE)`` checks and renames atomically. Where the filesystem or
    C library refuses it (EINVAL, ENOSYS: some network filesystems, old kernels), the
    fallback checks that ``new`` is absent and then renames: rename(2) of a directory
    never replaces a file or a non-empty directory, so what a racing creator could lose
    in that instant is at most an empty directory — never data.
    """
    if _renameat2 is not None:
        done = _renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), RENAME_NOREPLACE)
        if done == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), new)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), new)
    try:
        os.stat(new, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), new)
    try:
        os.rename(old, new, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), new) from None
        raise


def _check_writable(job: PersistJob, dir_fd: int | None = None) -> None:
    """The daemon may run as root: it creates a name only while the saving user could.

    Checked at commit, and again before each publish (in the directory the name goes
    into: ``dir_fd``, by default the one the files are written in), so a directory made
    read-only (or handed to another owner) while the data streamed gets nothing new in it.
    """
    fd = job.destination.dir_fd if dir_fd is None else dir_fd
    if job.peer is not None and not may_write_dir(os.fstat(fd), job.peer):
        raise JobFailed(
            ErrorCode.NOT_ALLOWED,
            f"uid {job.peer.uid} can no longer write {job.destination.shown()} (it was made "
            "read-only or changed owner while the checkpoint was written); nothing was "
            "published — make it writable again and save once more",
        )


def is_committed(dest: Destination) -> bool:
    """Whether this job's own manifest already carries the final name (the commit marker)."""
    return _is_ours(dest, MANIFEST_NAME, dest.manifest_fd)


def discard(dest: Destination, peer: Peer | None = None) -> None:
    """Give up a job that will not run: remove what it put in the directory (with its
    owner's filesystem rights), close it."""
    try:
        with credentials.acting_as(peer):
            _undo(dest)
    except credentials.CredentialError:
        pass  # the names stay; gc removes them once nobody holds them
    finally:
        dest.close()


def _sync_dir(dest: Destination, fsync: bool) -> None:
    if fsync:
        os.fsync(dest.dir_fd)


def _remove_temps(dest: Destination) -> None:
    for name, fd in ((dest.data_tmp, dest.data_fd), (dest.manifest_tmp, dest.manifest_fd)):
        if _is_ours(dest, name, fd):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dest.dir_fd)


def _undo(dest: Destination) -> None:
    """Remove what this job published, commit marker first, then its temporary files, then
    the directory it was given to create (pending, or already under its final name).

    Unpublishing the manifest before the data file means a reader never finds a manifest
    whose data is gone; only names that are this job's own files are removed, and the
    directory only while it is the very one the client made (and empty).
    """
    for name, fd in ((MANIFEST_NAME, dest.manifest_fd), (dest.data_file, dest.data_fd)):
        if _is_ours(dest, name, fd):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dest.dir_fd)
    _remove_temps(dest)
    if dest.pending:
        for name in (dest.final_dir, dest.pending_dir):
            if _names_directory(dest, name):
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=dest.parent_fd)

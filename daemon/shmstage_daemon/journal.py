"""The journal of acknowledged checkpoints: what a restarted daemon still has to publish.

Once the daemon answers ``committed`` the trainer may free its tensors or exit; from then on
the staged bytes in the slot's segments are the only copy. If the daemon is SIGKILLed (OOM
killer, a node agent, a crash) before the checkpoint is durable, the next daemon must still
publish it. So before acknowledging a commit the daemon writes one small entry per job to
its instance's journal directory (``/dev/shm/shmstage.<instance>.journal/<instance>.<job>.job``
by default), atomically (written to a temporary name, fsynced, renamed, directory fsynced),
and removes it once the job ended.

The trainer waits for that entry, so the journal must never wait on a disk: it lives in
memory-backed storage (tmpfs or ramfs, checked with statfs at start; a disk needs
``allow_disk_journal``). That costs nothing in safety: an entry describes shared-memory
segments, which a reboot erases as well. Each instance gets a directory of its own with an
unguessable name, so another local user cannot squat it in the world-writable /dev/shm.
Its instance lock names the journal and the socket, so no reaper unlinks the segments an
entry needs (``shmstage.instance``), and the daemon that serves the same socket next finds
its predecessors' journals through their locks and finishes every entry before it reaps the
dead instance's segments.

Finishing a job needs the destination again, and the daemon never resolves paths a user
supplied: the client opened the directory and passed its descriptor. At commit the daemon
asks the kernel where that descriptor points (``/proc/self/fd``), walks that path from ``/``
itself one component at a time with ``O_NOFOLLOW`` and keeps it only if it arrives at the
very same directory (st_dev, st_ino). After a restart it walks the recorded path the same
way and proceeds only if it again reaches that directory, the original uid may still write
it, and the temporary (or, if the killed daemon had got that far, final) names still hold the
very files the client created (st_dev, st_ino) — so a renamed, replaced or symlinked path
can never redirect the write. A directory the daemon cannot reach by path (another mount
namespace) is not journaled: that job is lost if the daemon dies, and the daemon logs so at
commit.

A save to a new directory is written into a hidden pending directory the client made in the
destination's parent and published by renaming it (``job``). Its entry records the parent
(``directory``, walked and checked the same way), the pending directory's hidden name and
identity, and the final name; after a restart the directory is looked up under either name
(the killed daemon may have renamed it already) and accepted only if it is that very
directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgpack

from shmstage import names, segment
from shmstage.instance import JOURNAL_SUFFIX, PENDING_SUFFIX
from shmstage.layout import Layout, LayoutError
from shmstage.manifest import MANIFEST_NAME
from shmstage.protocol import pack_map
from shmstage.segment import SegmentRef
from shmstage_daemon import credentials, job
from shmstage_daemon.admission import Peer, may_write_dir
from shmstage_daemon.store import SlotWire

log = logging.getLogger("shmstaged.journal")

ENTRY_VERSION: Final = 2
#: Version 1 entries (before new directories were published by rename) still load.
_OLDER_VERSIONS: Final = frozenset({1})
#: An entry holds a layout, a tree and metadata; a real one is well below this.
MAX_ENTRY_BYTES: Final = 256 * 1024 * 1024

FileId = tuple[int, int]  # (st_dev, st_ino)


class JournalError(Exception):
    """The journal, or a job it records, cannot be used; the message says which and why."""


#: statfs f_type of the filesystems a journal may live on without allow_disk_journal.
_MEMORY_FILESYSTEMS: Final = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def journal_dir(root: Path, instance: str) -> Path:
    """One instance's journal: a private directory under ``root`` (default /dev/shm)."""
    return root / f"shmstage.{instance}.journal"


def legacy_journal_dir(socket_path: Path) -> Path:
    """Where daemons before 0.2 kept the journal: next to the socket (often on a disk)."""
    return socket_path.with_name(socket_path.name + ".journal")


def filesystem_type(path: Path) -> int:
    """statfs(2)'s f_type for ``path`` (Python's statvfs does not expose it)."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.statfs(os.fsencode(path), buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def check_memory_backed(root: Path, *, allow_disk: bool) -> str:
    """Refuse a journal root on a disk unless allowed; returns the filesystem's name."""
    kind = filesystem_type(root)
    name = _MEMORY_FILESYSTEMS.get(kind)
    if name is not None:
        return name
    if allow_disk:
        return f"disk-backed (f_type {kind:#x}, allowed by allow_disk_journal)"
    raise JournalError(
        f"{root} is not memory-backed (statfs f_type {kind:#x}, not tmpfs or ramfs): every "
        "save would wait for a journal fsync on a disk the daemon is busy writing "
        "checkpoints to. Use a tmpfs ([server] journal_dir = \"/dev/shm\", the default), or "
        "set [server] allow_disk_journal = true (--allow-disk-journal) to accept that"
    )


_libc = ctypes.CDLL(None, use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]


@dataclass(frozen=True)
class Entry:
    """Everything needed to run one acknowledged persist job again, and nothing mutable."""

    instance: str
    job: int
    tensors: list[Any]
    segments: list[tuple[str, int]]
    header: bytes
    directory: str
    directory_id: FileId
    data_file: str
    data_tmp: str
    manifest_tmp: str
    data_id: FileId
    manifest_id: FileId
    tree: Any
    metadata: dict[str, Any]
    save_info: dict[str, Any]
    uid: int
    gid: int
    groups: list[int]
    fsync: bool
    #: A new directory: its hidden name while pending, its identity, its final name (all
    #: in ``directory``, the parent). Empty for files written into an existing directory.
    pending_dir: str = ""
    pending_id: FileId = (0, 0)
    final_dir: str = ""

    @property
    def name(self) -> str:
        return f"{self.instance}.{self.job}{JOURNAL_SUFFIX}"

    def peer(self) -> Peer:
        """The saving user as SO_PEERCRED saw it at commit (the pid no longer matters)."""
        return Peer(0, self.uid, self.gid, frozenset(self.groups))

    def describe(self) -> str:
        where = os.path.join(self.directory, self.final_dir) if self.final_dir else self.directory
        return f"job {self.job} of instance {self.instance} ({where}/{self.data_file})"

    def to_bytes(self, prepacked: Mapping[str, bytes] | None = None) -> bytes:
        """The entry as one msgpack map. ``prepacked``: fields whose encoding is already
        known (a slot's tensors and segments, see ``store.SlotWire``), spliced in as is;
        the bytes are the same as without it."""
        fields = {"v": ENTRY_VERSION, **{k: getattr(self, k) for k in _FIELDS}}
        return pack_map(fields, prepacked or {})

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise JournalError(f"undecodable entry: {type(exc).__name__}: {exc}") from None
        if not isinstance(raw, dict) or (
            raw.get("v") != ENTRY_VERSION and raw.get("v") not in _OLDER_VERSIONS
        ):
            raise JournalError(f"not a version-{ENTRY_VERSION} journal entry")
        if raw["v"] in _OLDER_VERSIONS:
            raw = {**_NEW_IN_V2, **raw}
        try:
            values = {k: raw[k] for k in _FIELDS}
        except KeyError as exc:
            raise JournalError(f"entry lacks {exc}") from None
        for key, kind in _FIELDS.items():
            if not isinstance(values[key], kind) or (
                isinstance(values[key], bool) and kind is not bool
            ):
                raise JournalError(f"entry field {key} is not {kind.__name__}")
        for key in ("directory_id", "data_id", "manifest_id", "pending_id"):
            values[key] = _file_id(values[key], key)
        values["segments"] = [_segment(item) for item in values["segments"]]
        return cls(**values)


_FIELDS: Final[dict[str, type]] = {
    "instance": str,
    "job": int,
    "tensors": list,
    "segments": list,
    "header": bytes,
    "directory": str,
    "directory_id": list,
    "data_file": str,
    "data_tmp": str,
    "manifest_tmp": str,
    "data_id": list,
    "manifest_id": list,
    "tree": object,
    "metadata": dict,
    "save_info": dict,
    "uid": int,
    "gid": int,
    "groups": list,
    "fsync": bool,
    "pending_dir": str,
    "pending_id": list,
    "final_dir": str,
}
_NEW_IN_V2: Final[dict[str, Any]] = {"pending_dir": "", "pending_id": [0, 0], "final_dir": ""}


def _file_id(value: Any, key: str) -> FileId:
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[1])
    raise JournalError(f"entry field {key} is not [st_dev, st_ino]")


def _segment(item: Any) -> tuple[str, int]:
    if (
        isinstance(item, list | tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], int)
    ):
        return (item[0], item[1])
    raise JournalError("entry lists a malformed segment")


def _tmp_name(name: str) -> str:
    return f".{name}{PENDING_SUFFIX}"


def entry_for(
    persist: job.PersistJob,
    wire: SlotWire,
    instance: str,
    peer: Peer,
    directory: str,
    directory_id: FileId,
) -> Entry:
    """The journal entry of a job about to be acknowledged (fstat only: no file I/O).

    ``directory`` is where the daemon reaches the directory the files are in; for a new
    directory, that is the pending directory in its parent, and the entry records the parent.
    """
    dest = persist.destination
    data, manifest = os.fstat(dest.data_fd), os.fstat(dest.manifest_fd)
    pending: dict[str, Any] = {}
    if dest.pending:
        parent = os.fstat(dest.parent_fd)
        pending = {
            "pending_dir": dest.pending_dir,
            "pending_id": directory_id,
            "final_dir": dest.final_dir,
        }
        directory = os.path.dirname(directory)  # a recovery checks it is the parent
        directory_id = (parent.st_dev, parent.st_ino)
    return Entry(
        instance=instance,
        job=persist.id,
        tensors=wire.tensors,
        segments=wire.segments,
        header=persist.header,
        directory=directory,
        directory_id=directory_id,
        data_file=dest.data_file,
        data_tmp=dest.data_tmp,
        manifest_tmp=dest.manifest_tmp,
        data_id=(data.st_dev, data.st_ino),
        manifest_id=(manifest.st_dev, manifest.st_ino),
        tree=persist.tree,
        metadata=persist.metadata,
        save_info=persist.save_info,
        uid=peer.uid,
        gid=peer.gid,
        groups=sorted(peer.groups),
        fsync=persist.fsync,
        **pending,
    )


# -- where the client's directory is -------------------------------------------------


def locate(dir_fd: int) -> str | None:
    """The absolute path by which this daemon reaches the directory behind ``dir_fd``.

    None when the kernel's name for it does not lead back to it (deleted, another mount
    namespace, renamed meanwhile): such a job cannot be journaled.
    """
    try:
        path = os.readlink(f"/proc/self/fd/{dir_fd}")
        st = os.fstat(dir_fd)
    except OSError:
        return None
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    try:
        os.close(open_directory(path, (st.st_dev, st.st_ino)))
    except (OSError, JournalError):
        return None
    return path


def open_directory(path: str, expected: FileId) -> int:
    """Open ``path`` without following any symlink and only if it is the expected directory.

    Every component is opened relative to its parent with ``O_NOFOLLOW``: a symlink swapped
    into the path fails the walk instead of redirecting it.
    """
    parts = [part for part in path.split("/") if part]
    if not path.startswith("/") or any(part in (".", "..") for part in parts):
        raise JournalError(f"{path!r} is not a canonical absolute path")
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                raise JournalError(
                    f"{path}: {part!r} is no longer a directory reached without following a "
                    f"symlink ({exc.strerror})"
                ) from None
            os.close(fd)
            fd = child
        final = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    st = os.fstat(final)
    if (st.st_dev, st.st_ino) != expected:
        os.close(final)
        raise JournalError(f"{path} is no longer the directory the checkpoint was committed to")
    return final


def _open_file(dir_fd: int, candidates: tuple[str, ...], expected: FileId) -> int | None:
    """A write descriptor on whichever candidate name still holds the expected file.

    Opened ``O_NONBLOCK``: a FIFO planted under a temporary name after a crash would
    otherwise block the writer thread in ``open()`` forever (O_WRONLY on a FIFO waits for
    a reader; with O_NONBLOCK it fails at once). The type is checked before anything else,
    then the flag is cleared for the regular file.
    """
    for name in candidates:
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except OSError:
            continue
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == expected:
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
    return None


def reopen(entry: Entry) -> job.Destination:
    """The destination of a journaled job, re-checked as strictly as at commit."""
    for name, final in (
        (entry.data_file, None),
        (entry.data_tmp, entry.data_file),
        (entry.manifest_tmp, MANIFEST_NAME),
    ):
        try:
            names.check_plain_name(name, what="file")
            if final is not None:
                names.check_temp_name(name, final)
            if entry.final_dir:
                names.check_pending_dir_name(entry.pending_dir)
                names.check_final_dir_name(entry.final_dir)
        except names.NameError_ as exc:
            raise JournalError(str(exc)) from None
    fds = [open_directory(entry.directory, entry.directory_id)]
    try:
        _check_writable(entry, fds[0], entry.directory)
        if entry.final_dir:
            fds.append(_open_pending(entry, fds[0]))
            _check_writable(entry, fds[1], entry.directory)
        dir_fd = fds[-1]
        data_fd = _open_file(dir_fd, (entry.data_tmp, entry.data_file), entry.data_id)
        if data_fd is None:
            raise JournalError(
                f"the data file the client created in {entry.directory} is gone "
                f"(neither {entry.data_tmp} nor {entry.data_file} is it any more)"
            )
        fds.append(data_fd)
        manifest_fd = _open_file(dir_fd, (entry.manifest_tmp, MANIFEST_NAME), entry.manifest_id)
        if manifest_fd is None:
            raise JournalError(f"the manifest file the client created in {entry.directory} is gone")
        fds.append(manifest_fd)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in fds[1:]:  # the pending directory and the files, in use again (see names)
        names.hold(fd)
    files = (dir_fd, data_fd, manifest_fd, entry.data_file, entry.data_tmp, entry.manifest_tmp)
    if not entry.final_dir:
        return job.Destination(*files, path=entry.directory)
    return job.Destination(
        *files,
        path=os.path.join(entry.directory, entry.pending_dir),
        parent_fd=fds[0],
        pending_dir=entry.pending_dir,
        final_dir=entry.final_dir,
    )


def _check_writable(entry: Entry, dir_fd: int, where: str) -> None:
    if not may_write_dir(os.fstat(dir_fd), entry.peer()):
        raise JournalError(
            f"uid {entry.uid} can no longer write {where}; shmstaged will not write there on "
            "its behalf"
        )


def _open_pending(entry: Entry, parent_fd: int) -> int:
    """The job's own directory in the parent, under its pending or (if the killed daemon
    had published it) its final name, without following a symlink."""
    for name in (entry.pending_dir, entry.final_dir):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=parent_fd)
        except OSError:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == entry.pending_id:
            return fd
        os.close(fd)
    raise JournalError(
        f"the checkpoint's directory is gone from {entry.directory} (neither "
        f"{entry.pending_dir} nor {entry.final_dir} is it any more)"
    )


def _check_segments(entry: Entry) -> list[SegmentRef]:
    """The entry's segments, each one this daemon's uid's and of the recorded instance."""
    refs = []
    for name, size in entry.segments:
        if segment.instance_of(name) != entry.instance:
            raise JournalError(f"segment {name!r} does not belong to instance {entry.instance}")
        try:
            st = os.stat(segment.SHM_DIR + name)
        except FileNotFoundError:
            raise JournalError(
                f"staged data of the job is gone: segment {name} was removed from "
                f"{segment.SHM_DIR} (reboot, or removed by hand)"
            ) from None
        if st.st_uid != os.geteuid() or st.st_size < size:
            raise JournalError(f"segment {name} is not the one the job staged")
        refs.append(SegmentRef(name, size))
    return refs


def recover(entry: Entry, stop: threading.Event | None = None) -> job.JobResult:
    """Finish a journaled job (runs in a writer thread; never raises).

    A job whose commit marker the killed daemon already wrote needs no staged bytes, only
    the directory synced; any other needs every segment it staged, or it is given up and
    whatever it had put in the directory removed. ``stop``: the daemon's stop request, as
    for any job (an interrupted recovery stays owed).
    """
    try:
        layout = Layout.from_wire(entry.tensors, max_tensors=1 << 30)
        with credentials.acting_as(entry.peer()):  # its files, with its rights
            destination = reopen(entry)
            committed = job.is_committed(destination)
    except (JournalError, LayoutError, OSError) as exc:
        return _failed(entry, exc)
    refs: list[SegmentRef] = []
    if not committed:
        try:
            refs = _check_segments(entry)
            try:
                layout.packing_for(len(refs))
            except ValueError as exc:
                raise JournalError(f"the entry's segments do not match its layout: {exc}") from None
        except (JournalError, OSError) as exc:
            with credentials.acting_as(entry.peer()):
                job.discard(destination)
            return _failed(entry, exc)
    persist = job.PersistJob(
        id=entry.job,
        layout=layout,
        segments=refs,
        header=entry.header,
        destination=destination,
        tree=entry.tree,
        metadata=entry.metadata,
        save_info={**entry.save_info, "recovered_by_restart": True},
        fsync=entry.fsync,
        peer=entry.peer(),
        stop=stop if stop is not None else threading.Event(),
    )
    return job.run(persist)


def _failed(entry: Entry, exc: Exception) -> job.JobResult:
    return job.JobResult(
        entry.job, False, code="journal", message=f"cannot finish {entry.describe()}: {exc}"
    )


# -- the journal directory -----------------------------------------------------------


class Journal:
    """One daemon identity's journal directory. Writes run in one dedicated I/O thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def prepare(self) -> None:
        """Create the directory, or accept it only if it is ours and nobody else's to write.

        Entries tell a root daemon where to write: a journal another user could add files to
        would let them aim it anywhere.
        """
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.directory, 0o700)
        self.check()

    def check(self) -> None:
        """The directory must be ours alone (not a symlink, not another user's, not open)."""
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise JournalError(
                f"journal {self.directory} is not a directory owned by uid {os.geteuid()}; "
                "remove it (shmstaged recreates it)"
            )
        if st.st_mode & 0o077:
            os.chmod(self.directory, 0o700)

    def remove_if_empty(self) -> bool:
        """Drop the directory once it owes nothing (a clean stop, a predecessor finished)."""
        try:
            os.rmdir(self.directory)
        except OSError:
            return False
        return True

    def record(
        self, entry: Entry, *, fsync: bool, prepacked: Mapping[str, bytes] | None = None
    ) -> None:
        """Add an entry atomically: whole after a crash, or absent."""
        self.write_pending(entry, fsync=fsync, prepacked=prepacked)
        self.publish(entry.name, fsync=fsync)

    def write_pending(
        self, entry: Entry, *, fsync: bool, prepacked: Mapping[str, bytes] | None = None
    ) -> None:
        """Write the entry under its temporary name: not owed yet, and ``load`` drops it.

        A commit the client sends while its copy still runs is journaled this way, and
        published (``publish``) only once the client says the slot is filled.
        """
        data = entry.to_bytes(prepacked)
        tmp = _tmp_name(entry.name)
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                job.write_all(fd, data, 0)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        finally:
            os.close(dir_fd)

    def publish(self, name: str, *, fsync: bool) -> None:
        """Give a prepared entry its name: from here the job is owed, whatever happens."""
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.rename(_tmp_name(name), name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            if fsync:
                os.fsync(dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(_tmp_name(name), dir_fd=dir_fd)
            raise
        finally:
            os.close(dir_fd)

    def discard(self, name: str) -> None:
        """Drop a prepared entry whose commit will not happen."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / _tmp_name(name))

    def remove(self, name: str, *, fsync: bool) -> None:
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            if fsync:
                os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load(self) -> list[Entry]:
        """Every intact entry; unusable ones are logged and removed (they can never finish)."""
        entries = []
        for name in sorted(os.listdir(self.directory)):
            path = self.directory / name
            if name.endswith(PENDING_SUFFIX):  # an entry never acknowledged: its job never ran
                path.unlink(missing_ok=True)
                continue
            if not name.endswith(JOURNAL_SUFFIX):
                continue
            try:
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise JournalError("not a regular file owned by this daemon's uid")
                if st.st_size > MAX_ENTRY_BYTES:
                    raise JournalError(f"{st.st_size} bytes is not a plausible entry")
                entry = Entry.from_bytes(path.read_bytes())
                if entry.name != name:
                    raise JournalError(f"its contents are those of {entry.name}")
            except (OSError, JournalError) as exc:
                log.error("journal: dropping unusable entry %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            entries.append(entry)
        return entries

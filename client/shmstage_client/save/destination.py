"""Where a save goes, checked, created and opened by the client: the daemon gets descriptors.

The daemon never resolves a path a user supplied. The client creates what the save writes
into and passes descriptors with the commit; creating them here also proves that this
user may write there. Two kinds of destination:

- A **new directory** (the usual case): the client makes a hidden pending directory in the
  destination's parent (``names.pending_dir_name``) with the two temporary files (data,
  manifest) inside; the daemon writes them, links them to their final names, and publishes
  the directory by renaming it to the final name, never replacing anything. A reader never
  sees a half-written checkpoint directory at all.
- An **existing directory** (``mkdir`` first, or PyTorch DCP's shared pending directory):
  the temporary files are created in it and linked to their final names there, as long as
  neither final name exists yet.

On a network filesystem each mkdir or create is a server round trip (tens to hundreds of
milliseconds under load), so after each save the Stager makes the *next* save's pending
directory and files in the background (``Spares``): a later save to a new directory beside
the last one only checks that the spare still fits, without a single create on the
trainer's thread. The promise stands: once ``save()`` returned, the daemon holds
descriptors of everything it writes, so the checkpoint completes even if the trainer dies.

Every temporary file and pending directory is ``flock``-ed shared by its creator right
after creation (``names.hold``); see ``shmstage.names`` for how that tells a cleaner which
ones are still in use. A spare left by a SIGKILLed trainer is such an orphan; one that
exits without ``close()`` removes its spares at exit (``_remove_spares_at_exit``).

Whoever may rename entries in the directory a checkpoint lands in can move the checkpoint
away and put one of their own at its path. So a save goes only into a directory (the
existing one it writes into, or the parent of the new one) that this user or root owns
and that nobody else may change: not writable by its group or others, unless it has the
sticky bit, as ``/tmp`` has (``check_private``). A shared group root (``2770``) needs the
sticky bit (``chmod +t``, then only each entry's owner renames it) or a run directory
per user inside it. Root is held to the same rule with itself as the only trusted owner.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from shmstage import names
from shmstage.datafile import SUFFIX
from shmstage.manifest import MANIFEST_NAME
from shmstage.paths import file_kind
from shmstage_client.errors import CheckpointExists, DestinationError, SaveError, UnsupportedValue

log = logging.getLogger("shmstage.client")

DEFAULT_DATA_FILE = "model.safetensors"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: O_RDWR, not O_WRONLY: NFS emulates flock with byte-range locks, whose shared kind needs
#: a descriptor open for reading.
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def check_private(st: os.stat_result, path: Path, what: str) -> None:
    """Refuse a directory another user could change: one that belongs to neither this
    user nor root, or that its group or others may write without the sticky bit. Its
    owner, or anyone who may rename its entries, could move a checkpoint saved there and
    plant another in its place; ``what``: how the directory serves the save."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise DestinationError(
            f"{path} ({what}) belongs to uid {st.st_uid}, not to this user (uid {me}) or "
            "root: its owner could replace the checkpoint saved there; save under a "
            "directory of your own (a run directory per user) — nothing was written"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(st.st_mode)
        raise DestinationError(
            f"{path} ({what}) is writable by its group or others (mode {mode:o}) without "
            "the sticky bit: any of them could rename the checkpoint saved there and put "
            f"another in its place; `chmod +t {path}` (as /tmp is), or save under a run "
            "directory of your own that only you may write (chmod go-w) — nothing was written"
        )


def check_data_file(name: str) -> str:
    """A data file name the daemon will accept: a plain name ending in ``.safetensors``."""
    names.check_plain_name(name, what="data file")
    if not name.endswith(SUFFIX):
        raise ValueError(f"data_file {name!r} must end in {SUFFIX}")
    return name


@dataclass(frozen=True)
class Fields:
    """What a commit says besides where: the data file's name, the strings for its header,
    the manifest's metadata — checked, with the metadata packed once for the wire."""

    data_file: str
    file_metadata: dict[str, str]
    metadata: dict[str, Any]
    packed_metadata: bytes

    @classmethod
    def check(
        cls,
        data_file: str,
        file_metadata: Mapping[str, str] | None,
        metadata: Mapping[str, Any] | None,
    ) -> Fields:
        plain = _check_metadata(metadata)
        try:
            packed = msgpack.packb(plain, use_bin_type=True)
        except OverflowError:
            raise UnsupportedValue(
                "metadata holds an integer outside the 64-bit range shmstage can store; "
                "store it as a str — nothing was written"
            ) from None
        return cls(check_data_file(data_file), _check_file_metadata(file_metadata), plain, packed)

    def wire(self) -> dict[str, Any]:
        """The commit's fields for these (the metadata goes prepacked)."""
        return {"data_file": self.data_file, "file_metadata": self.file_metadata}


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnsupportedValue(f"metadata must be plain JSON values: {exc}") from None


def _check_file_metadata(file_metadata: Mapping[str, str] | None) -> dict[str, str]:
    if file_metadata is None:
        return {"format": "pt"}
    bad = [
        key
        for key, value in file_metadata.items()
        if not isinstance(key, str) or not isinstance(value, str)
    ]
    if bad:
        raise UnsupportedValue(
            f"file_metadata must map str to str (safetensors header rule); bad entries: {bad[:5]}"
        )
    return dict(file_metadata)


class Target:
    """The destination as the client opened it: a directory descriptor holding the two
    temporary files and, for a new directory, the parent's descriptor and the pending
    directory's hidden name. Made in the background for a spare (``path`` still None)."""

    def __init__(self, dir_fd: int, data_file: str) -> None:
        self.dir_fd = dir_fd
        self.data_file = data_file
        self.data_tmp = names.temp_name(data_file)
        self.manifest_tmp = names.temp_name(MANIFEST_NAME)
        self.data_fd = self.manifest_fd = -1
        #: The checkpoint's final path (absolute), once a save claims this target.
        self.path: Path | None = None
        self.parent: Path | None = None
        self.parent_fd = -1
        self.pending_name = ""
        #: Parents this target had to create, outermost first: a failed save removes them.
        self.created: list[Path] = []

    @property
    def pending(self) -> bool:
        """A new directory, published by renaming the pending one (else: an existing one)."""
        return bool(self.pending_name)

    @classmethod
    def existing(cls, path: Path, data_file: str) -> Target:
        """Files into the existing directory ``path`` (whose final names must be free)."""
        try:
            dir_fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            raise _unusable(path, exc) from None
        target = cls(dir_fd, data_file)
        target.path = path
        with target._undone_on_failure():
            check_private(os.fstat(dir_fd), path, "the existing directory saved into")
            for existing in (MANIFEST_NAME, data_file):
                if _exists(existing, dir_fd):
                    raise CheckpointExists(
                        f"{path / existing} already exists: shmstage never overwrites a "
                        "checkpoint; save to a new directory"
                    )
            target._create_files(path)
        return target

    @classmethod
    def pending_in(cls, parent: Path, data_file: str) -> Target:
        """A new hidden pending directory in ``parent`` (made, with its parents, if
        missing) and the two temporary files inside; for one save, or a spare."""
        created: list[Path] = []
        try:
            try:
                parent_fd = os.open(parent, _DIR_FLAGS)
            except FileNotFoundError:
                created = _make_parents(parent)
                parent_fd = os.open(parent, _DIR_FLAGS)
        except OSError as exc:
            _remove_dirs(created)
            raise _unusable(parent, exc) from None
        try:
            check_private(os.fstat(parent_fd), parent, "the new checkpoint's parent")
        except BaseException:
            os.close(parent_fd)
            _remove_dirs(created)
            raise
        name = names.pending_dir_name()
        try:
            # Never writable by others, whatever the umask: readers trust a checkpoint
            # directory only if nobody else could have changed it (listing.not_written_for).
            os.mkdir(name, 0o755, dir_fd=parent_fd)
            dir_fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError as exc:
            os.close(parent_fd)
            _remove_dirs(created)
            raise _unusable(parent, exc, "cannot create the checkpoint's directory in") from None
        target = cls(dir_fd, data_file)
        target.parent, target.parent_fd, target.pending_name = parent, parent_fd, name
        target.created = created
        with target._undone_on_failure():
            names.hold(dir_fd)
            target._create_files(parent / name)
        return target

    def _create_files(self, where: Path) -> None:
        try:
            self.data_fd = os.open(self.data_tmp, _CREATE_FLAGS, 0o644, dir_fd=self.dir_fd)
            names.hold(self.data_fd)
            self.manifest_fd = os.open(self.manifest_tmp, _CREATE_FLAGS, 0o644, dir_fd=self.dir_fd)
            names.hold(self.manifest_fd)
        except OSError as exc:
            raise DestinationError(
                f"cannot create files in {where}: {exc.strerror or exc}; make the directory "
                "writable for this user or save elsewhere — nothing was written"
            ) from None

    @contextlib.contextmanager
    def _undone_on_failure(self) -> Any:
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def fits(self, parent: Path, data_file: str) -> bool:
        """Whether this spare can take a save to a new directory in ``parent``: made there
        for the same data file, the path still leads to that very directory, and the
        pending directory is still there. Cheap: a stat and an fstat."""
        if self.parent != parent or self.data_file != data_file:
            return False
        try:
            here, ours = os.stat(parent), os.fstat(self.parent_fd)
            alive = os.fstat(self.dir_fd).st_nlink > 0
            check_private(ours, parent, "the new checkpoint's parent")
        except (OSError, DestinationError):
            return False  # a new pending directory says why, if it cannot be made either
        return alive and (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino)

    def fds(self) -> list[int]:
        """The commit's descriptors, in the order ``protocol`` gives for each kind."""
        if self.pending:
            return [self.parent_fd, self.dir_fd, self.data_fd, self.manifest_fd]
        return [self.dir_fd, self.data_fd, self.manifest_fd]

    def wire(self) -> dict[str, str]:
        """The commit's names for this target."""
        names_ = {"data_tmp": self.data_tmp, "manifest_tmp": self.manifest_tmp}
        if self.pending:
            assert self.path is not None
            names_ |= {"pending_dir": self.pending_name, "final_dir": self.path.name}
        return names_

    def abort(self) -> None:
        """This save will not happen: remove what was created for it, close everything."""
        for name in (self.data_tmp, self.manifest_tmp):
            if self.dir_fd >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
        if self.pending and self.parent_fd >= 0:
            with contextlib.suppress(OSError):
                os.rmdir(self.pending_name, dir_fd=self.parent_fd)
        _remove_dirs(self.created)
        self.created = []
        self.close_fds()

    def close_fds(self) -> None:
        for fd in (self.data_fd, self.manifest_fd, self.dir_fd, self.parent_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.data_fd = self.manifest_fd = self.dir_fd = self.parent_fd = -1


#: Spares made (or being made) and neither taken nor removed, of every Spares in this
#: process, with the pid that made them: what ``_remove_spares_at_exit`` removes when a
#: trainer exits without close() (a forked child that exits leaves its parent's alone).
_UNTAKEN: dict[concurrent.futures.Future[Target], int] = {}
_UNTAKEN_LOCK = threading.Lock()


@atexit.register
def _remove_spares_at_exit() -> None:
    """A trainer that exits without ``Stager.close()`` (the README's one-liner) must not
    leave a hidden pending directory of two empty files beside its checkpoints. At exit
    the Stager's background threads have finished (``concurrent.futures`` joins them
    before ``atexit`` runs), so every spare asked for is made by now; one that is not
    (its thread hung) is left to ``shmstage gc`` and its lock."""
    with _UNTAKEN_LOCK:
        untaken = [future for future, pid in _UNTAKEN.items() if pid == os.getpid()]
        _UNTAKEN.clear()
    for future in untaken:
        if future.done():
            _abort_when_made(future)


def _untaken(future: concurrent.futures.Future[Target], *, add: bool) -> None:
    with _UNTAKEN_LOCK:
        if add:
            _UNTAKEN[future] = os.getpid()
        else:
            _UNTAKEN.pop(future, None)


class Spares:
    """The next save's pending directory, made in the background after each save.

    Only the saving thread calls ``take`` and ``prepare``; the work runs on the Stager's
    background thread, one task at a time. A spare not taken by exit is removed then.
    """

    def __init__(self, background: concurrent.futures.Executor, data_file: str) -> None:
        self._background = background
        self._data_file = data_file
        self._parent: Path | None = None
        self._future: concurrent.futures.Future[Target] | None = None

    def take(self, path: Path) -> Target | None:
        """The spare for a save to the new directory ``path``, if one is ready beside it."""
        future = self._future
        if future is None or not future.done() or self._parent != path.parent:
            return None
        self._future = self._parent = None
        _untaken(future, add=False)
        try:
            spare = future.result()
        except (OSError, SaveError) as exc:
            log.debug("shmstage: no spare pending directory in %s: %s", path.parent, exc)
            return None
        if not spare.fits(path.parent, self._data_file):
            self._background.submit(spare.abort)
            return None
        spare.path = path
        return spare

    def prepare(self, parent: Path) -> None:
        """After a save to a new directory in ``parent``: have the next one's ready there."""
        if self._future is not None:
            if self._parent == parent:
                return  # still being made, or made and not used yet
            _untaken(self._future, add=False)
            self._background.submit(_abort_when_made, self._future)
        self._parent = parent
        self._future = self._background.submit(Target.pending_in, parent, self._data_file)
        _untaken(self._future, add=True)

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the spare (if one is being made) is made; for tests and benchmarks."""
        future = self._future
        if future is None:
            return False
        concurrent.futures.wait([future], timeout)
        return future.done() and future.exception() is None

    def close(self) -> None:
        """Remove the spare (waits for one being made: the background runs in order)."""
        if self._future is not None:
            _untaken(self._future, add=False)
            self._background.submit(_abort_when_made, self._future).result()
            self._future = self._parent = None


def _abort_when_made(future: concurrent.futures.Future[Target]) -> None:
    with contextlib.suppress(Exception):
        future.result().abort()


def open_target(
    path: str | os.PathLike[str], data_file: str, spares: Spares | None = None
) -> Target:
    """Open where a save to ``path`` goes: a spare beside the last save when one fits
    (no create on this thread), else a new pending directory, or an existing directory."""
    given = os.fspath(path)
    if not given:
        raise DestinationError(
            "the checkpoint path is empty; pass the new directory to save to (for example "
            "/ckpt/step-1000) — nothing was written"
        )
    final = Path(given) if os.path.isabs(given) else Path.cwd() / given
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _unusable(final, exc) from None
    if st is None:
        try:
            names.check_final_dir_name(final.name)
        except names.NameError_ as exc:
            raise DestinationError(f"{final}: {exc}; name a new directory") from None
        target = spares.take(final) if spares is not None else None
        if target is None:
            target = Target.pending_in(final.parent, data_file)
            target.path = final
        return target
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(final)
        except OSError:
            raise DestinationError(
                f"{final} is a symlink to nothing ({os.readlink(final)!r}); remove it or "
                "save to another path — nothing was written"
            ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise DestinationError(
            f"{final} already exists and is a {file_kind(st.st_mode)}, not a directory: a "
            "checkpoint is a directory — remove it or save to another path; nothing was written"
        )
    return Target.existing(final, data_file)


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and its missing ancestors; returns those created, outermost first."""
    missing: list[Path] = []
    here = parent
    while not os.path.lexists(here):
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    created: list[Path] = []
    try:
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o777)
            except FileExistsError:
                continue  # made meanwhile by someone else: not ours to remove
            created.append(directory)
    except OSError:
        _remove_dirs(created)
        raise
    return created


def _remove_dirs(created: list[Path]) -> None:
    """Remove directories a failed save created, innermost first, if still empty."""
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _unusable(
    path: Path, exc: OSError, what: str = "cannot use checkpoint directory"
) -> DestinationError:
    advice = {
        errno.EACCES: "this user may not write there; save elsewhere or fix the permissions",
        errno.EPERM: "the directory does not permit it; save elsewhere",
        errno.ENOTDIR: "a component of the path is not a directory; fix the path",
        errno.EROFS: "the filesystem is read-only; save elsewhere",
        errno.ENOSPC: "the filesystem is full; free space or save elsewhere",
        errno.ELOOP: "too many symlinks; fix the path",
    }.get(exc.errno or 0, "fix the path or save elsewhere")
    return DestinationError(
        f"{what} {path}: {exc.strerror or exc} — {advice}; nothing was written"
    )


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True

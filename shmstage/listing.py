"""Find checkpoints under a directory and say, cheaply, what state each one is in.

``shmstage ls`` must answer "which steps do I have, and can I resume from them?" over a
directory with hundreds of checkpoints, so it reads manifests and stats files but never
reads tensor data (``shmstage verify`` does that). A directory is a checkpoint when it holds
the manifest, a data file, or a temporary file of a save in progress or abandoned.

``scan(uid=...)`` also says whether each checkpoint was written for that user
(``not_written_for``), before reading a byte of it: ``latest(under=...)`` restores only
its caller's own, so that a checkpoint another user planted in a shared directory (with a
``committed_unix`` far in the future, say) is skipped, never read.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shmstage import datafile, names, tree
from shmstage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError

__all__ = ["CheckpointInfo", "inspect", "not_written_for", "scan"]

COMPLETE = "complete"
PARTIAL = "partial"  # no manifest: a save in progress, or one that never committed
DAMAGED = "damaged"  # a manifest, but it or the files it names are not what it says
FOREIGN = "foreign"  # not written for the uid that asked (``scan(uid=...)``): not read

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    state: str
    step: int | None
    bytes: int
    files: int
    committed_unix: float | None = None
    problem: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


def _looks_like_checkpoint(entries: list[os.DirEntry[str]]) -> bool:
    return any(
        e.name == MANIFEST_NAME or e.name.endswith(datafile.SUFFIX) or names.is_temp(e.name)
        for e in entries
    )


def _step(metadata: Any) -> int | None:
    step = metadata.get("step") if isinstance(metadata, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def not_written_for(uid: int, dir_fd: int, manifest: Manifest | None = None) -> str:
    """Why the checkpoint directory open at ``dir_fd`` is not one written for ``uid``; ""
    when it is.

    The rule: the directory is owned by ``uid`` and nobody else may change its entries
    (not writable by its group or others, unless sticky: then they cannot rename or remove
    ``uid``'s); its manifest and, given ``manifest``, each data file it names are regular
    files owned by ``uid``; and the manifest records a save by ``uid`` (shmstaged writes the
    saving peer's uid into ``save.uid``). Whoever else could write there could have put
    any bytes there, with valid checksums (CRC-32C proves no authorship). Root is held to
    the same rule: it restores only checkpoints owned by root. Checked through ``dir_fd``,
    so a directory renamed or replaced meanwhile cannot slip in between check and read.
    """
    st = os.fstat(dir_fd)
    if st.st_uid != uid:
        return f"the directory belongs to uid {st.st_uid}, not uid {uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (
            f"the directory is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}"
            ", no sticky bit): anyone of them could have replaced its files"
        )
    names_ = [MANIFEST_NAME]
    if manifest is not None:
        recorded = manifest.save.get("uid") if isinstance(manifest.save, dict) else None
        if recorded != uid:
            return f"its manifest records a save by uid {recorded}, not uid {uid}"
        names_ += list(manifest.files)
    for name in names_:
        try:
            names.check_plain_name(name, what="its data file")
        except names.NameError_ as exc:
            return str(exc)
        try:
            owned = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # incomplete, which the caller reports as such
        if not stat.S_ISREG(owned.st_mode):
            return f"{name} is not a regular file"
        if owned.st_uid != uid:
            return f"{name} belongs to uid {owned.st_uid}, not uid {uid}"
    return ""


def inspect(
    path: Path, entries: list[os.DirEntry[str]] | None = None, *, uid: int | None = None
) -> CheckpointInfo:
    """State, step, size and file count of one checkpoint directory (no tensor data read);
    with ``uid``, FOREIGN (and nothing read) unless written for that user."""
    if entries is None:
        with os.scandir(path) as it:
            entries = list(it)
    sizes: dict[str, int] = {}
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[entry.name] = st.st_size
    total, count = sum(sizes.values()), len(sizes)
    if MANIFEST_NAME not in sizes:
        return CheckpointInfo(path, PARTIAL, None, total, count, problem=f"no {MANIFEST_NAME}")
    try:
        dir_fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        return CheckpointInfo(path, DAMAGED, None, total, count, problem=str(exc))
    try:
        if uid is not None and (foreign := not_written_for(uid, dir_fd)):
            return CheckpointInfo(path, FOREIGN, None, total, count, problem=foreign)
        try:
            if sizes[MANIFEST_NAME] > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{MANIFEST_NAME} is implausibly large")
            manifest = Manifest.from_bytes(_read_manifest(dir_fd))
        except (OSError, ManifestError) as exc:
            return CheckpointInfo(path, DAMAGED, None, total, count, problem=str(exc))
        if uid is not None and (foreign := not_written_for(uid, dir_fd, manifest)):
            return CheckpointInfo(path, FOREIGN, None, total, count, problem=foreign)
    finally:
        os.close(dir_fd)
    step = _step(manifest.metadata)
    try:
        tree.tensor_keys(manifest.tree)  # cheap: no tensor is read
    except tree.TreeError as exc:
        return CheckpointInfo(path, DAMAGED, step, total, count, problem=f"{MANIFEST_NAME}: {exc}")
    committed = manifest.save.get("committed_unix") if isinstance(manifest.save, dict) else None
    committed = committed if isinstance(committed, int | float) else None
    for name, size in manifest.files.items():
        actual = sizes.get(name)
        if actual != size:
            problem = (
                f"{name} is missing"
                if actual is None
                else f"{name} is {actual} bytes, the manifest says {size}"
            )
            return CheckpointInfo(path, DAMAGED, step, total, count, committed, problem)
    return CheckpointInfo(path, COMPLETE, step, total, count, committed)


def _read_manifest(dir_fd: int) -> bytes:
    """The manifest's bytes, never through a symlink, at most ``MAX_MANIFEST_BYTES``."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(MANIFEST_NAME, flags, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError(f"{MANIFEST_NAME} is not a regular file")
        data = file.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{MANIFEST_NAME} is implausibly large")
    return data


def scan(root: Path, *, max_depth: int = 4, uid: int | None = None) -> list[CheckpointInfo]:
    """Checkpoints at or below ``root`` (not inside a checkpoint; symlinks not followed);
    with ``uid``, those not written for that user are FOREIGN (``not_written_for``).

    Sorted by step (checkpoints without one last), then path.
    """
    found: list[CheckpointInfo] = []

    def walk(directory: Path, depth: int) -> None:
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except (PermissionError, FileNotFoundError, NotADirectoryError):
            return
        if _looks_like_checkpoint(entries):
            found.append(inspect(directory, entries, uid=uid))
            return
        if depth >= max_depth:
            return
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                walk(Path(entry.path), depth + 1)

    walk(root, 0)
    return sorted(found, key=lambda c: (c.step is None, c.step or 0, str(c.path)))

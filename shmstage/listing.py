"""Find checkpoints under a directory and say, cheaply, what state each one is in.

``shmstage ls`` must answer "which steps do I have, and can I resume from them?" over a
directory with hundreds of checkpoints, so it reads manifests and stats files but never
reads tensor data (``shmstage verify`` does that). A directory is a checkpoint when it holds
the manifest, a data file, or a temporary file of a save in progress or abandoned.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shmstage import datafile, names, tree
from shmstage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError

__all__ = ["CheckpointInfo", "inspect", "scan"]

COMPLETE = "complete"
PARTIAL = "partial"  # no manifest: a save in progress, or one that never committed
DAMAGED = "damaged"  # a manifest, but it or the files it names are not what it says


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


def inspect(path: Path, entries: list[os.DirEntry[str]] | None = None) -> CheckpointInfo:
    """State, step, size and file count of one checkpoint directory (no tensor data read)."""
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
        if sizes[MANIFEST_NAME] > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{MANIFEST_NAME} is implausibly large")
        manifest = Manifest.from_bytes((path / MANIFEST_NAME).read_bytes())
    except (OSError, ManifestError) as exc:
        return CheckpointInfo(path, DAMAGED, None, total, count, problem=str(exc))
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


def scan(root: Path, *, max_depth: int = 4) -> list[CheckpointInfo]:
    """Checkpoints at or below ``root`` (not inside a checkpoint; symlinks not followed).

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
            found.append(inspect(directory, entries))
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

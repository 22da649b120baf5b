"""Shared by the fault, hostile-input and soak tests: deterministic states, torn-checkpoint
checks, the journal's contents, and real small filesystems to break."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors import safe_open

from shmstage import checkpoint, instance, names, segment

if TYPE_CHECKING:  # trainer.py imports this module without the tests' harness on its path
    import user_forks
    from harness import RunningDaemon

TRAINER = Path(__file__).with_name("trainer.py")


def make_state(seed: int, *, numel: int = 1 << 16, tensors: int = 3) -> dict:
    """A state dict anyone can rebuild from its seed: the trainer process and the test."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers": [torch.randn(numel, generator=gen) for _ in range(tensors)],
        "bias": torch.arange(17, dtype=torch.int64) * seed,
        "step": seed,
    }


def single_tensor_state(seed: int) -> dict:
    """One tensor: a job that never reaches the ``mid-stream`` hook (it fires at tensor 2)."""
    return {"w": torch.full((1000,), float(seed))}


def assert_same_state(actual: object, expected: object, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where  # type: ignore[arg-type]
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")  # type: ignore[index]
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where  # type: ignore[arg-type]
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):  # type: ignore[call-overload]
            assert_same_state(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def assert_checkpoint_equals(path: Path, expected: object) -> None:
    from shmstage_client import load

    assert checkpoint.verify(path) == [], checkpoint.verify(path)
    assert_same_state(load(path), expected)


def assert_not_torn(path: Path) -> None:
    """Either a complete checkpoint that verifies, or no commit marker — and then any file
    under a final ``*.safetensors`` name (DCP reads them all) is whole: the daemon links a
    data file only once it is fully written and fsynced, and the manifest comes after."""
    if not path.exists():
        return
    if checkpoint.is_complete(path):
        assert checkpoint.verify(path) == [], checkpoint.verify(path)
        return
    for data in path.glob("*.safetensors"):
        with safe_open(str(data), framework="pt") as file:  # the real reader accepts it whole
            for key in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                file.get_tensor(key)


def published_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if not p.name.startswith("."))


def pending_dirs(parent: Path) -> list[str]:
    """Hidden pending directories of saves (or spares) in ``parent`` (see shmstage.names)."""
    return sorted(p.name for p in parent.iterdir() if names.is_pending_dir(p.name))


def writing_dir(parent: Path) -> Path:
    """The pending directory a job is writing into now (a spare's data file is empty)."""
    for name in pending_dirs(parent):
        if any(p.stat().st_size > 0 for p in (parent / name).iterdir()):
            return parent / name
    raise AssertionError(f"no pending directory being written in {parent}")


def assert_not_published(path: Path) -> None:
    """Nothing under a final name at all (a save that never reached its commit)."""
    assert not path.exists() or published_files(path) == [], published_files(path)


def journal_entries(daemon: RunningDaemon) -> list[str]:
    """What the daemon's own journal holds (empty once it is removed)."""
    directory = daemon.journal
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def lock_exists(instance_id: str) -> bool:
    return os.path.exists(instance.lock_path(instance_id))


def instance_clean(instance_id: str) -> bool:
    """No segment and no lock file of this (dead) daemon instance left in /dev/shm."""
    return segment.list_names(instance_id) == [] and not lock_exists(instance_id)


def start_trainer(
    sock: Path, root: Path, mode: str, seed: int, *extra: str
) -> subprocess.Popen | user_forks.Forked:
    """A real trainer process (``trainer.py``, forked with torch imported where it can be:
    ``user_forks``); it prints one marker line per milestone."""
    import user_forks

    argv = [str(TRAINER), str(sock), str(root), mode, str(seed), *extra]
    program = (
        f"import runpy, sys\nsys.argv = {argv!r}\nsys.path.insert(0, {str(TRAINER.parent)!r})\n"
        f"runpy.run_path({str(TRAINER)!r}, run_name='__main__')\n"
    )
    return user_forks.start(program, user_forks.environment()) or subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def read_marker(
    proc: subprocess.Popen | user_forks.Forked, expected: str, timeout: float = 60
) -> str:
    """The trainer's next marker line; fails with its stderr if it died or stayed silent."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise TimeoutError(f"trainer printed nothing for {timeout} s (wanted {expected})")
    line = proc.stdout.readline().strip()
    if not line.startswith(expected):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"trainer said {line!r}, wanted {expected!r}:\n{err}")
    return line


def kill(proc: subprocess.Popen | user_forks.Forked) -> None:
    proc.kill()
    proc.wait(10)


NOBODY = 65534
_AS_NOBODY = """
import os, sys, json, socket
import torch, posix_ipc
import shmstage_client
from shmstage_client import *
from shmstage import checkpoint, protocol, segment
os.setgroups([]); os.setgid({gid}); os.setuid({uid})
"""


def admitting_nobody(
    daemons: Callable[..., RunningDaemon], world: Path, *extra: str, server: str = "", **kw: object
):
    """A daemon whose allowlist has ``nobody`` and whose socket ``nobody`` can reach;
    ``server``: more lines for its ``[server]`` table."""
    config = world / "shmstaged.toml"
    config.write_text(f'[server]\nallowed_users = ["nobody"]\n{server}\n')
    running = daemons("--config", str(config), *extra, where=world / "d", **kw)
    (world / "d").chmod(0o755)
    running.socket.chmod(0o666)
    return running


def nobody_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    os.chown(path, NOBODY, NOBODY)
    return path


def run_as(code: str, *, uid: int = NOBODY, gid: int = NOBODY, timeout: float = 120) -> str:
    """Run ``code`` as another uid and return what it printed.

    The interpreter lives under /root (0700), so the child imports everything as root
    first and then drops to ``uid`` for good — SO_PEERCRED sees only the dropped uid.
    """
    import user_forks

    program = _AS_NOBODY.format(uid=uid, gid=gid) + textwrap.dedent(code)
    forked = user_forks.start(program, user_forks.environment())  # or None: python -c
    if forked is not None:
        out, err = forked.communicate(timeout)
        assert forked.returncode == 0, err[-3000:]
        return out
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (mounts, other uids)")


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real, tiny tmpfs: ENOSPC comes from the kernel, not from a mock."""
    require_root("a small tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    with _mounted(
        ["-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs"], where, "a tmpfs"
    ) as mounted:
        yield mounted


@contextlib.contextmanager
def ramfs(where: Path) -> Iterator[Path]:
    """A real ramfs: a filesystem that refuses O_DIRECT (EINVAL), as some FUSE and network
    filesystems do (tmpfs takes it since Linux 6.6)."""
    require_root("a ramfs")
    where.mkdir(parents=True, exist_ok=True)
    with _mounted(["-t", "ramfs", "ramfs"], where, "a ramfs") as mounted:
        yield mounted


@contextlib.contextmanager
def loop_ext4(where: Path, image: Path, size_mib: int = 32) -> Iterator[Path]:
    """A real ext4 filesystem on a loop device (for chattr +i, which tmpfs lacks)."""
    require_root("a loop-mounted ext4")
    where.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as file:
        file.truncate(size_mib << 20)
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-L", uuid.uuid4().hex[:12], str(image)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    with _mounted(["-o", "loop", str(image)], where, "a loop-mounted ext4") as mounted:
        yield mounted


@contextlib.contextmanager
def frozen(mountpoint: Path) -> Iterator[Path]:
    """The filesystem at ``mountpoint`` stops answering writes and fsyncs (``fsfreeze``):
    a real kernel freeze, the slowest disk there is, thawed on the way out whatever
    happened."""
    done = subprocess.run(
        ["fsfreeze", "--freeze", str(mountpoint)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        pytest.skip(f"cannot freeze {mountpoint}: {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(mountpoint)], capture_output=True,
                       timeout=60)


@contextlib.contextmanager
def _mounted(args: list[str], where: Path, what: str) -> Iterator[Path]:
    """``mount ARGS WHERE`` for the block, lazily unmounted after; skips if it cannot."""
    done = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {what} here ({done.stderr.strip()}); needs CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60)

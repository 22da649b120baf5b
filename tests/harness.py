"""Test harness: start a real shmstaged, and a raw protocol client that may misbehave."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import mmap
import multiprocessing
import multiprocessing.context
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from shmstage_daemon.admission import Peer
from shmstage_daemon.job import Destination, PersistJob

from shmstage import datafile, names, segment
from shmstage.instance import lock_path
from shmstage.layout import Layout, TensorSpec
from shmstage.manifest import MANIFEST_NAME
from shmstage.packing import Packing

if TYPE_CHECKING:
    import pytest  # imported where used: titan_ranks.py imports this module outside pytest


def shmstaged_command() -> list[str]:
    exe = shutil.which("shmstaged", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "shmstage_daemon.main"]


@dataclass
class RunningDaemon:
    socket: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    instance: str = field(default="")
    #: This instance's journal directory, as its start-up line says.
    journal: Path = field(default=Path("/nonexistent"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def segments(self) -> list[str]:
        """Names in /dev/shm belonging to this daemon instance."""
        return segment.list_names(self.instance) if self.instance else []

    def wait_log(self, text: str, timeout: float = 30) -> None:
        """Wait until the daemon's log says ``text`` (e.g. a fault hook reached its point)."""
        wait_for(lambda: text in self.log(), timeout, f"{text!r} in the daemon log")

    def kill(self) -> None:
        """SIGKILL and reap: no handler runs, exactly like the OOM killer."""
        self.proc.kill()
        self.proc.wait(10)

    def discard(self) -> None:
        """Kill it if it still runs, and leave nothing of it for the next test: its
        segments, and the lock file and journal directory a killed daemon leaves behind
        (the journal first: only the lock names it, so without the lock no daemon would
        ever find it again, and every run of the suite left a few hundred in /dev/shm)."""
        if self.proc.poll() is None:
            self.kill()
        for name in segment.list_names(self.instance) if self.instance else []:
            segment.unlink(name)
        shutil.rmtree(self.journal, ignore_errors=True)
        if self.instance:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path(self.instance))

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


#: Every daemon ``start_daemon`` started in this test session, for the session's end to
#: discard whatever a test left running or behind (``conftest.discard_every_daemon``).
STARTED: list[RunningDaemon] = []

#: What shmstaged logs once its event loop serves (``Service.run``).
READY_LINE = "ready: serving "


def start_daemon(
    tmp: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    log_name: str = "shmstaged.log",
    prefix: Sequence[str] = (),
    socket: Path | None = None,
    ready: bool = True,
) -> RunningDaemon:
    """Start shmstaged on ``tmp/shmstaged.sock`` (or ``socket``), logging to ``tmp``; a
    restart on the same ``tmp`` reuses the socket (and so finds its predecessor's journal)
    — give it another ``log_name`` to keep the first log. ``prefix`` runs the daemon under
    a wrapper (``unshare ...``) that must exec it. Returns once the daemon logged that it
    serves (its event loop running: descriptor counts and signals are then what they stay
    at), or with ``ready=False`` as soon as start-up logged "listening on", before that."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = socket or tmp / "shmstaged.sock"
    log_path = tmp / log_name
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [*prefix, *shmstaged_command(), "--socket", str(sock), "--log-level", "debug", *extra],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    log_file.close()
    daemon = RunningDaemon(sock, proc, log_path)
    STARTED.append(daemon)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"shmstaged exited with {proc.returncode}:\n{daemon.log()}")
        text = daemon.log()
        if "listening on" in text and (not ready or READY_LINE in text):
            daemon.instance = text.split("(instance ", 1)[1][:16]
            daemon.journal = Path(text.split(", journal ", 1)[1].split(" on ", 1)[0])
            return daemon
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"shmstaged did not start within 20 s:\n{daemon.log()}")


class RawClient:
    """A protocol-level client for tests that must misbehave on purpose."""

    def __init__(self, path: Path, *, hello: bool = True) -> None:
        import socket as _socket

        from shmstage.protocol import PROTOCOL_VERSION, Connection, Role

        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.conn = Connection(Role.CLIENT)
        self.ids = iter(range(1, 1 << 30))
        if hello:
            self.request(
                "hello", {"version": PROTOCOL_VERSION, "client": "raw", "pid": os.getpid()}
            )
            assert self.frame().op == "welcome"

    def request(self, op: str, body: dict, fds: list[int] | None = None) -> int:
        import socket as _socket

        rid = next(self.ids)
        data = self.conn.send(op, rid, body, len(fds or []))
        if fds:
            _socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)
        return rid

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, timeout: float = 10):
        """The next frame from the daemon; EOFError when it closed the connection."""
        import socket as _socket

        deadline = time.monotonic() + timeout
        while True:
            frame = self.conn.next_frame()
            if frame is not None:
                return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no frame from shmstaged")
            self.sock.settimeout(remaining)
            data, fds, _, _ = _socket.recv_fds(self.sock, 1 << 16, 253)
            self.conn.receive_data(data, fds)

    def close(self) -> None:
        self.sock.close()


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; every wait in the suite has a bound and a name."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.02)


def wait_file(path: Path, timeout: float = 60) -> None:
    """Wait for ``path`` to exist: how the tests and their rank processes signal each other."""
    wait_for(path.exists, timeout, f"{path} to appear")


def clone(state: object) -> object:
    """A deep copy of a state dict's tensors (detached), the rest as it is: what a
    checkpoint of it must equal."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(clone(v) for v in state)
    return state


def assert_same(
    actual: object, expected: object, where: str = "state", *, key_order: bool = True
) -> None:
    """Bit-exact equality of nested structures, tensors compared byte for byte.

    ``key_order=False`` compares dict keys as a set of strings (a DCP load rebuilds dicts).
    """
    assert type(actual) is type(expected) or (
        isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    ), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        a = actual.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{where}: bytes differ"
    elif isinstance(expected, dict):
        if key_order:
            assert list(actual) == list(expected), where
        else:
            assert sorted(map(str, actual)) == sorted(map(str, expected)), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]", key_order=key_order)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]", key_order=key_order)
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, where
    else:
        assert actual == expected, where


def packages_imported_by(modules: Sequence[str], packages: Sequence[str]) -> list[str]:
    """Which of ``packages`` a fresh interpreter loads when it imports ``modules``.

    A fresh process, because this test process has long since imported torch itself.
    """
    code = (
        f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted("
        f"m for m in sys.modules if m.split('.')[0] in {tuple(packages)!r})))"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout)


def staged_job(
    directory: Path,
    instance_id: str,
    tensors: Sequence[tuple[TensorSpec, bytes]],
    *,
    peer: Peer | None = None,
    new: bool = False,
    packed: bool = False,
) -> PersistJob:
    """A committed job as the daemon holds it: segments filled, the client's files open in
    the new ``directory``; for tests that run ``job.run`` (or the journal) in-process.
    ``new``: as a save to a new directory is, written into a hidden pending directory
    beside it and published by renaming that to ``directory``. ``packed``: the segments
    as the daemon makes them (``Layout.packing``), else one per tensor as before it packed."""
    layout = Layout.of([spec for spec, _ in tensors])
    sizes = [spec.nbytes for spec, _ in tensors]
    packing = layout.packing() if packed else Packing.one_each(sizes)
    refs = [segment.create(instance_id, size) for size in packing.sizes]
    mappings = []
    for ref in refs:
        fd = segment.open_fd(ref, writable=True)
        mappings.append(mmap.mmap(fd, ref.size))
        os.close(fd)
    for (spec, payload), (which, offset) in zip(tensors, packing.places, strict=True):
        assert len(payload) == spec.nbytes, spec
        mappings[which][offset : offset + len(payload)] = payload
    for mapping in mappings:
        mapping.close()
    pending = names.pending_dir_name() if new else ""
    (directory.parent / pending if new else directory).mkdir()
    dir_fd = os.open(directory.parent / pending if new else directory, os.O_RDONLY | os.O_DIRECTORY)
    data_tmp, manifest_tmp = names.temp_name("model.safetensors"), names.temp_name(MANIFEST_NAME)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    dest = Destination(
        dir_fd,
        os.open(data_tmp, flags, 0o644, dir_fd=dir_fd),
        os.open(manifest_tmp, flags, 0o644, dir_fd=dir_fd),
        "model.safetensors",
        data_tmp,
        manifest_tmp,
    )
    if new:
        dest.parent_fd = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY)
        dest.pending_dir, dest.final_dir = pending, directory.name
    return PersistJob(
        id=1,
        layout=layout,
        segments=refs,
        header=datafile.build_header(layout, {"format": "pt"}),
        destination=dest,
        tree={"d": [[spec.key, {"T": spec.key}] for spec, _ in tensors]},
        metadata={"step": 1},
        save_info={},
        peer=peer,
    )


def mapped_kib(address: int, size: int = 1) -> int:
    """How much of this process's mappings from ``address`` to ``address + size`` is
    mapped in (their Rss in /proc/self/smaps, KiB): the pages touched, and the neighbours
    a fault mapped with them. A region's segments are a mapping each."""
    total, inside, found = 0, False, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < address + size and address < high
                found = found or inside
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    if not found:
        raise AssertionError(f"no mapping holds {address:#x}")
    return total


def resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache: mincore(2) on a mapping of it, which reads nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    vector = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    finally:
        os.close(fd)
    try:
        assert libc.mincore(address, size, vector) == 0, ctypes.get_errno()
    finally:
        libc.munmap(address, size)
    return sum(byte & 1 for byte in vector.raw)


def skip_unless_installed(*packages: str) -> pytest.MarkDecorator:
    """A test module's ``pytestmark`` when what it tests needs an optional extra: skipped
    where one of ``packages`` is not installed. ``find_spec`` rather than
    ``pytest.importorskip``, so that collecting the suite (in every xdist worker, and again
    for the ``node_wide`` run) imports no framework: the tests import it where they use it,
    most of them in a forked run."""
    import pytest

    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


#: What the server of ``ForkedScript`` imports once, before it forks each script.
FORK_PRELOAD = ["torch", "torch.distributed.checkpoint", "safetensors", "shmstage_client"]


@contextlib.contextmanager
def own_fork_server(preload: Sequence[str]) -> Iterator[multiprocessing.context.ForkServerContext]:
    """Multiprocessing's forkserver context, its server importing ``preload``. A process
    has one server, started with the preload set when it was first used and kept until the
    process ends: one left by another test module would import what that module wanted,
    so the server is stopped before (and after) — the next user starts its own."""
    stop_fork_server()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    try:
        yield context
    finally:
        stop_fork_server()


def stop_fork_server() -> None:
    """End this process's forkserver, if one runs, at once: SIGKILLed rather than asked,
    which left it 1-2 s tearing the modules it imported down. What it forked is not its
    to end (a process it forked and that still runs then reports exit status 255)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()


def _run_script(script: str, args: Sequence[str], stdout: str, stderr: str) -> None:
    """In the forked child: ``python SCRIPT ARGS...`` with its output in two files."""
    import atexit
    import runpy
    import threading

    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # what an interpreter does at its end, and multiprocessing's os._exit does not
        threading._shutdown()  # type: ignore[attr-defined]  # waits for non-daemon threads
        atexit._run_exitfuncs()


class ForkedScript:
    """``python SCRIPT ARGS...`` as a new process forked from a server that imported torch
    and the client once (multiprocessing's forkserver), for the tests that start many
    trainers or ranks: each fresh interpreter spent 2-4 s of the machine's two cores
    importing them. A real process all the same — its own pid, memory, descriptors and
    connections — running the script as ``__main__``, and at its end waiting for its
    threads and running its atexit handlers as an interpreter would (not tearing its modules
    down: a test of what an interpreter's exit does starts a real one). Like
    ``subprocess.Popen`` it has ``communicate``, ``returncode``, ``poll``, ``wait`` and
    ``kill`` (text output, read from files once it ended). Its environment is the test
    process's when the server started (``own_fork_server``)."""

    def __init__(self, script: Path, *args: str, workdir: Path) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORK_PRELOAD)  # unless a server runs: own_fork_server
        workdir.mkdir(parents=True, exist_ok=True)
        fd, self._stdout = tempfile.mkstemp(prefix=f"{script.stem}.", suffix=".out", dir=workdir)
        os.close(fd)
        self._stderr = self._stdout[: -len(".out")] + ".err"
        self.args = [str(script), *args]
        self._proc = context.Process(
            target=_run_script, args=(str(script), list(args), self._stdout, self._stderr)
        )
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return tuple(  # type: ignore[return-value]
            Path(path).read_text(errors="replace") if os.path.exists(path) else ""
            for path in (self._stdout, self._stderr)
        )

    def kill(self) -> None:
        self._proc.kill()

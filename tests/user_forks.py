"""Test processes forked from one that imported torch once: users' code, trainers.

The security and fault suites run code in processes of its own, as a trainer is: its own
pid, its own connections, and for another user its uid, gid and groups dropped for good
before that code runs. What they spared is the import: each ``python -c`` imported torch
and the client anew (~2.7 s here, and 0.7 s more to tear them down at exit: most of those
suites' time). A server started once per test process imports everything as root (the
interpreter lives under /root: a user could not import it), and forks a process for each
request, which runs the program (dropping to its user first where it does) in a fresh
namespace and its own process group (so that ``killpg`` ends it and what it started), its
stdout and stderr the pipes the test reads. A helper process between the two waits for it
and reports its exit status, as ``Popen`` would.

A server imports for the environment it started with (some variables are read when a
module is imported), so a program run with other variables gets a server of its own: a
library imported in the test process may change ``os.environ`` for good (Lightning sets
PYTORCH_NVML_BASED_CUDA_CHECK when imported). Past ``MAX_SERVERS`` environments a program
goes through ``python -c`` as before (``start`` says so).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TextIO

#: The server: imports what the users' code does (while root: the interpreter lives under
#: /root), then forks a helper per request, which forks the user's process and reports.
SERVER = r"""
import atexit, gc, os, sys, json, socket, signal, traceback
import torch, posix_ipc, pytest, safetensors, safetensors.torch
import shmstage_client
from shmstage_client import *
import shmstage_daemon.main
from shmstage import checkpoint, protocol, segment
from shmstage.control import ControlClient
import msgpack, struct, time, shutil, threading, fcntl, mmap

class Worker(Exception):
    pass

def serve(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # helpers are reaped by the kernel
    print("READY", flush=True)
    while True:
        conn, _ = listener.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        if not data:
            conn.close()
            return
        if os.fork() == 0:  # the helper
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                raise Worker(conn, json.loads(data), fds)
            try:  # as the child does: a group of its own before anyone may signal it
                os.setpgid(pid, pid)
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
            try:  # the test may have stopped listening (a timeout)
                conn.sendall(json.dumps({"pid": pid}).encode())
                _, status = os.waitpid(pid, 0)
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)

try:
    serve(sys.argv[1])
    sys.exit(0)
except Worker as worker:  # in the forked process: its program runs outside this block
    conn, request, (stdin, stdout, stderr) = worker.args
conn.close()
os.setpgid(0, 0)
for fd, to in ((stdin, 0), (stdout, 1), (stderr, 2)):
    os.dup2(fd, to)
    os.close(fd)
os.environ.clear()
os.environ.update(request["env"])
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
status = 0
try:
    exec(compile(request["program"], "<string>", "exec"), namespace)
except SystemExit as exc:
    if isinstance(exc.code, int) or exc.code is None:
        status = exc.code or 0
    else:
        print(exc.code, file=sys.stderr)
        status = 1
except BaseException:
    traceback.print_exc()
    status = 1
# What the interpreter's exit does for the program (its threads joined, atexit, its
# objects' finalizers), not the teardown of torch's modules (0.7 s a process).
threading._shutdown()
atexit._run_exitfuncs()
namespace.clear()
gc.collect()
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
"""


class Drained:
    """A pipe read to its end as it fills (a full pipe would stop its writer), then
    ``read()`` whole. ``source``: its descriptor, or a text file on it."""

    def __init__(self, source: int | TextIO) -> None:
        self._file = os.fdopen(source, "r") if isinstance(source, int) else source
        self._text = ""
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        self._text = self._file.read()
        self._file.close()

    def read(self, timeout: float = 10) -> str:
        self._reader.join(timeout)
        return self._text


class Forked:
    """A forked user process, as much of ``subprocess.Popen`` as the suite uses: its
    ``pid`` (a process group's leader), ``stdout`` (a text pipe), ``stderr`` (read
    whole once it ended), ``returncode``."""

    def __init__(self, conn: socket.socket, stdout: int, stderr: int) -> None:
        self._conn = conn
        self.stdout = os.fdopen(stdout, "r")
        self.stderr = Drained(stderr)
        self.returncode: int | None = None
        self.pid = int(self._message(30)["pid"])

    def _message(self, timeout: float | None) -> dict:
        self._conn.settimeout(timeout)
        data = self._conn.recv(4096)
        if not data:
            raise RuntimeError("the user-process server's helper went away")
        return json.loads(data)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.returncode = int(self._message(None)["status"])
            self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(timeout)["status"])
            except TimeoutError:
                raise subprocess.TimeoutExpired("a forked user process", timeout or 0) from None
            self._conn.close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL its process group: the process and whatever it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Its output to the end and its exit status, as ``subprocess.run`` gets them;
        killed past ``timeout`` (``subprocess.TimeoutExpired``). Not with another reader
        of ``stdout``."""
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        try:
            if reader.is_alive():
                raise subprocess.TimeoutExpired("a forked user process", timeout)
            self.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.stdout.close()
        return out[0], self.stderr.read()


class Server:
    """The server of one test process (started on first use, ended at its exit)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._dir = tempfile.mkdtemp(prefix="shmstage-forks-")  # 0700: root's only
        self.path = str(Path(self._dir) / "forks.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.path],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(120)
        if ready != ["READY\n"]:
            self.proc.kill()
            raise RuntimeError(f"the user-process server did not start within 120 s: {ready}")
        atexit.register(self.close)

    def start(self, program: str, env: dict[str, str]) -> Forked:
        """Fork a process that runs ``program`` (which drops to its user first)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(30)
        conn.connect(self.path)
        stdin = os.open(os.devnull, os.O_RDONLY)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            request = json.dumps({"program": program, "env": env}).encode()
            socket.send_fds(conn, [request], [stdin, out_w, err_w])
        finally:
            for fd in (stdin, out_w, err_w):
                os.close(fd)
        return Forked(conn, out_r, err_r)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


#: Servers kept at once, one per environment (each holds an interpreter with torch).
MAX_SERVERS = 3

_servers: dict[frozenset[tuple[str, str]], Server] = {}
_lock = threading.Lock()


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment for a program (its output unbuffered: read as it
    comes), with ``extra`` on top."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


def start(program: str, env: dict[str, str]) -> Forked | None:
    """``program`` forked from the server of its environment (started on first use), or
    None where it must run in its own ``python -c``: past ``MAX_SERVERS`` environments."""
    key = _imported_with(env)
    with _lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            if server is None and len(_servers) >= MAX_SERVERS:
                return None
            server = _servers[key] = Server(env)
        return server.start(program, env)


def _imported_with(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    """What may matter to an import: all but the name of the test pytest is at."""
    return frozenset((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")

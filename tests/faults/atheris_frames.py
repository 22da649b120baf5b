"""Coverage-guided fuzzing of shmstaged's socket with atheris (libFuzzer).

    atheris_frames.py SOCKET -runs=N [libFuzzer flags]

Each input is split into frames (the length prefix included, so sizes are fuzzed too) and
sent on a fresh connection after a greeting, some with descriptors attached; the daemon must
then answer a status probe or close the connection. The daemon runs in another process, so
its coverage cannot steer libFuzzer; instead every input is also fed to the very protocol
state machine the daemon runs (``shmstage.protocol``, instrumented here), which steers the
mutations toward frames that get past the parser — those then exercise the real daemon.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from shmstage.protocol import Connection, ProtocolError, Role

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import FD_KINDS, FuzzConnection, encode, open_fds

SOCKET = Path(sys.argv.pop(1))
#: libFuzzer leaves with exit() from C, past Python's atexit: report after the last run.
RUNS = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("-runs=")), -1)
SCRATCH = Path(os.environ.get("TMPDIR", "/tmp"))
HELLO = encode({"op": "hello", "id": 1, "nfds": 0, "version": 2, "client": "atheris", "pid": 1})
inputs = 0
frames = 0


def parse_like_the_daemon(data: bytes) -> None:
    conn = Connection(Role.DAEMON, close_fd=lambda fd: None)
    try:
        conn.receive_data(HELLO + data)
        conn.receive_data(b"")
        while conn.next_frame() is not None:
            pass
    except (ProtocolError, EOFError):
        pass


def test_one_input(data: bytes) -> None:
    global inputs, frames
    inputs += 1
    parse_like_the_daemon(data)
    fdp = atheris.FuzzedDataProvider(data)
    chunks = []
    while fdp.remaining_bytes():
        size = fdp.ConsumeIntInRange(1, 512)
        kind = FD_KINDS[fdp.ConsumeIntInRange(0, len(FD_KINDS) - 1)]
        kinds = [kind] * fdp.ConsumeIntInRange(0, 3)
        chunks.append((fdp.ConsumeBytes(size), kinds))
    connection = FuzzConnection(SOCKET)
    try:
        connection.send(HELLO)
        connection.frames_sent -= 1
        for chunk, kinds in chunks[:16]:
            if not connection.send(chunk, open_fds(kinds, SCRATCH)):
                break
        connection.probe(request_id=1 << 30)
        frames += max(connection.frames_sent, 1)
    finally:
        connection.close()
    if inputs == RUNS:
        print(f"atheris: {inputs} inputs, {frames} frames sent", flush=True)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()

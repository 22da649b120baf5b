"""The descriptor table is grown once, to the size asked, and nothing open is touched.

Each case runs in a fresh interpreter: the table only grows, so the test process's own
would say nothing about what a new trainer's does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_table_grows_to_the_size_asked_in_one_step() -> None:
    got = _run(
        """
        import json, threading
        from shmstage import descriptors
        ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()
        before = descriptors.table_size()
        after = descriptors.reserve(3000)
        again = descriptors.reserve(100)  # never shrinks, never grows for less
        ev.set()
        print(json.dumps({"before": before, "after": after, "again": again}))
        """
    )
    assert 0 < got["before"] < 3000
    assert got["after"] >= 3000
    assert got["again"] == got["after"]


def test_open_descriptors_are_untouched_and_none_is_left_open() -> None:
    got = _run(
        """
        import json, os
        from shmstage import descriptors
        opened = [os.open("/dev/null", os.O_RDONLY) for _ in range(40)]
        def which():
            return {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in opened}
        before, listed = which(), sorted(os.listdir("/proc/self/fd"))
        size = descriptors.reserve(2048)
        print(json.dumps({"same": which() == before,
                          "listed": sorted(os.listdir("/proc/self/fd")) == listed,
                          "size": size}))
        """
    )
    assert got == {"same": True, "listed": True, "size": got["size"]}
    assert got["size"] >= 2048


def test_the_soft_limit_caps_a_reservation_without_an_error() -> None:
    got = _run(
        """
        import json, resource
        from shmstage import descriptors
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        print(json.dumps({"size": descriptors.reserve(10**9)}))
        """
    )
    assert 0 < got["size"] <= 256


def test_receiving_segments_reserves_room_for_two_batches() -> None:
    """The client grows its table before a batch of the daemon's descriptors arrives
    (``receivable_fds``), so the batch does not grow it on the way."""
    got = _run(
        """
        import json, os, sys
        sys.path.insert(0, "client")
        from shmstage import descriptors
        from shmstage.protocol import MAX_FDS_PER_FRAME
        from shmstage_client.connection import receivable_fds
        batch = receivable_fds()
        in_use = len(os.listdir("/proc/self/fd"))
        print(json.dumps({"size": descriptors.table_size(), "need": in_use + 2 * batch}))
        """
    )
    assert got["size"] >= got["need"]


def test_a_lease_to_come_grows_the_table_once_for_all_it_brings() -> None:
    """Before a lease, the client grows its table for the segments it keeps and the
    batches they arrive in (``expect_fds``); receiving them then grows nothing more."""
    got = _run(
        """
        import json, os, resource, sys, threading
        sys.path.insert(0, "client")
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
        from shmstage import descriptors
        from shmstage.protocol import MAX_FDS_PER_FRAME
        from shmstage_client.connection import expect_fds, receivable_fds, room_for_fds
        ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()
        before = descriptors.table_size()
        size = expect_fds(1000)
        batch, room = receivable_fds(), room_for_fds(1000)
        ev.set()
        print(json.dumps({"before": before, "size": size, "need": 1000 + 2 * MAX_FDS_PER_FRAME,
                          "room": room, "after": descriptors.table_size(),
                          "soft": min(hard, 8192)}))
        """
    )
    if got["soft"] < 4096:
        pytest.skip(f"the hard descriptor limit here ({got['soft']}) is too low for a lease")
    assert got["room"]
    assert got["before"] < got["need"] <= got["size"]
    assert got["after"] == got["size"]  # receiving grows nothing more

"""Commit-to-wake-up of a tiny published version, as ``--scenario publish`` measures it,
with what might be busy meanwhile varied: a large version published on another channel
just before (its checksums run in the daemon while the pings go), the daemon's checksums
off, the daemon's GIL switch interval, and where the time goes (``--split``: the version
frame's arrival at the reader against its ``pin`` round trip — the announced path: the
reader waits for the frame first, so the daemon holds no pin for it).

The reader's ``wait()`` has the daemon hold its pin request until the version comes (the
answer is the wake-up); ``--no-hold`` makes it wait for the announcement and pin then, as
it did before, and as it does with a daemon that does not hold pins.

    PYTHONPATH=.:daemon:client:bench python3 scripts/experiments/wake_latency.py \
        --pings 500 --big 256MiB
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import sys
import time
from typing import Any

import torch
from shmstage_bench.daemon import PrivateDaemon
from shmstage_bench.synthetic import parse_size

_DAEMON = """
import sys
{patch}
from shmstage_daemon.main import main
sys.exit(main())
"""
#: Each op of the daemon's that a wake-up passes through, timed (wall clock: the reader's
#: and the daemon's times compare on one host), to its log.
_TRACE = """
import functools, sys, time
from shmstage_daemon import publishing, versionsums
def _traced(owner, name):
    f = getattr(owner, name)
    if f.__code__.co_flags & 0x80:
        async def g(*a, **k):
            t = time.time(); r = await f(*a, **k)
            print("TRACE %.6f %s %.3f" % (t, name, 1000 * (time.time() - t)), file=sys.stderr)
            return r
    else:
        def g(*a, **k):
            t = time.time(); r = f(*a, **k)
            print("TRACE %.6f %s %.3f" % (t, name, 1000 * (time.time() - t)), file=sys.stderr)
            return r
    setattr(owner, name, functools.wraps(f)(g))
for _n in ("publish", "pin", "_tell", "unpin", "_wake", "_send_pinned"):
    if hasattr(publishing.Publishing, _n):  # a daemon before held pins has no _wake
        _traced(publishing.Publishing, _n)
for _n in ("start", "_done"):
    _traced(versionsums.VersionSums, _n)
_traced(versionsums, "compute")
import gc
_gc_started = [0.0]
def _gc(phase, info):
    if phase == "start":
        _gc_started[0] = time.time()
    else:
        took = 1000 * (time.time() - _gc_started[0])
        print("TRACE %.6f gc-gen%d %.3f" % (_gc_started[0], info["generation"], took),
              file=sys.stderr)
gc.callbacks.append(_gc)
"""
_NO_SUMS = """
from shmstage_daemon import versionsums
versionsums.VersionSums.start = lambda self, version, uid: None
"""


class Daemon(PrivateDaemon):
    def __init__(self, patch: str) -> None:
        super().__init__()
        self.patch = patch

    def _command(self) -> list[str]:
        code = _DAEMON.format(patch=self.patch)
        return [sys.executable, "-c", code, "--socket", self.requested or ""]


def reader(socket: str, pipe: Any, split: bool, hold: bool) -> None:
    from shmstage_client import subscribe

    ping = subscribe("ping", socket=socket)
    if not hold:
        ping._max_hold = None  # as with a daemon that holds no pins
    pipe.send("ready")
    while True:
        order = pipe.recv()
        if order[0] != "ping":
            break
        pipe.send("listening")
        frame_at = None
        if split:  # the version frame, then the pin: two times
            while ping.newest is None or ping.newest < order[1]:
                ping._announced(ping._next_event(60))
            frame_at = time.monotonic()
        with ping.wait(newer_than=order[1] - 1, timeout=60):
            woken = time.monotonic()
        pipe.send((woken, frame_at))
    ping.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pings", type=int, default=500)
    p.add_argument("--big", type=parse_size, default=0, help="a version published first")
    p.add_argument("--big-every", type=int, default=0, help="publish big again every N pings")
    p.add_argument("--no-sums", action="store_true", help="the daemon checksums nothing")
    p.add_argument("--switch", type=float, default=None, help="daemon's sys.setswitchinterval")
    p.add_argument("--split", action="store_true")
    p.add_argument("--no-hold", action="store_true", help="the reader waits for the "
                   "announcement, then pins (two round trips), as before held pins")
    p.add_argument("--trace", type=int, default=0, help="show the daemon's ops for the "
                   "first N pings and the slowest N")
    args = p.parse_args()
    from shmstage_client import Stager

    patch = _NO_SUMS if args.no_sums else ""
    if args.switch is not None:
        patch += f"\nimport sys; sys.setswitchinterval({args.switch})\n"
    if args.trace:
        patch += _TRACE
    daemon = Daemon(patch)
    socket = daemon.start()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=reader, args=(socket, theirs, args.split, not args.no_hold),
                            daemon=True)
    child.start()
    assert ours.poll(60) and ours.recv() == "ready"
    big = {"w": torch.randn(max(args.big // 4, 1))}
    tiny = {"x": torch.zeros(16)}
    delays, frames = [], []
    timeline: dict[int, list[tuple[float, str]]] = {}
    try:
        with Stager(socket, slots=2) as stager, Stager(socket, slots=2) as pinger:
            if args.big:
                stager.reserve(big)
            pinger.publish(tiny, "ping", step=0)
            big_step = 0
            for step in range(1, args.pings + 1):
                if args.big and (step == 1 or (args.big_every and step % args.big_every == 0)):
                    big_step += 1
                    stager.publish(big, "big", step=big_step)
                ours.send(("ping", step))
                assert ours.poll(60) and ours.recv() == "listening"
                time.sleep(0.002)
                published = pinger.publish(tiny, "ping", step=step)
                sent = time.monotonic() - published.timings.commit_seconds
                offset = time.time() - time.monotonic()
                assert ours.poll(60)
                woken, frame_at = ours.recv()
                delays.append((woken - sent, step))
                timeline[step] = [(sent + offset, "sent")] + (
                    [(frame_at + offset, "frame at the reader")] if frame_at else []
                ) + [(woken + offset, "woken")]
                if frame_at is not None:
                    frames.append(frame_at - sent)
        ours.send(("end",))
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
        log = daemon.log_text()
        daemon.stop()
    delays.sort()
    ms = [1000 * d for d, _ in delays]
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    print(f"wake-up p50 {ms[len(ms) // 2]:.3f} ms, p99 {p99:.3f} ms, max {ms[-1]:.3f} ms "
          f"over {len(ms)} pings")  # fmt: skip
    print("slowest (ms, ping):", [(round(1000 * d, 2), s) for d, s in delays[-8:]])
    if args.trace:
        ops = []
        for at, name, took in re.findall(r"TRACE (\S+) (\S+) ([0-9.]+)", log):
            ops.append((float(at), f"daemon {name} ({took} ms)"))
        collections = [float(took) for _, name, took in re.findall(
            r"TRACE (\S+) (gc-gen\d) ([0-9.]+)", log)]  # fmt: skip
        if collections:
            print(f"daemon GC: {len(collections)} collections, longest {max(collections):.3f} ms")
        slowest = [step for _, step in delays[-args.trace :]]
        for step in sorted(set(range(1, args.trace + 1)) | set(slowest)):
            events = timeline[step]
            begin, end = events[0][0], events[-1][0]
            events = sorted(events + [op for op in ops if begin - 0.001 <= op[0] <= end])
            print(f"ping {step}: " + "; ".join(
                f"+{1000 * (at - begin):.3f} {what}" for at, what in events))  # fmt: skip
    if frames:
        frames.sort()
        print(f"frame at the reader: p50 {1000 * frames[len(frames) // 2]:.3f} ms, "
              f"p99 {1000 * frames[int(len(frames) * 0.99)]:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

"""``--scenario publish``: the newest weights handed to a reader process on the same node.

One run, one state dict (``--total-bytes``, on ``--device``), against the physical limits
measured in the same run:

* the raw pinned copies of the same bytes: device-to-host (what ``publish()`` must do)
  and host-to-device (what a reader must do);
* ``publish()``'s stall (its layout reserved beforehand, as a trainer's loop would);
* a new subscriber's first version on its device (it maps the slot and copies it through
  its pinned staging, then registers the slot with CUDA read-only in the background)
  against the raw host-to-device copy + 0.05 s/GiB; the seconds until each slot is
  registered after its first version was read (``slot_1_settle_s``, ``slot_2_settle_s``:
  a version that comes sooner is copied through the staging as the first was); and later
  versions, the ring registered (from the third on), against the raw copy alone;
* the same first version read by a subscriber that prepared before the first publish
  (once the first subscriber's registration of that slot ended, so that the two do not
  share the host)
  (the publisher offered its reserved layout, ``Stager.offer``; the subscriber mapped and
  registered every slot, ``Subscriber.prepare``), against the same two limits;
* commit-to-wake-up: from the publisher sending "publish" (a tiny state) to the
  subscriber's ``wait()`` returning with the version pinned, p50 and p99;
* ``save(..., publish=)``'s stall over a plain ``save()``'s (each save durable before the
  next);
* a fixed training step (``compute.ComputeLoop``) alone, and while the reader pulls the
  version to its device over and over.

The reader is a process of its own (spawned); it talks to this one through a pipe. The
daemon is started by the bench (``daemon.BenchDaemon``). Run it as
``python -m shmstage_bench --scenario publish --device cuda --total-bytes 7GiB``; it
prints a table of figures and ratios, and with ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from .compute import ComputeLoop
from .daemon import BenchDaemon, PrivateDaemon
from .synthetic import build_state_dict, format_bytes, parse_size, resolve_device

GIB = 1 << 30


def _recv(pipe: Any, timeout: float = 300.0) -> Any:
    """The reader's next word; a reader that died or hangs ends the run, never hangs it."""
    if not pipe.poll(timeout):
        raise RuntimeError(f"the reader process said nothing for {timeout} s")
    return pipe.recv()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Any, device: torch.device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_copies(state: dict[str, torch.Tensor], device: torch.device) -> tuple[float, float]:
    """(device-to-host, host-to-device) seconds of the same bytes through pinned memory."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    views, offset = [], 0
    for tensor in state.values():
        size = tensor.numel() * tensor.element_size()
        views.append((host[offset : offset + size], tensor.view(-1).view(torch.uint8)))
        offset += size
    d2h = _median_time(lambda: [h.copy_(t, non_blocking=True) for h, t in views], device)
    back = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _median_time(lambda: back.copy_(host, non_blocking=True), device)
    return d2h, h2d


# -- the reader process -------------------------------------------------------------


def _timed_read(subscriber: Any, step: int, device: torch.device) -> tuple[dict[str, float], Any]:
    """Wait for step ``step`` and read it onto ``device``: the seconds until it was pinned
    (the wake-up), of the copy, and in all; and the state read (kept by the caller)."""
    started = time.perf_counter()
    with subscriber.wait(newer_than=step - 1, timeout=120) as version:
        woken = time.perf_counter()
        state = version.state(device)
        _sync(device)
    done = time.perf_counter()
    return {"pin": woken - started, "copy": done - woken, "total": done - started}, state


def reader(socket: str, device_name: str, pipe: Any) -> None:
    """Follows "bench" (the big state) and "ping" (a tiny one), as the parent asks."""
    from shmstage_client import subscribe

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    big = subscribe("bench", socket=socket)
    early = subscribe("bench", socket=socket)  # prepares before the first publish
    ping = subscribe("ping", socket=socket)
    pipe.send("ready")
    held: Any = None
    while True:
        order = pipe.recv()
        if order[0] == "version":  # the parent published step order[1] of "bench"
            held = None  # the last version read goes first
            timing, held = _timed_read(big, order[1], device)
            pipe.send(timing)
        elif order[0] == "prepare":  # the parent offered "bench"'s ring, published nothing
            started = time.perf_counter()
            slots = early.prepare(device, timeout=120, block=True)
            pipe.send({"prepare": time.perf_counter() - started, "slots": slots})
        elif order[0] == "early":  # read step order[1] with the prepared subscriber, once
            held = None
            pipe.send(_timed_read(early, order[1], device)[0])  # its state goes at once
            early.close()  # its registrations go: the rest of the run is as before
        elif order[0] == "settle":  # wait until every slot mapped is registered
            started = time.perf_counter()
            big.prepare(device, timeout=120, block=True)
            pipe.send(time.perf_counter() - started)
        elif order[0] == "stream":
            with big.wait(timeout=120) as version:
                started = time.perf_counter()
                count = sum(1 for _ in version.tensors(device, bucket_bytes=256 << 20))
                _sync(device)
            pipe.send({"stream": time.perf_counter() - started, "tensors": count})
        elif order[0] == "ping":  # the parent will publish "ping" step order[1]
            pipe.send("listening")
            with ping.wait(newer_than=order[1] - 1, timeout=60):
                woken = time.monotonic()
            pipe.send(woken)
        elif order[0] == "pull":  # pull the newest version over and over until told
            pulls = 0
            pipe.send("pulling")
            while not pipe.poll():
                with big.wait(timeout=60) as version:
                    held = None
                    held = version.state(device)
                    _sync(device)
                pulls += 1
            pipe.recv()
            pipe.send(pulls)
        else:
            break
    del held
    big.close()
    early.close()
    ping.close()


# -- the publisher (this process) ------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from shmstage_client import Stager

    device = resolve_device(args.device)
    state = build_state_dict(
        args.total_bytes,
        args.tensors,
        min(4096, args.total_bytes // args.tensors),
        max(args.total_bytes // 8, 4096),
        torch.bfloat16,
        device,
    )
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gib = nbytes / GIB
    d2h, h2d = raw_copies(state, device)
    out: dict[str, Any] = {
        "device": str(device),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": nbytes,
        "tensors": len(state),
        "raw_d2h_s": d2h,
        "raw_h2d_s": h2d,
    }
    daemon = PrivateDaemon() if args.socket is None else BenchDaemon(args.socket)
    socket = daemon.start()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=reader, args=(socket, args.device, theirs), daemon=True)
    child.start()
    try:
        assert ours.poll(120) and _recv(ours) == "ready", "the reader did not start"
        # One Stager holds one layout: the tiny "ping" state gets a Stager of its own, or
        # publishing it would release the big layout and every version in it.
        with Stager(socket, slots=2) as stager, Stager(socket, slots=2) as pinger:
            reserved = stager.reserve(state)
            out["reserve_s"] = reserved.seconds
            stager.offer("bench")
            ours.send(("prepare",))
            prepared = _recv(ours)
            out["prepare_s"] = prepared["prepare"]
            out["prepared_slots"] = prepared["slots"]
            stalls, reads, early = [], [], {}
            for step in range(1, args.versions + 1):
                published = stager.publish(state, "bench", step=step)
                stalls.append(published.timings.stall_seconds)
                ours.send(("version", step))
                reads.append(_recv(ours))
                if step <= 2:  # each slot registers after its first version is read
                    ours.send(("settle",))
                    out[f"slot_{step}_settle_s"] = _recv(ours)
                if step == 1:  # as a second reader of step 1, no registration running
                    ours.send(("early", step))
                    early = _recv(ours)
            out["publish_stall_s"] = statistics.median(stalls[1:] or stalls)
            out["first_version_s"] = reads[0]["total"]
            out["first_version_pin_s"] = reads[0]["pin"]
            out["first_version_copy_s"] = reads[0]["copy"]
            out["prepared_first_version_s"] = early["total"]
            out["prepared_first_version_copy_s"] = early["copy"]
            # the first version in each of the two slots maps and registers that slot
            later = reads[2:] or reads
            out["ring_version_s"] = statistics.median(r["total"] for r in later)
            out["ring_version_copy_s"] = statistics.median(r["copy"] for r in later)
            ours.send(("stream",))
            out["streamed_version_s"] = _recv(ours)["stream"]
            out.update(_wake_ups(pinger, ours, args.pings, device))
            out.update(_training(ours, device, args.step_seconds))
            out.update(_saves(stager, state, args))
        ours.send(("end",))
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
        daemon.stop()
    out["ratios"] = {
        "publish_stall / raw d2h (<= 1.10)": out["publish_stall_s"] / d2h,
        "ring version / raw h2d (<= 1.15)": out["ring_version_s"] / h2d,
        "first version / (raw h2d + 0.05 s/GiB) (<= 1)": out["first_version_s"]
        / (h2d + 0.05 * gib),
        "prepared first version / (raw h2d + 0.05 s/GiB) (<= 1)": out[
            "prepared_first_version_s"
        ]
        / (h2d + 0.05 * gib),
        "prepared first version / raw h2d (<= 1.15)": out["prepared_first_version_s"] / h2d,
        "step while pulling / step alone (<= 1.05)": out["step_pulling_s"] / out["step_alone_s"],
    }
    return out


def _wake_ups(stager: Any, pipe: Any, count: int, device: torch.device) -> dict[str, Any]:
    """Commit-to-wake-up of a tiny version: from just before "publish" went out (the
    publish's return less its round trip) to the reader's ``wait()`` returning."""
    tiny = {"x": torch.zeros(16, device=device)}
    stager.publish(tiny, "ping", step=0)  # the ring exists, the reader has mapped nothing
    delays = []
    for step in range(1, count + 1):
        pipe.send(("ping", step))
        assert _recv(pipe) == "listening"
        time.sleep(0.002)  # the reader blocks in wait() by now
        published = stager.publish(tiny, "ping", step=step)
        sent = time.monotonic() - published.timings.commit_seconds
        delays.append((_recv(pipe) - sent, step))
    delays.sort()
    return {
        "wake_p50_ms": 1000 * delays[len(delays) // 2][0],
        "wake_p99_ms": 1000 * delays[min(len(delays) - 1, int(len(delays) * 0.99))][0],
        # which pings were slowest: the first in each slot of the ring maps it
        "wake_slowest": [[round(1000 * delay, 3), step] for delay, step in delays[-5:]],
    }


def _training(pipe: Any, device: torch.device, seconds: float) -> dict[str, float]:
    loop = ComputeLoop(device)
    alone = loop.steps_for(seconds)
    pipe.send(("pull",))
    assert _recv(pipe) == "pulling"
    pulling = loop.steps_for(seconds)
    pipe.send(("stop",))
    pulls = _recv(pipe)
    return {
        "step_alone_s": statistics.median(alone),
        "step_pulling_s": statistics.median(pulling),
        "pulls_while_training": pulls,
    }


def _saves(stager: Any, state: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    """save() against save(..., publish=): each durable before the next."""
    where = tempfile.mkdtemp(prefix="shmstage-bench-publish-", dir=args.dir)
    plain, published = [], []
    for step in range(args.saves):
        for kind, stalls in (("plain", plain), ("published", published)):
            path = f"{where}/{kind}-{step}"
            metadata = {"step": 1000 + 2 * step + (kind == "published")}
            publish = "bench" if kind == "published" else None
            handle = stager.save(state, path, metadata=metadata, publish=publish)
            stalls.append(handle.timings.stall_seconds)
            handle.wait(600)
            shutil.rmtree(path, ignore_errors=True)  # 7 GiB each: the GPU host has 64 GiB
    shutil.rmtree(where, ignore_errors=True)
    return {
        "save_stall_s": statistics.median(plain),
        "save_publish_stall_s": statistics.median(published),
        "save_publish_extra_ms": 1000 * (statistics.median(published) - statistics.median(plain)),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="shmstage-bench --scenario publish")
    p.add_argument("--device", default="cuda")
    p.add_argument("--total-bytes", type=parse_size, default=parse_size("7GiB"))
    p.add_argument("--tensors", type=int, default=250)
    p.add_argument("--versions", type=int, default=6, help="versions read (first + ring)")
    p.add_argument(
        "--pings",
        type=int,
        default=1000,
        help="tiny versions for the wake-up (p99 of 200 was their second slowest: one burst "
        "of a slow machine set it)",
    )
    p.add_argument("--saves", type=int, default=3, help="saves of each kind (durable each)")
    p.add_argument("--step-seconds", type=float, default=5.0)
    p.add_argument("--socket", default=None)
    p.add_argument("--dir", default=None, help="where the saves go (default: a temp dir)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = measure(args)
    print(f"publish scenario: {format_bytes(out['bytes'])} in {out['tensors']} tensors, "
          f"{out['card']}")  # fmt: skip
    for key, value in out.items():
        if key != "ratios":
            print(f"  {key:28} {value:.4f}" if isinstance(value, float) else f"  {key:28} {value}")
    for key, value in out["ratios"].items():
        print(f"  {key:50} {value:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    sys.stdout.flush()
    return 0

"""A restarted trainer, timed from process start to its first save: with and without
``prepare_restore`` (issue 36, item 3), beside the raw pinned copies of the same bytes.

A trainer saves its state twice (both slots filled, as in a run) and is SIGKILLed once
both are durable; then new processes restart, alternately plain and prepared. Each one
initialises CUDA, (prepared: calls ``prepare_restore``), builds its model (the state's
tensors, seeded, plus ``--build-s`` of simulated build time in all, as a real model's
construction takes seconds), restores with ``latest()``, checks it bit for bit, loads it
into the model, makes a Stager and saves once (its first save), then leaves its layout
retained for the next restart (``close(retain=True)``). Printed: medians of ``latest()``
over the raw pinned host-to-device copy, of the first save's stall over the raw
device-to-host copy, and of the whole restart (process start to first save returned).

    .venv/bin/python scripts/restart_speed.py                 # 8 GiB, 512 tensors, GPU 0
    .venv/bin/python scripts/restart_speed.py --device cpu --gib 0.05 --build-s 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.time()  # this process's start, as near as Python gets (before torch)

GOALS = {"latest_prepared": 1.15, "first_save_prepared": 1.10}


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The model's state: ``--tensors`` bf16 tensors of ``--gib`` GiB in all, seeded."""
    import torch

    device = torch.device(args.device)
    per = int(args.gib * (1 << 30)) // args.tensors // 2  # bf16 elements per tensor
    gen = torch.Generator(device=device).manual_seed(1234)
    return {
        f"layer{i}.weight": torch.randn(per, generator=gen, device=device, dtype=torch.bfloat16)
        for i in range(args.tensors)
    }


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def say(**what: Any) -> None:
    print("RESULT " + json.dumps(what), flush=True)


def trainer(args: argparse.Namespace) -> None:
    """Saves twice, measures the raw copies of the same bytes, then waits to be killed."""
    import torch
    from shmstage_bench.limits import PinnedMirror
    from shmstage_client import Stager

    state = build(args)
    tensors = list(state.values())
    device = torch.device(args.device)
    mirror = PinnedMirror(tensors, pin=device.type == "cuda")
    d2h = [mirror.copy_from(tensors, device) for _ in range(3)]
    h2d = [mirror.copy_to(tensors, device) for _ in range(3)]  # the same bytes back
    mirror.close()
    stager = Stager(args.socket, slots=2)
    for name in ("c1", "c2"):
        began = time.perf_counter()
        handle = stager.save(state, Path(args.root) / name)
        stall = time.perf_counter() - began
        handle.wait(args.timeout)
    say(event="durable", raw_d2h=statistics.median(d2h), raw_h2d=statistics.median(h2d),
        trainer_last_stall=stall)
    time.sleep(600)  # until SIGKILLed


def restart(args: argparse.Namespace) -> None:
    """One restarted process (``--prepared`` or not): start to first save returned."""
    import torch
    from shmstage_client import Stager, latest, prepare_restore

    imported = time.time()
    if args.device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=args.device)
    if args.prepared:
        prepare_restore(args.device, socket=args.socket)
    building = time.perf_counter()
    model = build(args)
    sync(args.device)
    built = time.perf_counter() - building
    time.sleep(max(0.0, args.build_s - built))  # the rest of a real model's build
    sync(args.device)
    began = time.perf_counter()
    restored = latest(device=args.device, socket=args.socket)
    sync(args.device)
    latest_s = time.perf_counter() - began
    exact = restored.state.keys() == model.keys() and all(
        torch.equal(restored.state[key], tensor) for key, tensor in model.items()
    )
    with torch.no_grad():  # load_state_dict
        for key, tensor in model.items():
            tensor.copy_(restored.state[key])
    source, phases = restored.source, restored.phases
    del restored
    stager = Stager(args.socket, slots=2)
    began = time.perf_counter()
    handle = stager.save(model, Path(args.root) / f"restart-{os.getpid()}")
    first_save = time.perf_counter() - began
    done = time.time()
    handle.wait(args.timeout)
    stager.close(retain=True)  # the next restart finds this layout retained
    say(event="restarted", prepared=args.prepared, latest=latest_s, first_save=first_save,
        whole_from_exec=done - STARTED, whole_from_import=done - imported, import_s=imported -
        STARTED, build_s=built, source=source, exact=exact, phases=phases,
        first_save_timings=str(handle.timings) if hasattr(handle, "timings") else "")


def child(args: argparse.Namespace, role: str, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--role", role, "--socket", args.socket,
               "--root", args.root, "--device", args.device, "--gib", str(args.gib),
               "--tensors", str(args.tensors), "--build-s", str(args.build_s),
               "--timeout", str(args.timeout), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The child's next RESULT line (bounded); the child's other output is passed on."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited ({proc.wait(10)}) before it said its result")
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        sys.stdout.write(f"  | {line}")
    raise TimeoutError(f"no result within {timeout} s")


def start_daemon(where: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("shmstaged", path=os.path.dirname(sys.executable))
    command = [exe] if exe else [sys.executable, "-m", "shmstage_daemon.main"]
    sock = str(where / "shmstaged.sock")
    log = (where / "shmstaged.log").open("wb")
    proc = subprocess.Popen([*command, "--socket", sock, "--log-level", "info"], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "ready: serving" in (where / "shmstaged.log").read_text():
            return proc, sock
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("shmstaged did not start:\n" + (where / "shmstaged.log").read_text())


def _keep_newest(root: Path) -> None:
    """Remove every checkpoint under ``root`` but the newest (what the next restart
    restores from memory; its files are only the fallback)."""
    found = sorted(root.iterdir(), key=lambda path: path.stat().st_mtime)
    for old in found[:-1]:
        shutil.rmtree(old, ignore_errors=True)


def ratio(value: float | None, limit: float | None) -> str:
    return f"{value / limit:.2f}x" if value and limit else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="parent", choices=("parent", "trainer", "restart"))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--tensors", type=int, default=512)
    parser.add_argument("--restarts", type=int, default=3, help="of each kind")
    parser.add_argument("--build-s", type=float, default=3.0,
                        help="a restart's model build in all (simulated beyond the tensors)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--root", default="", help="checkpoints (default: under /var/tmp)")
    parser.add_argument("--socket", default="", help="a running shmstaged (default: start one)")
    parser.add_argument("--prepared", action="store_true")
    args = parser.parse_args()
    if args.role == "trainer":
        return trainer(args)
    if args.role == "restart":
        return restart(args)
    work = Path(tempfile.mkdtemp(prefix="shmstage-restart-", dir="/var/tmp"))
    args.root = args.root or str(work / "ckpt")
    Path(args.root).mkdir(parents=True, exist_ok=True)
    daemon = None
    if not args.socket:
        daemon, args.socket = start_daemon(work)
    try:
        run(args)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    began = time.monotonic()
    trainer_proc = child(args, "trainer")
    try:
        limits = result(trainer_proc, 4 * args.timeout)
    finally:
        trainer_proc.kill()  # SIGKILL: no handler runs, as an OOM kill
        trainer_proc.wait(30)
    print(f"trainer: saved twice, durable, SIGKILLed ({time.monotonic() - began:.1f} s)")
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for index in range(2 * args.restarts):
        prepared = index % 2 == 1
        proc = child(args, "restart", *(["--prepared"] if prepared else []))
        try:
            out = result(proc, 2 * args.timeout)
            proc.wait(args.timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        runs[prepared].append(out)
        _keep_newest(Path(args.root))  # 8 GiB a save: the disk holds a few at most
        print(f"restart {index + 1} ({'prepared' if prepared else 'plain'}): latest "
              f"{out['latest']:.3f} s, first save {out['first_save']:.3f} s, whole "
              f"{out['whole_from_exec']:.2f} s, {out['source']}, exact {out['exact']}; "
              f"phases {json.dumps({k: round(v, 3) for k, v in out['phases'].items()})}")
    h2d, d2h = limits["raw_h2d"], limits["raw_d2h"]
    print(f"\n{args.gib:g} GiB in {args.tensors} tensors on {args.device}; build {args.build_s} s"
          f"; medians of {args.restarts} restarts each")
    print(f"raw pinned H2D copy   {h2d:.3f} s")
    print(f"raw pinned D2H copy   {d2h:.3f} s")
    figures = {"raw_h2d": h2d, "raw_d2h": d2h}
    for prepared, kept in runs.items():
        kind = "prepared" if prepared else "plain"
        latest_s = statistics.median(r["latest"] for r in kept)
        save_s = statistics.median(r["first_save"] for r in kept)
        whole = statistics.median(r["whole_from_exec"] for r in kept)
        figures.update({f"latest_{kind}": latest_s, f"first_save_{kind}": save_s,
                        f"whole_{kind}": whole})
        exact = all(r["exact"] and r["source"] == "memory" for r in kept)
        print(f"{kind:9s} latest()     {latest_s:.3f} s  {ratio(latest_s, h2d):>6} raw H2D")
        print(f"{kind:9s} first save   {save_s:.3f} s  {ratio(save_s, d2h):>6} raw D2H")
        print(f"{kind:9s} whole restart {whole:.2f} s (process start to first save returned)"
              f"; all from memory and bit-exact: {exact}")
    for key, goal in GOALS.items():
        limit = h2d if key.startswith("latest") else d2h
        value = figures[key] / limit if limit else float("nan")
        print(f"goal {key}: {value:.2f}x <= {goal}x: {'met' if value <= goal else 'NOT met'}")
    print("FIGURES " + json.dumps(figures))
    print(f"total {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Why is the first save after ``reserve()`` slower to copy than the next ones?

The training scenario (``--scenario training --reserve``) measured the first save after
``reserve()`` at 1.07-1.23x the raw pinned copy, its copy alone at 0.166 s against
0.146 s for every later save, while the plain run's first save (which registers) copied
in 0.168 s and its second, into a slot pinned inside that save, in 0.145 s. So it is the
process's first copy through the Stager that is slow, not a fresh slot.

This builds the scenario's trainer (the bench's 0.66B Llama with fused AdamW), then per
round, with a new Stager: ``reserve()``, and saves one after another (each waited durable
before the next), timing the raw copy into a cudaHostAlloc mirror right before each. The
``--between`` variants say what runs between ``reserve()`` and the first save:

    nothing   the first save right after reserve()
    raw       a raw copy of the state into the pinned mirror (as the scenario does)
    steps     three training steps
    idle      two seconds of an idle GPU

    python3 scripts/experiments/reserve_first_save.py --saves 3 --between raw,nothing,steps

The suspect was CUDA loading a kernel's module at its first launch: the gathers' kernels
(a uint8 fill, ``_foreach_copy_`` of bit views) are ones training never launches.
``CUDA_MODULE_LOADING=EAGER`` in the environment is the control (every module loaded at
start). Run on an H100, 2026-11-28 (docs/perf/reserve-first-save-h100-1128.txt): with
``reserve()`` running the gathers once, save 0 copied in 0.145 s like the later saves; what
was left, 5-9 ms of flattening (``prep``), went once ``reserve()`` remembered the structure:
save 0 then stalled 1.07x the raw copy, save 1 1.04-1.06x.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from shmstage_bench.limits import PinnedMirror
from shmstage_bench.model import CUDA_DEFAULT, Trainer
from shmstage_bench.saves import tensors_of
from shmstage_client import Stager


def start_daemon(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    socket = str(root / "shmstaged.sock")
    log_path = root / "shmstaged.log"
    log = log_path.open("wb")
    command = [sys.executable, "-m", "shmstage_daemon.main", "--socket", socket]
    daemon = subprocess.Popen(command, stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while "ready: serving" not in log_path.read_text(errors="replace"):
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log_path.read_text(errors="replace"))
        time.sleep(0.05)
    return daemon, socket


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--between", default="raw,nothing,steps,idle")
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shmstage-reserve-", dir=args.dir))
    daemon, socket = start_daemon(root)
    device = torch.device("cuda")
    try:
        trainer = Trainer(CUDA_DEFAULT, device, 0)
        for _ in range(3):
            trainer.step()
        torch.cuda.synchronize()
        tensors = tensors_of(trainer.state())
        mirror = PinnedMirror(tensors, pin=True)
        raws = [mirror.copy_from(tensors, device) for _ in range(3)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        print(f"{len(tensors)} tensors, {nbytes / 2**30:.2f} GiB; raw copies "
              + " ".join(f"{r:.4f}" for r in raws), flush=True)
        for round_, between in enumerate(args.between.split(",")):
            with Stager(socket, slots=2) as stager:
                t0 = time.perf_counter()
                stager.reserve(trainer.state())
                reserved = time.perf_counter() - t0
                if between == "raw":
                    mirror.copy_from(tensors, device)
                elif between == "steps":
                    for _ in range(3):
                        trainer.step()
                    torch.cuda.synchronize()
                elif between == "idle":
                    time.sleep(2)
                line = [f"round {round_} ({between}): reserve {reserved:.3f} s;"]
                for index in range(args.saves):
                    if index:
                        raw = mirror.copy_from(tensors, device)
                        line.append(f"raw {raw:.4f}")
                    started = time.perf_counter()
                    handle = stager.save(trainer.state(), root / f"r{round_}-s{index}")
                    stall = time.perf_counter() - started
                    t = handle.timings
                    line.append(
                        f"save {index}: stall {stall:.4f} copy {t.copy_seconds:.4f} "
                        f"prep {t.prepare_seconds:.4f} setup {t.setup_seconds:.4f} "
                        f"commit {t.commit_seconds:.4f};"
                    )
                    handle.wait(600)
                    shutil.rmtree(root / f"r{round_}-s{index}", ignore_errors=True)
                print(" ".join(line), flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

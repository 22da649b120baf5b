"""A new subscriber's first version, part by part: what a read-only mapping of segments
another process filled costs to register with CUDA, whether populating its page table first
(reading a byte a page, MADV_POPULATE_READ, MAP_POPULATE) makes the registration cheaper,
whether registration scales over threads, and whether registering the next piece overlaps
the copy of the previous one. No daemon: segments in /dev/shm, mapped as the ring maps them.

    PYTHONPATH=.:client python3 scripts/experiments/first_version_gpu.py --total-gib 7
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import mmap
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from shmstage_client import cudart, pinning

from shmstage import segment
from shmstage.mapping import libc

GIB = 1 << 30
READ_ONLY = pinning.HOST_REGISTER_PORTABLE | 0x08
MADV_POPULATE_READ = 22
MAP_POPULATE = 0x8000


def make_segments(total: int, count: int) -> tuple[list[str], list[int]]:
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(count, generator=gen) + 0.05
    sizes = [int(w / weights.sum() * total) // 4096 * 4096 for w in weights]
    names = []
    for i, size in enumerate(sizes):
        name = f"/dev/shm/fvexp-{os.getpid()}-{i}"
        fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        t = torch.frombuffer(m, dtype=torch.int32)
        t.copy_(torch.arange(t.numel(), dtype=torch.int32) + i)
        del t
        m.close()
        os.close(fd)
        names.append(name)
    return names, sizes


def map_region(names: list[str], sizes: list[int], populate: bool = False) -> segment.Region:
    region = segment.Region(sizes)
    for i, name in enumerate(names):
        fd = os.open(name, os.O_RDONLY)
        if populate:
            want = region.address + region.offsets[i]
            flags = mmap.MAP_SHARED | 0x10 | MAP_POPULATE
            got = libc.mmap(want, region.sizes[i], mmap.PROT_READ, flags, fd, 0)
            assert got == want
        else:
            region.map(i, fd, writable=False)
        os.close(fd)
    return region


def touch(address: int, size: int) -> None:
    view = (ctypes.c_char * size).from_address(address)
    torch.frombuffer(view, dtype=torch.uint8)[:: mmap.PAGESIZE].sum()


def register(address: int, size: int, bases: list[int]) -> None:
    pinning.register_range(address, size, READ_ONLY, bases)


def timed(what: str, fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    took = time.perf_counter() - start
    print(f"  {what:48} {took:.4f} s", flush=True)
    return took


def sync() -> None:
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--total-gib", type=float, default=7)
    p.add_argument("--segments", type=int, default=250)
    p.add_argument("--only-register", action="store_true",
                   help="registration alone: flags, piece sizes, a huge-page tmpfs")
    p.add_argument("--publisher-pins", action="store_true",
                   help="another process maps the segments writable and registers them first, "
                   "as a publisher's Stager does")
    p.add_argument("--only-pipeline", action="store_true", help="G beside readers, then H")
    p.add_argument("--only-ring", action="store_true", help="only H: later versions' copies")
    args = p.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    cudart.runtime()
    total = int(args.total_gib * GIB)
    t0 = time.perf_counter()
    names, sizes = make_segments(total, args.segments)
    nbytes = sum(sizes)
    gib = nbytes / GIB
    print(f"{len(names)} segments, {gib:.2f} GiB, made in {time.perf_counter() - t0:.1f} s")
    target = torch.empty(segment.Region(sizes).size, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for _ in range(2):
        sync()
        s = time.perf_counter()
        target[:nbytes].copy_(host, non_blocking=True)
        sync()
    took = time.perf_counter() - s
    print(f"raw pinned H2D {took:.4f} s ({nbytes / took / 1e9:.1f} GB/s)")
    del host
    stream = torch.cuda.current_stream().cuda_stream
    rt = cudart.runtime()
    lock = threading.Lock()

    def fresh(populate: bool = False) -> segment.Region:
        s = time.perf_counter()
        region = map_region(names, sizes, populate)
        print(f"  map {len(names)} segments{' MAP_POPULATE' if populate else ''}: "
              f"{time.perf_counter() - s:.4f} s")
        return region

    def finish(region: segment.Region, bases: list[int]) -> None:
        pinning.unregister(bases)
        region.close()

    def whole_copy(region: segment.Region) -> float:
        sync()
        s = time.perf_counter()
        src = torch.frombuffer(region.buffer(), dtype=torch.uint8)
        target.copy_(src)
        sync()
        return time.perf_counter() - s

    if args.only_ring:
        ring_copies(names, sizes, target)
        return
    if args.publisher_pins:
        publisher = subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER, *names], stdout=subprocess.PIPE, text=True
        )
        assert publisher.stdout is not None and publisher.stdout.readline().strip() == "pinned"
        print("a publisher process registered the segments (writable) first")
        atexit.register(publisher.kill)
    if args.only_register:
        registration_costs(names, sizes)
        for name in names:
            os.unlink(name)
        return
    if args.only_pipeline:
        for round_ in range(2):
            for kind in ("ring", "ring-nocopy", "sequential", "two-threads"):
                region = map_region(names, sizes)
                readers = 4 if kind.endswith("cat") else 0
                busy = [
                    subprocess.Popen(["cat", *names[i::readers]], stdout=subprocess.DEVNULL)
                    for i in range(readers)
                ]
                if kind == "ring-nocopy":
                    took = pipeline(region, target, 28, copy=False)
                elif kind == "sequential":
                    bases: list[int] = []
                    sync()
                    s = time.perf_counter()
                    touch(region.address, region.size)
                    register(region.address, region.size, bases)
                    src = torch.frombuffer(region.buffer(), dtype=torch.uint8)
                    target[: region.size].copy_(src)
                    sync()
                    took = time.perf_counter() - s
                    pinning.unregister(bases)
                elif kind.startswith("ring"):
                    took = pipeline(region, target, 28)
                else:
                    took = two_threads(region, target, rt, stream, lock)
                for process in busy:
                    process.wait()
                print(f"G{round_}: {kind:12} {took:.4f} s (ring: 1 thread reads in, 1 registers; "
                      "two-threads: each reads in and registers; +cat: 4 readers of the "
                      "segments meanwhile, as the daemon's checksums)")  # fmt: skip
                region.close()
        ring_copies(names, sizes, target)
        return
    print("A: register whole, untouched (today)")
    r = fresh()
    bases: list[int] = []
    timed("register", register, r.address, r.size, bases)
    print(f"  copy {whole_copy(r):.4f} s; copy again {whole_copy(r):.4f} s")
    finish(r, bases)

    print("B: read a byte a page (1 thread), then register")
    r = fresh()
    timed("touch", touch, r.address, r.size)
    timed("register", register, r.address, r.size, bases)
    finish(r, bases)

    print("C: MADV_POPULATE_READ then register")
    r = fresh()
    timed("madvise", lambda: libc.madvise(r.address, r.size, MADV_POPULATE_READ))
    timed("register", register, r.address, r.size, bases)
    finish(r, bases)

    print("D: MAP_POPULATE then register")
    r = fresh(populate=True)
    timed("register", register, r.address, r.size, bases)
    finish(r, bases)

    for count in (28, 56):
        r = fresh()
        pieces = pinning.region_pieces(r, count)
        print(f"E: {len(pieces)} pieces; a copy spanning two registrations?")
        s = time.perf_counter()
        for a, b in pieces:
            register(r.address + a, b - a, bases)
        print(f"  register pieces serially {time.perf_counter() - s:.4f} s")
        try:
            print(f"  whole copy across pieces {whole_copy(r):.4f} s (no error)")
        except RuntimeError as exc:
            print(f"  whole copy across pieces failed: {str(exc)[:100]}")
            rt.clear_sticky_error()
        sync()
        s = time.perf_counter()
        for a, b in pieces:
            rt.copy_to_device(target.data_ptr() + a, r.address + a, b - a, stream)
        sync()
        print(f"  piecewise copy {time.perf_counter() - s:.4f} s")
        finish(r, bases)

    for threads in (2, 4, 8):
        for prefault in (False, True):
            r = fresh()
            pieces = pinning.region_pieces(r, 28)

            def one(piece, r=r, prefault=prefault):
                a, b = piece
                if prefault:
                    touch(r.address + a, b - a)
                mine: list[int] = []
                register(r.address + a, b - a, mine)
                with lock:
                    bases.extend(mine)

            s = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, pieces))
            what = "touch+register" if prefault else "register"
            print(f"F: {what} 28 pieces on {threads} threads {time.perf_counter() - s:.4f} s")
            finish(r, bases)

    for threads in (1, 2, 4, 8):
        for count in (28, 56):
            r = fresh()
            pieces = pinning.region_pieces(r, count)
            done: queue.Queue = queue.Queue()

            def one(index, r=r, pieces=pieces, done=done):
                a, b = pieces[index]
                touch(r.address + a, b - a)
                mine: list[int] = []
                register(r.address + a, b - a, mine)
                with lock:
                    bases.extend(mine)
                done.put(index)

            sync()
            s = time.perf_counter()
            ready = [False] * len(pieces)
            nxt = 0
            with ThreadPoolExecutor(threads) as pool:
                for index in range(len(pieces)):
                    pool.submit(one, index)
                while nxt < len(pieces):
                    ready[done.get()] = True
                    while nxt < len(pieces) and ready[nxt]:
                        a, b = pieces[nxt]
                        rt.copy_to_device(target.data_ptr() + a, r.address + a, b - a, stream)
                        nxt += 1
            queued = time.perf_counter() - s
            sync()
            took = time.perf_counter() - s
            print(f"G: pipeline {threads} threads, {len(pieces)} pieces: {took:.4f} s "
                  f"(last queued at {queued:.4f})")
            if threads == 4 and count == 28:
                src = torch.frombuffer(r.buffer(), dtype=torch.uint8)
                assert torch.equal(target.cpu()[: r.size], src), "pipelined copy differs"
                print("  bit-exact")
            finish(r, bases)

    ring_copies(names, sizes, target)


_PUBLISHER = """
import os, sys, time, torch
from shmstage import segment
from shmstage_client import pinning
names = sys.argv[1:]
sizes = [os.stat(n).st_size for n in names]
region = segment.Region(sizes)
for i, n in enumerate(names):
    fd = os.open(n, os.O_RDWR)
    region.map(i, fd, writable=True)
    os.close(fd)
torch.cuda.init()
bases = []
pinning.register_range(region.address, region.size, pinning.HOST_REGISTER_PORTABLE, bases)
print("pinned", flush=True)
time.sleep(600)
"""


def registration_costs(names: list[str], sizes: list[int]) -> None:
    """I: registering 7 GiB read in first, by flags and by piece size; then the same bytes in
    a tmpfs mounted with huge=always (if this process may mount one)."""
    for flags, label in ((READ_ONLY, "ro|portable"), (0x08, "ro")):
        for piece in (64 << 20, 256 << 20, 1 << 30, 1 << 40):
            region = map_region(names, sizes)
            touch(region.address, region.size)
            bases: list[int] = []
            s = time.perf_counter()
            for a, b in pinning.page_pieces(region.size, piece):
                pinning.register_range(region.address + a, b - a, flags, bases)
            took = time.perf_counter() - s
            pinning.unregister(bases)
            region.close()
            print(f"I: register {label:12} pieces of {min(piece, region.size) >> 20:5} MiB: "
                  f"{took:.4f} s")  # fmt: skip
    mount = "/tmp/fv-huge"
    os.makedirs(mount, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=16g", "none", mount])
    if made.returncode:
        print("I: no huge-page tmpfs here")
        return
    try:
        huge = []
        for i, name in enumerate(names):
            path = f"{mount}/seg-{i}"
            with open(name, "rb") as src, open(path, "wb") as dst:
                dst.write(src.read())
            huge.append(path)
        region = map_region(huge, sizes)
        s = time.perf_counter()
        touch(region.address, region.size)
        touched = time.perf_counter() - s
        bases = []
        s = time.perf_counter()
        for a, b in pinning.page_pieces(region.size, 256 << 20):
            pinning.register_range(region.address + a, b - a, READ_ONLY, bases)
        took = time.perf_counter() - s
        with open("/proc/meminfo") as info:
            hugepages = info.read().split("ShmemHugePages:")[1].split("\n")[0].strip()
        print(f"I: huge=always tmpfs: read in {touched:.4f} s, register {took:.4f} s; "
              f"ShmemHugePages {hugepages}")  # fmt: skip
        pinning.unregister(bases)
        region.close()
    finally:
        subprocess.run(["umount", "-l", mount])


def two_threads(region: segment.Region, target: torch.Tensor, rt, stream, lock) -> float:
    """G's first design: 2 threads each reading a piece in and registering it."""
    pieces = pinning.page_pieces(region.size, -(-region.size // 28 // 4096) * 4096)
    done: queue.Queue = queue.Queue()
    bases: list[int] = []

    def one(index: int) -> None:
        a, b = pieces[index]
        touch(region.address + a, b - a)
        mine: list[int] = []
        register(region.address + a, b - a, mine)
        with lock:
            bases.extend(mine)
        done.put(index)

    sync()
    s = time.perf_counter()
    ready = [False] * len(pieces)
    nxt = 0
    with ThreadPoolExecutor(2) as pool:
        for index in range(len(pieces)):
            pool.submit(one, index)
        while nxt < len(pieces):
            ready[done.get()] = True
            while nxt < len(pieces) and ready[nxt]:
                a, b = pieces[nxt]
                rt.copy_to_device(target.data_ptr() + a, region.address + a, b - a, stream)
                nxt += 1
    sync()
    took = time.perf_counter() - s
    pinning.unregister(bases)
    return took


def pipeline(
    region: segment.Region, target: torch.Tensor, count: int, copy: bool = True
) -> float:
    """The ring's first version as ``Ring.pieces`` and ``Version._copy`` do it: pieces
    read in on one thread and registered on another, each copied once registered."""
    from shmstage_client.subscribe import ring

    ours = ring.Ring.__new__(ring.Ring)  # its constructor wants a layout: set its fields
    ours._regions = {0: region}
    ours._registrations = {}
    ours._unpinnable = False
    ours._refusal = ""
    ours._warned = False
    ours._lock = threading.Lock()
    old = ring.PIECE_BYTES
    ring.PIECE_BYTES = -(-region.size // count // 4096) * 4096
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        sync()
        start = time.perf_counter()
        src = torch.frombuffer(region.buffer(), dtype=torch.uint8)
        for first, last, pinned in ours.pieces(0, device, 0, region.size):
            if copy:
                target[first:last].copy_(src[first:last], non_blocking=pinned)
        sync()
        took = time.perf_counter() - start
    finally:
        ring.PIECE_BYTES = old
        ours._close()
    return took


def ring_copies(names: list[str], sizes: list[int], target: torch.Tensor) -> None:
    """H: a later version's copy, the slot registered whole (one copy) against registered
    in 256 MiB pieces (a copy per piece, queued, one wait), alternated, medians of 7."""
    whole = map_region(names, sizes)
    pieced = map_region(names, sizes)
    whole_bases: list[int] = []
    pieced_bases: list[int] = []
    register(whole.address, whole.size, whole_bases)
    pieces = pinning.page_pieces(pieced.size, 256 << 20)
    for a, b in pieces:
        register(pieced.address + a, b - a, pieced_bases)
    times: dict[str, list[float]] = {"whole": [], "pieces": []}
    for _ in range(7):
        for kind in times:
            region = whole if kind == "whole" else pieced
            src = torch.frombuffer(region.buffer(), dtype=torch.uint8)
            sync()
            s = time.perf_counter()
            if kind == "whole":
                target[: region.size].copy_(src)
            else:
                for a, b in pieces:
                    target[a:b].copy_(src[a:b], non_blocking=True)
                torch.cuda.current_stream().synchronize()
            times[kind].append(time.perf_counter() - s)
    for kind, values in times.items():
        print(f"H: ring copy, {kind}: median {sorted(values)[3]:.4f} s, all "
              + " ".join(f"{v:.4f}" for v in values))  # fmt: skip
    pinning.unregister(whole_bases)
    pinning.unregister(pieced_bases)
    whole.close()
    pieced.close()
    for name in names:
        os.unlink(name)


if __name__ == "__main__":
    main()

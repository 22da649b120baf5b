"""Is a process's first ``preadv`` of shm pages slower than its next, and what removes that?

A one-off behind ``first-read.txt`` (now in the history of ``docs/perf/``): 512 segments
of 16 MiB (8 GiB) are written through a shared mapping by a process that exits; then new
processes read them all twice with ``preadv`` on 16 threads. ``passes`` puts other passes
in between (a mapping populated with ``MADV_POPULATE_READ``, or every page read into one
4 KiB buffer); ``drop`` drops the page cache in between instead (as root). Linux only;
writes 8 GiB to /dev/shm and removes it.

    python3 scripts/experiments/first_read_bench.py passes
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import subprocess
import sys
import time

#: Segments of 16 MiB (``SHMSTAGE_FIRST_READ_SEGMENTS``, for a quick try at a smaller size).
SEGMENTS = int(os.environ.get("SHMSTAGE_FIRST_READ_SEGMENTS", "512"))
SIZE, THREADS = 16 << 20, 16
NAMES = [f"/dev/shm/shmstage-first-read.{i}" for i in range(SEGMENTS)]
MADV_POPULATE_READ = 22


def write_all() -> None:
    """Fill every segment through a shared mapping, as a trainer's copies do."""
    block = os.urandom(1 << 20) * (SIZE >> 20)
    for name in NAMES:
        fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            with mmap.mmap(fd, SIZE) as mapping:
                mapping.write(block)
        finally:
            os.close(fd)


def read_all(label: str) -> None:
    """Two passes of ``preadv`` over every segment, timed."""
    fds = [os.open(name, os.O_RDONLY) for name in NAMES]
    buffers = [bytearray(SIZE) for _ in range(THREADS)]

    def reader(index: int) -> None:
        for k in range(index, SEGMENTS, THREADS):
            os.preadv(fds[k], [buffers[index]], 0)

    try:
        for number in (1, 2):
            begun = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(reader, range(THREADS)))
            print(f"{label} pass {number}: {time.perf_counter() - begun:.3f} s", flush=True)
    finally:
        for fd in fds:
            os.close(fd)


def pre_pass(how: str, threads: int) -> None:
    """One pass of another kind over every page."""

    def touch(index: int) -> None:
        scratch = memoryview(bytearray(4096))
        for k in range(index, SEGMENTS, threads):
            fd = os.open(NAMES[k], os.O_RDONLY)
            try:
                if how == "populate":
                    with mmap.mmap(fd, SIZE, prot=mmap.PROT_READ) as mapping:
                        mapping.madvise(MADV_POPULATE_READ)
                else:  # "scratch": every page into the same 4 KiB
                    for offset in range(0, SIZE, 4096 * 256):
                        os.preadv(fd, [scratch] * 256, offset)
            finally:
                os.close(fd)

    begun = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(touch, range(threads)))
    print(f"pass of {how} on {threads} threads: {time.perf_counter() - begun:.3f} s", flush=True)


def child(*args: str) -> None:
    subprocess.run([sys.executable, __file__, *args], check=True)


def main(mode: str) -> None:
    try:
        if mode == "passes":
            for how, threads in (("none", 1), ("scratch", 2), ("populate", 2), ("scratch", 8)):
                write_all()
                if how != "none":
                    child("pre-pass", how, str(threads))
                child("read", f"after {how}")
        elif mode == "drop":
            write_all()
            child("read", "fresh")
            child("read", "again")
            with open("/proc/sys/vm/drop_caches", "w") as control:
                control.write("1")
            child("read", "after drop_caches")
            child("read", "after that")
        else:
            raise SystemExit(f"usage: {sys.argv[0]} passes|drop")
    finally:
        for name in NAMES:
            if os.path.exists(name):
                os.unlink(name)


if __name__ == "__main__":
    if sys.argv[1] == "read":
        read_all(sys.argv[2])
    elif sys.argv[1] == "pre-pass":
        pre_pass(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1])

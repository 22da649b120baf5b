"""What a checkpoint write leaves in the page cache, read from ``/proc/meminfo``.

Dirty and Writeback pages are what the kernel throttles writers on and what competes with
the trainer's own memory; file pages that stay Cached after a write push other data out.
A sampler thread reads the counters every ~20 ms while a save runs: the report shows the
peak of Dirty+Writeback during it and the change of the file cache (Cached minus Shmem —
shared-memory segments count as Cached too, and a first save creates some) by its end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

FIELDS = ("Dirty", "Writeback", "Cached", "Shmem", "MemAvailable")


def read_meminfo() -> dict[str, int]:
    """The counters we need, in bytes; empty when /proc/meminfo is unreadable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in FIELDS:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def _file_cache(m: dict[str, int]) -> int:
    return m.get("Cached", 0) - m.get("Shmem", 0)


def _dirty(m: dict[str, int]) -> int:
    return m.get("Dirty", 0) + m.get("Writeback", 0)


@dataclass
class PageCacheUse:
    """Peak Dirty+Writeback during a save, and the file cache's growth by its end."""

    dirty_writeback_before: int
    dirty_writeback_peak: int
    file_cache_delta: int
    samples: int

    def detail(self) -> dict[str, int]:
        return {
            "dirty_writeback_before_bytes": self.dirty_writeback_before,
            "dirty_writeback_peak_bytes": self.dirty_writeback_peak,
            "file_cache_delta_bytes": self.file_cache_delta,
            "meminfo_samples": self.samples,
        }


class PageCacheSampler:
    """``with PageCacheSampler() as s: ...`` then ``s.use``; samples every ``interval``."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[str, int] = {}
        self._peak = 0
        self._samples = 0
        self.use: PageCacheUse | None = None

    def _sample(self) -> dict[str, int]:
        m = read_meminfo()
        if m:
            self._peak = max(self._peak, _dirty(m))
            self._samples += 1
        return m

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PageCacheSampler:
        self._first = self._sample()
        self._thread = threading.Thread(target=self._loop, name="meminfo", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        last = self._sample()
        if self._first and last:
            self.use = PageCacheUse(
                dirty_writeback_before=_dirty(self._first),
                dirty_writeback_peak=self._peak,
                file_cache_delta=_file_cache(last) - _file_cache(self._first),
                samples=self._samples,
            )

"""Deliberately broken methods, to prove that a peer's failure is one row and nothing more.

TEST-ONLY: offered by ``shmstage-bench`` only when ``SHMSTAGE_BENCH_TEST_METHODS=1`` is set
(``tests/bench/test_bench.py`` does). Each misbehaves the way a real peer did: nvidia-
resiliency-ext leaked descriptors until EMFILE and then hung; a native extension can crash
the process outright.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

from .method import Method, StateDict, Timing


class CrashingMethod(Method):
    """Dies with SIGSEGV in its first save, as a faulty native extension would."""

    name = "test-crash"
    description = "TEST-ONLY: the process crashes (SIGSEGV) during its first save"

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)  # not reached
        raise AssertionError("survived SIGSEGV")


class HangingMethod(Method):
    """Hangs in setup, outside any save: only the parent's deadline can end it."""

    name = "test-hang"
    description = "TEST-ONLY: setup never returns"

    def setup(self, state_dict: StateDict) -> None:
        time.sleep(3600)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        raise AssertionError("not reached")


class HangingSaveMethod(Method):
    """Hangs inside a save: the save's own deadline abandons it, the rows before survive."""

    name = "test-hang-save"
    description = "TEST-ONLY: the second save never returns"

    def setup(self, state_dict: StateDict) -> None:
        self.saves = 0

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        self.saves += 1
        if self.saves > 1:
            time.sleep(3600)
        return Timing(0.001, 0.002)


class LeakingMethod(Method):
    """Leaks descriptors until the process has none left, then tries to save."""

    name = "test-leak-fds"
    description = "TEST-ONLY: leaks descriptors until EMFILE, then saves"

    def setup(self, state_dict: StateDict) -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # quick to fill
        self.leaked: list[int] = []
        try:
            while True:
                self.leaked.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass  # EMFILE: every descriptor is taken, and stays taken

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        directory.mkdir(parents=True)
        with open(directory / "model.bin", "wb"):  # raises EMFILE
            pass
        return Timing(None, None)


FAULTY_METHODS: list[type[Method]] = [
    CrashingMethod,
    HangingMethod,
    HangingSaveMethod,
    LeakingMethod,
]

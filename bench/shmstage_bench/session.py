"""What every scenario shares in the parent process: the daemon, the directories, the clock.

The parent never measures anything itself. It starts ``shmstaged``, runs each measured part
in an isolated child with a deadline (capped by ``--budget``, so that a whole run ends in
time and still writes its report), and collects what the children hand back.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .daemon import BenchDaemon
from .isolation import Child, Outcome, describe_exception, run_isolated

#: Kept back from ``--budget`` for stopping the daemon and drawing the report.
REPORT_RESERVE_S = 30.0


class BenchSession:
    """One bench run in the parent: ``with BenchSession(args) as s: ...``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.deadline = None if args.budget is None else self.started + args.budget
        self.own_root = args.dir is None
        self.root = (
            Path(tempfile.mkdtemp(prefix="shmstage-bench-")) if self.own_root else Path(args.dir)
        )
        self.root.mkdir(parents=True, exist_ok=True)
        self.workdir = Path(tempfile.mkdtemp(prefix="shmstage-bench-logs-"))
        self.daemon = BenchDaemon(args.socket, attach=args.attach)
        self.socket: str | None = None
        self.daemon_error = ""

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def __enter__(self) -> BenchSession:
        try:
            self.socket = self.daemon.start()
            if self.daemon.info is not None:
                self.log(self.daemon.info.describe())
        except Exception as exc:  # the rows that need it say so; the rest still run
            self.daemon_error = f"cannot start shmstaged: {describe_exception(exc)}"
            self.log(self.daemon_error)
        return self

    def __exit__(self, *exc: object) -> None:
        self.daemon.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def daemon_report(self) -> dict[str, Any]:
        info = self.daemon.info
        out: dict[str, Any] = {"error": self.daemon_error} if self.daemon_error else {}
        if info is not None:
            out.update(vars(info))
            out["description"] = info.describe()
        elif self.daemon_error:
            out["description"] = self.daemon_error
        return out

    # -- isolated parts ----------------------------------------------------------

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - time.monotonic() - REPORT_RESERVE_S

    def _capped(self, timeout: float) -> float:
        left = self.remaining()
        return timeout if left is None else min(timeout, left)

    def out_of_time(self) -> str:
        """Why a part is not run, or "" when there is time left for it."""
        left = self.remaining()
        if left is not None and left < 5:
            return f"not run: the bench's --budget of {self.args.budget:.0f} s was spent"
        return ""

    def run(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> Outcome:
        """``fn(*args)`` in an isolated child, bounded by ``timeout`` and the budget."""
        why = self.out_of_time()
        if why:
            self.log(f"{name}: {why}")
            return Outcome(error=why)
        capped = self._capped(timeout)
        self.log(f"{name}: starting (deadline {capped:.0f} s)")
        outcome = run_isolated(
            name,
            fn,
            args,
            timeout=capped,
            workdir=self.workdir,
            start_method=self.args.start_method,
            sink=None if self.args.quiet else sys.stderr,
        )
        if not outcome.ok and capped < timeout and outcome.seconds >= capped:
            # stopped at the budget's edge, not at its own deadline: not a hang
            outcome.error = (
                f"stopped after {capped:.0f} s, where the bench's --budget of "
                f"{self.args.budget:.0f} s ran out (its own deadline: {timeout:.0f} s)"
            )
        self.log(f"{name}: {'done' if outcome.ok else outcome.error} ({outcome.seconds:.1f} s)")
        return outcome

    def child(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Child:
        """A child the caller talks to (``next_message``, ``kill``, ``result``)."""
        self.log(f"{name}: starting")
        return Child(
            name,
            fn,
            args,
            workdir=self.workdir,
            start_method=self.args.start_method,
            sink=None if self.args.quiet else sys.stderr,
        )

    def part_timeout(self, timeout: float) -> float:
        return self._capped(timeout)

"""``shmstaged``: run the staging service in the foreground (systemd or a terminal)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from shmstage.paths import default_socket_path
from shmstage_daemon import __version__
from shmstage_daemon.server import Daemon, Settings, StartupError
from shmstage_daemon.store import Limits

log = logging.getLogger("shmstaged")


def default_budget() -> int:
    """Half of /dev/shm: room for the staging of this node's trainers, not all of it."""
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize // 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmstaged",
        description="Per-node checkpoint staging service: owns shared-memory segments that "
        "trainers fill, and streams them to storage.",
    )
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="unix socket to listen on (default: $SHMSTAGE_SOCKET, "
        "else /run/shmstage/shmstaged.sock as root, else a per-user path)",
    )
    parser.add_argument("--slots", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--writer-threads", type=int, default=4)
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="skip fsync (tests and scratch storage only: not crash-safe)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds to let in-flight checkpoints finish on SIGTERM",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--version", action="version", version=f"shmstaged {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = Settings(
        socket_path=args.socket or default_socket_path(prefer_system=False),
        limits=Limits(shm_budget_bytes=default_budget()),
        writer_threads=args.writer_threads,
        fsync=not args.no_fsync,
        shutdown_timeout=args.shutdown_timeout,
    )
    daemon = Daemon(settings)
    try:
        daemon.start()
    except StartupError as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(_serve(daemon))


async def _serve(daemon: Daemon) -> int:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_stop)
    await daemon.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

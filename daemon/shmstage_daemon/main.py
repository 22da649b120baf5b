"""``shmstaged``: run the staging service in the foreground (systemd or a terminal).

Configuration comes from the TOML file (``--config``, else /etc/shmstage/shmstaged.toml
when it exists, else built-in defaults); command-line flags override single settings and
keep overriding them across SIGHUP reloads. Any configuration problem stops the daemon
before it serves, with exit status 78 (EX_CONFIG), which the unit does not restart on:
restarting cannot fix a typo.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from shmstage.units import format_size
from shmstage_daemon import __version__, logsetup
from shmstage_daemon.admission import Allowlist
from shmstage_daemon.config import Config, ConfigError, load_config
from shmstage_daemon.notify import Notifier, listen_fds, unix_stream_listener
from shmstage_daemon.retention import RetentionPolicy
from shmstage_daemon.server import Daemon, Settings, StartupError
from shmstage_daemon.service import EarlySignals, Service
from shmstage_daemon.store import Limits

log = logging.getLogger("shmstaged")

EXIT_STARTUP: Final = 2
EXIT_CONFIG: Final = 78  # sysexits.h EX_CONFIG; RestartPreventExitStatus= in the unit

#: Flag destination -> Config field, for flags that override one setting of the file.
_OVERRIDES: Final = {
    "socket": "socket_path",
    "writer_threads": "writer_threads",
    "io_threads": "io_threads",
    "write_chunk": "write_chunk",
    "write_buffers": "write_buffers",
    "shutdown_timeout": "shutdown_timeout",
    "log_level": "log_level",
    "log_format": "log_format",
    "shm_budget": "shm_budget",
    "max_bytes": "max_bytes",
    "max_segments": "max_segments",
    "max_layouts": "max_layouts",
    "max_jobs": "max_jobs",
    "max_connections": "max_connections",
    "max_prepared": "max_prepared",
    "max_journal_bytes": "max_journal_bytes",
    "max_buffered_bytes": "max_buffered_bytes",
    "default_slots": "default_slots",
    "size_check_interval": "size_check_interval",
    "metrics_port": "metrics_port",
    "metrics_socket": "metrics_socket",
    "journal_dir": "journal_dir",
    "retain_ttl": "retain_ttl",
    "retain_budget": "retain_budget",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmstaged",
        description="Per-node checkpoint staging service: owns shared-memory segments that "
        "trainers fill, and streams them to storage. Flags override the configuration file.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML configuration (default: /etc/shmstage/shmstaged.toml when it exists, "
        "else built-in defaults)",
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration (file and flags), print the effective settings, exit",
    )
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="unix socket to listen on (default: [server] socket_path, else $SHMSTAGE_SOCKET, "
        "else /run/shmstage/shmstaged.sock as root, else a per-user path)",
    )
    parser.add_argument(
        "--writer-threads",
        type=_number,
        default=None,
        metavar="N",
        help="checkpoints written at once; more wait, started in turns between users "
        "(default 16; restart to change)",
    )
    parser.add_argument(
        "--io-threads",
        type=_number,
        default=None,
        metavar="N",
        help="threads writing data, shared in turns by all checkpoints: the disk's queue "
        "depth (default 4)",
    )
    parser.add_argument(
        "--write-chunk",
        default=None,
        metavar="SIZE",
        help='bytes per data write, a multiple of 4096 (default "4MiB")',
    )
    parser.add_argument(
        "--write-buffers",
        default=None,
        metavar="SIZE",
        help="memory for data being written, all checkpoints together; released when idle "
        '(default "64MiB")',
    )
    parser.add_argument(
        "--no-direct-io",
        action="store_true",
        help="write through the page cache (written out and dropped as it goes) even where "
        "the filesystem takes O_DIRECT",
    )
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="fsync = never (tests and scratch storage only: not crash-safe)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_number,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight checkpoints may finish (default 60); past it "
        "their writers stop and the next start finishes them; 0 stops at once",
    )
    parser.add_argument(
        "--log-level",
        default=None,
        help="debug, info (default), warning or error",
    )
    parser.add_argument("--log-format", default=None, help="text (default) or json")
    parser.add_argument(
        "--shm-budget",
        default=None,
        metavar="SIZE",
        help='shared memory all clients together may stage: bytes, "64GiB" or "80%%" of '
        "/dev/shm (default 80%%)",
    )
    parser.add_argument(
        "--max-bytes",
        default=None,
        metavar="SIZE",
        help="shared memory one user may hold, all its connections together (default: the budget)",
    )
    parser.add_argument(
        "--max-segments",
        type=_number,
        default=None,
        metavar="N",
        help="segments (tensors x slots) one user may hold (default 262144)",
    )
    parser.add_argument(
        "--max-layouts",
        type=_number,
        default=None,
        metavar="N",
        help="state dict structures one user may have registered at once (default 64)",
    )
    parser.add_argument(
        "--max-jobs",
        type=_number,
        default=None,
        metavar="N",
        help="checkpoints of one user being written at once (default 32)",
    )
    parser.add_argument(
        "--max-connections",
        type=_number,
        default=None,
        metavar="N",
        help="connections one user may hold open (default 64)",
    )
    parser.add_argument(
        "--max-prepared",
        type=_number,
        default=None,
        metavar="N",
        help="commits one user may have sent ahead of their copy (default 32)",
    )
    parser.add_argument(
        "--max-journal-bytes",
        default=None,
        metavar="SIZE",
        help='journal space one user\'s acknowledged checkpoints may take (default "64MiB")',
    )
    parser.add_argument(
        "--max-buffered-bytes",
        default=None,
        metavar="SIZE",
        help='bytes of requests still arriving one user may have the daemon buffer '
        '(default "256MiB")',
    )
    parser.add_argument(
        "--default-slots",
        type=_number,
        default=None,
        metavar="N",
        help="staging slots per layout when the client does not say (default 2)",
    )
    parser.add_argument(
        "--size-check-interval",
        type=_number,
        default=None,
        metavar="SECONDS",
        help="how often segments a client resized through its descriptor are put back to "
        "their size: until then, what it grew them by is memory no limit counts (default 10; "
        "at least 0.5)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_number,
        default=None,
        metavar="PORT",
        help="also serve Prometheus metrics on http://127.0.0.1:PORT/metrics",
    )
    parser.add_argument(
        "--metrics-socket",
        type=Path,
        default=None,
        metavar="PATH",
        help="also serve the metrics over HTTP on this unix socket (mode 0660: the daemon's "
        "user and group only)",
    )
    parser.add_argument(
        "--journal-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the journal of acknowledged checkpoints lives (default /dev/shm); must "
        "be memory-backed unless --allow-disk-journal",
    )
    parser.add_argument(
        "--allow-disk-journal",
        action="store_true",
        help="accept a journal directory on a disk (every save then waits for its fsync)",
    )
    parser.add_argument(
        "--retain-ttl",
        type=_number,
        default=None,
        metavar="SECONDS",
        help="how long a checkpoint stays in memory after its trainer went away, for a "
        "restart to restore and adopt (default 1800; 0 keeps nothing)",
    )
    parser.add_argument(
        "--retain-budget",
        default=None,
        metavar="SIZE",
        help='memory all retained checkpoints may hold: bytes, "16GiB" or "50%%" of the '
        "shared-memory budget (default 50%%)",
    )
    parser.add_argument("--version", action="version", version=f"shmstaged {__version__}")
    return parser


def _number(text: str) -> int | float | str:
    """A numeric flag's value; anything else passes through so that the configuration's
    validator refuses it like a bad file value (exit 78, naming the setting), rather than
    argparse exiting 2 with a usage line."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gives, as Config field names (absent flags omitted)."""
    out = {field: getattr(args, dest) for dest, field in _OVERRIDES.items()}
    for key in ("socket_path", "journal_dir", "metrics_socket"):
        if out[key] is not None:
            out[key] = Path(out[key]).absolute()
    if args.no_fsync:
        out["fsync"] = "never"
    if args.allow_disk_journal:
        out["allow_disk_journal"] = True
    if args.no_direct_io:
        out["direct_io"] = False
    return {k: v for k, v in out.items() if v is not None}


def load(path: Path | None, overrides: dict[str, Any]) -> Config:
    """The file (or defaults) with the command line on top; what a reload re-runs."""
    return load_config(path).replace(**overrides)


def settings_of(config: Config) -> Settings:
    limits: dict[str, int] = {
        "shm_budget_bytes": config.shm_budget_bytes,
        "max_user_segments": config.max_segments,
        "max_user_layouts": config.max_layouts,
        "max_user_jobs": config.max_jobs,
        "max_user_connections": config.max_connections,
        "max_user_prepared": config.max_prepared,
        "max_user_journal_bytes": int(config.max_journal_bytes),
        "max_user_buffered_bytes": int(config.max_buffered_bytes),
    }
    if config.max_bytes is not None:
        limits["max_user_bytes"] = config.max_bytes
    return Settings(
        socket_path=config.socket_path,
        limits=Limits(**limits),
        allowlist=Allowlist(config.allowed_users, config.allowed_groups),
        writer_threads=config.writer_threads,
        io_threads=config.io_threads,
        write_chunk=int(config.write_chunk),
        write_buffers=int(config.write_buffers),
        direct_io=config.direct_io,
        fsync=config.fsync == "always",
        shutdown_timeout=config.shutdown_timeout,
        default_slots=config.default_slots,
        size_check_interval=config.size_check_interval,
        operator_gids=config.operator_groups,
        journal_root=config.journal_dir,
        allow_disk_journal=config.allow_disk_journal,
        config_source=config.source,
        publish_gids=config.publish_groups,
        retention=RetentionPolicy(
            ttl=config.retain_ttl,
            budget_bytes=config.retain_budget_bytes,
            user_budget_bytes=config.retain_user_budget_bytes,
            min_free_bytes=config.retain_min_free_bytes,
            lease_seconds=config.lease_seconds,
            max_lease_seconds=config.max_lease_seconds,
            max_leases=config.max_leases,
            revoke_grace=config.revoke_grace,
            restore_groups=config.restore_groups,
        ),
    )


def describe(config: Config) -> str:
    """The effective settings, for ``--check-config`` (what the daemon would run with)."""
    budget = f"{config.shm_budget_bytes} bytes ({format_size(config.shm_budget_bytes)})"
    max_bytes = "budget only" if config.max_bytes is None else format_size(config.max_bytes)
    lines = [
        f"configuration OK: {config.source or 'built-in defaults (no file)'}",
        f"  socket_path      {config.socket_path}",
        f"  allowed_users    {sorted(config.allowed_users)}",
        f"  allowed_groups   {sorted(config.allowed_groups)}",
        f"  operator_groups  {sorted(config.operator_groups)}",
        f"  shutdown_timeout {config.shutdown_timeout:g} s",
        f"  metrics_port     {config.metrics_port or 'off'}",
        f"  metrics_socket   {config.metrics_socket or 'off'}",
        f"  journal_dir      {config.journal_dir}"
        + (" (disk allowed)" if config.allow_disk_journal else ""),
        f"  shm_budget       {config.shm_budget} = {budget}",
        f"  per user         max_bytes {max_bytes}, max_segments {config.max_segments}, "
        f"max_layouts {config.max_layouts}, max_jobs {config.max_jobs}",
        f"                   max_connections {config.max_connections}, max_prepared "
        f"{config.max_prepared}, max_journal_bytes {format_size(int(config.max_journal_bytes))}, "
        f"max_buffered_bytes {format_size(int(config.max_buffered_bytes))}",
        f"  default_slots    {config.default_slots}",
        f"  size checks      every {config.size_check_interval:g} s",
        f"  retention        ttl {config.retain_ttl:g} s, budget {config.retain_budget} = "
        f"{format_size(config.retain_budget_bytes)} (per user {config.retain_user_budget} = "
        f"{format_size(config.retain_user_budget_bytes)}), min_free {config.retain_min_free} = "
        f"{format_size(config.retain_min_free_bytes)}; leases {config.lease_seconds:g} s "
        f"(at most {config.max_lease_seconds:g} s, {config.max_leases} per uid, revoked "
        f"{config.revoke_grace:g} s after their memory is due); "
        f"restore_groups {sorted(config.restore_groups)}, "
        f"publish_groups {sorted(config.publish_groups)}",
        f"  storage          writer_threads {config.writer_threads}, io_threads "
        f"{config.io_threads}, fsync {config.fsync}",
        f"  data writes      write_chunk {format_size(int(config.write_chunk))}, write_buffers "
        f"{format_size(int(config.write_buffers))}, direct_io "
        f"{'on' if config.direct_io else 'off'}",
        f"  log              level {config.log_level}, format {config.log_format}",
    ]
    lines += [f"warning: {w}" for w in config.warnings]
    return "\n".join(lines)


def activated_listener(sockets: list[socket.socket], path: Path) -> socket.socket | None:
    """Pick the control socket systemd passed; the rest are closed (we serve only one)."""
    if not sockets:
        return None
    chosen = unix_stream_listener(sockets, path) or unix_stream_listener(sockets)
    for sock in sockets:
        if sock is not chosen:
            sock.close()
    if chosen is None:
        raise StartupError(
            "socket activation passed no listening unix stream socket; check ListenStream= "
            "in shmstaged.socket"
        )
    actual = chosen.getsockname()
    if actual != str(path):
        log.warning(
            "serving the activated socket %s; [server] socket_path says %s — make them equal "
            "so clients that read the configuration find the daemon",
            actual,
            path,
        )
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = overrides_of(args)
    # Taken first and unset at once, so nothing we start later mistakes them for its own.
    passed = [] if args.check_config else listen_fds()
    try:
        config = load(args.config, overrides)
    except ConfigError as exc:
        print("shmstaged: configuration error; not starting:", file=sys.stderr)
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(describe(config))
        return 0
    early = EarlySignals()  # a stop or reload during start-up waits for the loop
    logsetup.configure(config.log_level, config.log_format)
    for warning in config.warnings:
        log.warning("%s", warning)
    notifier = Notifier(unset_environment=True)
    daemon = Daemon(settings_of(config))
    try:
        daemon.start(activated_listener(passed, config.socket_path))
    except StartupError as exc:
        log.error("%s", exc)
        return EXIT_STARTUP
    service = Service(
        daemon,
        notifier,
        config,
        functools.partial(load, args.config, overrides),
        settings_of,
        early,
    )
    status = asyncio.run(service.run())
    if daemon.abandoned_writers:
        # A writer is stuck in the kernel (hung storage): a normal exit would join its
        # thread forever. Everything it owed is journaled, so leave without it.
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""``shmstage``: the operator's command line (no torch, no daemon package; safe on any node).

``verify`` and ``ls`` read checkpoints; ``status`` and ``metrics`` ask the running daemon
over its socket; ``gc`` removes shared memory that dead daemons left behind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shmstage import checkpoint, instance, listing, orphans
from shmstage.control import ControlClient, ControlError
from shmstage.metrics import render
from shmstage.units import format_size

EXIT_DAEMON_UNREACHABLE = 3  # like `systemctl status` for a unit that is not running


# ------------------------------------------------------------------------------ verify


def _verify(args: argparse.Namespace) -> int:
    status = 0
    for path in args.paths:
        problems = checkpoint.verify(path)
        if problems:
            status = 1
            print(f"FAIL {path}", flush=True)
            for problem in problems:
                print(f"  {problem}")
        else:
            with checkpoint.Checkpoint(path) as ckpt:
                total = sum(ckpt.manifest.files.values())
                print(
                    f"OK   {path}: {len(ckpt.keys)} tensors, {total} bytes in "
                    f"{len(ckpt.manifest.files)} file(s), checksums match"
                )
    return status


# ---------------------------------------------------------------------------------- ls


def _ls(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        print(f"shmstage ls: {root} is not a directory", file=sys.stderr)
        return 2
    found = listing.scan(root, max_depth=args.depth)
    if args.json:
        json.dump([c.to_json() for c in found], sys.stdout, indent=1)
        print()
        return 0
    if not found:
        print(f"no checkpoints under {root}")
        return 0
    rows = [
        [
            "-" if c.step is None else str(c.step),
            c.state,
            format_size(c.bytes),
            str(c.files),
            _when(c.committed_unix),
            _relative(c.path, root),
        ]
        for c in found
    ]
    header, *lines = _table_lines(["STEP", "STATE", "SIZE", "FILES", "COMMITTED", "PATH"], rows)
    out = [header[2:]]
    for c, line in zip(found, lines, strict=True):
        out.append(line[2:])
        if c.state == listing.DAMAGED:  # its own line: a long reason would stretch the column
            out.append(f"    damaged: {c.problem}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root)) or "."
    except ValueError:
        return str(path)


def _when(unix: float | None) -> str:
    if unix is None:
        return "-"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")


# -------------------------------------------------------------------------------- gc


def _gc(args: argparse.Namespace) -> int:
    """Reap what dead daemons left; root may reap any user's, others only their own.

    With ``--checkpoints DIR``, also remove orphaned temporary files of saves that will
    never finish (``shmstage.orphans``) — none while a dead daemon's journal still owes a
    checkpoint, whose temporary files look orphaned until the next daemon reopens them; and
    the sweep itself asks the journals again before each removal, so a daemon that dies
    while it runs loses nothing either.
    """
    euid = os.geteuid()
    only_uid = None if euid == 0 else euid
    report = instance.reap(only_uid=only_uid, dry_run=args.dry_run)
    swept = None
    if args.checkpoints and not report.held:
        swept = orphans.sweep(
            [Path(p) for p in args.checkpoints],
            only_uid=only_uid,
            dry_run=args.dry_run,
            min_age=args.min_age,
        )
    if args.json:
        out = {**report.to_json(), "dry_run": args.dry_run}
        if args.checkpoints:
            out["temporary_files"] = None if swept is None else swept.to_json()
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(report.segments)} segment(s), {format_size(report.bytes)}, and "
        f"{len(report.locks)} lock(s) of {len(report.instances)} dead shmstaged instance(s)"
    )
    for held in sorted(report.held):
        jobs = report.owed.get(held, [])
        print(
            f"kept: shared memory of dead instance {held} — its journal "
            f"{report.journals.get(held, '?')} still owes {len(jobs)} acknowledged "
            f"checkpoint(s) ({', '.join(jobs[:3])}{', ...' if len(jobs) > 3 else ''}); the next "
            "shmstaged on that socket finishes them, then frees it"
        )
    if report.held:
        print(f"kept in all: {report.held_segments} segment(s), {format_size(report.held_bytes)}")
    if report.live:
        print(f"left alone: live instance(s) {', '.join(sorted(report.live))}")
    if report.skipped_other_uid:
        print(
            f"left alone: {report.skipped_other_uid} dead segment(s) of other users "
            "(run as root to remove them)"
        )
    if args.checkpoints:
        _print_swept(swept, verb)
    return 0


def _print_swept(swept: orphans.Swept | None, verb: str) -> None:
    if swept is None:
        print(
            "temporary files: none removed while a dead daemon's journal owes checkpoints "
            "(start shmstaged on its socket, then run gc again)"
        )
        return
    print(
        f"temporary files: {verb} {len(swept.removed)} orphaned ({format_size(swept.bytes)}); "
        f"left {swept.live} in use, {swept.young} younger than --min-age"
        + (f", {swept.owed} a daemon's journal still owes" if swept.owed else "")
        + (f", {swept.other_uid} of other users" if swept.other_uid else "")
    )
    for path in swept.removed:
        print(f"  {path}")


# ---------------------------------------------------------------------------- metrics


def _metrics(args: argparse.Namespace) -> int:
    try:
        with ControlClient(args.socket, timeout=args.timeout) as client:
            sys.stdout.write(render(client.metrics()))
    except ControlError as exc:
        print(f"shmstage metrics: {exc}", file=sys.stderr)
        return EXIT_DAEMON_UNREACHABLE
    return 0


# ----------------------------------------------------------------------------- status


def _status(args: argparse.Namespace) -> int:
    if not args.watch:
        try:
            with ControlClient(args.socket, timeout=args.timeout) as client:
                status = client.status()
        except ControlError as exc:
            print(f"shmstage status: {exc}", file=sys.stderr)
            return EXIT_DAEMON_UNREACHABLE
        if args.json:
            status = {**status, "clients": _other_clients(status)}
            json.dump(status, sys.stdout, indent=1, default=str)
            print()
        else:
            sys.stdout.write(format_status(status))
        return 0
    return _watch(args)


def _watch(args: argparse.Namespace) -> int:
    """Redraw every ``--interval`` seconds until Ctrl-C (or ``--count`` refreshes).

    One connection serves every refresh; when the daemon restarts, the next refresh
    reconnects, and meanwhile the screen says why it is not updating.
    """
    client: ControlClient | None = None
    tty = sys.stdout.isatty()
    refreshes = 0
    try:
        while args.count is None or refreshes < args.count:
            try:
                if client is None:
                    client = ControlClient(args.socket, timeout=args.timeout)
                text = format_status(client.status(), bars=True, width=_width())
            except ControlError as exc:
                if client is not None:
                    client.close()
                client = None
                text = f"shmstage status: {exc}\n(retrying every {args.interval:g} s)\n"
            sys.stdout.write(("\x1b[H\x1b[2J" if tty else "") + text + ("" if tty else "\n"))
            sys.stdout.flush()
            refreshes += 1
            if args.count is None or refreshes < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        if client is not None:
            client.close()
    return 0


def _width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _bar(fraction: float, width: int = 24) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + f"] {fraction * 100:5.1f}%"


def _rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:.2f} GB/s"


def format_status(status: dict[str, Any], *, bars: bool = False, width: int = 100) -> str:
    """The daemon's status as an operator reads it: summary, clients, jobs, errors."""
    out: list[str] = []
    s = status
    budget, used = s["shm_budget_bytes"], s["shm_reserved_bytes"]
    shm = s.get("shm", {})
    limits = s.get("limits", {})
    out.append(
        f"shmstaged {s['version']}  pid {s['pid']}  instance {s['instance']}  "
        f"up {_duration(s['uptime_seconds'])}" + ("  STOPPING" if s.get("stopping") else "")
    )
    socket_note = " (socket activation)" if s.get("activated") else ""
    out.append(f"socket     {s.get('socket', '?')}{socket_note}")
    out.append(f"config     {s.get('config') or 'built-in defaults'}")
    share = used / budget if budget else 0.0
    mine = s.get("restricted_to_uid")
    # an ordinary user sees its own figures only (the daemon sends no one else's)
    usage = f"{format_size(used)} of {format_size(budget)} budget" + (
        "" if mine is None else f" held by uid {mine}"
    )
    if bars:
        out.append(f"shm        {_bar(share)} {usage}")
    else:
        out.append(f"shm        {usage} reserved ({share * 100:.1f}%)")
    if shm:
        out.append(
            f"node       /dev/shm {format_size(shm['free_bytes'])} free of "
            f"{format_size(shm['total_bytes'])}; memory available "
            f"{format_size(shm['memory_available_bytes'])}"
        )
    if limits:
        max_bytes = limits["max_user_bytes"]
        out.append(
            "limits     per client: "
            + ("budget" if max_bytes >= 1 << 60 else format_size(max_bytes))
            + f", {limits['max_user_segments']} segments, {limits['max_user_layouts']} "
            f"layouts, {limits['max_user_jobs']} jobs; default slots "
            f"{limits.get('default_slots', '?')}"
        )
    recent = s.get("recent", {})
    totals = s.get("totals", {})
    if recent:
        out.append(
            f"recent     {recent['saves']} save(s), {format_size(recent['bytes'])} in the last "
            f"{_duration(recent['window_seconds'])}; writing at "
            f"{_rate(recent['write_bytes_per_second'])}"
        )
    if totals:
        out.append(
            f"totals     {totals.get('saves', 0)} saved ({format_size(totals.get('bytes', 0))}), "
            f"{totals.get('failed', 0)} failed" + ("" if mine is None else f" by uid {mine}")
        )
    out.append("")
    clients = _other_clients(s)
    out.append(f"CLIENTS ({len(clients)})")
    if clients:
        out.extend(
            _table_lines(
                ["ID", "PID", "UID", "LAYOUTS", "SEGMENTS", "BYTES", "JOBS", "CONNECTED", "NAME"],
                [
                    [
                        str(c["id"]),
                        str(c["pid"]),
                        str(c["uid"]),
                        str(c["layouts"]),
                        str(c["segments"]),
                        format_size(c["bytes"]),
                        str(c.get("jobs", 0)),
                        _duration(c.get("connected_seconds", 0.0)),
                        c.get("name", "?"),
                    ]
                    for c in clients
                ],
            )
        )
    out.extend(_memory_lines(s.get("memory")))
    out.extend(_channel_lines(s.get("channels")))
    out.append("")
    jobs = s.get("jobs", [])
    out.append(f"JOBS IN FLIGHT ({len(jobs)})")
    for j in jobs:
        total = j["bytes"]
        done = j.get("bytes_written", 0)
        fraction = done / total if total else 1.0
        progress = _bar(fraction) if bars else f"{fraction * 100:5.1f}%"
        out.append(
            f"  job {j['job']}  client {j['client']} (pid {j.get('client_pid', '?')})  "
            f"{progress}  {format_size(done)} / {format_size(total)}  "
            f"{j.get('phase', '?')}  {_duration(j['running_seconds'])}"
        )
        out.append(f"      {j.get('directory', '?')}/{j.get('data_file', '')}"[: width + 6])
    errors = s.get("errors", [])
    if errors:
        out.append("")
        out.append(f"RECENT ERRORS ({len(errors)})")
        for e in errors[-10:]:
            when = datetime.datetime.fromtimestamp(e["time_unix"]).strftime("%H:%M:%S")
            job = f" job {e['job']}" if e.get("job") is not None else ""
            line = f"  {when}{job} {e['client']}: [{e['code']}] {e['message']}"
            out.append(line if len(line) <= width else line[: width - 1] + "…")
    return "\n".join(out) + "\n"


def _memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """Checkpoints a restart can restore from the daemon's memory: each layout's newest,
    its owner, size and age; RETAINED ones outlived their trainer and expire."""
    if not memory:
        return []
    ttl = memory.get("ttl_seconds", 0)
    policy = (
        f"retention {format_size(memory.get('retained_bytes', 0))} of "
        f"{format_size(memory.get('budget_bytes', 0))}, ttl {_duration(ttl)}, "
        f"{memory.get('leases', 0)} lease(s)"
        if ttl
        else "retention off (ttl 0)"
    )
    checkpoints = memory.get("checkpoints", [])
    out = ["", f"CHECKPOINTS IN MEMORY ({len(checkpoints)}; {policy})"]
    if checkpoints:
        out.extend(
            _table_lines(
                ["UID", "JOB", "SIZE", "MEMORY", "AGE", "STATE", "EXPIRES", "LEASES", "PATH"],
                [
                    [
                        str(c["uid"]),
                        str(c["job"]),
                        format_size(c["bytes"]),
                        format_size(c.get("memory_bytes", 0)),
                        _duration(c.get("age_seconds", 0.0)),
                        ("retained" if c.get("retained") else "live")
                        + ("" if c.get("durable") else ", writing"),
                        "-" if c.get("expires_seconds") is None
                        else _duration(c["expires_seconds"]),
                        str(c.get("leases", 0)),
                        c.get("directory", "?"),
                    ]
                    for c in checkpoints
                ],
            )
        )
    return out


def _channel_lines(channels: list[dict[str, Any]] | None) -> list[str]:
    """Published channels (``Stager.publish``): each one's newest step, the versions and
    slots that hold them, readers' pins and subscribers, and the groups it is shared with."""
    if channels is None:  # a daemon from before channels were shown
        return []
    out = ["", f"CHANNELS ({len(channels)})"]
    if channels:
        out.extend(
            _table_lines(
                ["UID", "STEP", "VERSIONS", "SLOTS", "SIZE", "PINS", "SUBSCRIBERS", "SHARED",
                 "NAME"],
                [
                    [
                        str(c["uid"]),
                        "-" if c.get("newest_step") is None else str(c["newest_step"]),
                        str(c.get("versions", 0)),
                        str(c.get("slots", 0)),
                        format_size(c.get("bytes", 0)),
                        str(c.get("pins", 0)),
                        str(c.get("subscribers", 0)),
                        ",".join(str(gid) for gid in c.get("shared_gids", [])) or "-",
                        c.get("name", "?"),
                    ]
                    for c in channels
                ],
            )
        )
    return out


def _other_clients(status: dict[str, Any]) -> list[dict[str, Any]]:
    """This command's own connection is a client too; not what the operator asks about."""
    return [c for c in status.get("clients", []) if c.get("pid") != os.getpid()]


def _table_lines(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


# ------------------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmstage", description="Inspect shmstage checkpoints and the shmstaged service."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser(
        "verify", help="check that checkpoints are complete and every checksum matches"
    )
    verify.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint directory")
    verify.set_defaults(run=_verify)

    ls = commands.add_parser(
        "ls", help="list checkpoints under a directory: step, state, size, files"
    )
    ls.add_argument("dir", metavar="DIR")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("--depth", type=int, default=4, help="directory levels to search (4)")
    ls.set_defaults(run=_ls)

    def daemon_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--socket",
            type=Path,
            default=None,
            help="daemon socket (default: $SHMSTAGE_SOCKET, else the system socket when it "
            "exists, else the per-user path)",
        )
        sub.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")

    status = commands.add_parser(
        "status", help="what the daemon is doing: memory, clients, jobs, throughput, errors"
    )
    daemon_options(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--watch", action="store_true", help="refresh with progress bars")
    status.add_argument("--interval", type=float, default=1.0, help="--watch refresh (1 s)")
    status.add_argument("--count", type=int, default=None, help="--watch: stop after N")
    status.set_defaults(run=_status)

    metrics = commands.add_parser("metrics", help="the daemon's metrics, Prometheus text format")
    daemon_options(metrics)
    metrics.set_defaults(run=_metrics)

    gc = commands.add_parser(
        "gc", help="remove shared memory left by dead daemons (never a live daemon's)"
    )
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    gc.add_argument(
        "--checkpoints",
        nargs="+",
        metavar="DIR",
        default=[],
        help="also remove orphaned temporary files of dead saves below these directories "
        "(never one a live trainer or daemon holds)",
    )
    gc.add_argument(
        "--min-age",
        type=float,
        default=orphans.MIN_AGE_S,
        metavar="SECONDS",
        help=f"leave temporary files younger than this (default {orphans.MIN_AGE_S:g})",
    )
    gc.set_defaults(run=_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # `shmstage status --json | head`: end quietly on a closed pipe, as Unix tools do,
    # rather than with a BrokenPipeError traceback.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())

"""``shmstage-bench``: shmstage side by side with its peers and the physical limits.

All methods checkpoint the same synthetic state dict in the same process, one after the
other, into the same filesystem, so that the only thing that differs between rows is the
method. A method that fails or is not installed is a row saying so; the bench itself only
fails on bad arguments.

Some peers (nvidia-resiliency-ext) spawn worker processes with the ``spawn`` start
method, which re-imports the main module: run the bench through the ``shmstage-bench``
console script or ``python -m shmstage_client.bench``, both of which guard ``main()``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .peers import HUNG_THREADS, METHOD_NAMES, METHODS, BenchContext, MethodResult, measure
from .report import build_report, format_table, write_json, write_png
from .synthetic import (
    build_state_dict,
    format_bytes,
    parse_size,
    resolve_device,
    resolve_dtype,
    state_dict_bytes,
)

__all__ = ["main", "parse_args", "run"]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _methods(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHOD_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHOD_NAMES)}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; sizes accept units such as ``8GiB``, ``256MiB`` or ``1.5GB``."""
    p = argparse.ArgumentParser(
        prog="shmstage-bench",
        description="Measure checkpoint stall and time-to-durable for shmstage, its peers "
        "and the raw copy / write limits, on the same synthetic state dict.",
    )
    p.add_argument(
        "--total-bytes",
        type=_size,
        default=parse_size("1GiB"),
        help="total bytes of the state dict (default 1GiB)",
    )
    p.add_argument("--tensors", type=int, default=250, help="number of tensors (default 250)")
    p.add_argument(
        "--min-tensor-bytes",
        type=_size,
        default=parse_size("4KiB"),
        help="smallest tensor before scaling (default 4KiB)",
    )
    p.add_argument(
        "--max-tensor-bytes",
        type=_size,
        default=parse_size("256MiB"),
        help="largest tensor before scaling (default 256MiB)",
    )
    p.add_argument("--dtype", default="bf16", help="tensor dtype (default bf16)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the state dict lives (default: cuda if available)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for sizes and values")
    p.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a new temp dir)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measured saves per method after the first (median; default 3)",
    )
    p.add_argument(
        "--save-timeout",
        type=float,
        default=300.0,
        help="seconds one save may take before its method is reported as hung (default 300)",
    )
    p.add_argument(
        "--socket",
        default=None,
        help="socket of a running shmstaged (default: start one in a temp dir)",
    )
    p.add_argument("--slots", type=int, default=2, help="shmstage slots per Stager (default 2)")
    p.add_argument(
        "--methods",
        type=_methods,
        default=list(METHOD_NAMES),
        help=f"comma list of methods (default all: {','.join(METHOD_NAMES)})",
    )
    p.add_argument("--json", default=None, help="write the full report as JSON here")
    p.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-save progress lines")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.tensors < 1:
        p.error("--tensors must be at least 1")
    try:
        args.torch_dtype = resolve_dtype(args.dtype)
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> dict:
    """Build the state dict, measure every selected method, return the report."""
    device = resolve_device(args.device)

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    own_dir = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="shmstage-bench-")) if own_dir else Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    log(f"building {format_bytes(args.total_bytes)} in {args.tensors} tensors on {device}")
    state_dict = build_state_dict(
        args.total_bytes,
        args.tensors,
        args.min_tensor_bytes,
        args.max_tensor_bytes,
        dtype=args.torch_dtype,
        device=device,
        seed=args.seed,
    )
    total = state_dict_bytes(state_dict)
    ctx = BenchContext(device=device, root=root, socket=args.socket, slots=args.slots)
    results: list[MethodResult] = []
    try:
        for cls in METHODS:
            if cls.name in args.methods:
                log(f"{cls.name}: {cls.description}")
                results.append(measure(cls(ctx), state_dict, args.repeats, log, args.save_timeout))
    finally:
        ctx.close()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    config = {
        "total_bytes": total,
        "tensors": len(state_dict),
        "min_tensor_bytes": args.min_tensor_bytes,
        "max_tensor_bytes": args.max_tensor_bytes,
        "smallest_tensor_bytes": min(t.numel() * t.element_size() for t in state_dict.values()),
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in state_dict.values()),
        "dtype": args.dtype,
        "device": str(device),
        "seed": args.seed,
        "repeats": args.repeats,
        "dir": str(root),
        "socket": args.socket,
        "slots": args.slots,
        "methods": [c.name for c in METHODS if c.name in args.methods],
    }
    return build_report(results, config, total)


def _raise_fd_limit() -> None:
    """Peers that pass one descriptor per tensor (nvidia-resiliency-ext's queues) exhaust
    the default soft limit of 1024 at 10,000 tensors; give every method the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # as root the hard limit itself may rise, up to the kernel's nr_open
        with open("/proc/sys/fs/nr_open") as f:
            ceiling = min(int(f.read()), 1 << 20)
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, ceiling))
    except (OSError, ValueError):
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    """Console entry point; exits 0 even when methods failed, since those are results."""
    args = parse_args(argv)
    _raise_fd_limit()
    report = run(args)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"JSON written to {args.json}")
    if args.png:
        print(write_png(report, args.png))
    if HUNG_THREADS:  # a hung peer's threads would block interpreter exit forever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0

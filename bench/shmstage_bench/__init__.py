"""``shmstage-bench``: what a user of shmstage feels, next to its peers and the limits.

Scenarios (``--scenario``):

* ``peers`` (default): shmstage, ``torch.save``, DCP, nvidia-resiliency-ext, DLRover Flash
  Checkpoint and ML Flashpoint against the raw copy, the buffered write and the disk's
  direct-I/O limit, on one synthetic state dict; page-cache use per save; a fixed trainer
  step idle and while shmstaged persists. With ``--budget`` every method gets a share of
  it (the slow peers fewer repeats, said in their rows) and the closing limit bracket runs.
* ``overlapped``: each save issued while the previous one still persists (slots=2): the
  wall-clock stall per save, backpressure (slot waits) apart, against the raw copy.
* ``training``: a small Llama-style decoder trained with AdamW between saves; per-save
  stall breakdown, step time with and without a checkpoint in flight, every checkpoint
  compared bit-exact with the state at its call; ``--guard`` adds the non-blocking save.
* ``restore``: the restart story — host-to-device and disk-read limits, ``load()`` cold
  and warm, from the daemon's memory where the client can, and a trainer SIGKILLed after
  its checkpoint was acknowledged and restored by new processes, as they come and with
  ``prepare_restore`` called before they build the model.

Each measured part runs in its own process; the parent starts the daemon (as a root
container would: default paths) and always writes the text, the JSON and the chart.
Run it as the ``shmstage-bench`` console script or ``python -m shmstage_bench``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .isolation import describe_exception
from .report import Table, build_report, format_text, write_json, write_png
from .session import BenchSession
from .synthetic import parse_size, resolve_device, resolve_dtype

__all__ = ["SCENARIOS", "main", "parse_args", "run"]

Runner = Callable[[BenchSession], tuple[dict[str, Any], list[Table], list[str]]]


def _scenarios() -> dict[str, Runner]:
    from . import comparison, overlapped, restore, training

    return {
        "peers": comparison.run,
        "overlapped": overlapped.run,
        "training": training.run,
        "restore": restore.run,
    }


SCENARIOS = ("peers", "overlapped", "training", "restore")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _methods(text: str) -> list[str]:
    from .peers import available_methods

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = available_methods()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return names


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("all scenarios")
    g.add_argument("--scenario", choices=SCENARIOS, default="peers", help="default: peers")
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the state lives (default: cuda if available)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for sizes and values")
    g.add_argument("--dir", default=None, help="where checkpoints go (default: a new temp dir)")
    g.add_argument(
        "--socket",
        default=None,
        help="where the bench's shmstaged listens (default: the daemon's own default — "
        "/run/shmstage/shmstaged.sock as root, as in a container)",
    )
    g.add_argument(
        "--attach",
        action="store_true",
        help="use the shmstaged already listening at --socket instead of starting one",
    )
    g.add_argument("--slots", type=int, default=2, help="shmstage slots per Stager (default 2)")
    g.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds the whole run may take; parts that would exceed it become error rows "
        "and the report is still written (default: no limit)",
    )
    g.add_argument(
        "--start-method",
        choices=["forkserver", "spawn"],
        default="forkserver",
        help="how each part's process starts (default forkserver: a clean server that "
        "imported torch once)",
    )
    g.add_argument("--json", default=None, help="write the full report as JSON here")
    g.add_argument("--png", default=None, help="write a chart here (needs matplotlib)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _add_synthetic(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synthetic state (peers, overlapped, restore)")
    g.add_argument("--total-bytes", type=_size, default=parse_size("1GiB"), help="default 1GiB")
    g.add_argument("--tensors", type=int, default=250, help="number of tensors (default 250)")
    g.add_argument("--min-tensor-bytes", type=_size, default=parse_size("4KiB"))
    g.add_argument("--max-tensor-bytes", type=_size, default=parse_size("256MiB"))
    g.add_argument("--dtype", default="bf16", help="tensor dtype (default bf16)")


def _add_peers(p: argparse.ArgumentParser) -> None:
    from .peers import METHOD_NAMES

    g = p.add_argument_group("peers")
    g.add_argument(
        "--methods",
        type=_methods,
        default=None,
        help=f"comma list (default all: {','.join(METHOD_NAMES)}; a peer named here runs "
        "even beyond the tensor count it is known to cope with)",
    )
    g.add_argument("--repeats", type=int, default=3, help="saves after the first (median; 3)")
    g.add_argument(
        "--save-timeout",
        type=float,
        default=300.0,
        help="seconds one save may take before its method is reported as hung (default 300)",
    )
    g.add_argument(
        "--method-timeout",
        type=float,
        default=None,
        help="seconds one method's process may run in all before it is killed (default: "
        "300 + (repeats+1) × save timeout)",
    )
    g.add_argument("--direct-threads", type=int, default=4, help="O_DIRECT threads (default 4)")
    g.add_argument(
        "--direct-chunk", type=_size, default=parse_size("8MiB"), help="O_DIRECT chunk (8MiB)"
    )


def _add_sequence(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("overlapped and training")
    g.add_argument(
        "--saves",
        type=int,
        default=None,
        help="saves measured after the first (default: overlapped 6, training 4)",
    )
    g.add_argument(
        "--interval",
        type=float,
        default=None,
        help="overlapped: seconds between saves (default: 0.6 × one save's durable time, so "
        "each save is issued while the previous one persists)",
    )
    g.add_argument("--guard", action="store_true", help="training: also run with guard()")
    g.add_argument(
        "--reserve",
        action="store_true",
        help="training: also run with stager.reserve(state) before the loop",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="training: steps between saves (default: about 0.6 × the write, in steps)",
    )
    g.add_argument("--dim", type=int, default=None, help="training: model width")
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--ffn", type=int, default=None)
    g.add_argument("--vocab", type=int, default=None)
    g.add_argument("--seq", type=int, default=None)
    g.add_argument("--batch", type=int, default=None)
    g.add_argument("--micro-batches", type=int, default=None, help="fwd+bwd per optimizer step")
    g.add_argument(
        "--part-timeout",
        type=float,
        default=600.0,
        help="seconds one part's process may run (overlapped, training, restore; default 600)",
    )


def _add_restore(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("restore")
    g.add_argument(
        "--drop-caches",
        choices=["auto", "fadvise", "none"],
        default="auto",
        help="how the cold load drops the page cache: fadvise(DONTNEED) on the files, plus "
        "/proc/sys/vm/drop_caches as root (auto); fadvise only; or not at all",
    )
    g.add_argument(
        "--restores",
        type=int,
        default=3,
        help="restores from memory timed in the bench's process, and restarted processes "
        "after the SIGKILL, each row their median (default 3)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; sizes accept units such as ``8GiB``, ``256MiB`` or ``1.5GB``."""
    p = argparse.ArgumentParser(
        prog="shmstage-bench",
        description="Measure what a trainer feels from a checkpoint — stall, time to "
        "durable, restore — for shmstage, its peers and the physical limits.",
    )
    _add_common(p)
    _add_synthetic(p)
    _add_peers(p)
    _add_sequence(p)
    _add_restore(p)
    args = p.parse_args(argv)
    args.methods_named = args.methods is not None
    if args.methods is None:
        from .peers import METHOD_NAMES

        args.methods = list(METHOD_NAMES)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.tensors < 1:
        p.error("--tensors must be at least 1")
    if args.saves is not None and args.saves < 2:
        p.error("--saves must be at least 2 (a steady figure needs more than one)")
    if args.direct_chunk % 4096:
        p.error("--direct-chunk must be a multiple of 4096")
    try:
        resolve_dtype(args.dtype)
        args.torch_device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))
    args.device = args.torch_device.type
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario; the report is built whatever its parts did."""
    with BenchSession(args) as session:
        try:
            config, tables, notes = _scenarios()[args.scenario](session)
        except Exception as exc:  # a bench bug still ends in a report that says so
            config, notes = {"what": "the scenario itself failed"}, []
            row = {
                "name": args.scenario,
                "status": "error",
                "error": describe_exception(exc),
                "traceback": traceback.format_exc(limit=-10),
            }
            tables = [Table("failure", "Scenario failure", [], rows=[row])]
        daemon = session.daemon_report()
    config.setdefault("device", args.device)
    config["budget_s"] = args.budget
    return build_report(args.scenario, config, tables, daemon=daemon, notes=notes)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; exits 0 even when parts failed, since those are results."""
    args = parse_args(argv)
    report = run(args)
    print(format_text(report), flush=True)
    if args.json:
        try:
            write_json(report, args.json)
            print(f"JSON written to {args.json}")
        except OSError as exc:
            print(f"JSON not written: {exc}")
    if args.png:
        print(write_png(report, args.png))
    sys.stdout.flush()
    return 0

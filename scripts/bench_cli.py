"""What the GPU bench scripts share: the options of their command lines, and the process
group of a run that may or may not be under torchrun.

Imported by ``dcp_gpu_bench.py``, ``torchtitan_gpu_bench.py``, ``lightning_gpu_bench.py``
and ``hf_gpu_bench.py`` (their own folder is first on ``sys.path`` when they run as
``python3 scripts/NAME.py`` or under torchrun), so that an option means the same in each
and a fix to one is a fix to all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def parser_for(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the script docstring's first paragraph."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_sizes(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """One integer option per keyword (``kv_heads`` is ``--kv-heads``): the model's sizes."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


# ------------------------------------------- one process training a model (Lightning, HF)


def add_trainer_options(
    parser: argparse.ArgumentParser, methods: Sequence[str], *, save_every: int, saves: int
) -> None:
    """The options of a one-process trainer bench: ``--tiny``, how often and how many
    saves, which methods, and where checkpoints, the daemon and the report are."""
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--save-every", type=int, default=save_every)
    parser.add_argument("--saves", type=int, default=saves, help="per method, the first included")
    parser.add_argument("--methods", nargs="+", choices=methods, default=list(methods))


def add_output_options(parser: argparse.ArgumentParser, out_default: str) -> None:
    """``--out``, ``--socket`` and ``--json`` of a one-process trainer bench."""
    where = f"where checkpoints go (default: {out_default})"
    parser.add_argument("--out", default=None, help=where)
    parser.add_argument("--socket", default=None, help="a running shmstaged (default: start one)")
    parser.add_argument("--json", default=None, help="also write the results here")


@contextlib.contextmanager
def trainer_run(
    args: argparse.Namespace, prefix: str, parent: str | None = None
) -> Iterator[tuple[str, Path, str | None]]:
    """The device, checkpoint folder and shmstaged socket of a one-process trainer bench.

    The CPU with ``--tiny`` or without CUDA; ``--out`` or a new temporary folder (removed
    at the end); ``--socket`` or, when a shmstage method runs, a private daemon started
    here and stopped at the end, however the run ends.
    """
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    out = Path(args.out or tempfile.mkdtemp(prefix=prefix, dir=parent))
    out.mkdir(parents=True, exist_ok=True)
    daemon = None
    sock = args.socket
    if any(m.startswith("shmstage") for m in args.methods) and sock is None:
        from shmstage_bench.daemon import PrivateDaemon

        daemon = PrivateDaemon()
        sock = daemon.start()
    try:
        yield device, out, sock
    finally:
        if daemon is not None:
            daemon.stop()
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


def shrink_if_tiny(args: argparse.Namespace, **tiny: int) -> argparse.Namespace:
    """With ``--tiny``, these sizes instead of the command line's (a check on any CPU)."""
    if args.tiny:
        for name, value in tiny.items():
            setattr(args, name, value)
    return args


# ---------------------------------------------- ranks under torchrun (DCP, torchtitan)


def add_rank_options(
    parser: argparse.ArgumentParser,
    methods: Sequence[str],
    *,
    directory: str,
    timeout: float,
    device_help: str | None = None,
    dir_help: str | None = None,
    daemon_help: str | None = None,
) -> None:
    """The options of a bench whose ranks may run under torchrun: device, methods (a comma
    list), where checkpoints go, this node's daemon, slots, report and a save's timeout."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help=device_help)
    parser.add_argument("--methods", default=",".join(methods))
    parser.add_argument("--dir", default=directory, help=dir_help)
    parser.add_argument("--socket", default=None, help="this node's shmstaged socket")
    parser.add_argument("--start-daemon", action="store_true", help=daemon_help)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the report here (rank 0)")
    parser.add_argument("--timeout", type=float, default=timeout, help="per save, seconds")


def parse_rank_options(
    parser: argparse.ArgumentParser, methods: Sequence[str], argv: list[str] | None
) -> argparse.Namespace:
    """Parse, with ``--methods`` split and checked and ``--device`` cuda where there is one."""
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(methods)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(methods)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def init_distributed(device: str, timeout: float) -> None:
    """The default process group: torchrun's world, or a world of one on a free port
    (so that the same script runs with or without torchrun); NCCL for CUDA tensors and
    gloo for the CPU's."""
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(seconds=timeout))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))

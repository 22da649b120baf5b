"""``shmstage``: the operator's command line (no torch; safe on any node)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shmstage import checkpoint


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())

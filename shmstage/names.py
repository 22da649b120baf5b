"""File names inside a checkpoint directory, and the rules that keep writes inside it.

The daemon never resolves a path a user supplied: it works relative to a directory
descriptor the client opened, on plain names that these rules accept — no separators, no
``.``/``..``, nothing ending in ``.safetensors`` unless it is complete.
"""

from __future__ import annotations

import secrets
from typing import Final

TEMP_SUFFIX: Final = ".shmstage-tmp"
MAX_NAME_BYTES: Final = 255


class NameError_(ValueError):
    """A file name that could escape the checkpoint directory or look complete too early."""


def check_plain_name(name: str, *, what: str) -> str:
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\0" in name
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
    ):
        raise NameError_(f"{what} {name!r:.80} is not a plain file name")
    return name


def temp_name(final: str) -> str:
    """A hidden, unguessable name that never ends in the final name's suffix."""
    return f".{final}.{secrets.token_hex(8)}{TEMP_SUFFIX}"


def check_temp_name(name: str, final: str) -> str:
    check_plain_name(name, what="temporary file")
    if not (name.startswith(f".{final}.") and name.endswith(TEMP_SUFFIX)):
        raise NameError_(f"temporary file {name!r:.80} does not belong to {final!r}")
    return name


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)

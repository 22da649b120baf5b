"""Human-readable byte sizes, shared by the daemon's configuration and the client's CLI.

Operators write budgets the way `df -h` and `free` print them ("64GiB", "512 MiB"), so the
configuration accepts that form instead of forcing byte counts with twelve digits. Binary
(KiB, MiB, ...) and decimal (KB, MB, ...) suffixes both exist in the wild and mean different
things; we honour each literally rather than guessing, because a 7% error on a shared-memory
budget is the difference between fitting a checkpoint and a SIGBUS.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["format_size", "parse_size"]

_MULTIPLIERS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}

_SIZE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")

ACCEPTED_UNITS = "B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB, PB"


def parse_size(value: int | str) -> int:
    """Return the number of bytes that `value` ("64GiB", "1.5 GB", "4096", 4096) denotes.

    Suffixes are case-insensitive but never ambiguous: "G"/"M" alone are rejected because
    half of the tools an operator copies numbers from mean 2**30 by them and half 10**9.
    Fractions are allowed with a suffix and must come out as a whole number of bytes.

    Raises ValueError with a message that lists the accepted forms.
    """
    if isinstance(value, bool):  # bool is an int subclass; `true` is never a size
        raise ValueError(f"expected a size, got a boolean ({value!r})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f'expected a size (integer bytes or a string like "64GiB"), got {value!r}')
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse size {value!r}: "
            f"expected a number with an optional unit ({ACCEPTED_UNITS})"
        )
    unit = match["unit"].lower()
    if unit not in _MULTIPLIERS:
        raise ValueError(
            f"unknown unit {match['unit']!r} in size {value!r} (accepted: {ACCEPTED_UNITS})"
        )
    try:
        number = Decimal(match["num"])
    except InvalidOperation as exc:  # pragma: no cover - the regex already guarantees digits
        raise ValueError(f"cannot parse size {value!r}") from exc
    total = number * _MULTIPLIERS[unit]
    if total != total.to_integral_value():
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(total)


def format_size(nbytes: int) -> str:
    """Render a byte count with the largest binary unit that keeps it readable ("24.0 GiB").

    Used in error messages next to the raw byte count, so rounding here never hides the
    exact figure from the operator.
    """
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover

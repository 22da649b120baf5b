"""CRC-32C of many buffers at memory speed: pieces checksummed on several threads, combined.

A checkpoint records one CRC-32C per tensor. Verifying a restore tensor by tensor on one
thread runs at the speed of one core (about 11 GB/s with SSE4.2), slower than the copy to a
GPU it has to keep up with. Here every buffer is cut into pieces of at most ``PIECE_BYTES``,
small buffers are batched so that a task is never trivially small, tasks run on a thread
pool (``crc32c`` releases the GIL), and the pieces' checksums are combined into the
buffer's own with ``combine`` — the CRC of a concatenation from the CRCs of its parts, the
way zlib's ``crc32_combine`` does it for CRC-32 (the arithmetic is polynomial
multiplication modulo the CRC's polynomial, and does not care which polynomial it is).
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable, Sequence
from typing import Final

import crc32c

#: CRC-32C (Castagnoli), bit-reflected.
_POLY: Final = 0x82F63B78
#: Work per task: large enough that thread hand-offs cost nothing next to the checksum.
PIECE_BYTES: Final = 32 << 20


def _times_x(value: int) -> int:
    return (value >> 1) ^ _POLY if value & 1 else value >> 1


def _bitwise_times_x4(nibble: int) -> int:
    for _ in range(4):
        nibble = _times_x(nibble)
    return nibble


#: What multiplying by x^4 adds for each value of the low four bits (reflected: the bits
#: that shift out).
_TIMES_X4: Final = [_bitwise_times_x4(nibble) for nibble in range(16)]


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, both in the reflected representation.

    Four bits of ``a`` at a time (Horner's rule, from its highest powers, bits 0-3), with
    a table of ``b``'s 16 products with polynomials below x^4: ~3x faster in Python than
    bit by bit, which set the cost of combining a restore's parts.
    """
    b1 = _times_x(b)
    b2 = _times_x(b1)
    base = (_times_x(b2), b2, b1, b)  # bit i of a nibble (from its low end): x^(3 - i)
    table = [0] * 16
    for nibble in range(1, 16):
        low = nibble & -nibble
        table[nibble] = table[nibble ^ low] ^ base[low.bit_length() - 1]
    product = 0
    for shift in range(0, 32, 4):
        product = (product >> 4) ^ _TIMES_X4[product & 15] ^ table[(a >> shift) & 15]
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial for k in 0..63 (x^1 is 1 << 30 when reflected).

    All 64 of them: zlib's CRC-32 reuses the first 32 (x^(2^32) is x again modulo its
    polynomial), but modulo CRC-32C's it is not, and wrapping gave wrong checksums for
    parts of 512 MiB or more.
    """
    table = [1 << 30]
    for _ in range(63):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X2N: Final = _powers()
#: x^0, the multiplicative identity, in the reflected representation.
_ONE: Final = 1 << 31


@functools.cache
def _digit_powers() -> list[list[int]]:
    """x^(8 * d * 16^k) modulo the polynomial for every hexadecimal digit d (row k) of a
    length in bytes below 2^64: a shift then takes one product per nonzero digit, not one
    per set bit (a 16 MiB restore combines ~1,000 parts; 0.1 ms each per bit cost 13-23 ms
    of a new process's restore)."""
    table = []
    for k in range(16):
        step, row = _X2N[3 + 4 * k], [_ONE]  # x^(8 * 16^k) = x^(2^(3 + 4k))
        for _ in range(15):
            row.append(_multiply(row[-1], step))
        table.append(row)
    return table


@functools.lru_cache(maxsize=4096)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: appending ``nbytes`` bytes to a message."""
    if nbytes >= 1 << 64:
        raise ValueError(f"cannot combine checksums over {nbytes} bytes (2^64 or more)")
    power, digits = _ONE, _digit_powers()
    for row in digits:
        if not nbytes:
            break
        if nbytes & 15:
            power = _multiply(row[nbytes & 15], power)
        nbytes >>= 4
    return power


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of A followed by B, from the CRC of A, the CRC of B and B's length."""
    return _multiply(_shift(len_b), crc_a) ^ crc_b


def expect_combines(lengths: Iterable[int]) -> None:
    """Do now the arithmetic that combining over these lengths of B will need (~40 us of
    Python per length not seen before), for a caller with time to spare before the
    combining (a restore, while its readers wait for their staging)."""
    for length in lengths:
        _shift(length)


def checksums(
    buffers: Sequence[memoryview],
    pool: concurrent.futures.Executor | None = None,
    *,
    piece: int = PIECE_BYTES,
) -> list[int]:
    """The CRC-32C of every buffer, computed on ``pool`` (in this thread without one)."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    tasks: list[list[tuple[int, int, int]]] = [[]]
    load = 0
    for index, view in enumerate(views):
        for start in range(0, max(len(view), 1), piece):
            end = min(start + piece, len(view))
            if load and load + end - start > piece:
                tasks.append([])
                load = 0
            tasks[-1].append((index, start, end))
            load += end - start

    def run(task: list[tuple[int, int, int]]) -> list[int]:
        return [crc32c.crc32c(views[i][start:end]) for i, start, end in task]

    if pool is None or len(tasks) == 1:
        results = [run(task) for task in tasks]
    else:
        results = list(pool.map(run, tasks))
    totals = [0] * len(views)
    started = [False] * len(views)
    for task, values in zip(tasks, results, strict=True):
        for (index, start, end), value in zip(task, values, strict=True):
            if started[index]:
                totals[index] = combine(totals[index], value, end - start)
            else:
                totals[index], started[index] = value, True
    return totals

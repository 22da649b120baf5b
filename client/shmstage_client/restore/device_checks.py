"""CRC-32C of tensors already on a device, computed there: a restore reads its bytes once.

A restore from the daemon's memory copies each chunk into a pinned buffer and the device
copies it from there. Checksumming those buffers on the host reads them a second time, and
on the GPU hosts the copy out of shared memory, the device's reads and the checksums'
together run at the host's memory bandwidth: a verified restore of 8 GiB took 2.0x the
raw pinned copy, an unverified one 1.6x. Here the device checks the bytes it received.
Measured, that frees the host's cores (1.5-1.8 core-seconds per 8 GiB become 0.25) but did
not shorten a restore beyond the VMs' noise, so ``transfer`` uses it only when asked
(``SHMSTAGE_DEVICE_CHECKSUMS=1``) and only once ``warm_up`` has loaded its kernels.

A CRC with zero initial value is linear over GF(2) in the message's bits, so every piece
of the arithmetic is a 0/1 matrix product, which a device does with integer matrix
multiplication (``torch._int_mm``), exactly:

- A tensor is cut into blocks of ``BLOCK`` bytes aligned to its *end*; its first block is
  padded in front with zeros, which leave a zero-initialised CRC unchanged.
- Each block's own CRC is one product: its bits times a (8 * BLOCK) x 32 matrix.
- A block's part in its tensor's CRC is its own CRC carried past the blocks after it: the
  CRC register advanced by ``d`` zero bytes, a 32 x 32 matrix, applied by the binary digits
  of ``d`` (the matrices for 2^k bytes, each the square of the one before).
- A tensor's CRC is the sum modulo 2 of its blocks' parts, plus the standard initial value
  ~0 carried past the whole tensor, plus the final ~0.

The blocks are checked batch by batch as the bytes arrive (``advance``), on a stream of
their own, so the work overlaps the copies still in flight; ``finish`` does the carrying
and summing for all tensors at once and brings back one 32-bit value per tensor. On the
CPU the same code runs (the tests check it there against the ``crc32c`` library).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Final

import crc32c
import torch

from shmstage.checksums import combine

log = logging.getLogger("shmstage.client")

#: Bytes per block: one row of the block product (8 * BLOCK bits). Larger blocks mean
#: fewer rows to carry; a tensor's zero padding is at most one block.
BLOCK: Final = 4096
_BLOCK_BITS: Final = BLOCK.bit_length() - 1
#: Rows per batch: 8,192 rows of 4 KiB is 32 MiB of checkpoint, 256 MiB of unpacked bits.
BATCH_ROWS: Final = 8192
#: Device memory a check needs besides the restored bytes: the unpacked bits of a batch
#: and the block product's result; ``reserve`` adds ~320 bytes per block (its 32 bits as
#: int32, and the carrying's temporaries): ~8% of the bytes checked.
WORKING_BYTES: Final = BATCH_ROWS * BLOCK * 9


def reserve(nbytes: int) -> int:
    """Device memory a check of ``nbytes`` of tensors takes on top of the tensors."""
    return WORKING_BYTES + (nbytes // BLOCK + 1) * 32 * 10


def _bits(value: int) -> list[int]:
    return [(value >> q) & 1 for q in range(32)]


def _advance_bytes(value: int, nbytes: int) -> int:
    """The (zero-initialised) CRC register after ``nbytes`` more zero bytes."""
    return combine(value, 0, nbytes)


@functools.lru_cache(maxsize=4)
def tables(device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The block matrix (8 * BLOCK x 32: rows bit k of byte p at k * BLOCK + p) and the carry
    matrices for 2^k bytes, k in 0..47, as int8 on ``device``: made once per process
    (20-40 ms, on the host, then copied; ``warm_up`` makes them)."""
    one_byte = torch.tensor(
        [_bits(_advance_bytes(1 << q, 1)) for q in range(32)], dtype=torch.int32
    )
    carries = [one_byte]
    for _ in range(47):
        carries.append((carries[-1] @ carries[-1]) & 1)
    # the CRC of a lone byte with bit k set is the register (1 << k) advanced one byte
    # (row k of one_byte); in block position p it is carried past the BLOCK - 1 - p bytes
    # after it
    behind = one_byte[:8].unsqueeze(0)  # [distance 0, 8 bits of the byte, 32]
    for k in range(_BLOCK_BITS):  # distances 0 .. BLOCK - 1 by doubling
        behind = torch.cat([behind, (behind @ carries[k]) & 1])
    by_position = behind.flip(0)  # position p is distance BLOCK - 1 - p
    # rows in the order of the unpacked block: the byte planes k = 0..7, each all positions
    block_matrix = by_position.permute(1, 0, 2).reshape(8 * BLOCK, 32).to(torch.int8)
    return _column_major(block_matrix, device), [
        _column_major(c.to(torch.int8), device) for c in carries
    ]


_WARM: set[torch.device] = set()
_WARMING: set[torch.device] = set()
_WARM_LOCK = threading.Lock()


def ready(device: torch.device) -> bool:
    """Whether this process can check on ``device`` at once: its kernels are loaded."""
    return device_key(device) in _WARM


def device_key(device: torch.device) -> torch.device:
    """``device`` with its index: the key per device of what a process has warmed up."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def warm_up(device: torch.device) -> None:
    """Make the tables and load every kernel a check uses, by checking a full batch (the
    block product picks its kernel by shape) and a small one, both with padded heads, and
    comparing with the host's checksums."""
    device = device_key(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return  # torch._int_mm needs int8 tensor cores: such a device is never ready
    tables(device)
    size = (BATCH_ROWS + 3) * BLOCK
    pattern = (torch.arange(size, dtype=torch.int32, device=device) % 251).to(torch.uint8)
    ranges = [(BLOCK + 1, BATCH_ROWS * BLOCK - 3), ((BATCH_ROWS + 2) * BLOCK, 5)]
    got = DeviceChecksums(pattern, ranges, torch.cuda.Stream(device)).finish()
    host = pattern.cpu().numpy()
    if got != [crc32c.crc32c(host[offset : offset + n]) for offset, n in ranges]:
        raise RuntimeError(f"checksums on {device} disagree with the host's: not used")
    _WARM.add(device)


def warm_up_later(device: torch.device) -> None:
    """``warm_up`` on a thread of its own, once per device."""
    device = device_key(device)
    with _WARM_LOCK:
        if device in _WARM or device in _WARMING:
            return
        _WARMING.add(device)

    def run() -> None:
        try:
            warm_up(device)
        except Exception as exc:  # the host keeps checking
            log.warning("checksums on %s stay on the host: %s", device, exc)

    # not a daemon thread: one stopped inside a CUDA call at the interpreter's exit aborts
    # the process ("terminate called without an active exception"); exit waits for it
    threading.Thread(target=run, name="shmstage-check-warm-up").start()


def _column_major(matrix: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The right operand as cuBLASLt's int8 products take it (transposed in memory)."""
    return matrix.t().contiguous().to(device).t()


def _product(bits: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``bits @ matrix`` in int32, exactly (int8 operands; at least 17 rows)."""
    rows = bits.shape[0]
    if rows <= 16:
        bits = torch.cat([bits, bits.new_zeros(17 - rows, bits.shape[1])])
    return torch._int_mm(bits, matrix)[:rows]


class DeviceChecksums:
    """CRC-32C of byte ranges of one 1-D uint8 buffer on a device, on that device.

    ``ranges`` are (offset, length) pairs in ascending offset order, not overlapping. The
    buffer must hold ``BLOCK`` bytes of slack before the first range's offset (a head
    block reads there, masked). ``advance(ready)`` promises that bytes below ``ready`` are
    in place once ``event`` has completed; ``finish`` returns each range's CRC-32C.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        ranges: Sequence[tuple[int, int]],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        if ranges and ranges[0][0] < BLOCK:
            raise ValueError(f"the first range starts at {ranges[0][0]}, inside the slack")
        for (before, length), (offset, _) in itertools.pairwise(ranges):
            if offset < before + length:
                raise ValueError(f"the range at {offset} overlaps the one at {before}")
        self.device = buffer.device
        self._stream = stream
        self._block_matrix, self._carries = tables(self.device)
        self._lengths = [length for _, length in ranges]
        counts = [-(-length // BLOCK) for length in self._lengths]
        self._ends = [offset + length for offset, length in ranges]
        #: Per range, its first row and the end of its rows.
        self._first: list[int] = []
        total = 0
        for count in counts:
            self._first.append(total)
            total += count
        self.rows = total
        self._done = 0
        self._max_distance = max(counts, default=1) - 1
        with self._on_stream():
            self._build_rows(buffer, counts)

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _build_rows(self, buffer: torch.Tensor, counts: list[int]) -> None:
        """Per row (block): where it starts, its zero padding, its distance (in blocks)
        from its range's end and its range, built on the device without a sync."""
        device, total = self.device, self.rows
        count = torch.tensor(counts, dtype=torch.int64, device=device)
        end = torch.tensor(self._ends, dtype=torch.int64, device=device)
        length = torch.tensor(self._lengths, dtype=torch.int64, device=device)
        first = torch.tensor(self._first, dtype=torch.int64, device=device)
        self._range = torch.repeat_interleave(
            torch.arange(len(counts), device=device), count, output_size=total
        )
        index = torch.arange(total, dtype=torch.int64, device=device) - first[self._range]
        self._distance = count[self._range] - 1 - index
        self._start = end[self._range] - (self._distance + 1) * BLOCK
        pad = count * BLOCK - length
        self._pad = torch.where(index == 0, pad[self._range], 0).to(torch.int32)
        #: Rows whose block has padding: those need masking (on the host, for batching).
        self._padded = [
            self._first[i] for i, c in enumerate(counts) if c and c * BLOCK != self._lengths[i]
        ]
        self._blocks = buffer.as_strided((max(0, buffer.numel() - BLOCK + 1), BLOCK), (1, 1))
        self._level = torch.zeros(total, 32, dtype=torch.int32, device=device)
        self._length = length
        self._padded_rows = torch.tensor(self._padded, dtype=torch.int64, device=device)
        self._column = torch.arange(BLOCK, dtype=torch.int32, device=device)
        self._shifts = torch.arange(8, dtype=torch.int64, device=device).view(1, 8, 1)

    def rows_before(self, ready: int) -> int:
        """How many rows (in order) lie wholly below byte ``ready``."""
        i = bisect.bisect_right(self._ends, ready)
        if i == len(self._ends):
            return self.rows
        # range i is cut by ``ready``: its blocks end at end - k * BLOCK, k = 0..count-1
        behind = -(-(self._ends[i] - ready) // BLOCK)
        count = (self._first[i + 1] if i + 1 < len(self._first) else self.rows) - self._first[i]
        return self._first[i] + max(0, count - behind)

    def advance(self, ready: int, event: torch.cuda.Event | None = None) -> None:
        """Checksum the blocks below byte ``ready`` not done yet (queued on the stream,
        after ``event``)."""
        upto = self.rows_before(ready)
        if upto <= self._done:
            return
        with self._on_stream():
            if event is not None and self._stream is not None:
                self._stream.wait_event(event)
            while self._done < upto:
                stop = min(upto, self._done + BATCH_ROWS)
                self._batch(self._done, stop)
                self._done = stop

    def _batch(self, lo: int, hi: int) -> None:
        blocks = self._blocks.index_select(0, self._start[lo:hi])
        first, last = (bisect.bisect_left(self._padded, row) for row in (lo, hi))
        if last > first:  # zero the bytes before each padded head block's range
            heads = self._padded_rows[first:last] - lo
            masked = blocks.index_select(0, heads)
            masked.masked_fill_(self._column < self._pad[lo + heads, None], 0)
            blocks.index_copy_(0, heads, masked)
        # plane k holds every byte shifted right by k, 8 bytes to a word: bit 0 of each
        # byte is then its bit k (what crosses from the next byte lands above bit 0), and
        # the parity of a product's sum depends only on its terms' bit 0
        words = blocks.view(torch.int64).view(hi - lo, 1, BLOCK // 8)
        planes = torch.bitwise_right_shift(words, self._shifts).view(torch.int8)
        sums = _product(planes.view(hi - lo, 8 * BLOCK), self._block_matrix)
        torch.bitwise_and(sums, 1, out=self._level[lo:hi])

    def finish(self) -> list[int]:
        """Each range's CRC-32C (waits for the device)."""
        self.advance(1 << 62)
        with self._on_stream():
            level = self._level.to(torch.int8)
            distance = self._distance
            for k in range(max(self._max_distance, 0).bit_length()):
                carried = _product(level, self._carries[k + _BLOCK_BITS]).bitwise_and_(1)
                chosen = (torch.bitwise_right_shift(distance, k) & 1).bool()[:, None]
                level = torch.where(chosen, carried.to(torch.int8), level)
            ranges = len(self._lengths)
            total = torch.zeros(ranges, 32, dtype=torch.int32, device=self.device)
            total.index_add_(0, self._range, level.to(torch.int32))  # sums of 0/1
            # the initial ~0 carried past each range's bytes
            initial = torch.ones(ranges, 32, dtype=torch.int8, device=self.device)
            for k in range(max(self._lengths, default=0).bit_length()):
                carried = _product(initial, self._carries[k]).bitwise_and_(1)
                chosen = (torch.bitwise_right_shift(self._length, k) & 1).bool()[:, None]
                initial = torch.where(chosen, carried.to(torch.int8), initial)
            crc = ((total & 1) ^ initial.to(torch.int32) ^ 1).to(torch.int64)
            weights = torch.bitwise_left_shift(
                torch.ones(32, dtype=torch.int64, device=self.device),
                torch.arange(32, dtype=torch.int64, device=self.device),
            )
            values = (crc * weights).sum(1)
        if self._stream is not None:
            self._stream.synchronize()
        return [int(v) for v in values.cpu().tolist()]

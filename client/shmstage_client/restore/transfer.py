"""Bytes to tensors on a device: large pieces, several threads, verified as they pass.

Restoring a checkpoint moves its bytes from host memory — the daemon's segments, read
through their descriptors or mapped read-only, or a data file's pages — to a device, and
checks every tensor against the CRC-32C its manifest recorded. Tensor by tensor, on one
thread, that runs at the speed of one core and of one small copy at a time (a 4 GiB
``load()`` reached 4 GB/s to an H200).

Here the source is cut into chunks of 16 MiB. Several threads each take the next chunk
and, on the CPU, read it straight into the destination; for a device, through a pinned
piece of its own (``_Relay``): read the chunk into it (for a file or the segments'
descriptors, a read; for a mapping, a memcpy) and checksum it in the same pass, a MiB at a
time while it is in the core's cache (``shmstage.readsum``; where that is not built, in a
second pass while the device copies), queue its copy to the device on one stream, and
wait for that copy only when the piece is next refilled (the other readers' pieces keep
the device busy meanwhile). The pieces
are few and reused at once, so they stay in the processor's cache and the host reads
memory once per byte, mostly: a restarted trainer's restore of 8 GiB from the daemon's
memory went from 2.49-2.67x the raw copy to 2.08-2.33x on an H200 VM and from 2.51x to
2.34x on an H100 VM (alternating; docs/performance.md), where 16 MiB chunks through 18
buffers had written and reread 288 MiB. The tensors come
back as views of one destination buffer at their offsets (a tensor that is not aligned
for its dtype there gets its own copy). A tensor's checksum is continued across a
chunk's pieces and combined across chunks (``shmstage.checksums.combine``), in whatever
order threads finished. Asked to (``DEVICE_CHECKSUMS``), a process that has restored to
a GPU twice checks there instead (``device_checks``, ``_DeviceCheck``): the readers
then only read and queue.

Copying the daemon's segments through the pinned buffers beat registering them with CUDA
in place (``cudaHostRegister(..., cudaHostRegisterReadOnly)``) on the H100 host: 8 GiB in
0.29-0.32 s against 0.51-0.56 s on 16 threads, both verified; pinning a fresh mapping costs
per 4 KiB page, a memcpy does not. The pinned pieces are the process's staging
(``host_staging``), which outlives a transfer; the bytes come from any ``sources.Source``.
Where the pinning was paid ahead, off the restore's path — a restart's ``prepare_restore``
adopts its own layout and pins the checkpoint's slot while the model is built, and checks
it there too (``verify_in_place``) — the copy engine reads the slot directly
(``transfer_pinned``): one pass over host memory, no staging.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import functools
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from shmstage.checkpoint import ChecksumError
from shmstage.checksums import combine, expect_combines
from shmstage_client import cudart
from shmstage_client.restore import device_checks, host_staging
from shmstage_client.restore.sources import MappedSource, Source, sum_spans

log = logging.getLogger("shmstage.client")

#: With ``SHMSTAGE_DEVICE_CHECKSUMS=1``, verify a transfer to a CUDA device on the device
#: (``device_checks``) rather than on the host, where the device has the memory for it:
#: ~1.3 fewer host core-seconds per 8 GiB, the same time within the VMs' noise (-8% to
#: +15% on three VMs, docs/performance.md), so not the default.
DEVICE_CHECKSUMS = os.environ.get("SHMSTAGE_DEVICE_CHECKSUMS", "0") == "1"
#: Device memory left free beside the restored bytes and the check's working memory.
DEVICE_HEADROOM: Final = 256 << 20
#: Bytes per copy out of pinned memory (``transfer_pinned``): few calls, and a copy the
#: stream queues while the one before it runs.
PINNED_COPY: Final = 256 << 20


@dataclass(frozen=True)
class Placement:
    """One tensor: where its bytes are in the source (and the destination), what it is."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    #: What the checksum must be; None when nothing recorded one (a checkpoint still being
    #: written has no manifest yet).
    crc32c: int | None = None


#: Restores per device checked on the host, and how many before the device's checks are
#: warmed up for the next ones.
_HOST_CHECKED: dict[torch.device, int] = {}
WARM_CHECKS_AFTER: Final = 2


def _count_host_checked(device: torch.device) -> None:
    """Warm the device's checks up once a process restores to it again and again.

    A process's first use of the checks loads a dozen CUDA kernels, each on the thread
    that launches it while holding the GIL: 0.18-0.32 s on an H200 VM, more than checking
    on the host costs a new process's restore (8 GiB: 0.03-0.05 s over unverified). A
    restarted trainer restores once and never pays it; a process that loads the newest
    weights over and over (an RL rollout worker, an evaluator) pays it once, in the
    background after its second restore, and checks on the device from then on.
    """
    device = device_checks.device_key(device)  # "cuda" and "cuda:0" count as one
    count = _HOST_CHECKED.get(device, 0) + 1
    _HOST_CHECKED[device] = count
    if count == WARM_CHECKS_AFTER:
        device_checks.warm_up_later(device)


def transfer(
    source: Source,
    placements: Sequence[Placement],
    device: torch.device,
    *,
    verify: bool = True,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every placement's tensor on ``device``, its checksum verified (with ``verify`` and
    a recorded one); raises ChecksumError naming the first tensor that does not match."""
    return _Transfer(source, placements, device, verify, threads).run()


def _host_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, writable (``preadv`` reads into them)."""
    return memoryview((ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr()))


def _disjoint(spans: Sequence[tuple[int, int]]) -> bool:
    """Whether no two spans overlap (tensors that share bytes overlap: a second pass)."""
    return all(before[1] <= after[0] for before, after in itertools.pairwise(spans))


def _extend(
    start: int,
    spans: Sequence[tuple[int, int]],
    values: Sequence[int],
    owners: Sequence[int],
    parts: dict[int, list[int]],
) -> None:
    """Continue ``parts`` (see ``_Transfer._tensor_spans``) with a piece's checksummed spans."""
    for (lo, hi), value, index in zip(spans, values, owners, strict=True):
        part = parts.get(index)
        if part is None:
            parts[index] = [start + lo, value, hi - lo]
        else:
            part[1] = value
            part[2] += hi - lo


def _as_tensor(view: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: only ever read from
        return torch.frombuffer(view, dtype=torch.uint8)


class _Relay:
    """One reader's share of the staging, cut in ``PIECES`` pieces that take turns: the
    reader waits only for the copy out of the piece it is about to refill (with one
    piece, for its own last copy, while the other readers' copies keep the device busy).

    The copies are queued through ``cudart`` rather than ``Tensor.copy_``: at hundreds
    of pieces per restore from 16 threads, each microsecond a copy holds the GIL counts.
    Where torch's CUDA runtime is not a library ctypes can load (a build linking it
    statically), through ``Tensor.copy_`` after all.
    """

    def __init__(
        self, share: tuple[int, int], stream: torch.cuda.Stream, runtime: cudart.Runtime | None
    ) -> None:
        address, size = share
        self.size = size // host_staging.PIECES
        self._addresses = [address + index * self.size for index in range(host_staging.PIECES)]
        self._events: list[torch.cuda.Event | None] = [None] * host_staging.PIECES
        self._turn = 0
        self._stream = stream
        self._runtime = runtime

    def send(
        self, fill: Callable[[memoryview], None], nbytes: int, target: torch.Tensor
    ) -> memoryview:
        """Fill the next piece's first ``nbytes`` (``fill`` reads them in) and queue their
        copy into ``target`` (as many bytes, on the device); returns the piece's bytes,
        which stay valid until the reader's next send (a second pass of checksums reads
        them while the device copies)."""
        turn = self._turn
        self._turn = (turn + 1) % host_staging.PIECES
        event = self._events[turn]
        if event is None:
            event = self._events[turn] = torch.cuda.Event()
        else:
            event.synchronize()  # the device is done with this piece's previous bytes
        address = self._addresses[turn]
        piece = memoryview((ctypes.c_char * nbytes).from_address(address))
        fill(piece)
        if self._runtime is not None:
            stream = self._stream.cuda_stream
            self._runtime.copy_to_device(target.data_ptr(), address, nbytes, stream)
        else:
            with torch.cuda.stream(self._stream):
                target.copy_(_as_tensor(piece), non_blocking=True)
        event.record(self._stream)
        return piece


def _copy_runtime() -> cudart.Runtime | None:
    """The CUDA runtime the pieces' copies are queued through; None: through torch."""
    try:
        return cudart.runtime()
    except cudart.UNAVAILABLE as exc:
        log.debug("queuing restore copies through torch: %s", exc)
        return None


class _Transfer:
    def __init__(
        self,
        source: Source,
        placements: Sequence[Placement],
        device: torch.device,
        verify: bool,
        threads: int | None,
    ) -> None:
        self.source = source
        self.placements = sorted(placements, key=lambda p: p.offset)
        self.device = device
        self.verify = verify
        self.threads = threads or max(1, min(host_staging.MAX_THREADS, os.cpu_count() or 1))
        self.cuda = device.type == "cuda"
        self._ends = [p.offset + p.nbytes for p in self.placements]
        #: Per tensor, its parts' (start, checksum, length), appended by the threads.
        self._parts: list[list[tuple[int, int, int]]] = [[] for _ in self.placements]
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._staging: host_staging.Staging | None = None
        self._checks: _DeviceCheck | None = None
        self._spans: Iterator[tuple[int, int]] = iter(())
        self._runtime: cudart.Runtime | None = None
        self._lock = threading.Lock()
        self._failed = False
        #: Bytes before the restored ones in ``destination``: a device check's slack.
        self._lead = 0

    def run(self) -> dict[str, torch.Tensor]:
        size = self.source.size
        checked = [p for p in self.placements if p.crc32c is not None and p.nbytes]
        on_device = self.cuda and self.verify and bool(checked) and self._device_can_check(size)
        self._lead = device_checks.BLOCK if on_device else 0
        self.destination = torch.empty(size + self._lead, dtype=torch.uint8, device=self.device)
        self._host = None if self.cuda else _host_buffer(self.destination)
        if on_device:
            try:
                self._checks = _DeviceCheck(
                    self.destination, checked, self._lead, self._stream, self.source.where
                )
            except ValueError:  # tensors sharing bytes: each is checked on the host
                self._checks = None
        chunk = host_staging.CHUNK
        spans = [(start, min(start + chunk, size)) for start in range(0, size, chunk)]
        self._spans = iter(spans)
        readers = max(1, min(self.threads, len(spans)))
        on_host = self.verify and self._checks is None  # checked here, not on the device
        if self.cuda:
            self._staging = host_staging.Staging(readers)
            self._runtime = _copy_runtime()
        try:
            if readers == 1:
                self._read()
            else:
                with concurrent.futures.ThreadPoolExecutor(
                    readers, thread_name_prefix="shmstage-restore"
                ) as pool:
                    running = [pool.submit(self._read) for _ in range(readers)]
                    if on_host:
                        expect_combines(self._combined_lengths())  # meanwhile
                    for done in running:
                        done.result()
            if on_host:
                self._check()  # while the device copies the last pieces
        finally:
            if self._checks is not None:
                self._checks.close()
            if self._stream is not None:
                self._stream.synchronize()
            if self._staging is not None:
                self._staging.close()
        if self._checks is not None:
            for placement, actual in self._checks.results():
                self._compare(placement, actual)
        elif self.verify and self.cuda and DEVICE_CHECKSUMS:
            _count_host_checked(self.device)
        return {p.key: self._tensor(p) for p in self.placements}

    def _device_can_check(self, size: int) -> bool:
        """Whether the device checks this transfer: where the process has the checks'
        kernels loaded already (see ``_count_host_checked``) and the device has the memory."""
        if not DEVICE_CHECKSUMS or not device_checks.ready(self.device):
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= size + device_checks.reserve(size) + DEVICE_HEADROOM

    def _read(self) -> None:
        """One reader: the next chunk, until none is left or another reader failed."""
        try:
            if not self.cuda:
                while (span := self._next_span()) is not None:
                    self._to_host(*span)
                return
            assert self._staging is not None and self._stream is not None
            with torch.cuda.device(self.device):  # the runtime's calls are for this device
                relay = _Relay(self._staging.take(), self._stream, self._runtime)
                while (span := self._next_span()) is not None:
                    self._to_device(*span, relay)
        except BaseException:
            with self._lock:
                self._failed = True
            raise

    def _next_span(self) -> tuple[int, int] | None:
        with self._lock:
            return None if self._failed else next(self._spans, None)

    def _to_host(self, start: int, end: int) -> None:
        """On the CPU: straight into the destination."""
        assert self._host is not None
        host = self._host[start:end]
        parts: dict[int, list[int]] = {}
        if self.verify:
            spans, values, owners = self._tensor_spans(start, end, parts)
            if _disjoint(spans):
                self.source.read_summed(start, host, spans, values)
            else:
                self.source.read_into(start, host)
                sum_spans(host, spans, values)
            _extend(start, spans, values, owners, parts)
        else:
            self.source.read_into(start, host)
        self._keep(parts)

    def _to_device(self, start: int, end: int, relay: _Relay) -> None:
        parts: dict[int, list[int]] = {}
        for piece in range(start, end, relay.size):
            upto = min(piece + relay.size, end)
            target = self.destination[self._lead + piece : self._lead + upto]
            read = functools.partial(self.source.read_into, piece)
            if self._checks is not None or not self.verify:
                relay.send(read, upto - piece, target)
                continue
            spans, values, owners = self._tensor_spans(piece, upto, parts)
            if self.source.summing and _disjoint(spans):  # checksummed as it is read
                summed = functools.partial(
                    self.source.read_summed, piece, spans=spans, values=values
                )
                relay.send(summed, upto - piece, target)
            else:  # checksummed while the device copies
                sum_spans(relay.send(read, upto - piece, target), spans, values)
            _extend(piece, spans, values, owners, parts)
        if self._checks is not None:
            self._checks.arrived(start, end)
        else:
            self._keep(parts)

    def _tensor_spans(
        self, start: int, end: int, parts: dict[int, list[int]]
    ) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """The part of every tensor that lies in [start, end): its span of those bytes
        (offsets from ``start``), its checksum so far and its placement's index. ``parts``
        holds per placement the [start, checksum, length] of its bytes in the chunk so far,
        which the chunk's next piece continues (``_extend``).

        A piece is read and checksummed in one pass where ``shmstage.readsum`` runs (1 MiB
        at a time, in C); in Python, checksumming in cache-sized bits as they were read was
        slower than a second pass over the piece (0.40 against 0.35 s for 8 GiB on the H100
        host), as the many more calls contend for the GIL.
        """
        spans: list[tuple[int, int]] = []
        values: list[int] = []
        owners: list[int] = []
        index = bisect.bisect_right(self._ends, start)
        while index < len(self.placements):
            placement = self.placements[index]
            if placement.offset >= end:
                break
            lo, hi = max(start, placement.offset), min(end, placement.offset + placement.nbytes)
            if hi > lo:
                part = parts.get(index)
                spans.append((lo - start, hi - start))
                values.append(0 if part is None else part[1])
                owners.append(index)
            index += 1
        return spans, values, owners

    def _keep(self, parts: dict[int, list[int]]) -> None:
        """A chunk's parts, for ``_check`` (``list.append`` is atomic: readers share them)."""
        for index, (start, value, length) in parts.items():
            self._parts[index].append((start, value, length))

    def _combined_lengths(self) -> set[int]:
        """The lengths ``_check`` combines over: each checked tensor's bytes in every chunk
        after its first (a chunk's length, and what its last chunk holds of it).

        Worked out while the readers read: in a new process, where none was seen before,
        the combining took 12-14 ms after the last byte of 8 GiB had arrived."""
        lengths = set()
        for placement in self.placements:
            end = placement.offset + placement.nbytes
            first_end = (placement.offset // host_staging.CHUNK + 1) * host_staging.CHUNK
            if placement.crc32c is None or end <= first_end:
                continue
            if end - first_end > host_staging.CHUNK:
                lengths.add(host_staging.CHUNK)
            lengths.add(end - (end - 1) // host_staging.CHUNK * host_staging.CHUNK)
        return lengths

    def _check(self) -> None:
        for placement, parts in zip(self.placements, self._parts, strict=True):
            if placement.crc32c is None:
                continue
            actual = 0
            for i, (_, value, length) in enumerate(sorted(parts)):
                actual = value if i == 0 else combine(actual, value, length)
            self._compare(placement, actual)

    def _compare(self, placement: Placement, actual: int) -> None:
        if actual != placement.crc32c:
            raise ChecksumError(
                f"tensor {placement.key!r} in {self.source.where}: checksum mismatch "
                f"(crc32c {actual:#010x}, manifest {placement.crc32c:#010x})"
            )

    def _tensor(self, placement: Placement) -> torch.Tensor:
        return _tensor_at(self.destination, self._lead, placement)

    def check_in_place(self) -> None:
        """Only the checksums, of bytes read where they are (``verify_in_place``)."""
        assert isinstance(self.source, MappedSource)
        source, chunk = self.source, host_staging.CHUNK
        size = source.size
        self._spans = iter([(lo, min(lo + chunk, size)) for lo in range(0, size, chunk)])

        def read() -> None:
            while (span := self._next_span()) is not None:
                start, end = span
                parts: dict[int, list[int]] = {}
                spans, values, owners = self._tensor_spans(start, end, parts)
                sum_spans(source.view(start, end), spans, values)
                _extend(start, spans, values, owners, parts)
                self._keep(parts)

        with concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix="shmstage-check"
        ) as pool:
            for done in [pool.submit(read) for _ in range(self.threads)]:
                done.result()
        self._check()


def _tensor_at(destination: torch.Tensor, lead: int, placement: Placement) -> torch.Tensor:
    """A placement's tensor: a view of ``destination`` ``lead`` bytes after its offset."""
    if placement.nbytes == 0:
        return torch.empty(placement.shape, dtype=placement.dtype, device=destination.device)
    start = lead + placement.offset
    raw = destination[start : start + placement.nbytes]
    if placement.offset % placement.dtype.itemsize:
        raw = raw.clone()  # not aligned for its dtype here: a copy of its own
    return raw.view(placement.dtype).view(placement.shape)


def verify_in_place(
    source: MappedSource, placements: Sequence[Placement], *, threads: int
) -> None:
    """Check every placement with a recorded checksum against the mapped bytes, on
    ``threads`` threads (the CRC releases the GIL); raises ChecksumError naming the first
    that does not match. A prepared restore checks its adopted slot this way while the
    model is built, so that ``latest()`` only copies."""
    _Transfer(source, placements, torch.device("cpu"), True, threads).check_in_place()


def transfer_pinned(
    source: MappedSource,
    ranges: Sequence[tuple[int, int]],
    placements: Sequence[Placement],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every placement's tensor on the CUDA ``device``, copied straight out of ``source``,
    whose bytes are page-locked already in ``ranges`` ((start, end) offsets, each one
    registration, together covering it: a copy never crosses two). Nothing is checked:
    the caller verified the bytes (``verify_in_place``) where nothing can change them.

    One pass over host memory, by the copy engine alone: what a restarted trainer's
    ``latest()`` costs once ``prepare_restore`` adopted and pinned its slot."""
    destination = torch.empty(source.size, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    runtime = _copy_runtime()
    with torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream(device))  # the destination's allocation
        for start, end in ranges:
            for lo in range(start, end, PINNED_COPY):
                hi = min(lo + PINNED_COPY, end)
                if runtime is not None:
                    target = destination.data_ptr() + lo
                    runtime.copy_to_device(target, source.address + lo, hi - lo, stream.cuda_stream)
                else:
                    with torch.cuda.stream(stream):
                        destination[lo:hi].copy_(_as_tensor(source.view(lo, hi)), non_blocking=True)
    stream.synchronize()
    return {p.key: _tensor_at(destination, 0, p) for p in placements}


class _DeviceCheck:
    """The device checks the tensors as their bytes land, on a stream of its own.

    Readers report each chunk they queued (``arrived``); once the chunks from the start
    form a longer unbroken run, an event recorded on the copy stream marks it, and a
    thread of its own queues the check of the blocks in that run behind the event, so the
    checks overlap the copies still to come and no reader waits for them.
    """

    def __init__(
        self,
        destination: torch.Tensor,
        placements: Sequence[Placement],
        lead: int,
        copies: torch.cuda.Stream | None,
        where: str,
    ) -> None:
        self._placements = list(placements)
        self._where = where
        self._copies = copies
        self._stream = torch.cuda.Stream(destination.device)
        self._lead = lead
        ranges = [(lead + p.offset, p.nbytes) for p in self._placements]
        self._sums = device_checks.DeviceChecksums(destination, ranges, self._stream)
        self._arrived: dict[int, int] = {}  # start -> end of chunks queued past the run
        self._ready = 0  # the run of queued bytes from the start
        self._marked: tuple[int, torch.cuda.Event] | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="shmstage-check", daemon=True)
        self._thread.start()

    def arrived(self, start: int, end: int) -> None:
        """Bytes [start, end) were queued for copying (on the copy stream)."""
        with self._cond:
            self._arrived[start] = end
            ready = self._ready
            while ready in self._arrived:
                ready = self._arrived.pop(ready)
            if ready == self._ready:
                return
            self._ready = ready
            event = torch.cuda.Event()
            event.record(self._copies)  # after every chunk of the run: all were queued
            self._marked = (ready, event)
            self._cond.notify()

    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._marked is None and not self._closed:
                        self._cond.wait()
                    marked, self._marked = self._marked, None
                    if marked is None:
                        return
                ready, event = marked
                self._sums.advance(self._lead + ready, event)
        except BaseException as exc:  # handed to the restoring thread, in results()
            self._failure = exc

    def close(self) -> None:
        """No more chunks: let the thread finish what it was given."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def results(self) -> list[tuple[Placement, int]]:
        """Each placement with the CRC-32C its bytes have on the device."""
        try:
            if self._failure is not None:
                raise self._failure
            if self._copies is not None:
                self._stream.wait_stream(self._copies)
            values = self._sums.finish()
        except torch.OutOfMemoryError as exc:  # another process took the memory meanwhile
            raise ChecksumError(
                f"{self._where}: the device ran out of memory while checking the restored "
                f"tensors, so they are not verified ({exc})"
            ) from exc
        return list(zip(self._placements, values, strict=True))

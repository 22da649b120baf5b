"""One version of a channel, pinned: its step, its metadata, and its tensors on a device.

A ``Version`` is what ``Subscriber.wait`` returns: the daemon has pinned it (its slot is
not refilled until ``close``, the pin's time, or the subscriber's end), so everything
copied out of it while the pin holds is that version and nothing else — all of it, never
a mix of two steps. Use it as a context manager: leaving the block unpins it.

``state(device)`` copies the whole version at once: one copy of the slot's mapped range
into one buffer on the device (through the ring's CUDA registration: pinned speed), and
every tensor is a view of that buffer. ``tensors(device, bucket_bytes=...)`` streams it
instead, a bucket of consecutive tensors at a time, for a consumer that loads each into
its own parameters (an inference engine): the device holds one bucket beside the model,
never a second copy of the whole state; ``specs`` lists what it will yield (key, dtype,
shape, bytes, in that order) before a byte is copied, for an engine to check or allocate.
Both check afterwards that the pin still held, and raise ``VersionExpired`` if it ran
out meanwhile (what was copied may be torn).

Every version's tensors are checksummed by the daemon after the version became visible,
off the path of its publisher and of its readers (for 7 GiB ~0.2-0.7 s, depending on the
host); a reader is woken at once and never waits for them unless it asks to. ``verify``
says what a copy does about them:

- ``"if-ready"`` (the default: what a rollout worker wants, never a wait): verify
  when the checksums are there (they came with the pin, or the daemon has them when the
  copy starts — one round trip to ask), otherwise copy straight from the ring, unverified.
- ``True``: wait for them (at most ``CHECKSUM_WAIT_S``, and never past the pin's end),
  then verify; raises ``ChecksumsUnavailable`` if none came.
- ``False``: never verify.

A verified copy to the CPU goes through the restore wing's transfer (read and checksummed
in one pass), and so does one to a GPU from a slot not registered with CUDA yet (its first
version here: see ``ring``); from a registered slot it is the unverified copy at pinned
speed, followed by a check of the same bytes in place on several threads (see
``_verified`` for why after, not before); ``verified`` says which the last copy was, and a
tensor that does not match raises ``ChecksumError`` naming it. The pin is what keeps a
version whole against the daemon and other publishers; the checksums catch what the pin
cannot: a process writing into a published slot (its publisher holds the slot's
segments writable), or memory corruption.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, Literal, NamedTuple

import torch

from shmstage import tree
from shmstage_client.dtypes import FROM_SAFETENSORS
from shmstage_client.errors import SaveError
from shmstage_client.restore.sources import MappedSource
from shmstage_client.restore.transfer import Placement, transfer, verify_in_place
from shmstage_client.subscribe.ring import Ring

#: A bucket's default size for ``Version.tensors``.
BUCKET_BYTES: Final = 256 << 20
#: A pin counts as ended this long before the daemon's clock says so (the two clocks
#: started at different moments of the request).
PIN_MARGIN_S: Final = 0.5
#: With ``verify=True``, the longest a copy waits for the daemon to finish a version's
#: checksums.
CHECKSUM_WAIT_S: Final = 30.0

#: Threads checking a copy to a GPU in place (the CRC-32C releases the GIL).
VERIFY_THREADS: Final = 8

#: What a copy does about checksums (see the module).
Verify = bool | Literal["if-ready"]
#: Asks the daemon for a pin's checksums, waiting up to the seconds given (0: only ask).
FetchChecksums = Callable[[int, float], "list[int] | None"]


class VersionExpired(SaveError):
    """The pin on a version ended before its copy finished: what was read may be torn."""


class ChecksumsUnavailable(SaveError):
    """``verify=True`` and the daemon had no checksums for the version in time."""


class TensorSpec(NamedTuple):
    """One tensor of a version, as an engine allocating its parameters needs it."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class Version:
    """A pinned version of a channel (see the module)."""

    def __init__(
        self,
        *,
        step: int,
        metadata: dict[str, Any],
        encoded: Any,
        ring: Ring,
        slot: int,
        pin: int,
        expires: float,
        unpin: Callable[[int], bool],
        fetch_checksums: FetchChecksums,
        checksums: list[int] | None = None,
    ) -> None:
        self.step = step
        self.metadata = metadata
        self._checksums = checksums
        self._fetch_checksums = fetch_checksums
        #: Whether the last ``state()`` or ``tensors()`` checked every tensor it copied
        #: against its CRC-32C.
        self.verified = False
        self._encoded = encoded
        self._ring = ring
        self._slot = slot
        self._pin = pin
        #: monotonic time past which the pin may have ended.
        self._expires = expires
        self._unpin = unpin
        self._closed = False
        #: The device a copy went to through staging (the slot was not registered): its
        #: registration starts once the copies are done.
        self._staged_to: torch.device | None = None
        ring.use()

    def __enter__(self) -> Version:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Version(step={self.step}, {'closed' if self._closed else 'pinned'})"

    @property
    def pinned(self) -> bool:
        """Whether the pin still holds (its slot cannot have been refilled)."""
        return not self._closed and time.monotonic() < self._expires

    @property
    def nbytes(self) -> int:
        return self._ring.layout.nbytes

    @property
    def specs(self) -> list[TensorSpec]:
        """Every tensor's (flat key, dtype, shape, bytes), in the order ``tensors()`` yields
        them (their order in memory): what an engine needs to allocate or check its
        parameters before any byte is copied."""
        tensors = self._ring.layout.tensors
        return [
            TensorSpec(spec.key, FROM_SAFETENSORS[spec.dtype], tuple(spec.shape), spec.nbytes)
            for spec in (tensors[index] for index in self._order())
        ]

    def close(self) -> bool:
        """Unpin; True when the pin held until now. Once; later calls return False."""
        if self._closed:
            return False
        self._closed = True
        try:
            self._register_staged()
            return self._unpin(self._pin)
        finally:
            self._ring.done()

    def state(self, device: str | torch.device = "cpu", *, verify: Verify = "if-ready") -> Any:
        """The version's state dict on ``device``: nested as published, plain values
        included, bit-exact. ``verify``: see the module (``verified`` says whether every
        tensor was checked; one that does not match raises ChecksumError naming it).
        Unverified, every tensor is a view of one buffer holding the whole version."""
        device = torch.device(device)
        self._check_open()
        checksums = self._checksums_for(verify, device)
        indices = range(len(self._ring.layout.tensors))
        if checksums is not None:
            region = self._ring.region(self._slot)
            tensors = self._verified(0, region.size, indices, checksums, device)
        else:
            buffer = self._copy(0, self._ring.region(self._slot).size, device)
            tensors = dict(self._views(buffer, indices))
        self._check_held()
        self._register_staged()
        self.verified = checksums is not None
        return tree.unflatten(self._encoded, tensors.__getitem__)

    def _checksums_for(self, verify: Verify, device: torch.device) -> list[int] | None:
        """The checksums to verify a copy to ``device`` against, as ``verify`` asks (see
        the module); none for the meta device, where nothing is copied."""
        if verify not in (True, False, "if-ready"):
            raise ValueError(f"verify={verify!r}: give True, False or 'if-ready'")
        if verify is False or device.type == "meta":
            return None
        if self._checksums is None:
            wait = 0.0
            if verify is True:
                wait = max(0.0, min(CHECKSUM_WAIT_S, self._expires - time.monotonic()))
            self._checksums = self._fetch_checksums(self._pin, wait)
            if self._checksums is None and verify is True:
                raise ChecksumsUnavailable(
                    f"shmstaged had no checksums for version {self.step} within "
                    f"{wait:.1f} s (it computes them after the version becomes visible); "
                    "copy with verify='if-ready' to verify only when they are there"
                )
        count = len(self._ring.layout.tensors)
        if self._checksums is not None and len(self._checksums) != count:
            raise SaveError("shmstaged sent checksums that do not match the version's tensors")
        return self._checksums

    def _verified(
        self,
        start: int,
        end: int,
        indices: Iterable[int],
        checksums: Sequence[int],
        device: torch.device,
    ) -> dict[str, torch.Tensor]:
        """Tensors ``indices``, which lie in bytes ``start:end`` of the slot's mapped
        range, on ``device``, each checked against its CRC-32C.

        To the CPU, through the restore wing's transfer (read and checksummed in one pass).
        To a GPU, copied from the ring's registered mapping at pinned speed as unverified,
        then checked where the bytes are (``verify_in_place``, on several threads) — after
        the copy, so that a write into the slot before or during it is seen (one after the
        check of its bytes came after the copy and changed nothing copied). That keeps the
        ring's point: no staging, one DMA per bucket."""
        indices = list(indices)
        region = self._ring.region(self._slot)
        specs = self._ring.layout.tensors
        placements = [
            Placement(
                specs[index].key,
                FROM_SAFETENSORS[specs[index].dtype],
                specs[index].shape,
                self._offset(index) - start,
                specs[index].nbytes,
                checksums[index],
            )
            for index in indices
        ]
        source = MappedSource(region.address + start, end - start, f"version {self.step}")
        if device.type != "cuda":
            return transfer(source, placements, device)
        device = _indexed(device)
        if not self._ring.direct(self._slot):  # read and checksummed in one pass
            self._staged_to = device
            return transfer(source, placements, device)
        buffer = self._copy(start, end, device)
        verify_in_place(source, placements, threads=VERIFY_THREADS)
        return dict(self._views(buffer, indices, base=start))

    def tensors(
        self,
        device: str | torch.device = "cpu",
        *,
        bucket_bytes: int = BUCKET_BYTES,
        verify: Verify = "if-ready",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as (flat key, tensor on ``device``), in the order they lie in
        memory (``specs``), copied a bucket of about ``bucket_bytes`` at a time (a larger
        tensor is a bucket alone). Each bucket is a buffer of its own: keep what you need,
        drop the rest. ``verify`` as for ``state`` (decided before the first bucket; a
        bucket that does not match raises ChecksumError before any of its tensors is
        yielded). Raises VersionExpired as soon as a bucket is copied after the pin ran out."""
        device = torch.device(device)
        self._check_open()
        checksums = self._checksums_for(verify, device)
        self.verified = False
        specs = self._ring.layout.tensors
        order = self._order()
        first = 0
        while first < len(order):
            last, start = first + 1, self._offset(order[first])
            end = start + specs[order[first]].nbytes
            while last < len(order):
                index = order[last]
                reach = self._offset(index) + specs[index].nbytes
                if reach - start > bucket_bytes:
                    break
                end = max(end, reach)
                last += 1
            bucket = order[first:last]
            if checksums is not None:
                tensors = self._verified(start, end, bucket, checksums, device)
                self._check_held()
                yield from ((specs[index].key, tensors[specs[index].key]) for index in bucket)
            else:
                buffer = self._copy(start, end, device)
                self._check_held()
                yield from self._views(buffer, bucket, base=start)
            first = last
        self._register_staged()
        self.verified = checksums is not None

    # -- copying -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SaveError(f"version {self.step} was closed (unpinned); wait for another")

    def _register_staged(self) -> None:
        """Once a copy went through staging, start registering the slot for the versions
        after this one (not during the copy: the two would contend for the host)."""
        if self._staged_to is not None:
            self._ring.register_soon(self._slot, self._staged_to)
            self._staged_to = None

    def _check_held(self) -> None:
        if time.monotonic() >= self._expires:
            raise VersionExpired(
                f"the pin on version {self.step} ran out before its copy ended; what was "
                "copied may mix two versions. Read versions within the pin's time "
                "([retention] lease_seconds), or wait for the next one"
            )

    def _order(self) -> list[int]:
        """Tensor indices in the order their bytes lie in the slot."""
        return sorted(range(len(self._ring.layout.tensors)), key=self._offset)

    def _offset(self, index: int) -> int:
        """Where tensor ``index`` starts in the slot's mapped range."""
        which, offset = self._ring.layout.packing().places[index]
        return self._ring.region(self._slot).offsets[which] + offset

    def _copy(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Bytes ``start:end`` of the slot's mapped range, copied into a new buffer on
        ``device`` (once the copy is complete).

        To a GPU from a registered slot, one DMA per registered piece, then one wait on the
        stream; from a slot not registered yet (its first version here), through the
        process's pinned staging on several threads, and its registration starts after."""
        region = self._ring.region(self._slot)
        size = max(end - start, 0)
        source = torch.frombuffer(region.buffer(), dtype=torch.uint8)
        if device.type != "cuda" or not size:
            target = torch.empty(size, dtype=torch.uint8, device=device)
            target.copy_(source[start : start + size])
            return target
        device = _indexed(device)
        if not self._ring.direct(self._slot):
            mapped = MappedSource(region.address + start, size, f"version {self.step}")
            whole = Placement("", torch.uint8, (size,), 0, size)
            self._staged_to = device
            return transfer(mapped, [whole], device, verify=False)[""]
        pieces = self._ring.pieces(self._slot, device, start, end)
        target = torch.empty(size, dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device)
        try:
            with torch.cuda.device(device):
                for first, last, pinned in pieces:
                    piece = target[first - start : last - start]
                    piece.copy_(source[first:last], non_blocking=pinned)
        finally:  # never leave a DMA running from a mapping its ring may close next
            stream.synchronize()
        return target

    def _views(
        self, buffer: torch.Tensor, indices: Iterable[int], base: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors ``indices`` as views of ``buffer``, which holds the range from ``base``
        (a tensor's place is aligned for any dtype: pages and 64-byte packing)."""
        specs = self._ring.layout.tensors
        for index in indices:
            spec = specs[index]
            dtype = FROM_SAFETENSORS[spec.dtype]
            if spec.nbytes == 0:
                yield spec.key, torch.empty(spec.shape, dtype=dtype, device=buffer.device)
                continue
            start = self._offset(index) - base
            view = buffer[start : start + spec.nbytes].view(dtype).view(spec.shape)
            yield spec.key, view


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: the ring registers on threads whose device is 0."""
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device

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
never a second copy of the whole state. Both check afterwards that the pin still held,
and raise ``VersionExpired`` if it ran out meanwhile (what was copied may be torn).

A version published by ``save(..., publish=)`` whose checkpoint is durable comes with each
tensor's CRC-32C as the daemon computed them writing the files: ``state()`` then copies
through the restore wing's verified transfer (``restore.transfer``: pinned pieces,
checksummed as they pass) and ``verified`` says so. Other versions have no checksums —
nothing computed any — and are copied straight from the ring (``verified`` False): the pin
is what guarantees they are whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import torch

from shmstage import tree
from shmstage_client.dtypes import FROM_SAFETENSORS
from shmstage_client.errors import SaveError
from shmstage_client.restore.sources import MappedSource
from shmstage_client.restore.transfer import Placement, transfer
from shmstage_client.subscribe.ring import Ring

#: A bucket's default size for ``Version.tensors``.
BUCKET_BYTES: Final = 256 << 20
#: A pin counts as ended this long before the daemon's clock says so (the two clocks
#: started at different moments of the request).
PIN_MARGIN_S: Final = 0.5


class VersionExpired(SaveError):
    """The pin on a version ended before its copy finished: what was read may be torn."""


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
        checksums: list[int] | None = None,
    ) -> None:
        self.step = step
        self.metadata = metadata
        self._checksums = checksums
        #: Whether the last ``state()`` checked every tensor against its CRC-32C.
        self.verified = False
        self._encoded = encoded
        self._ring = ring
        self._slot = slot
        self._pin = pin
        #: monotonic time past which the pin may have ended.
        self._expires = expires
        self._unpin = unpin
        self._closed = False
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

    def close(self) -> bool:
        """Unpin; True when the pin held until now. Once; later calls return False."""
        if self._closed:
            return False
        self._closed = True
        try:
            return self._unpin(self._pin)
        finally:
            self._ring.done()

    def state(self, device: str | torch.device = "cpu", *, verify: bool = True) -> Any:
        """The version's state dict on ``device``: nested as published, plain values
        included, bit-exact. Without checksums (or ``verify=False``) every tensor is a
        view of one buffer holding the whole version; with them, each is checked (raises
        ChecksumError naming the first that does not match) and ``verified`` is True."""
        device = torch.device(device)
        self._check_open()
        if verify and self._checksums is not None:
            tensors = self._verified(device)
        else:
            buffer = self._copy(0, self._ring.region(self._slot).size, device)
            tensors = dict(self._views(buffer, range(len(self._ring.layout.tensors))))
        self._check_held()
        self.verified = verify and self._checksums is not None
        return tree.unflatten(self._encoded, tensors.__getitem__)

    def _verified(self, device: torch.device) -> dict[str, torch.Tensor]:
        region = self._ring.region(self._slot)
        specs = self._ring.layout.tensors
        if self._checksums is None or len(self._checksums) != len(specs):
            raise SaveError("shmstaged sent checksums that do not match the version's tensors")
        placements = [
            Placement(
                spec.key,
                FROM_SAFETENSORS[spec.dtype],
                spec.shape,
                self._offset(index),
                spec.nbytes,
                crc,
            )
            for index, (spec, crc) in enumerate(zip(specs, self._checksums, strict=True))
        ]
        where = f"version {self.step}"
        return transfer(MappedSource(region.address, region.size, where), placements, device)

    def tensors(
        self, device: str | torch.device = "cpu", *, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as (flat key, tensor on ``device``), in the order they lie in
        memory, copied a bucket of about ``bucket_bytes`` at a time (a larger tensor is a
        bucket alone). Each bucket is a buffer of its own: keep what you need, drop the
        rest. Raises VersionExpired as soon as a bucket is copied after the pin ran out."""
        device = torch.device(device)
        self._check_open()
        specs = self._ring.layout.tensors
        order = sorted(range(len(specs)), key=self._offset)
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
            buffer = self._copy(start, end, device)
            self._check_held()
            yield from self._views(buffer, order[first:last], base=start)
            first = last

    # -- copying -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SaveError(f"version {self.step} was closed (unpinned); wait for another")

    def _check_held(self) -> None:
        if time.monotonic() >= self._expires:
            raise VersionExpired(
                f"the pin on version {self.step} ran out before its copy ended; what was "
                "copied may mix two versions. Read versions within the pin's time "
                "([retention] lease_seconds), or wait for the next one"
            )

    def _offset(self, index: int) -> int:
        """Where tensor ``index`` starts in the slot's mapped range."""
        which, offset = self._ring.layout.packing().places[index]
        return self._ring.region(self._slot).offsets[which] + offset

    def _copy(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Bytes ``start:end`` of the slot's mapped range, copied into a new buffer on
        ``device`` (once the copy is complete)."""
        region = self._ring.region(self._slot)
        size = max(end - start, 0)
        source = torch.frombuffer(region.buffer(), dtype=torch.uint8)[start : start + size]
        if device.type == "cuda":
            self._ring.register(self._slot)
        target = torch.empty(size, dtype=torch.uint8, device=device)
        target.copy_(source)  # from a registered range: a DMA at pinned speed, then a sync
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

"""The physical limits every row is divided by, measured on the same bytes in the same run.

* raw copy: the stall floor — one copy into a preallocated pinned host buffer;
* raw write + fsync: the same bytes written buffered to one file (what most writers do);
* disk limit (direct I/O): the same bytes with aligned O_DIRECT parallel writes + fsync,
  which is what the disk itself can take — a writer that goes through the page cache is
  compared with the first, the disk's real capability is the second.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import torch

from .direct_io import AlignedBuffer, DirectIOUnsupported, filesystem_of, write_direct
from .method import Method, MethodUnavailable, StateDict, Timing, fsync_dir, synchronize
from .synthetic import ALIGN, format_bytes, state_dict_bytes


class PinnedMirror:
    """A (pinned, on CUDA) host buffer with one view per tensor, 64-byte aligned, touched.

    The destination of the raw copy limits: copies into it cost what the link costs, with
    no allocation, page fault or pinning inside the timed region.
    """

    def __init__(self, tensors: list[torch.Tensor], *, pin: bool) -> None:
        total = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
        self.buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self.buf.zero_()  # touch every page now, so page faults are not timed
        self.views: list[torch.Tensor] = []
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.views.append(self.buf[off : off + n].view(t.dtype).view(t.shape))
            off += -(-n // ALIGN) * ALIGN

    def copy_from(self, tensors: list[torch.Tensor], device: torch.device) -> float:
        """Seconds to copy ``tensors`` into the mirror (device synchronised around it)."""
        synchronize(device)
        t0 = time.perf_counter()
        for dst, src in zip(self.views, tensors, strict=True):
            dst.copy_(src, non_blocking=True)
        synchronize(device)
        return time.perf_counter() - t0

    def copy_to(self, tensors: list[torch.Tensor], device: torch.device) -> float:
        """Seconds to copy the mirror back into ``tensors`` (host to device on CUDA)."""
        synchronize(device)
        t0 = time.perf_counter()
        for dst, src in zip(tensors, self.views, strict=True):
            dst.copy_(src, non_blocking=True)
        synchronize(device)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.views = []
        self.buf = torch.empty(0)


class RawCopy(Method):
    """The stall floor: one copy of the same bytes into a preallocated (pinned) host buffer."""

    name = "raw-copy"
    kind = "limit"
    description = "limit: copy into a preallocated pinned host buffer (CPU: plain host buffer)"

    def setup(self, state_dict: StateDict) -> None:
        pin = self.device.type == "cuda"
        self.mirror = PinnedMirror(list(state_dict.values()), pin=pin)
        if not pin:
            self.note = "no CUDA: host-to-host copy"

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        return Timing(self.mirror.copy_from(list(state_dict.values()), self.device), None)

    def close(self) -> None:
        mirror = getattr(self, "mirror", None)
        if mirror is not None:
            mirror.close()


def host_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor, without needing numpy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def concatenated(state_dict: StateDict) -> torch.Tensor:
    """The state dict's bytes back to back in one host tensor (setup, not timed)."""
    buf = torch.empty(state_dict_bytes(state_dict), dtype=torch.uint8)
    off = 0
    for t in state_dict.values():
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        off += n
    return buf


class RawWrite(Method):
    """The buffered durability floor: the same bytes written once to one file and fsynced."""

    name = "raw-write-fsync"
    kind = "limit"
    description = "limit: write the same bytes to one file in the same directory + fsync"
    chunk = 64 << 20

    def setup(self, state_dict: StateDict) -> None:
        self.buf = concatenated(state_dict)

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        view = host_view(self.buf)
        t0 = time.perf_counter()
        directory.mkdir(parents=True)
        fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + self.chunk])
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(directory)
        return Timing(None, time.perf_counter() - t0)

    def close(self) -> None:
        self.buf = torch.empty(0)


def probe_direct_io(directory: Path) -> None:
    """Raise MethodUnavailable, naming the filesystem, where O_DIRECT writes are refused."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".direct-probe-{os.getpid()}"
    block = AlignedBuffer(4096)
    try:
        write_direct(block, probe, threads=1)
    except DirectIOUnsupported as exc:
        raise MethodUnavailable(
            f"O_DIRECT refused on {filesystem_of(directory)} at {directory}: {exc.strerror}"
        ) from None
    finally:
        block.close()
        probe.unlink(missing_ok=True)


class DirectWrite(Method):
    """The disk's limit: aligned O_DIRECT writes on several threads, then fsync."""

    name = "disk-limit-direct"
    kind = "limit"
    description = "limit: disk limit (direct I/O): aligned O_DIRECT parallel writes + fsync"

    def setup(self, state_dict: StateDict) -> None:
        probe_direct_io(self.ctx.root)
        self.buffer = AlignedBuffer(state_dict_bytes(state_dict))
        self.buffer.fill(state_dict.values())
        self.note = (
            f"{self.ctx.direct_threads} threads, {format_bytes(self.ctx.direct_chunk)} chunks"
        )

    def run_once(self, state_dict: StateDict, directory: Path) -> Timing:
        t0 = time.perf_counter()
        directory.mkdir(parents=True)
        try:
            write_direct(
                self.buffer,
                directory / "raw.bin",
                threads=self.ctx.direct_threads,
                chunk=self.ctx.direct_chunk,
            )
        except DirectIOUnsupported as exc:
            raise MethodUnavailable(f"O_DIRECT refused at {directory}: {exc.strerror}") from None
        fsync_dir(directory)
        return Timing(None, time.perf_counter() - t0)

    def close(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            buffer.close()

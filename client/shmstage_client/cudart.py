"""The CUDA runtime entry points the client calls itself, from the libcudart torch loaded.

Through ctypes, for two reasons. Failures torch does not expose: a failed
``cudaHostRegister`` leaves a sticky error that the next unrelated torch CUDA call would
report as its own, so it is cleared here (``cudaGetLastError``) and turned into an
exception that names the call. And cost: a restore queues one host-to-device copy per
16 MiB piece, hundreds of them from 16 threads, and every microsecond a copy holds the
GIL is a microsecond no other reader runs Python. ``Tensor.copy_`` from a buffer holds it
for the tensor views, the stream context and the dispatch; a ctypes call converts three
integers and releases it while the driver queues the copy.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Final

import torch

#: ``cudaMemcpyHostToDevice``.
_HOST_TO_DEVICE: Final = 1


class CudaError(RuntimeError):
    """A runtime call failed; the message names the call and CUDA's error."""


class Runtime:
    """torch's own libcudart, with the signatures of the calls the client makes."""

    def __init__(self) -> None:
        torch.cuda.init()
        library = _loaded_cudart()
        if library is None:
            raise CudaError("torch's libcudart is not loaded as a shared library")
        self.lib = ctypes.CDLL(library)
        lib = self.lib
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]

    def error(self, code: int) -> str:
        return f"{self.lib.cudaGetErrorString(code).decode()} (cudaError {code})"

    def clear_sticky_error(self) -> None:
        """Forget this thread's last error, so that torch's next call does not report it."""
        self.lib.cudaGetLastError()

    def copy_to_device(self, device: int, host: int, size: int, stream: int) -> None:
        """Queue a copy of ``size`` bytes from host address ``host`` to device address
        ``device`` on ``stream`` (torch's ``Stream.cuda_stream``). Only pinned host memory
        is copied asynchronously: the caller must not reuse it before the copy is done."""
        code = self.lib.cudaMemcpyAsync(device, host, size, _HOST_TO_DEVICE, stream)
        if code != 0:
            self.clear_sticky_error()
            raise CudaError(f"cudaMemcpyAsync of {size} bytes failed: {self.error(code)}")


def _loaded_cudart() -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.rsplit(" ", 1)[-1]
        if "/libcudart.so" in path:
            return path
    return None


#: What a call through this module may fail with: a CUDA error, no loadable libcudart, a
#: symbol the library lacks.
UNAVAILABLE: Final = (CudaError, OSError, AttributeError)

_runtime: Runtime | None = None
_lock = threading.Lock()


def runtime() -> Runtime:
    """The process's one ``Runtime``, made on first use (CUDA initialised then)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime

"""A published version as a read-only safetensors directory in memory, for readers that
only take a path.

SGLang's ``update_weights_from_disk(model_path)`` and vLLM's ``disk`` weight-transfer
backend (``update_weights({"path": ...})``) read a checkpoint directory of
``*.safetensors`` files; they cannot take tensors from a subscriber. ``export(version)``
writes the pinned version once into such a directory under ``/dev/shm`` (tmpfs: memory,
never a disk), makes it read-only, and removes it on ``close()`` (or when the process
exits normally; a directory of a process that was killed is removed by the next
``export`` of the same user on the node). The files are plain safetensors (the real
safetensors library reads them back bit-exact in the tests; neither engine was run here)
and sharded like a Hugging Face checkpoint
(``model-00001-of-00002.safetensors`` and ``model.safetensors.index.json`` beyond one
shard). ``shmstage-version.json`` beside them says which step it is, with the
publisher's metadata.

The cost, stated: the directory is a second copy of the version's bytes, in tmpfs — as
much node memory again as the version, for as long as the directory exists — and making
it reads every byte twice: out of the pinned slot into a fresh buffer
(``Version.tensors``), then into the file. Measured on a 1 GiB version (8 tensors of
128 MiB) on a loaded 2-core CPU VM: 4.6-7 s/GiB, where one write of the same bytes into
tmpfs took 2.0-2.2 s/GiB and one copy into a fresh buffer 2.2-2.5 s/GiB — so about
2.5-3 times one copy of the bytes (the ratio, not the seconds, is what to expect
elsewhere; not measured on other hosts). The engine then reads the files again
when it loads them. A reader that can take tensors (``Version.tensors``, the vLLM backend
in ``integrations.vllm``) pays none of this; use the directory only where a path is all
an engine takes. Because it is a copy, the directory stays that one version after the pin
ends: close the version as soon as ``export`` returns.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final

import torch

from shmstage_client.dtypes import safetensors_name
from shmstage_client.processes import alive

if TYPE_CHECKING:
    from shmstage_client.subscribe.version import Version

#: Where directories go by default: tmpfs on every Linux node.
DEFAULT_ROOT: Final = "/dev/shm"
#: A shard's size at most (one larger tensor is a shard alone), as Hugging Face's default.
SHARD_BYTES: Final = 5 << 30
#: Bytes copied out of the slot at a time while writing.
COPY_BUCKET_BYTES: Final = 64 << 20
#: The manifest beside the shards.
MANIFEST: Final = "shmstage-version.json"
INDEX: Final = "model.safetensors.index.json"
_PREFIX: Final = "shmstage-export-"


@dataclass(frozen=True)
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ExportedVersion:
    """A version written as a read-only safetensors directory (see the module). Use it as
    a context manager, or ``close()`` it: the directory is removed then."""

    def __init__(self, path: Path, step: int, files: Sequence[str], nbytes: int) -> None:
        self.path = path
        self.step = step
        self.files = list(files)
        #: Bytes of tensor data written (the headers are a few KiB more).
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _remove, path)

    def __enter__(self) -> ExportedVersion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"ExportedVersion(step={self.step}, path={str(self.path)!r})"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the directory (once; later calls do nothing)."""
        self._finalizer()


def export(
    version: Version,
    *,
    root: str | os.PathLike[str] = DEFAULT_ROOT,
    extra_files: Iterable[str | os.PathLike[str]] = (),
    shard_bytes: int = SHARD_BYTES,
) -> ExportedVersion:
    """Write ``version`` (pinned, open) as a read-only safetensors directory under ``root``.

    ``extra_files`` are copied in beside the shards: an engine that reloads from a path
    may want the model's ``config.json`` and tokenizer files beside the weights, as in the
model directory it was started from.
    Only the version's tensors are written; its plain values are in the manifest's
    ``metadata`` only if the publisher put them in ``metadata``."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes={shard_bytes}: give a positive size in bytes")
    sweep_dead(root)
    entries = _entries(version)
    shards = _shards(entries, shard_bytes)
    names = _shard_names(len(shards))
    path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))
    exported = ExportedVersion(path, version.step, names, sum(e.nbytes for e in entries))
    try:
        _write_shards(version, shards, names, path, version.step)
        if len(shards) > 1:
            weight_map = {e.key: name for name, shard in zip(names, shards, strict=True)
                          for e in shard}
            index = {"metadata": {"total_size": exported.nbytes}, "weight_map": weight_map}
            _write_json(path / INDEX, index)
        for extra in extra_files:
            target = path / Path(extra).name
            if target.name in (MANIFEST, INDEX, *names):
                raise ValueError(f"extra file {extra}: its name is one the export writes")
            shutil.copyfile(extra, target)
            os.chmod(target, 0o444)
        manifest = {
            "step": version.step,
            "metadata": version.metadata,
            "files": names,
            "tensors": len(entries),
            "total_size": exported.nbytes,
        }
        _write_json(path / MANIFEST, manifest)
        os.chmod(path, 0o555)
    except BaseException:
        exported.close()
        raise
    return exported


def sweep_dead(root: str | os.PathLike[str] = DEFAULT_ROOT) -> list[Path]:
    """Remove this user's export directories under ``root`` whose process is gone (it was
    killed before it could remove them). Returns what was removed."""
    removed = []
    uid = os.getuid()
    with os.scandir(root) as entries:
        for entry in entries:
            pid = _owner_pid(entry.name)
            if pid is None or pid == os.getpid() or alive(pid):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_dir(
                    follow_symlinks=False
                ):
                    continue
            except FileNotFoundError:
                continue
            _remove(Path(entry.path))
            removed.append(Path(entry.path))
    return removed


# -- writing ---------------------------------------------------------------------------


def _entries(version: Version) -> list[_Entry]:
    """Every tensor's key, dtype and shape, in the order they lie in the slot (``specs``:
    nothing is copied)."""
    entries = []
    for key, dtype, shape, nbytes in version.specs:
        name = safetensors_name(dtype)
        if name is None:  # a published tensor always has a safetensors dtype
            raise ValueError(f"tensor {key!r} has dtype {dtype}, which safetensors lacks")
        entries.append(_Entry(key, name, shape, nbytes))
    return entries


def _shards(entries: list[_Entry], shard_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(shard: list[_Entry], step: int) -> bytes:
    """The safetensors header: JSON of every tensor's dtype, shape and byte range, padded
    with spaces to a multiple of 8 (the format's alignment)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "shmstage_step": str(step)}}
    offset = 0
    for entry in shard:
        end = offset + entry.nbytes
        header[entry.key] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_shards(
    version: Version, shards: list[list[_Entry]], names: list[str], path: Path, step: int
) -> None:
    """Stream the version's tensors into the shards, in slot order (the order of the
    entries), a bucket at a time; each file read-only once written."""
    tensors = version.tensors("cpu", bucket_bytes=COPY_BUCKET_BYTES)
    for shard, name in zip(shards, names, strict=True):
        target = path / name
        with open(target, "xb") as file:
            file.write(_header(shard, step))
            for entry in shard:
                key, tensor = next(tensors)
                if key != entry.key:  # the same version read twice: same order
                    raise RuntimeError(f"version {step} changed order while exported ({key})")
                _write_tensor(file, tensor)
        os.chmod(target, 0o444)
    if next(tensors, None) is not None:
        raise RuntimeError(f"version {step} has more tensors than its first reading listed")


def _write_tensor(file: BinaryIO, tensor: torch.Tensor) -> None:
    if tensor.numel():
        file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def _write_json(target: Path, value: Any) -> None:
    with open(target, "x") as file:
        json.dump(value, file, indent=1)
    os.chmod(target, 0o444)


# -- removal ---------------------------------------------------------------------------


def _remove(path: Path) -> None:
    """Remove an export directory (read-only: given write permission back first)."""
    try:
        os.chmod(path, stat.S_IRWXU)
    except FileNotFoundError:
        return
    shutil.rmtree(path, ignore_errors=True)


def _owner_pid(name: str) -> int | None:
    if not name.startswith(_PREFIX):
        return None
    pid = name[len(_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None

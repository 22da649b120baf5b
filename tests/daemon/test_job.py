"""The persist job, in-process on real segments and real files: what it writes is exactly
the staged bytes, however many tensors and whatever their sizes."""

from __future__ import annotations

from pathlib import Path

from harness import staged_job
from safetensors import safe_open
from shmstage_daemon import job

from shmstage import checkpoint
from shmstage.layout import TensorSpec


def pattern(index: int, nbytes: int) -> bytes:
    """Bytes that differ per tensor and per position, so any misplacement shows."""
    return (bytes(range(index % 7, 256)) * (nbytes // 200 + 1))[:nbytes]


def test_many_small_tensors_a_large_one_and_empty_ones_are_written_exactly(
    tmp_path: Path, instance_id: str
) -> None:
    """Small tensors are gathered into a buffer (more than fit in one), larger ones are
    written from their mappings (one over WRITE_CHUNK in several chunks), between them."""
    small = [3, 0, job.GATHER_BYTES - 1, 17]
    count = 2 * job.GATHER_BUFFER // sum(small) + 1
    sizes = small * count + [job.GATHER_BYTES, job.WRITE_CHUNK + 5, 0, 1000, 2]
    tensors = [(TensorSpec(f"t{i}", "U8", (n,)), pattern(i, n)) for i, n in enumerate(sizes)]
    persist = staged_job(tmp_path / "c", instance_id, tensors)
    result = job.run(persist)
    assert result.ok, result.message
    with safe_open(str(tmp_path / "c" / "model.safetensors"), "numpy") as f:
        for spec, payload in tensors:
            assert f.get_tensor(spec.key).tobytes() == payload, spec.key
    assert checkpoint.verify(tmp_path / "c") == []  # every per-tensor checksum matches
    assert persist.progress.written == sum(sizes)

"""The persist job, in-process on real segments and real files: what it writes is exactly
the staged bytes, however many tensors and whatever their sizes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("renameat2", ["kernel", "refused"])
def test_publishing_a_directory_never_replaces_anything_that_holds_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: str
) -> None:
    """``rename_noreplace`` with renameat2(RENAME_NOREPLACE), and with its fallback for a
    filesystem or C library that refuses it — simulated by hiding renameat2, since no such
    filesystem is at hand: a file or a non-empty directory under the new name stays."""
    if renameat2 == "refused":
        monkeypatch.setattr(job, "_renameat2", None)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "pending").mkdir()
        (tmp_path / "a-file").write_text("kept")
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "theirs").write_text("kept")
        for taken in ("a-file", "full"):
            with pytest.raises(FileExistsError):
                job.rename_noreplace(dir_fd, "pending", taken)
        assert (tmp_path / "a-file").read_text() == "kept"
        assert os.listdir(tmp_path / "full") == ["theirs"]
        job.rename_noreplace(dir_fd, "pending", "published")
        assert sorted(os.listdir(tmp_path)) == ["a-file", "full", "published"]
    finally:
        os.close(dir_fd)


def test_a_new_directory_is_published_by_rename_and_undone_on_failure(
    tmp_path: Path, instance_id: str
) -> None:
    tensors = [(TensorSpec("w", "U8", (5,)), b"hello")]
    persist = staged_job(tmp_path / "c", instance_id, tensors, new=True)
    assert job.run(persist).ok
    assert os.listdir(tmp_path) == ["c"] and checkpoint.verify(tmp_path / "c") == []
    failing = staged_job(tmp_path / "d", instance_id, tensors, new=True)
    (tmp_path / "d").mkdir()  # the final name is taken meanwhile
    result = job.run(failing)
    assert not result.ok and result.code == "exists", result.message
    assert sorted(os.listdir(tmp_path)) == ["c", "d"] and os.listdir(tmp_path / "d") == []

"""A published version as a read-only safetensors directory in /dev/shm, read back by the
real safetensors library (as SGLang's update_weights_from_disk and vLLM's disk backend
read a path): a real daemon, a real publisher, a real subscriber."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from shmstage_client import Stager, subscribe
from shmstage_client.integrations import safetensors_dir
from shmstage_client.integrations.safetensors_dir import export


def weights(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "model.embed.weight": torch.randn(128, 64, generator=generator),
        "model.layers.0.proj.weight": torch.randn(64, 64, generator=generator).bfloat16(),
        "model.layers.0.count": torch.tensor(step, dtype=torch.int64),  # 0-dim
        "model.empty": torch.empty(0, 3, dtype=torch.float16),
        "lm_head.weight": torch.randn(64, 128, generator=generator).half(),
    }


def bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def published(socket: str, name: str, step: int, **export_args: Any) -> Any:
    """Publish ``weights(step)`` and export it from a subscriber; the version is unpinned
    before this returns (the directory is a copy)."""
    with Stager(socket) as stager, subscribe(name, socket=socket) as subscriber:
        stager.publish(weights(step), name, step=step, metadata={"note": "hello"})
        with subscriber.wait(timeout=10) as version:
            return export(version, **export_args)


def test_a_version_becomes_a_read_only_safetensors_directory_the_real_library_reads(
    socket: str, name: str
) -> None:
    with published(socket, name, 3) as exported:
        path = exported.path
        assert path.parent == Path("/dev/shm")
        assert exported.files == ["model.safetensors"]
        assert bit_exact(load_file(path / "model.safetensors"), weights(3))
        with safe_open(path / "model.safetensors", "pt") as opened:
            assert opened.metadata() == {"format": "pt", "shmstage_step": "3"}
        manifest = json.loads((path / "shmstage-version.json").read_text())
        assert manifest["step"] == 3
        assert manifest["metadata"] == {"note": "hello"}
        assert manifest["files"] == ["model.safetensors"]
        assert manifest["tensors"] == 5
        for entry in [path, *path.iterdir()]:
            assert not entry.stat().st_mode & 0o222, f"{entry} is writable"
        if os.getuid() != 0:  # root writes through any mode
            with pytest.raises(PermissionError):
                open(path / "model.safetensors", "r+b")  # noqa: SIM115
            with pytest.raises(PermissionError):
                (path / "new").write_bytes(b"x")
    assert not path.exists()
    exported.close()  # again: nothing to do


def test_a_large_version_is_sharded_with_an_index_as_a_hugging_face_checkpoint(
    socket: str, name: str, tmp_path: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "tiny"}')
    with published(
        socket, name, 4, shard_bytes=20 << 10, extra_files=[config], root=tmp_path
    ) as exported:
        path = exported.path
        assert len(exported.files) == 3
        assert exported.files[0] == "model-00001-of-00003.safetensors"
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(exported.files)
        assert index["metadata"]["total_size"] == exported.nbytes
        merged: dict[str, torch.Tensor] = {}
        for file in exported.files:
            tensors = load_file(path / file)
            assert all(index["weight_map"][key] == file for key in tensors)
            merged.update(tensors)
        assert bit_exact(merged, weights(4))
        assert (path / "config.json").read_text() == '{"model_type": "tiny"}'
    assert not path.exists()


def test_a_directory_left_by_a_killed_process_is_removed_by_the_next_export(
    socket: str, name: str, tmp_path: Path
) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    left = tmp_path / f"shmstage-export-{int(dead.stdout)}-abc"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"x")
    os.chmod(left, 0o555)
    alive = tmp_path / f"shmstage-export-{os.getppid()}-def"
    alive.mkdir()
    with published(socket, name, 5, root=tmp_path) as exported:
        assert exported.path.exists()
        assert not left.exists()
        assert alive.exists()


def test_an_export_that_fails_leaves_no_directory(
    socket: str, name: str, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        published(socket, name, 6, root=tmp_path, extra_files=[tmp_path / "missing.json"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("shmstage-export-")]
    assert safetensors_dir.sweep_dead(tmp_path) == []

"""Reading checkpoints: a damaged or hostile manifest is a CheckpointError, never a crash.

A loop over many checkpoints (``shmstage verify``/``ls``, a restart script calling
``load``) must report the bad one and go on to the next.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import staged_job
from shmstage_client import CheckpointError, load
from shmstage_daemon import job

from shmstage import checkpoint, listing
from shmstage.layout import TensorSpec
from shmstage.manifest import MANIFEST_NAME


@pytest.fixture
def good(tmp_path: Path, instance_id: str) -> Path:
    """A real checkpoint written by the daemon's job: two float32 tensors."""
    spec_a, spec_b = TensorSpec("a", "F32", (2,), None), TensorSpec("b", "F32", (1,), None)
    persist = staged_job(
        tmp_path / "good", instance_id, [(spec_a, b"\x00" * 8), (spec_b, b"\x01" * 4)]
    )
    assert job.run(persist).ok
    return tmp_path / "good"


def damaged(good: Path, name: str, edit) -> Path:
    """A copy of ``good`` whose manifest text went through ``edit``."""
    path = good.with_name(name)
    path.mkdir()
    for file in good.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    manifest = path / MANIFEST_NAME
    manifest.write_text(edit(manifest.read_text()))
    return path


def with_tree(tree_text: str):
    def edit(text: str) -> str:
        document = json.loads(text)
        document["tree"] = "@TREE@"
        return json.dumps(document).replace('"@TREE@"', tree_text)

    return edit


DAMAGE = {
    "nested-500-deep": with_tree('{"l": [' * 500 + '{"T": "a"}' + "]}" * 500),
    "nested-past-the-format": with_tree('{"l": [' * 80 + '{"T": "a"}' + "]}" * 80),
    "bad-float-tag": with_tree('{"d": [["x", {"f": "zz"}], ["a", {"T": "a"}]]}'),
    "float-tag-overflow": with_tree('{"d": [["x", {"f": "0x1p99999"}], ["a", {"T": "a"}]]}'),
    "tensors-not-a-map": lambda text: text.replace('"tensors": {', '"tensors": [{', 1)
    .replace('"tree"', '"x": 1}], "tree"', 1),
    "not-json": lambda text: text[: len(text) // 2],
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_manifest_is_a_checkpoint_error_for_every_reader(good: Path, kind: str) -> None:
    bad = damaged(good, kind, DAMAGE[kind])
    problems = checkpoint.verify(bad)
    assert problems, f"{kind} verified"
    assert all(isinstance(p, str) for p in problems)
    with pytest.raises(CheckpointError):
        load(bad)
    [info] = [c for c in listing.scan(bad.parent) if c.path == bad]
    assert info.state == listing.DAMAGED, info


def test_shmstage_verify_reports_every_path_and_goes_on(good: Path, tmp_path: Path) -> None:
    bad = damaged(good, "deep", DAMAGE["nested-500-deep"])
    missing = tmp_path / "nonexistent"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "verify", str(bad), str(missing), str(a_file),
         str(good)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr
    assert f"FAIL {bad}" in out.stdout
    assert f"{missing} does not exist" in out.stdout
    assert f"{a_file} is not a directory" in out.stdout
    assert f"OK   {good}" in out.stdout, out.stdout


def test_shmstage_ls_lists_a_hostile_manifest_as_damaged(good: Path) -> None:
    damaged(good, "deep", DAMAGE["nested-500-deep"])
    out = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "ls", str(good.parent)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "damaged" in out.stdout and "complete" in out.stdout

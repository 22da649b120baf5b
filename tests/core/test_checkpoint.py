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
    # json refuses to decode an int this long with a plain ValueError
    "int-past-pythons-digit-limit": lambda text: text.replace(
        '"crc32c": ', '"crc32c": ' + "9" * 4400 + ', "x": ', 1
    ),
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


def reshaped(good: Path, name: str, **claims: object) -> Path:
    """A copy of ``good`` whose tensor "a" claims ``claims`` (``shape``, ``data_offsets``,
    ``crc32c``) in its manifest and, for shape and offsets, in its data file's header too,
    which is rewritten in place at its length: the two agree, so only the format's own
    rules can refuse the claim."""
    path = damaged(good, name, lambda text: text)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    record = manifest["tensors"]["a"]
    for field in ("shape", "crc32c"):
        record[field] = claims.get(field, record[field])
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    data = path / record["file"]
    raw = data.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    for field in ("shape", "data_offsets"):
        header["a"][field] = claims.get(field, header["a"][field])
    text = json.dumps(header).encode()
    assert len(text) <= length
    data.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length :])
    return path


HOSTILE_SHAPES = {
    # the same 8 bytes as [2], by a product of two negatives
    "negative-dims": {"shape": [-2, -1]},
    # no bytes at all, but more elements than torch (or any int64) counts
    "overflowing-dims": {"shape": [1 << 40, 1 << 40, 0], "data_offsets": [0, 0], "crc32c": 0},
    "float-dims": {"shape": [2.0]},
    "float-offsets": {"data_offsets": [0.0, 8.0]},
    "bool-dims": {"shape": [True, 2]},
    "crc-past-32-bits": {"crc32c": 1 << 40},
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_SHAPES))
def test_verify_and_load_refuse_the_same_impossible_tensor_and_name_it(
    good: Path, kind: str
) -> None:
    bad = reshaped(good, kind, **HOSTILE_SHAPES[kind])
    problems = checkpoint.verify(bad)
    assert problems, f"{kind} verified"
    assert any("'a'" in p for p in problems), problems
    with pytest.raises(CheckpointError, match="'a'"):
        load(bad, source="files")
    out = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "verify", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and f"FAIL {bad}" in out.stdout, out
    assert "Traceback" not in out.stderr, out.stderr


_PEAK_GROWTH = """
import resource, sys
from shmstage import checkpoint
import shmstage_client

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

before = peak()
if sys.argv[1] == "verify":
    problems = checkpoint.verify(sys.argv[2])
else:
    try:
        shmstage_client.load(sys.argv[2], source="files")
        problems = []
    except shmstage_client.CheckpointError as exc:
        problems = [str(exc)]
print(peak() - before)
print(problems)
"""


@pytest.mark.parametrize("reader", ["verify", "load"])
def test_a_manifest_of_tiny_objects_is_refused_before_it_costs_memory(
    good: Path, reader: str
) -> None:
    """A 16 MiB manifest padded with empty maps (25x its size once decoded: 400 MiB before
    the fix, measured as the reader process's peak RSS) costs about its own size."""
    size = 16 << 20
    pad = "[" + "{}," * (size // 3) + "0]"
    metadata = '"metadata": {"x": ' + pad + ","
    bad = damaged(good, "tiny", lambda text: text.replace('"metadata": {', metadata, 1))
    assert (bad / MANIFEST_NAME).stat().st_size > size
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_GROWTH, reader, str(bad)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    growth, problems = out.stdout.splitlines()
    assert "not a manifest shmstage wrote" in problems
    assert int(growth) < 4 * size, f"peak RSS grew {int(growth) >> 20} MiB"

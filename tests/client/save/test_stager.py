"""Stager.save through a real shmstaged: every checkpoint equals the tensors of its own save."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import ForkedScript, assert_same, clone, start_daemon, wait_for
from safetensors import safe_open
from shmstage_client import (
    CheckpointExists,
    ChecksumError,
    DaemonRefused,
    SlotUnavailable,
    Stager,
    StagingLimitExceeded,
    UnsupportedValue,
    load,
    statedict,
)
from shmstage_client.dtypes import TO_SAFETENSORS
from shmstage_client.save import slots as slots_module

from shmstage import checkpoint, segment
from shmstage.manifest import MANIFEST_NAME


def train_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model[2].to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model[2](model[1](model[0](torch.randn(8, 16))).to(torch.bfloat16)).float().sum()
    loss.backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 100,
        "rng": torch.get_rng_state(),
        "config": {
            "name": "demo",
            "dropout": 0.1,
            "sizes": (16, 32, 4),
            "note": None,
            "flags": [True, False],
        },
    }


def test_model_and_optimizer_round_trip_bit_exact(module_daemon, ckpt: Path) -> None:
    state = train_state()
    expected = clone(state)
    with Stager(module_daemon.socket) as stager:
        result = stager.save(state, ckpt / "step-100", metadata={"step": 100}).wait(60)
    assert result.bytes > 0 and result.stage_seconds >= 0 and result.persist_seconds > 0
    assert sorted(os.listdir(ckpt / "step-100")) == sorted([MANIFEST_NAME, "model.safetensors"])
    assert_same(load(ckpt / "step-100"), expected)
    assert checkpoint.verify(ckpt / "step-100") == []
    manifest = json.loads((ckpt / "step-100" / MANIFEST_NAME).read_text())
    assert manifest["metadata"] == {"step": 100}
    # Every tensor is also readable by the real safetensors library under its flat key.
    with safe_open(str(ckpt / "step-100" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.0.weight").equal(expected["model"]["0.weight"])
        assert f.get_tensor("model.2.weight").dtype == torch.bfloat16
        assert f.get_tensor("optimizer.state.0.exp_avg").equal(
            expected["optimizer"]["state"][0]["exp_avg"]
        )
        assert len(list(f.keys())) == len(manifest["tensors"])


@pytest.mark.parametrize("packed", [False, True], ids=["one-segment-each", "packed"])
def test_every_safetensors_dtype_and_awkward_tensors(
    module_daemon, ckpt: Path, packed: bool
) -> None:
    """Packed: 300 more small tensors of odd lengths make the layout pack its small tensors
    into shared segments, so every dtype's view starts at its place in a pack."""
    base = torch.arange(64, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for dtype in TO_SAFETENSORS:
        if dtype.is_floating_point or dtype.is_complex:
            state[str(dtype)] = (torch.randn(5, 3) * 4).to(dtype)
        elif dtype is torch.bool:
            state[str(dtype)] = torch.rand(7) > 0.5
        else:
            state[str(dtype)] = torch.arange(11).to(dtype)
    matrix = base.view(8, 8)
    state |= {
        "transposed": matrix.t(),  # non-contiguous
        "strided": base[::3],
        "view_a": matrix[2:4],  # two views sharing one storage
        "view_b": matrix[3:6],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
    }
    if packed:
        state |= {f"pad.{i}": torch.arange(i % 7 + 1, dtype=torch.int16) for i in range(300)}
    expected = clone(state)
    with Stager(module_daemon.socket) as stager:
        stager.save(state, ckpt / "dtypes").wait(60)
    assert_same(load(ckpt / "dtypes"), expected)
    with safe_open(str(ckpt / "dtypes" / "model.safetensors"), "pt") as f:
        for key in ("torch.float8_e4m3fn", "torch.bfloat16", "torch.bool", "transposed"):
            assert_same(f.get_tensor(key), expected[key], key)


def test_reallocation_under_unchanged_structure_saves_the_new_values(daemon, ckpt: Path) -> None:
    """Bug 1 of the brief: a cache keyed on structure repeated stale data after reallocation."""
    with Stager(daemon.socket) as stager:
        for step in range(4):
            state = {"w": torch.full((256,), float(step)), "b": torch.randn(16) + step}
            expected = clone(state)
            stager.save(state, ckpt / f"s{step}").wait(60)
            del state  # the next save gets brand-new tensors at new addresses
            assert_same(load(ckpt / f"s{step}"), expected)
        layout = stager._layouts.current
        assert layout is not None and layout.id == 1  # one registration


@pytest.mark.parametrize("slots", [1, 2])
def test_rapid_saves_mutated_right_after_return_each_equal_their_source(
    module_daemon, ckpt: Path, slots: int
) -> None:
    """Bug 2 of the brief: a buffer reused while still being written corrupts checkpoints."""
    weights = torch.zeros(1 << 18)  # 1 MiB
    extra = torch.zeros(3, 7)
    expected = []
    handles = []
    with Stager(module_daemon.socket, slots=slots) as stager:
        for step in range(12):
            weights.fill_(step)
            extra.copy_(torch.randn(3, 7))
            expected.append({"w": weights.clone(), "x": extra.clone()})
            handles.append(stager.save({"w": weights, "x": extra}, ckpt / f"s{step}"))
            weights.add_(1000)  # immediately scribble over the source
            extra.zero_()
        results = [h.wait(60) for h in handles]
    for step, want in enumerate(expected):
        assert_same(load(ckpt / f"s{step}"), want, f"checkpoint {step}")
    assert all(r.slot_wait_seconds >= 0 for r in results)


def test_structure_changes_register_new_layouts(daemon, ckpt: Path) -> None:
    states = [
        ({"a": torch.ones(4)}, None),
        ({"a": torch.ones(4), "b": torch.zeros(2)}, None),  # added key
        ({"a": torch.ones(5), "b": torch.zeros(2)}, None),  # changed shape
        ({"a": torch.ones(5), "b": torch.zeros(2)}, {"a": [0]}),
        ({"a": torch.full((5,), 7.0), "b": torch.zeros(2)}, {"a": [5]}),  # changed offset
    ]
    with Stager(daemon.socket, slots=1) as stager:
        layout_ids = []
        for i, (state, offsets) in enumerate(states):
            stager.save(state, ckpt / f"c{i}", offsets=offsets).wait(60)
            layout_ids.append(stager._layouts.current.id)
            assert_same(load(ckpt / f"c{i}"), clone(state))
        assert len(set(layout_ids)) == len(states)
        manifest = json.loads((ckpt / "c4" / MANIFEST_NAME).read_text())
        assert manifest["tensors"]["a"]["offsets"] == [5]
        # Only the current layout's segments are alive: old ones were released.
        assert len(daemon.segments()) == 2


def test_two_clients_at_once_each_get_their_own_layouts(daemon, ckpt: Path, fork_server) -> None:
    code = """
import sys, torch
from shmstage_client import Stager
sock, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(seed)
with Stager(sock, slots=2) as st:
    for i in range(5):
        state = {"w": torch.randn(1000 + seed), f"only_{seed}": torch.randn(seed + 1)}
        torch.save(state, f"{out}/expect-{seed}-{i}.pt")
        st.save(state, f"{out}/c-{seed}-{i}")
"""
    script = ckpt.parent / "client.py"
    script.write_text(code)
    procs = [  # processes of their own, forked from a server that imported torch once
        ForkedScript(script, str(daemon.socket), str(ckpt), str(seed), workdir=ckpt.parent)
        for seed in (1, 2)
    ]
    assert [p.wait(120) for p in procs] == [0, 0]
    for seed in (1, 2):
        for i in range(5):
            expected = torch.load(ckpt / f"expect-{seed}-{i}.pt")
            assert_same(load(ckpt / f"c-{seed}-{i}"), expected)
    assert daemon.segments() == []  # both clients gone: everything released


def test_existing_checkpoint_is_never_overwritten(module_daemon, ckpt: Path) -> None:
    with Stager(module_daemon.socket) as stager:
        stager.save({"a": torch.ones(3)}, ckpt / "c").wait(60)
        before = (ckpt / "c" / "model.safetensors").read_bytes()
        with pytest.raises(CheckpointExists, match="never overwrites"):
            stager.save({"a": torch.zeros(3)}, ckpt / "c")
    assert (ckpt / "c" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(ckpt / "c")) == sorted([MANIFEST_NAME, "model.safetensors"])


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"a": torch.ones(2), "bad": {1, 2}}, "state_dict['bad']: value of type builtins.set"),
        ({"q": torch.ones(2, dtype=torch.complex128)}, "tensor 'q' has dtype torch.complex128"),
        ({"s": torch.ones(2).to_sparse()}, "tensor 's'"),
        ({"m": torch.empty(2, device="meta")}, "tensor 'm'"),
    ],
)
def test_unsupported_values_fail_before_anything_is_written(
    module_daemon, ckpt: Path, state: dict, message: str
) -> None:
    before = set(module_daemon.segments())  # the module's earlier tests' (being released)
    with Stager(module_daemon.socket) as stager, pytest.raises(UnsupportedValue) as info:
        stager.save(state, ckpt / "bad")
    assert message in str(info.value) and "nothing was written" in str(info.value)
    assert not (ckpt / "bad").exists()
    assert set(module_daemon.segments()) <= before  # not one segment made for it


def test_a_tensor_that_turns_unsupported_in_an_unchanged_structure_is_still_refused(
    module_daemon, ckpt: Path
) -> None:
    """Steady-state saves skip rebuilding the layout when the tensors look the same; a
    sparse or meta tensor of the same key, dtype and shape must not slip through that."""
    with Stager(module_daemon.socket) as stager:
        stager.save({"s": torch.ones(2)}, ckpt / "good").wait(60)
        layout = stager._layouts.current
        for bad in (torch.ones(2).to_sparse(), torch.empty(2, device="meta")):
            with pytest.raises(UnsupportedValue, match="nothing was written"):
                stager.save({"s": bad}, ckpt / "bad")
            assert not (ckpt / "bad").exists()
        # A Parameter where a Tensor was is the same layout: no new registration.
        stager.save({"s": torch.nn.Parameter(torch.full((2,), 3.0))}, ckpt / "param").wait(60)
        assert stager._layouts.current is layout
    assert_same(load(ckpt / "param"), {"s": torch.full((2,), 3.0)})


def test_saving_leaves_the_garbage_collector_as_the_caller_set_it(
    module_daemon, ckpt: Path
) -> None:
    """save() holds off cyclic collection while it runs (see ``collection``)."""
    with Stager(module_daemon.socket) as stager:
        assert gc.isenabled()
        stager.save({"w": torch.ones(4)}, ckpt / "a").wait(60)
        assert gc.isenabled()
        gc.disable()
        try:
            stager.save({"w": torch.ones(4)}, ckpt / "b").wait(60)
            assert not gc.isenabled()
            with pytest.raises(UnsupportedValue):
                stager.save({"w": {1, 2}}, ckpt / "c")
            assert not gc.isenabled()
        finally:
            gc.enable()
        with pytest.raises(UnsupportedValue):
            stager.save({"w": {1, 2}}, ckpt / "c")
        assert gc.isenabled()


def test_fail_fast_when_every_slot_is_busy(module_daemon, ckpt: Path) -> None:
    big = {"w": torch.ones(32 << 20, dtype=torch.uint8)}
    with Stager(module_daemon.socket, slots=1, wait_for_slot=False) as stager:
        handles = [stager.save(big, ckpt / "first")]
        failures = 0
        for i in range(20):  # persisting 32 MiB with fsync outlasts some of these attempts
            try:
                handles.append(stager.save(big, ckpt / f"again-{i}"))
            except SlotUnavailable as exc:
                assert "busy" in str(exc)
                failures += 1
                break
        for h in handles:
            h.wait(60)
    assert failures == 1
    assert not (ckpt / f"again-{i}").exists()  # a refused save leaves no directory behind


def test_a_corrupted_file_is_caught_naming_key_and_file(module_daemon, ckpt: Path) -> None:
    with Stager(module_daemon.socket) as stager:
        stager.save({"a": torch.ones(100), "b": torch.arange(100.0)}, ckpt / "c").wait(60)
    data = ckpt / "c" / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-4] ^= 0xFF  # inside tensor "b"
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"tensor 'b' in .*model\.safetensors: checksum"):
        load(ckpt / "c")
    cli = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "verify", str(ckpt / "c")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and "checksum mismatch" in cli.stdout


def test_verify_cli_accepts_a_sound_checkpoint(module_daemon, ckpt: Path) -> None:
    with Stager(module_daemon.socket) as stager:
        stager.save(train_state(), ckpt / "ok").wait(60)
    cli = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "verify", str(ckpt / "ok")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert cli.stdout.startswith("OK")
    missing = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "verify", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "missing" in missing.stdout


def test_a_stager_that_vanishes_leaves_its_checkpoint_in_memory_until_the_ttl(
    tmp_path: Path, ckpt: Path, fork_server
) -> None:
    code = """
import os, sys, torch
from shmstage_client import Stager
st = Stager(sys.argv[1], slots=2)
st.save({"w": torch.randn(4096)}, sys.argv[2]).wait(60)
print("saved", flush=True)
os._exit(0)  # no close(), no release: as if the trainer crashed
"""
    # The TTL only has to outlast the verify and the load below (well under a second),
    # which begin as soon as the crashed trainer has exited.
    daemon = start_daemon(tmp_path / "d", "--retain-ttl", "3")
    script = tmp_path / "trainer.py"
    script.write_text(code)
    try:  # a process of its own, forked from a server that imported torch once
        stdout, stderr = ForkedScript(
            script, str(daemon.socket), str(ckpt / "c"), workdir=tmp_path
        ).communicate(timeout=120)
        assert "saved" in stdout, stderr
        assert checkpoint.verify(ckpt / "c") == []
        restored = load(ckpt / "c", with_info=True, socket=daemon.socket)
        assert restored.source == "memory"  # retained for a restart...
        assert_same(restored.state, load(ckpt / "c", source="files"))
        _wait_for(lambda: daemon.segments() == [], "the retention to end", timeout=30)
    finally:  # ...for its time-to-live only
        assert daemon.stop() == 0


def test_daemon_shutdown_unlinks_everything(daemon, ckpt: Path) -> None:
    stager = Stager(daemon.socket, slots=2)
    stager.save({"w": torch.randn(4096)}, ckpt / "c").wait(60)
    # the second slot arrives in the background after the first save (see below)
    wait_for(lambda: len(daemon.segments()) == 2, 30, "both slots' segments")
    assert daemon.stop() == 0
    assert daemon.segments() == []
    assert not daemon.socket.exists()
    assert segment.list_names(daemon.instance) == []
    stager._connection.close()


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_many_segments_register_under_a_small_descriptor_limit(
    module_daemon, ckpt: Path, fork_server
) -> None:
    """Brief bug 7: 1,200 segments arrive in batches of 253, are closed once mapped, and
    the mappings hold no descriptor: RLIMIT_NOFILE 640 suffices for 600 tensors x 2 slots."""
    _save_and_load_under_a_descriptor_limit(module_daemon, ckpt, nofile=640, tensors=600)


def test_each_batch_of_descriptors_fits_what_the_client_can_take(
    module_daemon, ckpt: Path, fork_server
) -> None:
    """With ``ulimit -n 256`` a state dict of 125 or more tensors (x 2 slots) could not be
    saved: the daemon sent 253 descriptors per message, more than the trainer had free,
    and the error blamed a leak. The client now says how many it can take per message."""
    _save_and_load_under_a_descriptor_limit(module_daemon, ckpt, nofile=256, tensors=200)


def _save_and_load_under_a_descriptor_limit(
    daemon, ckpt: Path, *, nofile: int, tensors: int
) -> None:
    """A process limited to ``nofile`` descriptors saves ``tensors`` small tensors in two
    slots and loads them back bit-exact."""
    code = f"""
import resource, sys, torch
resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))
from shmstage_client import Stager, load
state = {{f"t{{i}}": torch.full((3,), float(i)) for i in range({tensors})}}
with Stager(sys.argv[1], slots=2) as st:
    st.save(state, sys.argv[2]).wait(120)
back = load(sys.argv[2])
assert all(torch.equal(back[k], v) for k, v in state.items())
print("ok")
"""
    stdout, stderr = _trainer(code, daemon, ckpt)
    assert stdout.strip() == "ok", stderr[-2000:]


def _trainer(code: str, daemon, ckpt: Path) -> tuple[str, str]:
    """``code`` run as a trainer of its own (``python trainer.py SOCKET CKPT/c``), forked
    from a server that imported torch once; its output."""
    script = ckpt.parent / "trainer.py"
    script.write_text(code)
    forked = ForkedScript(script, str(daemon.socket), str(ckpt / "c"), workdir=ckpt.parent)
    return forked.communicate(timeout=180)


def test_a_descriptor_limit_too_low_to_work_names_the_limit_to_raise(
    module_daemon, ckpt: Path, fork_server
) -> None:
    code = """
import os, resource, sys, torch
from shmstage_client import SaveError, Stager
stager = Stager(sys.argv[1])
in_use = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 20, in_use + 20))
try:
    stager.save({"w": torch.ones(3)}, sys.argv[2])
except SaveError as exc:
    print("REFUSED", exc)
"""
    stdout, stderr = _trainer(code, module_daemon, ckpt)
    assert stdout.startswith("REFUSED"), stderr[-2000:]
    assert "RLIMIT_NOFILE is" in stdout and "raise the limit to at least" in stdout
    assert not (ckpt / "c").exists()


def test_a_stager_grows_its_descriptor_table_before_its_first_save(
    module_daemon, ckpt: Path, fork_server
) -> None:
    """In a process with threads each growth of the table waits for an RCU grace period
    (``shmstage.descriptors``): a Stager grows it when made, so that its first save's
    registration finds room for two batches of segments already."""
    code = """
import os, sys
from shmstage import descriptors
from shmstage.protocol import MAX_FDS_PER_FRAME
from shmstage_client import Stager
before = descriptors.table_size()
with Stager(sys.argv[1]):
    in_use = len(os.listdir("/proc/self/fd"))
    print(before, descriptors.table_size(), in_use + 2 * MAX_FDS_PER_FRAME)
"""
    stdout, stderr = _trainer(code, module_daemon, ckpt)
    before, size, need = map(int, stdout.split())
    assert before < need <= size, stderr[-2000:]


def test_a_large_layout_is_created_on_several_threads_and_saved_exactly(daemon, ckpt: Path) -> None:
    """Above segment.PARALLEL_MIN_BYTES per thread the daemon reserves segments on several
    threads (and a CUDA client pins them so): every segment still lands in its place."""
    count = 128 << 20  # int8 elements: 2 tensors x 2 slots = 512 MiB, 2+ setup groups
    state = {
        "a": torch.arange(count, dtype=torch.int32).to(torch.int8),
        "b": torch.arange(count, dtype=torch.int32).mul_(7).to(torch.int8),
        "small": torch.arange(10.0),
    }
    assert len(segment.setup_groups([count, count, 40] * 2)) >= min(2, os.cpu_count() or 1)
    with Stager(daemon.socket, slots=2) as stager:
        stager.save(state, ckpt / "one").wait(120)
        state["a"].neg_()
        stager.save(state, ckpt / "two").wait(120)  # the second slot
        assert len(daemon.segments()) == 6
    assert_same(load(ckpt / "two"), state)
    state["a"].neg_()
    assert_same(load(ckpt / "one"), state)


def test_pinning_pieces_never_split_a_tensor() -> None:
    """CUDA refuses a copy into host memory that spans two registrations, so a slot is
    registered in pieces cut only where one segment ends and the next begins."""
    sizes = [(100 << 20) + 3, 4096, 300 << 20, 1, 700 << 20, 50 << 20]
    region = segment.Region(sizes)  # address space only: nothing is mapped or touched
    try:
        pieces = slots_module._pieces(region)
        starts = [piece.data_ptr() - region.address for piece in pieces]
        assert starts[0] == 0 and set(starts) <= set(region.offsets)
        assert sum(piece.numel() for piece in pieces) == region.size
        assert len(pieces) > 1  # 1.1 GiB: worth several threads
    finally:
        region.close()


def test_a_first_save_sets_up_one_slot_and_the_next_save_overlaps_its_write(
    tmp_path: Path, ckpt: Path
) -> None:
    """The save that stalls training creates one slot; the second arrives in the
    background, so the next save still fills a slot while the first checkpoint is written
    (here held mid-stream by the daemon's fault hook, only for the first job)."""
    daemon = start_daemon(tmp_path / "daemon", env={"SHMSTAGE_FAULT": "pause-mid-stream:5@1"})
    try:
        state = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(4096)}
        expected_first = clone(state)
        with Stager(daemon.socket) as stager:  # the daemon's default: 2 slots
            first = stager.save(state, ckpt / "first")
            assert "2 tensors x 1 slot(s)" in daemon.log()
            daemon.wait_log("fault: pausing at mid-stream")
            state["a"].add_(1)
            second = stager.save(state, ckpt / "second")
            assert not first.done()  # the second save did not wait for the first write
            assert second.timings.slot_wait_seconds < 2.5
            second.wait(60)
            first.wait(60)
            assert len(stager._layouts.current.slots) == 2 and stager._layouts.current.growth.done()
        assert "added 1 slot(s) to layout" in daemon.log()
        assert_same(load(ckpt / "first"), expected_first)
        assert_same(load(ckpt / "second"), state)
    finally:
        daemon.discard()


def test_a_save_never_fills_a_slot_while_it_is_still_being_faulted_in(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second slot arrives in the background and is faulted in there by a
    read-modify-write of a byte per page. A save granted that slot meanwhile must wait:
    copied under the prefault, a byte per page of it would be put back to what the
    prefault read (the soak caught this as a checkpoint that differed from its source).

    The prefault is slowed down here — read, pause, write back, which is what ``add_(0)``
    does in a few nanoseconds — because the real one is too quick to hit on purpose; what
    it wrote back then shows in the slot (read from memory) rather than in the file."""
    faulting, real = threading.Event(), slots_module.prefault
    page = 4096

    def slow_prefault(buffer: torch.Tensor) -> None:
        before = buffer[::page].clone()
        faulting.set()
        threading.Event().wait(0.5)
        buffer[::page].copy_(before)
        real(buffer)

    monkeypatch.setattr(slots_module, "prefault", slow_prefault)
    first = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB: 1,024 pages
    second = {"w": torch.arange(1 << 20, dtype=torch.float32) + 0.5}
    expected = clone(second)
    with Stager(daemon.socket, slots=2) as stager:
        stager.save(first, ckpt / "a").wait(60)  # slot 1 comes, and is faulted in, now
        assert faulting.wait(30), "the added slot was never faulted in"
        handle = stager.save(second, ckpt / "b")  # slot 1: it holds nothing, slot 0 job 1
        second["w"].fill_(-7)  # the trainer moves on
        handle.wait(60)
        stager._layouts.current.growth.result(30)  # the prefault has written back what it read
        in_memory = load(ckpt / "b", source="memory", socket=daemon.socket)
        assert_same(in_memory, expected)  # the slot, as the daemon wrote it
    assert "added 1 slot(s) to layout" in daemon.log()
    assert_same(load(ckpt / "b", source="files"), expected)


def test_a_save_waits_for_the_prefault_of_its_own_slot_only(
    module_daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With three slots, two arrive in the background and are faulted in one after the
    other: a save granted the first of them need not wait for the second's prefault."""
    release, original = threading.Event(), slots_module.MappedLayout.prefault_slot

    def held_back(self: slots_module.MappedLayout, index: int, threads: int) -> None:
        if index == 2:
            release.wait(30)  # the third slot's prefault takes as long as the test says
        original(self, index, threads)

    monkeypatch.setattr(slots_module.MappedLayout, "prefault_slot", held_back)
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    try:
        with Stager(module_daemon.socket, slots=3) as stager:
            stager.save(state, ckpt / "a").wait(60)
            wait_for(lambda: stager._layouts.current.ready == 2, 30, "the second slot to be ready")
            started = time.monotonic()
            second = stager.save({"w": state["w"] + 1}, ckpt / "b")  # slot 1, ready
            waited = time.monotonic() - started
            assert not release.is_set() and waited < 10, f"save() took {waited:.1f} s"
            release.set()
            second.wait(60)
            grown = stager._layouts.current
            assert grown.growth.result(30) is None and grown.ready == 3
    finally:
        release.set()
    assert_same(load(ckpt / "b", source="files"), {"w": state["w"] + 1})


def test_slots_one_never_asks_for_more(module_daemon, ckpt: Path) -> None:
    log_before = len(module_daemon.log())  # the module's earlier tests' lines
    with Stager(module_daemon.socket, slots=1) as stager:
        stager.save({"w": torch.ones(8)}, ckpt / "a").wait(60)
        stager.save({"w": torch.zeros(8)}, ckpt / "b").wait(60)
        assert len(stager._layouts.current.slots) == 1 and stager._layouts.current.growth is None
    assert "added" not in module_daemon.log()[log_before:]


def test_a_new_structure_while_slots_are_still_being_added_releases_the_old_cleanly(
    daemon, ckpt: Path
) -> None:
    """The background request adding the first layout's slots may still run when the next
    save brings another structure: the old layout is released and unmapped only once that
    request ended, and nothing of it stays in /dev/shm."""
    first = {f"t{i}": torch.full((4096,), float(i)) for i in range(300)}
    second = {"other": torch.arange(10.0)}
    with Stager(daemon.socket) as stager:
        stager.save(first, ckpt / "a")
        old = stager._layouts.current
        stager.save(second, ckpt / "b").wait(60)  # right away: a new layout
        assert old.growth is not None and old.growth.done() and not old.slots
        stager.save(second, ckpt / "c").wait(60)
        assert len(stager._layouts.current.slots) == 2
        assert_same(load(ckpt / "c"), second)
    assert_same(load(ckpt / "a"), first)
    wait_for(lambda: not daemon.segments(), 10, "every segment unlinked after close()")


def test_an_impossible_slot_count_is_refused_naming_the_range(
    module_daemon, ckpt: Path
) -> None:
    for slots in (0, 99):
        refusal = r"slots=\d+: this daemon allows 1\.\.8"
        with (
            Stager(module_daemon.socket, slots=slots) as stager,
            pytest.raises(DaemonRefused, match=refusal),
        ):
            stager.save({"w": torch.ones(4)}, ckpt / f"s{slots}")
        assert not (ckpt / f"s{slots}").exists()


def test_slots_refused_after_the_first_save_leave_a_working_layout_and_a_warning(
    tmp_path: Path, ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Registration checks the budget for every planned slot, but the slots themselves come
    later: another layout may take the room in between. The first layout then keeps its
    one slot — its saves wait for the previous write — and the trainer is told once."""
    mib = 1 << 20
    daemon = start_daemon(tmp_path / "daemon", "--shm-budget", str(5 * mib // 2))
    try:
        with Stager(daemon.socket) as first, Stager(daemon.socket, slots=1) as other:
            gate = threading.Event()
            first._background.submit(gate.wait, 60)  # holds back the request for slot 2
            first.save({"w": torch.ones(mib // 4)}, ckpt / "a").wait(60)  # 1 of 2 MiB
            other.save({"v": torch.ones(mib // 4)}, ckpt / "b").wait(60)  # the other MiB
            with caplog.at_level(logging.WARNING, logger="shmstage.client"):
                gate.set()
                first._layouts.current.growth.result(60)
            assert "keeps 1 of its 2 slots" in caplog.text and "budget" in caplog.text
            assert len(first._layouts.current.slots) == 1 and first._layouts.current.whole
            first.save({"w": torch.zeros(mib // 4)}, ckpt / "c").wait(60)
        assert_same(load(ckpt / "c"), {"w": torch.zeros(mib // 4)})
    finally:
        daemon.discard()


def test_a_structure_change_while_slots_are_being_added_warns_of_nothing(
    module_daemon, ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The layout a save stops using is released on purpose: a request still adding slots
    to it (held back here until the release is under way) fails with unknown_layout, and
    that is no news for the trainer — it used to read "keeps 1 of its 2 slots: adding the
    others failed (unknown_layout)"."""
    warnings = caplog.at_level(logging.WARNING, "shmstage.client")
    with Stager(module_daemon.socket) as stager, warnings:
        gate = threading.Event()
        stager._background.submit(gate.wait, 60)  # holds back the request for slot 2
        stager.save({"w": torch.ones(16)}, ckpt / "a").wait(60)
        grown = stager._layouts.current
        threading.Timer(1.0, gate.set).start()  # once the next save is replacing the layout
        stager.save({"w": torch.ones(16), "v": torch.ones(8)}, ckpt / "b").wait(60)
        grown.growth.result(60)
        stager.save({"w": torch.ones(16), "v": torch.ones(8)}, ckpt / "c").wait(60)
    assert "keeps" not in caplog.text and "unknown_layout" not in caplog.text, caplog.text
    assert_same(load(ckpt / "c"), {"w": torch.ones(16), "v": torch.ones(8)})


def test_after_reserve_the_first_save_registers_nothing_and_finds_every_slot_faulted_in(
    daemon, ckpt: Path
) -> None:
    """reserve() pays for the layout before the loop: one registration, every slot added
    and faulted in, so the first save's setup is a lookup and asks the daemon for no slot."""
    state = {f"t{i}": torch.full((4096,), float(i)) for i in range(50)}
    with Stager(daemon.socket, slots=3) as stager:
        info = stager.reserve(state)
        mapped = stager._layouts.current
        assert (info.layout, info.slots, info.changed) == (mapped.id, 3, True)
        assert info.bytes == 3 * sum(mapped.layout.packing().sizes) and info.pinned == 0
        assert len(mapped.slots) == mapped.ready == 3 and mapped.growth is None
        assert "50 tensors x 1 slot(s)" in daemon.log() and "added 2 slot(s)" in daemon.log()
        log_before = daemon.log()
        handles = [stager.save(state, ckpt / f"c{i}") for i in range(2)]
        for handle in handles:
            handle.wait(60)
        assert stager._layouts.current is mapped and mapped.growth is None
        assert daemon.log().count("registered layout") == 1
        assert "added" not in daemon.log()[len(log_before) :]
        assert handles[0].timings.setup_seconds < 0.05, handles[0].timings
    assert_same(load(ckpt / "c1"), state)


def test_after_reserve_no_save_of_the_same_structure_flattens_it_again(
    module_daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reserve() remembers the state dict's structure at once (a Stager otherwise first
    remembers it in its second save, a flatten's cost again inside that save's stall), so
    the loop's first save already finds its tensors in bulk; the checkpoint is the same."""
    flattened: list[int] = []
    full_flatten = statedict._flatten

    def counted(state_dict: object) -> tuple:
        flattened.append(1)
        return full_flatten(state_dict)

    monkeypatch.setattr(statedict, "_flatten", counted)  # a spy: counts, changes nothing
    state = {"model": {f"t{i}": torch.full((64,), float(i)) for i in range(20)}, "step": 7}
    with Stager(module_daemon.socket, slots=2) as stager:
        stager.reserve(state)
        assert len(flattened) == 1
        for i in range(2):
            state["model"]["t0"].fill_(i)
            stager.save(state, tmp_path / f"c{i}").wait(60)
        assert len(flattened) == 1, "a save after reserve() flattened the structure again"
    assert_same(load(tmp_path / "c1"), state)


def test_reserved_slots_are_faulted_in_on_the_callers_thread(
    module_daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    faulted: list[tuple[int, str]] = []
    original = slots_module.MappedLayout.prefault_slot

    def noted(self: slots_module.MappedLayout, index: int, threads: int) -> None:
        faulted.append((index, threading.current_thread().name))
        original(self, index, threads)

    monkeypatch.setattr(slots_module.MappedLayout, "prefault_slot", noted)
    with Stager(module_daemon.socket, slots=2) as stager:
        stager.reserve({"w": torch.ones(1 << 16)})
    me = threading.current_thread().name
    assert faulted == [(0, me), (1, me)]


def test_reserving_the_same_structure_twice_does_nothing_the_second_time(
    daemon, ckpt: Path
) -> None:
    state = {"w": torch.ones(1024), "step": 3}
    with Stager(daemon.socket) as stager:
        assert stager.reserve(state).changed
        again = stager.reserve({"w": torch.zeros(1024), "step": 4})  # new values, same layout
        assert not again.changed and again.slots == 2
        stager.save(state, ckpt / "a").wait(60)
        assert not stager.reserve(state).changed
    assert daemon.log().count("registered layout") == 1
    assert daemon.log().count("added 1 slot(s)") == 1


def test_a_save_of_another_structure_after_reserve_registers_its_own_layout(
    daemon, ckpt: Path
) -> None:
    reserved = {"w": torch.ones(1024)}
    other = {"w": torch.ones(1024), "b": torch.arange(8.0)}
    with Stager(daemon.socket) as stager:
        stager.reserve(reserved)
        first = stager._layouts.current
        stager.save(other, ckpt / "other").wait(60)
        assert stager._layouts.current is not first and not first.slots  # released, unmapped
        stager.save(reserved, ckpt / "back").wait(60)
    assert_same(load(ckpt / "other"), other)
    assert_same(load(ckpt / "back"), reserved)
    assert daemon.log().count("registered layout") == 3


def test_reserve_refuses_an_unsupported_value_naming_its_key(module_daemon) -> None:
    before = set(module_daemon.segments())  # the module's earlier tests' (being released)
    with Stager(module_daemon.socket) as stager, pytest.raises(UnsupportedValue, match="'bad'"):
        stager.reserve({"a": torch.ones(2), "bad": {1, 2}})
    assert set(module_daemon.segments()) <= before  # not one segment made for it


def test_reserve_beyond_the_budget_is_refused_as_a_save_would_be(tmp_path: Path) -> None:
    mib = 1 << 20
    daemon = start_daemon(tmp_path / "daemon", "--shm-budget", str(mib))
    try:
        with Stager(daemon.socket) as stager:
            with pytest.raises(StagingLimitExceeded) as reserved:
                stager.reserve({"w": torch.ones(mib)})  # 4 MiB x 2 slots
            with pytest.raises(StagingLimitExceeded) as saved:
                stager.save({"w": torch.ones(mib)}, tmp_path / "c")
        assert str(reserved.value) == str(saved.value)
    finally:
        daemon.discard()

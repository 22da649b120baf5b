"""The GPU fast path: pinned segments, side-stream copies, one event wait, nothing device-wide;
and non-blocking saves whose copy a guard lets run behind the next step.

These run only where CUDA is present (the GPU machine); everywhere else they are skipped.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from harness import assert_same
from shmstage_client import SaveTimeout, Stager, cudart, load
from shmstage_client.pinning import PinError, try_pin
from shmstage_client.restore import device_checks, host_staging, transfer

from shmstage import segment

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_each_slot_is_pinned_once_before_its_first_copy(daemon, ckpt: Path) -> None:
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pinning failure would warn
        with Stager(daemon.socket, slots=2) as stager:
            stager.save(state, ckpt / "a").wait(60)
            assert stager.pinned
            pinned = stager._layouts.current.pinned
            # The first save pinned only its own slot, as one range: the slot's segments
            # lie back to back (segment.Region); 2 would mean the driver refused the
            # whole-slot range and it fell back per tensor.
            assert list(pinned) == [0] and len(pinned[0]) == 1
            first = pinned[0]
            stager._layouts.current.growth.result(60)
            stager.save(state, ckpt / "b").wait(60)  # slot 1, added after the first save
            assert sorted(pinned) == [0, 1] and len(pinned[1]) == 1
            stager.save(state, ckpt / "c").wait(60)
            assert stager._layouts.current.pinned[0] is first  # reused, not registered again
    assert torch.equal(load(ckpt / "c")["w"], state["w"].cpu())


def test_reserve_pins_every_slot_before_the_first_save(daemon, ckpt: Path) -> None:
    """reserve() pins every slot on the caller's thread, so no save pins any: the ranges
    the saves copy into are the very ones reserve() registered."""
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pinning failure would warn
        with Stager(daemon.socket, slots=3) as stager:
            info = stager.reserve(state)
            pinned = dict(stager._layouts.current.pinned)
            assert info.slots == info.pinned == 3 and sorted(pinned) == [0, 1, 2]
            for i in range(3):
                stager.save(state, ckpt / f"c{i}").wait(60)
            assert stager._layouts.current.pinned == pinned
            assert not stager.reserve(state).changed
    assert_same(load(ckpt / "c2"), {k: v.cpu() for k, v in state.items()})


def test_cpu_only_state_is_not_pinned(daemon, ckpt: Path) -> None:
    with Stager(daemon.socket) as stager:
        stager.save({"w": torch.ones(10)}, ckpt / "a").wait(60)
        assert not stager.pinned


def test_in_place_updates_after_save_never_reach_the_checkpoint(daemon, ckpt: Path) -> None:
    # 8 Mi float32 values stay exact under +1 steps (below 2**24); 32 MiB per save.
    source = torch.arange(8 << 20, device="cuda", dtype=torch.float32)
    snapshots = []
    with Stager(daemon.socket, slots=2) as stager:
        handles = []
        for step in range(4):
            source.add_(1.0)  # pending on the caller's stream when save() starts
            snapshots.append(source.cpu())  # (this synchronizes only the test's view)
            source.add_(1.0)
            handles.append(stager.save({"w": source}, ckpt / f"s{step}"))
            source.mul_(-1.0)  # in-place right after save() returns
            source.mul_(-1.0)
        for handle in handles:
            handle.wait(120)
    for step in range(4):
        assert torch.equal(load(ckpt / f"s{step}")["w"], snapshots[step] + 1.0)


def test_work_on_other_streams_does_not_delay_save(daemon, ckpt: Path) -> None:
    state = {"w": torch.randn(1 << 20, device="cuda")}
    with Stager(daemon.socket) as stager:
        stager.save(state, ckpt / "warm").wait(60)  # registration out of the way
        busy = torch.cuda.Stream()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(int(3e9))  # ~2 s of spinning on another stream
        started = time.perf_counter()
        handle = stager.save(state, ckpt / "during")
        stall = time.perf_counter() - started
        still_busy = not busy.query()
        handle.wait(60)
        busy.synchronize()
    assert still_busy, "the other stream finished first: the test proves nothing"
    assert stall < 0.5, f"save() waited {stall:.2f} s: it synchronized more than its stream"
    assert torch.equal(load(ckpt / "during")["w"], state["w"].cpu())


def test_a_failed_registration_warns_once_and_leaves_cuda_usable() -> None:
    buffer = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()  # already page-locked
    with pytest.warns(RuntimeWarning, match="could not pin the staging segments"):
        assert try_pin([buffer]) is None
    # The sticky error was cleared: unrelated CUDA work runs and reports no stale error.
    x = torch.ones(1024, device="cuda") * 2
    torch.cuda.current_stream().synchronize()
    assert float(x.sum()) == 2048.0


def test_layouts_unregister_before_unmapping(daemon, ckpt: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for round_ in range(3):  # new mappings may land where old ones were
            with Stager(daemon.socket) as stager:
                stager.save({"w": torch.randn(1 << 18, device="cuda")}, ckpt / f"r{round_}")
                assert stager.pinned
            # a structure change also replaces (and so unregisters) a layout
        with Stager(daemon.socket) as stager:
            stager.save({"a": torch.randn(10, device="cuda")}, ckpt / "x").wait(60)
            stager.save({"a": torch.randn(11, device="cuda")}, ckpt / "y").wait(60)
            assert stager.pinned


def test_cpu_and_cuda_tensors_in_one_state_and_a_move_between_saves(daemon, ckpt: Path) -> None:
    """Copies are grouped per device; the groups follow the tensors when they move."""
    state = {
        "gpu": torch.randn(1 << 16, device="cuda"),
        "cpu": torch.randn(1 << 10),
        "gpu_strided": torch.randn(64, 128, device="cuda").t(),
        "step": 7,
    }
    with Stager(daemon.socket) as stager:
        stager.save(state, ckpt / "mixed").wait(60)
        layout = stager._layouts.current
        moved = {**state, "cpu": state["cpu"].cuda(), "gpu": state["gpu"].cpu()}
        stager.save(moved, ckpt / "moved").wait(60)
        assert stager._layouts.current is layout  # same structure: the segments are reused
    for name, source in (("mixed", state), ("moved", moved)):
        loaded = load(ckpt / name)
        for key in ("gpu", "cpu", "gpu_strided"):
            assert torch.equal(loaded[key], source[key].cpu()), (name, key)
        assert loaded["step"] == 7


def test_a_large_layout_pinned_in_pieces_saves_every_tensor_exactly(daemon, ckpt: Path) -> None:
    """Above segment.PARALLEL_MIN_BYTES a slot is pinned as several pieces on several
    threads; copies into tensors on either side of a cut must still land (a copy spanning
    two registrations would fail with cudaErrorInvalidValue)."""
    state = {f"t{i}": torch.randn((37 << 18) + 7 * i, device="cuda") for i in range(16)}
    with Stager(daemon.socket, slots=2) as stager:
        for name in ("a", "b", "c"):  # both slots, then the first again
            stager.save(state, ckpt / name).wait(120)
            pinned = stager._layouts.current.pinned
            assert pinned and all(len(ranges) >= 2 for ranges in pinned.values())
            loaded = load(ckpt / name)
            assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
            for tensor in state.values():
                tensor.add_(1.0)


# -- non-blocking saves behind a guard (issue 14) ---------------------------------------


def _cuda_trainer(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """64 MiB of fp32 weights and their AdamW state on the GPU, after one step. Fused AdamW
    keeps its step counters on the GPU; the foreach one keeps them on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
    _cuda_step(model, optimizer, 0)
    return model, optimizer


def _cuda_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(64, 4096, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _on_cpu(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_cpu(v) for v in state)
    return state


@pytest.mark.parametrize("fused", [True, False], ids=["fused (steps on GPU)", "foreach"])
def test_a_guarded_save_returns_before_its_copy_and_the_step_waits_on_the_device(
    daemon, ckpt: Path, fused: bool
) -> None:
    """save(block=False) returns while the caller's stream is still busy (its copy queued
    behind it), the optimizer step right after it returns on the host at once (its stream
    waits for the copy's event), and the checkpoint is the state at the call."""
    model, optimizer = _cuda_trainer(fused)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    with Stager(daemon.socket, slots=2) as stager:
        stager.guard(optimizer)
        stager.save(state, ckpt / "warm").wait(60)  # registers and pins
        torch.cuda.current_stream().synchronize()
        want = _on_cpu(state)
        torch.cuda._sleep(int(3e9))  # ~2 s on the caller's stream: the copy waits behind it
        started = time.perf_counter()
        handle = stager.save(state, ckpt / "late", block=False)
        stall = time.perf_counter() - started
        with pytest.raises(SaveTimeout):
            handle.staged(timeout=0)  # still queued
        started = time.perf_counter()
        _cuda_step(model, optimizer, 1)
        host_step = time.perf_counter() - started
        still_busy = not torch.cuda.current_stream().query()
        result = handle.wait(120)
    assert still_busy, "the stream drained first: the test proves nothing"
    assert stall < 0.5, f"save() waited {stall:.2f} s for the caller's stream"
    assert host_step < 0.5, f"the guarded step held the host {host_step:.2f} s"
    assert result.timings.deferred_copy_seconds > 0
    assert_same(load(ckpt / "late"), want)


def test_an_unguarded_cuda_tensor_is_copied_before_a_non_blocking_save_returns(
    daemon, ckpt: Path
) -> None:
    model, optimizer = _cuda_trainer(True)
    buffer = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "buffer": buffer}
    with Stager(daemon.socket) as stager:
        stager.guard(optimizer)
        torch.cuda.current_stream().synchronize()
        want = _on_cpu(state)
        handle = stager.save(state, ckpt / "c", block=False)
        buffer.mul_(-1.0)  # outside the optimizer: must already be copied
        _cuda_step(model, optimizer, 1)
        result = handle.wait(120)
    assert result.timings.deferred_copy_seconds > 0
    assert_same(load(ckpt / "c"), want)


def test_guarded_saves_every_step_of_a_cuda_loop_are_each_the_state_at_the_call(
    daemon, ckpt: Path
) -> None:
    """12 steps, a non-blocking save after each, the next step at once: every checkpoint
    equals a snapshot taken at its call (slots=2, so saves also wait for earlier copies)."""
    model, optimizer = _cuda_trainer(True)
    wants, handles = [], []
    with Stager(daemon.socket, slots=2) as stager:
        stager.guard(optimizer)
        for step in range(12):
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
            torch.cuda.current_stream().synchronize()
            wants.append(_on_cpu(state))
            handles.append(stager.save(state, ckpt / f"s{step}", block=False))
            _cuda_step(model, optimizer, step + 1)
        for handle in handles:
            handle.wait(120)
    for handle, want in zip(handles, wants, strict=True):
        assert_same(load(handle.path), want)


def _gpu_state() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(3)
    return {
        "big": torch.randn(40 << 20, device="cuda", generator=gen),  # 160 MiB: three chunks
        "flags": torch.ones(3, dtype=torch.bool, device="cuda"),
        "h": torch.randn(1000, device="cuda", generator=gen).to(torch.bfloat16),
    }


def test_restore_to_the_gpu_from_memory_and_from_files_is_bit_exact(daemon, ckpt: Path) -> None:
    """Memory and files both pass through staging buffers the restore registers with CUDA
    and gives back after; both bit-exact, and CUDA stays usable (no sticky error)."""
    state = _gpu_state()
    with Stager(daemon.socket) as stager:
        stager.save(state, ckpt / "c").wait(120)
        memory = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
        files = load(ckpt / "c", device="cuda", with_info=True, source="files")
    assert (memory.source, files.source) == ("memory", "files")
    for restored in (memory, files):
        for key, tensor in state.items():
            assert restored.state[key].device.type == "cuda"
            assert torch.equal(restored.state[key].view(torch.uint8), tensor.view(torch.uint8))
    torch.cuda.synchronize()
    assert torch.ones(1, device="cuda").item() == 1.0


def _flip(daemon, position: int) -> None:
    """Flip a bit of a byte of the largest segment (as the daemon's uid: real)."""
    big = max(daemon.segments(), key=lambda n: os.stat(segment.SHM_DIR + n).st_size)
    with open(segment.SHM_DIR + big, "r+b") as shm:
        shm.seek(position)
        byte = shm.read(1)
        shm.seek(position)
        shm.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.filterwarnings("ignore:.*could not pin the staging segments")  # copies="torch"
@pytest.mark.parametrize("copies", ["cudart", "torch"])
def test_pieces_of_a_chunk_are_checked_as_one_and_a_corrupt_byte_in_any_is_caught(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch, copies: str
) -> None:
    """A reader passes each chunk through its pinned pieces in turn, continuing each
    tensor's checksum from piece to piece; a flipped byte in any piece sends the restore
    to the files. With ``copies="torch"`` the copies go through ``Tensor.copy_``, as where
    torch links its CUDA runtime statically — which cannot be had here, so loading the
    runtime is made to fail (a stand-in for that reason only)."""
    monkeypatch.setattr(host_staging, "CHUNK", 1 << 20)
    monkeypatch.setattr(host_staging, "PIECE", 256 << 10)  # four pieces per chunk
    monkeypatch.setattr(transfer, "DEVICE_CHECKSUMS", False)
    host_staging._SPARES.free()
    if copies == "torch":

        def static() -> cudart.Runtime:
            raise cudart.CudaError("torch's libcudart is not loaded as a shared library")

        monkeypatch.setattr(cudart, "runtime", static)
    state = _gpu_state()  # "big": 160 MiB, 640 pieces
    with Stager(daemon.socket, slots=1) as stager:
        stager.save(state, ckpt / "c").wait(120)
        good = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
        assert (good.source, good.verified) == ("memory", True)
        assert_same(good.state, state)
        for position in ((5 << 20) + (300 << 10) + 7, (9 << 20) + (700 << 10)):
            _flip(daemon, position)
            result = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
            assert result.source == "files" and "checksum mismatch" in result.reason
            assert "'big'" in result.reason
            assert_same(result.state, state)
            _flip(daemon, position)  # mended: memory serves again
            mended = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
            assert mended.source == "memory"


def test_a_restore_to_the_gpu_is_checked_on_the_device_and_a_corrupt_byte_is_caught(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked to (SHMSTAGE_DEVICE_CHECKSUMS=1), the device computes every tensor's CRC-32C
    itself (the host never reads the staging buffers again); one flipped byte deep inside
    a large tensor, or in its last block, sends the restore to the files, which hold the
    right bytes."""
    checked: list[int] = []
    finish = device_checks.DeviceChecksums.finish

    def counting(self: device_checks.DeviceChecksums) -> list[int]:
        values = finish(self)
        checked.append(len(values))
        return values

    monkeypatch.setattr(device_checks.DeviceChecksums, "finish", counting)
    monkeypatch.setattr(host_staging, "CHUNK", 1 << 20)  # many chunks, checked as they land
    monkeypatch.setattr(transfer, "DEVICE_CHECKSUMS", True)  # SHMSTAGE_DEVICE_CHECKSUMS=1
    device_checks.warm_up(torch.device("cuda"))  # as from a process's third restore
    checked.clear()
    gen = torch.Generator(device="cuda").manual_seed(3)
    state = {
        "big": torch.randn((3 << 20) + 5, device="cuda", generator=gen),
        **_gpu_state(),
    }
    with Stager(daemon.socket, slots=1) as stager:
        stager.save(state, ckpt / "c").wait(120)
        good = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
        assert (good.source, good.verified) == ("memory", True)
        assert_same(good.state, state)
        assert checked == [len(state)]
        for position in ((5 << 20) + 3, state["big"].nbytes - 2):
            _flip(daemon, position)
            result = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
            assert result.source == "files" and "checksum mismatch" in result.reason
            assert "'big'" in result.reason
            assert_same(result.state, state)
            _flip(daemon, position)  # mended for the next position


def test_a_process_checks_on_the_host_until_its_second_restore_warms_the_device_up(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the checks' kernels costs a new process more than host checks do, so a
    restarted trainer's one restore checks on the host; after a second restore the
    kernels load in the background and later restores check on the device."""
    monkeypatch.setattr(transfer, "DEVICE_CHECKSUMS", True)  # SHMSTAGE_DEVICE_CHECKSUMS=1
    monkeypatch.setattr(transfer, "_HOST_CHECKED", {})
    monkeypatch.setattr(device_checks, "_WARM", set())
    monkeypatch.setattr(device_checks, "_WARMING", set())
    on_device: list[bool] = []
    run = transfer._Transfer.run

    def noting(self: transfer._Transfer) -> dict[str, torch.Tensor]:
        try:
            return run(self)
        finally:
            on_device.append(self._checks is not None)

    monkeypatch.setattr(transfer._Transfer, "run", noting)
    state = _gpu_state()
    with Stager(daemon.socket) as stager:
        stager.save(state, ckpt / "c").wait(120)
        for _ in range(2):
            assert_same(load(ckpt / "c", device="cuda", socket=daemon.socket), state)
        assert on_device == [False, False]
        deadline = time.monotonic() + 60
        while not device_checks.ready(torch.device("cuda")):
            assert time.monotonic() < deadline, "the device's checks never warmed up"
            time.sleep(0.05)
        restored = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
        assert (restored.source, restored.verified, on_device) == (
            "memory",
            True,
            [False] * 2 + [True],
        )
        assert_same(restored.state, state)


@pytest.mark.parametrize("registered", [True, False])
def test_back_to_back_restores_reuse_their_staging_and_free_it_when_idle(
    daemon, ckpt: Path, monkeypatch: pytest.MonkeyPatch, registered: bool
) -> None:
    """A restore leaves its staging buffers to the next one of the process, which frees
    them after a while unused, unregistering each before unmapping it (registering a
    range that was unmapped while registered fails with error 712); where registering is
    refused, torch's pinned memory serves."""
    monkeypatch.setattr(host_staging, "CHUNK", 1 << 20)  # many small buffers
    monkeypatch.setattr(host_staging, "KEEP_STAGING_S", 0.5)
    host_staging._SPARES.free()
    if not registered:

        def refuse(*args: object) -> None:
            raise PinError("refused by the test")

        monkeypatch.setattr(host_staging, "register_range", refuse)
    state = _gpu_state()
    with Stager(daemon.socket) as stager:
        stager.save(state, ckpt / "c").wait(120)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                restored = load(ckpt / "c", device="cuda", with_info=True, socket=daemon.socket)
                assert restored.source == "memory"
                assert_same(restored.state, state)
            assert host_staging._SPARES._buffers  # kept for the next restore
            time.sleep(1.5)
            assert host_staging._SPARES._buffers == []
            # the freed addresses are mapped again and registered anew
            assert_same(load(ckpt / "c", device="cuda", socket=daemon.socket), state)
    assert torch.ones(1, device="cuda").item() == 1.0


_PREPARED_RESTART = """
import sys, threading, torch
from shmstage_client import latest, prepare_restore
from shmstage_client.restore import host_staging
made = []
class Counted(host_staging._HostBuffer):
    def __init__(self, *args, **kwargs):
        made.append(threading.current_thread().name)
        super().__init__(*args, **kwargs)
host_staging._HostBuffer = Counted
torch.cuda.init()
prepare_restore("cuda")
model = torch.zeros(1 << 20, device="cuda")  # the start-up the staging is made beside
restored = latest(device="cuda", socket=sys.argv[1])
torch.save({key: value.cpu() for key, value in restored.state.items()}, sys.argv[2])
print(restored.source, restored.verified, ",".join(made))
"""


def test_a_restart_that_prepares_first_restores_through_the_staging_made_meanwhile(
    daemon, ckpt: Path
) -> None:
    """A restart script calls ``prepare_restore`` before it builds its model: the staging
    is made meanwhile on a thread, and ``latest()`` takes it instead of making its own,
    bit-exact and verified."""
    state = _gpu_state()
    out = ckpt / "restored.pt"
    with Stager(daemon.socket) as stager:
        stager.save(state, ckpt / "c").wait(120)
        run = subprocess.run(
            [sys.executable, "-c", _PREPARED_RESTART, str(daemon.socket), str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["memory", "True", "shmstage-staging"]
    assert_same({k: v.cuda() for k, v in torch.load(out).items()}, state)


def _published_state(step: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(1024, 1024, generator=generator),  # 4 MiB: many pieces of 64 KiB
        "layers": [torch.randint(0, 1 << 30, (100_000,), generator=generator), torch.ones(7)],
        "step": step,
    }


def _count_ring_registrations(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A subscriber's ring registers in 64 KiB pieces (many, for small states); returns
    the list each registration's size is appended to, as it goes on to CUDA."""
    from shmstage_client import pinning
    from shmstage_client.subscribe import ring

    monkeypatch.setattr(ring, "PIECE_BYTES", 64 << 10)
    calls: list[object] = []
    register = pinning.register_range

    def counted(*args: object) -> None:
        calls.append(args[1])
        register(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pinning, "register_range", counted)
    return calls


def _count_staged_copies(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The list each copy of a version through pinned staging appends its ``verify`` to."""
    from shmstage_client.subscribe import version as version_module

    staged: list[bool] = []
    real = version_module.transfer

    def counted(source, placements, device, **kwargs):  # type: ignore[no-untyped-def]
        staged.append(kwargs.get("verify", True))
        return real(source, placements, device, **kwargs)

    monkeypatch.setattr(version_module, "transfer", counted)
    return staged


def test_a_first_version_goes_through_staging_and_the_next_straight_from_its_registered_slot(
    daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new subscriber's first version is copied through the pinned staging, bit-exact,
    registering nothing on its way; its slot registers once the copy is done, and the next
    version in that slot copies straight from the registration, registering nothing again
    (whole, verified and streamed in buckets that span pieces)."""
    from shmstage_client import subscribe

    calls = _count_ring_registrations(monkeypatch)
    staged = _count_staged_copies(monkeypatch)
    with Stager(daemon.socket, slots=1) as stager, subscribe("g", socket=daemon.socket) as sub:
        first = _published_state(1)
        stager.publish(first, "g", step=1)
        with sub.wait(timeout=30) as version:
            ring = version._ring
            assert not ring.direct(version._slot)
            assert_same(version.state("cuda", verify=False), first)
            assert staged == [False]
            assert ring.registered(60)  # started by the copy's end, in the background
            registration = ring._registrations[version._slot]
            assert len(registration.pieces) > 50 and all(d.result() for d in registration.done)
            assert len(calls) == len(registration.pieces)
        second = _published_state(2)
        stager.publish(second, "g", step=2)
        with sub.wait(newer_than=1, timeout=30) as version:
            assert version._ring.direct(version._slot)
            assert version._ring._registrations[version._slot] is registration
            assert_same(version.state("cuda"), second)
            streamed = dict(version.tensors("cuda", bucket_bytes=100 << 10))  # spans pieces
            assert torch.equal(streamed["w"].cpu(), second["w"])
            assert torch.equal(streamed["layers.0"].cpu(), second["layers"][0])
            assert_same(version.state("cuda", verify=True), second)
            assert version.verified
        assert staged == [False], "a copy from a registered slot went through staging"
        assert len(calls) == len(registration.pieces)  # nothing registered again
    assert torch.ones(1, device="cuda").item() == 1.0


def test_a_verified_first_version_is_checked_as_it_passes_the_staging(daemon) -> None:
    """``verify=True`` on a slot's first version: read and checksummed in one pass through
    the staging, bit-exact, ``verified``; a streamed first version too."""
    from shmstage_client import subscribe

    with Stager(daemon.socket, slots=2) as stager, subscribe("v", socket=daemon.socket) as sub:
        for step in (1, 2):  # one in each slot: both first versions there
            state = _published_state(step)
            stager.publish(state, "v", step=step)
            with sub.wait(newer_than=step - 1, timeout=30) as version:
                assert not version._ring.direct(version._slot)
                if step == 1:
                    assert_same(version.state("cuda", verify=True), state)
                else:
                    streamed = dict(version.tensors("cuda", bucket_bytes=1 << 20, verify=True))
                    assert torch.equal(streamed["w"].cpu(), state["w"])
                    assert torch.equal(streamed["layers.1"].cpu(), state["layers"][1])
                assert version.verified


def test_a_slot_cuda_refuses_midway_warns_once_and_copies_through_staging(
    daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA refusing a registration cannot be caused on demand: the test refuses the fourth
    call itself. Once it refused, every copy goes through the staging, bit-exact, with one
    warning for the ring; the pieces registered stay registered (released with the ring)."""
    from shmstage_client import pinning, subscribe
    from shmstage_client.subscribe import ring

    monkeypatch.setattr(ring, "PIECE_BYTES", 64 << 10)
    register = pinning.register_range
    calls = []

    def refuse_after_three(*args: object) -> None:
        calls.append(args[1])
        if len(calls) > 3:
            raise PinError("refused by the test")
        register(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pinning, "register_range", refuse_after_three)
    with Stager(daemon.socket, slots=1) as stager, subscribe("r", socket=daemon.socket) as sub:
        state = _published_state(3)
        stager.publish(state, "r", step=3)
        with sub.wait(timeout=30) as version:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # staged: nothing refused yet
                assert_same(version.state("cuda"), state)
            assert version._ring.registered(60)
            with pytest.warns(RuntimeWarning, match="could not register the published slots"):
                assert_same(version.state("cuda"), state)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert_same(version.state("cuda"), state)
            done = version._ring._registrations[version._slot].done
            registered = [d.result() for d in done]  # the pieces start in order, on 2 threads
            assert registered[0] and sum(registered) == 3 and not any(registered[5:])
    assert torch.ones(1, device="cuda").item() == 1.0


# -- gathering small tensors on the device before their copy to the host (save.gather) --

_GATHER_DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool,
    torch.float64, torch.int32, torch.float8_e4m3fn,
]


def _many_small(count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` CUDA tensors of every dtype, 0 B to ~16 KiB, a few of 2 MiB (direct), one
    empty, about one in ten strided (column-major, or every other column of a wider one),
    filled with random bytes (NaN payloads included: the copies must keep every bit)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sizes = torch.randint(1, 2048, (count,), generator=gen, device="cuda").tolist()
    state = {}
    for i, elements in enumerate(sizes):
        dtype = _GATHER_DTYPES[i % len(_GATHER_DTYPES)]
        if i == 5:
            shape: tuple[int, ...] = (0, 3)
        elif i % 10007 == 11:
            shape = (1024, 512)  # over the gather threshold for any dtype but one byte
        else:
            shape = (max(1, elements // 4), 4)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
        tensor = raw.view(dtype).view(shape) if dtype != torch.bool else (raw > 127).view(shape)
        if i % 10 == 3 and tensor.numel():
            tensor = tensor.t().contiguous().t()
        elif i % 10 == 7 and tensor.numel():
            wide = torch.empty((shape[0], shape[1] * 2), dtype=dtype, device="cuda")
            wide[:, ::2] = tensor
            tensor = wide[:, ::2]
        state[f"t{i:06d}"] = tensor
    return state


def _rewrite(tensors: Iterable[torch.Tensor], seed: int) -> None:
    """New random bytes into every tensor, in place, through its own strides."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
        fresh = raw > 127 if tensor.dtype == torch.bool else raw.view(tensor.dtype)
        tensor.copy_(fresh.view(tensor.shape))


def test_gather_saves_100k_mixed_small_cuda_tensors_bit_exact_within_the_scratch_bound(
    daemon, ckpt: Path
) -> None:
    """100,000 tensors of nine dtypes, strided ones and an empty one among them: two saves
    (the second after every tensor changed in place, so each is its own save's bytes) land
    bit-exact, through the gather (small ones in batches, large ones direct), and the
    device never holds more than the bound for it."""
    bound = 8 << 20
    state = _many_small(100_000, seed=7)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with Stager(daemon.socket, slots=2, gather_bytes=bound) as stager:
        stager.save(state, ckpt / "a").wait(300)  # allocates the scratch
        peak = torch.cuda.max_memory_allocated() - before
        kept = torch.cuda.memory_allocated() - before
        want_a = _on_cpu(state)
        _rewrite(state.values(), seed=8)  # its temporaries are not the save's: peak reset
        want_b = _on_cpu(state)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() - before
        stager.save(state, ckpt / "b").wait(300)
        peak = max(peak, torch.cuda.max_memory_allocated() - before - held + kept)
        gatherer = stager._copier._gatherer
        [prepared] = gatherer._prepared.values()
        gathered = sum(len(r.members) for b in prepared.plan.batches for r in b.runs)
    assert gathered > 90_000, f"only {gathered} of 100,000 tensors were gathered"
    large = {i for i, t in enumerate(state.values()) if t.numel() * t.itemsize >= 1 << 20}
    assert len(large) >= 5 and large <= set(prepared.plan.direct)  # 1 MiB and up: direct
    assert_same(load(ckpt / "a"), want_a)  # the bytes first: they matter most
    assert_same(load(ckpt / "b"), want_b)
    assert 0 < kept <= bound, f"the scratch kept is {kept} bytes"
    # A direct copy of a tensor with gaps (every other column) goes through a dense copy of
    # it on the device, gathering or not: that one (4 MiB of int64 here) is not the gather's.
    dense_copy = max(
        (t.numel() * t.itemsize
        for i, t in enumerate(state.values())
        if i in large and not (t.is_contiguous() or t.t().is_contiguous())),
        default=0,
    )
    assert peak <= bound + dense_copy + (1 << 20), f"the saves held {peak} bytes of device memory"


def test_gather_of_a_guarded_non_blocking_save_is_the_state_at_the_call(
    daemon, ckpt: Path
) -> None:
    """Thousands of small parameters and their AdamW state, saved with block=False after
    every step and the next step queued at once: the gathered copy read every source
    before the step rewrote it (the step's stream waits for the one event), and each
    checkpoint is the state at its call. reserve() made the plans the saves use."""
    torch.manual_seed(0)
    params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(int(n), device="cuda"))
        for n in torch.randint(1, 3000, (3000,))
    )
    optimizer = torch.optim.AdamW(params.parameters(), lr=1e-2, fused=True)

    def step(seed: int) -> None:
        torch.manual_seed(seed)
        sum((p * torch.randn_like(p)).sum() for p in params).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    wants, handles = [], []
    with Stager(daemon.socket, slots=2, gather_bytes=1 << 20) as stager:
        stager.guard(optimizer)
        stager.reserve({"model": params.state_dict(), "optim": optimizer.state_dict()})
        made = dict(stager._copier._gatherer._prepared)  # blocking, and guarded's passes
        assert {key[2] for key in made} == {"now", "later"}, sorted(key[2:] for key in made)
        for i in range(6):
            state = {"model": params.state_dict(), "optim": optimizer.state_dict()}
            torch.cuda.current_stream().synchronize()
            wants.append(_on_cpu(state))
            torch.cuda._sleep(int(2e8))  # the copy waits behind the caller's stream
            handles.append(stager.save(state, ckpt / f"s{i}", block=False))
            step(i + 1)
        for handle in handles:
            handle.wait(120)
        kept = stager._copier._gatherer._prepared
        assert all(kept[key] is plan for key, plan in made.items())  # reserve's, reused
        assert any(p.plan.batches for p in kept.values())
    for handle, want in zip(handles, wants, strict=True):
        assert_same(load(handle.path), want)


def test_reserve_runs_the_gathers_once_so_the_first_save_launches_no_new_kernel(
    daemon, ckpt: Path
) -> None:
    """reserve() gathers the small tensors into the scratch once, device-side, so that the
    kernels' modules are loaded (CUDA loads them lazily, at a kernel's first launch) before
    the loop and not inside its first save's copy; nothing reaches the slot meanwhile."""
    # More tensors than PACK_FROM_TENSORS: only packed small tensors share a segment, and
    # only tensors that share one are gathered.
    state = {f"w{i}": torch.randn(300 + i, device="cuda") for i in range(400)}
    with Stager(daemon.socket, slots=1, gather_bytes=1 << 20) as stager:
        stager.reserve(state)
        torch.cuda.synchronize()
        (scratch,) = stager._copier._gatherer._scratch.values()
        gathered = scratch.cpu().numpy().tobytes()
        for key, tensor in state.items():
            assert tensor.cpu().numpy().tobytes() in gathered, key
        slot = stager._layouts.current.slots[0]
        assert not any(view.any() for view in slot), "reserve() copied to the host"
        stager.save(state, ckpt / "a").wait(60)
    assert_same(load(ckpt / "a"), {k: v.cpu() for k, v in state.items()})


def test_gather_falls_back_to_direct_copies_with_one_warning_when_its_scratch_cannot_be_had(
    daemon, ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The process's CUDA memory is capped at what it holds (a real allocation failure):
    the scratch is refused, the save copies each tensor directly, bit-exact, and says so
    once. The cap alone was not enough in the full GPU run (the save gathered, with no
    warning): a segment the caching allocator keeps for an earlier test's live tensor can
    have a free block the scratch fits in, so the free blocks of 16 MiB or more are taken
    first; the scratch wants 31 MiB."""
    state = {f"w{i}": torch.randn(2000, device="cuda") for i in range(4000)}  # 32 MB
    gc.collect()  # earlier tests' cycles, and the device memory only they still hold
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (2 << 20)) / total)
    balloon = []
    try:
        while True:  # ends at the cap: nothing is freed meanwhile
            balloon.append(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    try:
        with Stager(daemon.socket, gather_bytes=64 << 20) as stager:
            stager.save(state, ckpt / "a").wait(60)
            stager.save(state, ckpt / "b").wait(60)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del balloon
    warned = [r for r in caplog.records if "to gather small tensors" in r.getMessage()]
    assert len(warned) == 1, torch.cuda.memory_summary(abbreviated=True)
    assert_same(load(ckpt / "b"), _on_cpu(state))


def test_a_subscriber_prepared_before_the_first_publish_copies_it_bit_exact_registering_nothing(
    daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher offers its reserved layout; the subscriber maps and registers every
    slot of it (``prepare``) before a version exists; the first versions, one in each
    slot, land bit-exact on the device through those registrations, registering nothing."""
    from shmstage_client import subscribe

    calls = _count_ring_registrations(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a registration CUDA refused would warn
        with Stager(daemon.socket, slots=2) as stager, subscribe(
            "p", socket=daemon.socket
        ) as sub:
            stager.reserve(_published_state(0))
            stager.offer("p")
            assert sub.prepare("cuda", timeout=60, block=True) == 2
            (prepared,) = sub._rings.values()
            registrations = dict(prepared._registrations)
            assert sorted(registrations) == sorted(prepared._regions)
            assert all(d.result() for r in registrations.values() for d in r.done)
            registered = len(calls)
            assert registered == sum(len(r.pieces) for r in registrations.values()) > 100
            for step in (1, 2):
                state = _published_state(step)
                stager.publish(state, "p", step=step)
                with sub.wait(newer_than=step - 1, timeout=30) as version:
                    assert version._ring is prepared
                    assert version._ring._registrations[version._slot] is (
                        registrations[version._slot]
                    )
                    assert_same(version.state("cuda"), state)
            assert len(calls) == registered, "a prepared slot was registered again"
    assert torch.ones(1, device="cuda").item() == 1.0

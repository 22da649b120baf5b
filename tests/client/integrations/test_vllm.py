"""The vLLM backend's work on CPU: a real daemon, a real publisher, and a tiny model whose
``load_weights`` takes an iterable of ``(name, tensor)`` as vLLM's models do.

vLLM itself cannot be installed here (nor on the GPU machine): the backend class is
tested against a stand-in of the two vLLM modules it touches (``weight_transfer.base``'s
``WeightTransferEngine`` and ``weight_transfer.factory``'s registry), written from vLLM's
source — the only mock in this file, because that one cannot be had for real.
"""

from __future__ import annotations

import abc
import dataclasses
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from shmstage_client import Stager
from shmstage_client.integrations import vllm as shmstage_vllm
from shmstage_client.integrations.vllm import IncompleteUpdate, WeightReceiver


class TinyModel(torch.nn.Module):
    """Loads weights as vLLM's models do: from an iterable of (checkpoint name, tensor),
    each copied into the parameter of that name."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        self.seen_buffers: list[torch.Tensor] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        parameters = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            self.seen_buffers.append(tensor)
            with torch.no_grad():
                parameters[name].copy_(tensor)
            loaded.add(name)
        return loaded


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ours, theirs = a.state_dict(), b.state_dict()
    return ours.keys() == theirs.keys() and all(
        torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in ours
    )


@pytest.fixture
def stager(socket: str) -> Iterator[Stager]:
    with Stager(socket, slots=2) as made:
        yield made


def test_an_update_loads_the_published_step_bit_exactly_and_reports_it_once_finished(
    socket: str, name: str, stager: Stager
) -> None:
    trainer, rollout = TinyModel(seed=1), TinyModel(seed=2)
    receiver = WeightReceiver(name, socket=socket)
    try:
        stager.publish(trainer.state_dict(), name, step=1)
        receiver.start()
        assert receiver.receive(rollout.load_weights, step=1, timeout=10) == 1
        assert receiver.loaded_step is None  # not reported before finish
        assert receiver.finish() == 1
        assert receiver.loaded_step == 1
        assert same(trainer, rollout)

        with torch.no_grad():
            trainer.proj.weight.add_(1)
        stager.publish(trainer.state_dict(), name, step=2)
        receiver.start()
        assert receiver.receive(rollout.load_weights, timeout=10) == 2  # the newest
        assert receiver.finish() == 2
        assert same(trainer, rollout)
    finally:
        receiver.close()


def test_tensors_reach_load_weights_a_bucket_at_a_time_never_as_a_second_whole_copy(
    socket: str, name: str, stager: Stager
) -> None:
    trainer, rollout = TinyModel(seed=3), TinyModel(seed=4)
    bucket = 8 << 10  # the largest tensor is 8 KiB: several buckets
    receiver = WeightReceiver(name, socket=socket, bucket_bytes=bucket)
    try:
        stager.publish(trainer.state_dict(), name, step=5)
        receiver.start()
        receiver.receive(rollout.load_weights, step=5, timeout=10)
        receiver.finish()
    finally:
        receiver.close()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in rollout.seen_buffers}
    whole = sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert len(storages) > 1
    assert all(s.nbytes() <= bucket for s in storages.values())
    assert bucket < whole
    assert same(trainer, rollout)


def test_a_load_weights_that_stops_early_leaves_the_update_without_a_version(
    socket: str, name: str, stager: Stager
) -> None:
    trainer, rollout = TinyModel(seed=5), TinyModel(seed=6)

    def takes_one(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rollout.load_weights([next(iter(weights))])

    receiver = WeightReceiver(name, socket=socket)
    try:
        stager.publish(trainer.state_dict(), name, step=1)
        receiver.start()
        with pytest.raises(IncompleteUpdate, match="took 1 of the 4 tensors of step 1"):
            receiver.receive(takes_one, step=1, timeout=10)
        with pytest.raises(IncompleteUpdate, match=r"no version .* was loaded whole"):
            receiver.finish()
        assert receiver.loaded_step is None
        with pytest.raises(IncompleteUpdate, match="call start_weight_update first"):
            receiver.receive(rollout.load_weights, step=1, timeout=10)
        # the next update loads it whole
        receiver.start()
        receiver.receive(rollout.load_weights, step=1, timeout=10)
        assert receiver.finish() == 1
        assert same(trainer, rollout)
    finally:
        receiver.close()


def test_a_step_already_replaced_by_a_newer_one_is_refused_naming_the_newest(
    socket: str, name: str, stager: Stager
) -> None:
    trainer, rollout = TinyModel(seed=7), TinyModel(seed=8)
    receiver = WeightReceiver(name, socket=socket)
    try:
        stager.publish(trainer.state_dict(), name, step=3)
        stager.publish(trainer.state_dict(), name, step=4)
        receiver.start()
        with pytest.raises(IncompleteUpdate, match="newest version is step 4: ask for step 4"):
            receiver.receive(rollout.load_weights, step=3, timeout=10)
        receiver.receive(rollout.load_weights, step=4, timeout=10)
        assert receiver.finish() == 4
    finally:
        receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_every_bucket_lands_in_the_models_parameters_there(
    socket: str, name: str, stager: Stager
) -> None:
    trainer, rollout = TinyModel(seed=11), TinyModel(seed=12).cuda()
    receiver = WeightReceiver(name, socket=socket, device="cuda", bucket_bytes=8 << 10)
    try:
        for step in (1, 2):
            with torch.no_grad():
                trainer.proj.bias.add_(step)
            stager.publish(trainer.state_dict(), name, step=step)
            receiver.start()
            receiver.receive(rollout.load_weights, step=step, timeout=10)
            assert receiver.finish() == step
            assert all(t.is_cuda for t in rollout.seen_buffers)
            assert same(trainer, rollout.cpu())
            rollout.cuda()
    finally:
        receiver.close()


# -- the backend class, against a stand-in of vLLM's modules --------------------------


def standin_vllm() -> dict[str, types.ModuleType]:
    """The vLLM modules the backend imports, reduced to what it touches: the engine base
    class (the newer signature: config, vllm_config, device, model; update_weights parses
    its dict and calls receive_weights) and the factory's lazy registry."""
    base = types.ModuleType("vllm.distributed.weight_transfer.base")

    @dataclasses.dataclass
    class WeightTransferInitInfo(abc.ABC):  # noqa: B024
        pass

    @dataclasses.dataclass
    class WeightTransferUpdateInfo(abc.ABC):  # noqa: B024
        pass

    class WeightTransferEngine(abc.ABC):
        init_info_cls: type
        update_info_cls: type

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            self.config, self.vllm_config, self.device, self.model = (
                config, vllm_config, device, model
            )
            self.model_config = vllm_config.model_config

        def parse_init_info(self, info: dict[str, Any]) -> Any:
            return self.init_info_cls(**info)

        def update_weights(self, info: dict[str, Any]) -> None:
            self.receive_weights(self.update_info_cls(**info))

        @abc.abstractmethod
        def init_transfer_engine(self, init_info: Any) -> None: ...
        @abc.abstractmethod
        def start_weight_update(self) -> None: ...
        @abc.abstractmethod
        def receive_weights(self, update_info: Any) -> None: ...
        @abc.abstractmethod
        def finish_weight_update(self) -> None: ...
        @abc.abstractmethod
        def shutdown(self) -> None: ...

    base.WeightTransferInitInfo = WeightTransferInitInfo  # type: ignore[attr-defined]
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo  # type: ignore[attr-defined]
    base.WeightTransferEngine = WeightTransferEngine  # type: ignore[attr-defined]

    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")

    class WeightTransferEngineFactory:
        _registry: dict[str, Any] = {}  # noqa: RUF012

        @classmethod
        def register_engine(cls, name: str, module: str, class_name: str) -> None:
            if name in cls._registry:
                raise ValueError(f"{name} is already registered")
            cls._registry[name] = lambda: getattr(sys.modules[module], class_name)

        @classmethod
        def create_engine(cls, config: Any, vllm_config: Any, device: Any, model: Any) -> Any:
            return cls._registry[config.backend]()(config, vllm_config, device, model)

    factory.WeightTransferEngineFactory = WeightTransferEngineFactory  # type: ignore[attr-defined]
    modules = {"vllm": types.ModuleType("vllm")}
    for package in ("vllm.distributed", "vllm.distributed.weight_transfer"):
        modules[package] = types.ModuleType(package)
    modules[base.__name__] = base
    modules[factory.__name__] = factory
    return modules


@pytest.fixture
def vllm_standin(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    if "vllm" in sys.modules or _installed("vllm"):
        pytest.skip("a real vLLM is installed: this stand-in must not shadow it")
    modules = standin_vllm()
    for module_name, module in modules.items():
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.setattr(shmstage_vllm, "_ENGINE_CLASS", None)
    return modules


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_the_registered_backend_subclasses_vllms_engine_and_runs_its_four_phases(
    socket: str, name: str, stager: Stager, vllm_standin: dict[str, types.ModuleType]
) -> None:
    base = vllm_standin["vllm.distributed.weight_transfer.base"]
    factory = vllm_standin["vllm.distributed.weight_transfer.factory"].WeightTransferEngineFactory
    shmstage_vllm.register()
    shmstage_vllm.register()  # a second registration does nothing
    trainer, rollout = TinyModel(seed=9), TinyModel(seed=10)
    config = types.SimpleNamespace(backend="shmstage")
    vllm_config = types.SimpleNamespace(model_config=None, parallel_config=None)
    engine = factory.create_engine(config, vllm_config, torch.device("cpu"), rollout)
    assert isinstance(engine, base.WeightTransferEngine)
    recorded: list[str | None] = []

    def finish(weight_version: str | None) -> None:
        """As LLM.finish_weight_update: the workers' finish, then the version recorded."""
        engine.finish_weight_update()
        recorded.append(weight_version)

    try:
        engine.init_transfer_engine(engine.parse_init_info({"channel": name, "socket": socket}))
        stager.publish(trainer.state_dict(), name, step=11)
        engine.start_weight_update()
        engine.update_weights({"step": 11, "timeout": 10})
        finish("11")
        assert recorded == ["11"]
        assert same(trainer, rollout)

        engine.start_weight_update()  # an update in which nothing landed
        with pytest.raises(IncompleteUpdate):
            finish("12")
        assert recorded == ["11"]
    finally:
        engine.shutdown()


def test_without_vllm_the_backend_class_names_what_to_install() -> None:
    if _installed("vllm"):
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match="needs vLLM with weight-transfer engines"):
        shmstage_vllm.engine_class()
    with pytest.raises(ImportError, match="pip install vllm"):
        shmstage_vllm.register()


def test_importing_the_module_imports_no_vllm(fresh_imports: dict[str, Any]) -> None:
    """In a fresh interpreter (``conftest.FRESH_IMPORTS``)."""
    assert fresh_imports["vllm"] == []

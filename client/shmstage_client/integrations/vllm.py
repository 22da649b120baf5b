"""vLLM through shmstage: a weight-transfer backend named ``"shmstage"``.

A trainer on the node publishes each step's weights (``Stager.publish(state, "policy",
step=step)``, named as the model's checkpoint names them, as vLLM's ``load_weights``
takes them). vLLM's workers follow the channel and load each version straight out of
the daemon's memory — no NCCL group, no CUDA IPC handle, no file::

    # in every vLLM process (the workers too): the plugin entry point does it, see below
    from shmstage_client.integrations import vllm as shmstage_vllm
    shmstage_vllm.register()
    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="shmstage"))
    # (vllm serve ... --weight-transfer-config '{"backend": "shmstage"}')
    llm.init_weight_transfer_engine({"init_info": {"channel": "policy"}})
    # each step, after the trainer's publish of step 7:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": 7}})
    llm.finish_weight_update("7")

vLLM builds the engine inside each worker process, which may be spawned: the backend
must be registered there too. vLLM runs its ``vllm.general_plugins`` entry points in
every process, and ``register`` is meant to be one (``[project.entry-points.
"vllm.general_plugins"] shmstage = "shmstage_client.integrations.vllm:register"``; until
the client package declares it, declare it in a package of your own). ``register`` may
run any number of times. vLLM versions whose ``WeightTransferConfig.backend`` is a fixed
list of names refuse any other name before the factory is asked.

vLLM drives the four phases on every worker. ``init_transfer_engine`` subscribes to the
channel (``init_info``: ``channel``, and optionally ``owner``, ``socket``,
``bucket_bytes``); ``start_weight_update`` opens an update; ``update_weights`` pins the
version (``update_info``: ``step``, the one the trainer published — or none for the
newest — and ``timeout`` in seconds to wait for it), streams its tensors onto the
worker's device a bucket at a time into ``model.load_weights`` and unpins it;
``finish_weight_update`` succeeds only when every tensor of that one version was
consumed by the model, and raises otherwise — so ``LLM.finish_weight_update(version)``,
which records the version string after its workers' ``finish_weight_update`` returns,
never records a version whose tensors did not all land. No engine swaps weights
atomically: the model holds a mix of two versions while ``load_weights`` runs, and after
a failed update until the next one succeeds; what shmstage guarantees is that what it
hands over is one version, never torn (it is pinned throughout). With several workers
(tensor parallel), pass ``step``: each worker pins for itself, and "the newest" could
differ between two workers while the trainer publishes.

What was tested, and what was not: the core (``WeightReceiver``: follow, pin, stream in
buckets, count what landed, report the step) is tested on CPU against a real daemon and a
tiny torch model whose ``load_weights`` takes an iterable of ``(name, tensor)`` as vLLM's
models do; the backend class is tested against a stand-in for vLLM's
``vllm.distributed.weight_transfer`` modules (``WeightTransferEngine``, the factory's
``register_engine``), written from vLLM's source, because vLLM cannot be installed here
nor on the GPU machine. No vLLM engine has run this backend yet.

vLLM is imported only when ``register()`` runs or the backend class is first asked for,
so importing this module costs nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import torch

from shmstage_client.errors import SaveError
from shmstage_client.subscribe.subscriber import Subscriber, subscribe
from shmstage_client.subscribe.version import BUCKET_BYTES

#: The name the backend registers under: ``--weight-transfer-config '{"backend": "shmstage"}'``.
BACKEND: Final = "shmstage"
#: Seconds ``update_weights`` waits for the asked step by default.
UPDATE_TIMEOUT: Final = 600.0

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


class IncompleteUpdate(SaveError):
    """An update did not load every tensor of one version: its version must not be
    reported (the model may hold a mix of two versions until the next update)."""


class WeightReceiver:
    """The backend's work, without vLLM: follow channel ``channel`` and load its versions
    into a model through a ``load_weights``-style callable, reporting a version's step
    only once every one of its tensors was consumed.

    One update is ``start()``, ``receive(load_weights, step=...)`` (again after a failure,
    if wanted) and ``finish()``. ``loaded_step`` is the step the model holds whole (None
    before the first finished update, and while an update is open)."""

    def __init__(
        self,
        channel: str,
        *,
        device: str | torch.device = "cpu",
        owner: int | str | None = None,
        socket: str | os.PathLike[str] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.channel = channel
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.subscriber: Subscriber = subscribe(channel, owner=owner, socket=socket)
        self.loaded_step: int | None = None
        #: The step received whole in the open update (None: none yet), and whether one is open.
        self._received: int | None = None
        self._open = False
        self._last_step: int | None = None

    def start(self) -> None:
        """Open an update: until ``finish`` succeeds, no step is reported."""
        if self._open:
            raise IncompleteUpdate(
                f"an update of channel {self.channel!r} is already open: finish it "
                "(finish_weight_update) before starting another"
            )
        self._open = True
        self._received = None
        self.loaded_step = None

    def receive(
        self,
        load_weights: LoadWeights,
        *,
        step: int | None = None,
        timeout: float | None = UPDATE_TIMEOUT,
    ) -> int:
        """Pin version ``step`` (None: the newest one newer than the last loaded, waiting
        at most ``timeout`` seconds for it), hand its tensors to ``load_weights`` as one
        iterable streamed a bucket at a time onto the device, and check that every tensor
        was taken. Returns the step received. Raises IncompleteUpdate when the version
        asked for is no longer the newest (a newer one was published first: ask for that
        one), or when ``load_weights`` returned before taking every tensor."""
        if not self._open:
            raise IncompleteUpdate(
                f"no update of channel {self.channel!r} is open: call start_weight_update first"
            )
        self._received = None
        newer_than = self._last_step if step is None else step - 1
        with self.subscriber.wait(newer_than=newer_than, timeout=timeout) as version:
            if step is not None and version.step != step:
                raise IncompleteUpdate(
                    f"asked for step {step} of channel {self.channel!r}, but the newest "
                    f"version is step {version.step}: ask for step {version.step} (or for "
                    "none: the newest)"
                )
            landed = _Counted(version.tensors(self.device, bucket_bytes=self.bucket_bytes))
            load_weights(landed)
            expected = len(version.specs)
            if not landed.exhausted or landed.count != expected:
                raise IncompleteUpdate(
                    f"load_weights took {landed.count} of the {expected} tensors of step "
                    f"{version.step} of channel {self.channel!r}: the model may hold a mix "
                    "of two versions; update again"
                )
        self._received = version.step
        self._last_step = version.step
        return version.step

    def finish(self) -> int:
        """Close the update; its step, only if one version landed whole since ``start``
        (otherwise IncompleteUpdate, and the update is closed without a step)."""
        if not self._open:
            raise IncompleteUpdate(f"no update of channel {self.channel!r} is open to finish")
        self._open = False
        if self._received is None:
            raise IncompleteUpdate(
                f"no version of channel {self.channel!r} was loaded whole in this update: "
                "its version is not reported; run update_weights again in a new update"
            )
        self.loaded_step = self._received
        return self._received

    def close(self) -> None:
        self.subscriber.close()


class _Counted:
    """The version's tensors as handed to ``load_weights``, counting what it took."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._tensors = tensors
        self.count = 0
        self.exhausted = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self._tensors:
            self.count += 1
            yield item
        self.exhausted = True


# -- vLLM ------------------------------------------------------------------------------


_ENGINE_CLASS: type | None = None


def engine_class() -> type:
    """``ShmStageWeightTransferEngine``: built on first use as a subclass of vLLM's
    ``WeightTransferEngine`` (importing vLLM), then kept."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        _ENGINE_CLASS = _build_engine_class()
    return _ENGINE_CLASS


def register(name: str = BACKEND) -> None:
    """Register the backend with vLLM's weight-transfer factory under ``name`` (by module
    path: vLLM builds the class when a config names it). Once per process; a second call
    does nothing."""
    factory = _import_vllm("vllm.distributed.weight_transfer.factory")
    registry = factory.WeightTransferEngineFactory
    if name in getattr(registry, "_registry", {}):
        return
    try:
        registry.register_engine(name, __name__, "ShmStageWeightTransferEngine")
    except ValueError:  # registered meanwhile (vLLM refuses a name twice)
        if name not in getattr(registry, "_registry", {name: None}):
            raise


def __getattr__(name: str) -> Any:
    """The factory's lazy loader reads ``ShmStageWeightTransferEngine`` off this module."""
    if name == "ShmStageWeightTransferEngine":
        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _import_vllm(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the shmstage vLLM backend needs vLLM with weight-transfer engines ({module}): "
            "install a vLLM that has them (pip install vllm) in this environment"
        ) from exc


def _layerwise() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """vLLM's layerwise reload hooks for checkpoint-format weights, where vLLM has them."""
    try:
        from vllm.model_executor.model_loader.reload import (  # type: ignore[import-not-found]
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _build_engine_class() -> type:
    base = _import_vllm("vllm.distributed.weight_transfer.base")

    @dataclasses.dataclass
    class ShmStageInitInfo(base.WeightTransferInitInfo):  # type: ignore[name-defined,misc]
        channel: str
        owner: int | str | None = None
        socket: str | None = None
        bucket_bytes: int = BUCKET_BYTES

    @dataclasses.dataclass
    class ShmStageUpdateInfo(base.WeightTransferUpdateInfo):  # type: ignore[name-defined,misc]
        step: int | None = None
        timeout: float | None = UPDATE_TIMEOUT

    class ShmStageWeightTransferEngine(base.WeightTransferEngine):  # type: ignore[name-defined,misc]
        """vLLM's worker side of shmstage (see ``shmstage_client.integrations.vllm``).

        Built for vLLM's newer engine signature (``config, vllm_config, device, model``)
        and its older one (``config, parallel_config``, with ``load_weights`` handed to
        ``receive_weights``): the model's ``load_weights`` is used when vLLM gives none."""

        init_info_cls = ShmStageInitInfo
        update_info_cls = ShmStageUpdateInfo

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.receiver: WeightReceiver | None = None
            self._reloading = False

        def _device(self) -> torch.device:
            device = getattr(self, "device", None)
            if device is not None:
                return torch.device(device)
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")

        def _receiver(self) -> WeightReceiver:
            if self.receiver is None:
                raise IncompleteUpdate(
                    "the shmstage backend follows no channel yet: call "
                    "init_weight_transfer_engine({'init_info': {'channel': NAME}}) first"
                )
            return self.receiver

        def init_transfer_engine(self, init_info: Any) -> None:
            if self.receiver is not None:
                self.receiver.close()
            self.receiver = WeightReceiver(
                init_info.channel,
                device=self._device(),
                owner=init_info.owner,
                socket=init_info.socket,
                bucket_bytes=init_info.bucket_bytes,
            )

        def start_weight_update(self) -> None:
            self._receiver().start()
            hooks = _layerwise()
            model = getattr(self, "model", None)
            if hooks is not None and model is not None:
                hooks[0](model)
                self._reloading = True

        def receive_weights(self, update_info: Any, load_weights: Any = None) -> None:
            if load_weights is None:
                load_weights = self.model.load_weights
            self._receiver().receive(
                load_weights, step=update_info.step, timeout=update_info.timeout
            )

        def finish_weight_update(self) -> None:
            try:
                self._receiver().finish()
            finally:
                if self._reloading:
                    self._reloading = False
                    hooks = _layerwise()
                    assert hooks is not None
                    hooks[1](self.model, self.model_config)

        def shutdown(self) -> None:
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None

        @staticmethod
        def trainer_send_weights(
            iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: Any
        ) -> None:
            """The trainer's side, for vLLM versions that ask engines for one: publish the
            named tensors as one version (``trainer_args``: ``stager``, ``name``,
            ``step``). A trainer may as well call ``Stager.publish`` itself."""
            args = dict(trainer_args)
            args["stager"].publish(dict(iterator), args["name"], step=args["step"])

    ShmStageWeightTransferEngine.__module__ = __name__
    ShmStageInitInfo.__module__ = __name__
    ShmStageUpdateInfo.__module__ = __name__
    return ShmStageWeightTransferEngine

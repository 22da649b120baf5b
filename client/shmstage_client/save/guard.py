"""The guard: optimizers wait for a non-blocking save's copy before they mutate.

A checkpoint needs the bytes as they were at ``save()``. Between two optimizer steps the
forward and backward only *read* the parameters and the optimizer's state, so their copy
may run behind them, as long as the next ``optimizer.step()`` does not start before the
copy has read them. ``Stager.guard(optimizer)`` makes that automatic: a step pre-hook
(``Optimizer.register_step_pre_hook``) holds the step back — on a CUDA device by making the
step's stream wait for the copy's event, with no host wait at all; for CPU tensors, whose
copy runs on a thread, on the host.

What a guard covers (``Coverage``): the storages of its optimizers' parameters and of
their per-parameter state (exp_avg, momentum buffers, step counters...), read at each save
— the state appears after the first step — and matched against the saved tensors by memory
range, so ``model.state_dict()``'s detached views of the parameters are covered too.
Nothing else is: buffers (BatchNorm's running statistics, which forward updates in
place), gradients (which backward accumulates in place, and ``zero_grad`` zeroes),
tensors inside param groups (an LR scheduler ``fill_``s a tensor ``lr``) and anything
else in the state dict are copied before ``save()`` returns, as a blocking save does.
Plain values (a float ``lr``, the scheduler's counters) are encoded when ``save()`` is
called, so an LR scheduler's step right after it changes nothing either.

A step given a closure (``optimizer.step(closure)``, as Lightning and LBFGS call it) runs
the forward and backward inside that call, after the pre-hook: for torch.optim's own
optimizers, which evaluate the closure before they mutate anything, the guard waits after
the closure instead, so the copy still runs behind the forward and backward.

``zero_grad`` is left alone on purpose: gradients are never deferred, and holding
``zero_grad`` back would, in the usual ``zero_grad(); forward; backward; step()`` loop,
hold the whole forward and backward behind the copy.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from shmstage_client.errors import SaveTimeout

if TYPE_CHECKING:
    from shmstage_client.save.handover import Landing

log = logging.getLogger("shmstage.client")


class Guard:
    """The step pre-hooks ``Stager.guard()`` put on some optimizers; ``remove()`` takes them
    off (also a context manager). A Stager's ``close()`` removes its guards.

    Made by the Stager with what the hooks need of it: the copy in flight now
    (``in_flight``: the last non-blocking save's, until it has landed), how long a step may
    wait for it (``timeout``: the Stager's ``request_timeout``), and whom to tell that the
    guard is gone (``forget``).
    """

    def __init__(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        in_flight: Callable[[], Landing | None],
        timeout: float,
        forget: Callable[[Guard], None],
    ) -> None:
        self.optimizers = tuple(optimizers)
        if not self.optimizers:
            raise ValueError("guard() needs at least one optimizer")
        for optimizer in self.optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"guard() takes torch.optim.Optimizer instances, not "
                    f"{type(optimizer).__name__}: pass the optimizer whose step() mutates the "
                    "saved parameters and state"
                )
        self._in_flight = in_flight
        self._timeout = timeout
        self._forget = forget
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in self.optimizers]

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[Any, Any] | None:
        landing = self._in_flight()
        if landing is None:
            return None
        if not _evaluates_closure_first(optimizer) or not _closure_of(args, kwargs):
            landing.hold_back(self._timeout)
            return None
        # A step given a closure (Lightning's, LBFGS's) runs forward and backward inside
        # it: waiting here would put them behind the copy. torch.optim's optimizers call
        # the closure before they mutate anything, so the wait goes right after it.
        closure, timeout = _closure_of(args, kwargs), self._timeout

        def closure_then_wait() -> Any:
            try:
                return closure()
            finally:
                landing.hold_back(timeout)

        if len(args) > 1:  # (the optimizer, the closure, ...): torch passes the step's self
            return (args[0], closure_then_wait, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_wait}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor these optimizers' steps mutate in place: parameters and their state."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                yield from group["params"]
            for state in optimizer.state.values():
                if isinstance(state, Mapping):
                    yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def remove(self) -> None:
        """Take the hooks off, once a copy these optimizers' tensors may be part of has
        landed (bounded by the Stager's ``request_timeout``: SaveTimeout, and the guard
        stays, if it has not)."""
        landing = self._in_flight()
        if landing is not None and not landing.settled(self._timeout):
            raise SaveTimeout(
                f"a save's copy is still running after {self._timeout} s; the "
                "guard stays until it lands (call remove() again)"
            )
        self.detach()

    def detach(self) -> None:
        """Take the hooks off now, without waiting for a copy in flight: the Stager's
        ``close()``, once that copy has settled or its wait ran out."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._forget(self)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Coverage:
    """The memory that guarded optimizers mutate, as byte ranges per device.

    A saved tensor is covered when every byte it reads lies in one of those storages.
    Built and matched at every non-blocking save (the state changes between steps), in
    plain loops: at 10,000 tensors each costs a few milliseconds of the stall.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans: dict[torch.device, list[tuple[int, int]]] = {}
        for tensor in _plain(tensors):
            storage = tensor.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
            if size:
                spans.setdefault(tensor.device, []).append((start, start + size))
        self._starts: dict[torch.device, list[int]] = {}
        self._ends: dict[torch.device, list[int]] = {}
        for device, ranges in spans.items():
            starts, ends = self._starts[device], self._ends[device] = [], []
            for start, end in sorted(ranges):
                if ends and start < ends[-1]:  # the same storage seen twice (tied weights)
                    ends[-1] = max(ends[-1], end)
                else:
                    starts.append(start)
                    ends.append(end)

    def covers(self, tensor: torch.Tensor) -> bool:
        starts = self._starts.get(tensor.device)
        if starts is None:
            return False
        size = tensor.nbytes if tensor.is_contiguous() else _extent(tensor)
        if not size:
            return False  # an empty tensor has nothing to copy later
        first = tensor.data_ptr()
        i = bisect.bisect_right(starts, first) - 1
        return i >= 0 and first + size <= self._ends[tensor.device][i]

    def mask(self, tensors: Iterable[torch.Tensor]) -> list[bool] | None:
        """Which of ``tensors`` are covered; None when none is."""
        covered = [self.covers(tensor) for tensor in tensors]
        return covered if any(covered) else None


def _evaluates_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step(closure)`` calls the closure before it changes anything:
    true of every optimizer torch.optim ships; another (SAM-style, which perturbs the
    weights first) gets the wait before its step."""
    return type(optimizer).__module__.startswith("torch.optim.")


def _closure_of(args: Any, kwargs: Any) -> Any:
    """The closure a step was given; a step pre-hook's ``args`` start with the optimizer."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    return closure if callable(closure) else None


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (0 if it has none)."""
    if tensor.numel() == 0:
        return 0
    steps = zip(tensor.shape, tensor.stride(), strict=True)
    last = sum((size - 1) * stride for size, stride in steps)
    return (last + 1) * tensor.element_size()


#: Tensor types that hold their own data (the common case, checked first: cheap).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors holding the data: a DTensor (FSDP2) holds its local shard."""
    for tensor in tensors:
        if type(tensor) in _PLAIN_TYPES or not is_traceable_wrapper_subclass(tensor):
            yield tensor
            continue
        names, _ = tensor.__tensor_flatten__()  # a DTensor's include its device mesh
        inner = (getattr(tensor, name) for name in names)
        yield from _plain(t for t in inner if isinstance(t, torch.Tensor))

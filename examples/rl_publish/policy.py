"""The model both sides of the example build, and the fingerprint that checks a copy.

The trainer puts ``fingerprint(state)`` and the step into each version's metadata, and
sets the model's ``step`` buffer to the step; the rollout recomputes the fingerprint of
what its own model holds after loading, so a version that arrived torn, mixed with
another step or mislabelled is caught, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


class Policy(torch.nn.Module):
    """A small MLP with a ``step`` buffer: the step whose weights it holds."""

    def __init__(self, seed: int, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
        )
        self.head = torch.nn.Linear(width, 8).to(torch.bfloat16)
        self.register_buffer("step", torch.tensor(-1, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).to(torch.bfloat16)).float()


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

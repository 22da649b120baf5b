"""``load``: read a checkpoint back into the nested state dict it was saved from.

Every tensor's bytes are checked against the CRC-32C recorded when they were written; a
mismatch raises and names the key and file rather than handing corrupt weights to a run.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from shmstage import tree
from shmstage.checkpoint import Checkpoint, CheckpointError
from shmstage_client.dtypes import FROM_SAFETENSORS


def load(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", *, verify: bool = True
) -> Any:
    """The state dict saved at ``path``, bit-exact, with tensors on ``device``."""
    with Checkpoint(path) as checkpoint:

        def tensor(key: str) -> torch.Tensor:
            record = checkpoint.record(key)
            dtype = FROM_SAFETENSORS.get(record.dtype)
            if dtype is None:
                raise CheckpointError(
                    f"tensor {key!r}: dtype {record.dtype} has no torch equivalent here"
                )
            with checkpoint.tensor_bytes(key, verify=verify) as view:
                if len(view) == 0:
                    out = torch.empty(record.shape, dtype=dtype)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # read-only mapping; we clone at once
                        raw = torch.frombuffer(view, dtype=torch.uint8)
                    out = raw.clone().view(dtype).view(record.shape)
                    del raw
            return out.to(device)

        try:
            return tree.unflatten(checkpoint.manifest.tree, tensor)
        except tree.TreeError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

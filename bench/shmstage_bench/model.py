"""A small Llama-style decoder in plain torch, so the training scenario needs nothing else.

RMSNorm, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` and a SwiGLU MLP: the shapes and tensor mix of a real
model's state (a few large matrices, many small norms), trained in fp32 master weights under
bf16 autocast on CUDA so that AdamW's two fp32 moments make the state 12 bytes a parameter,
as in a real run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int
    micro_batches: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def parameters(self) -> int:
        """Parameter count without building the model."""
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn
        per_layer += 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim

    def state_bytes(self) -> int:
        """fp32 parameters plus AdamW's two fp32 moments (the step counters are noise)."""
        return 12 * self.parameters()

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


#: ≥ 7 GiB of state with AdamW (652 M parameters), fwd+bwd longer than its D2H copy on an
#: H100/H200 (two micro-batches of 4 × 2048 tokens), in well under 40 GiB of GPU memory.
CUDA_DEFAULT = ModelConfig(
    vocab=32000,
    dim=1536,
    layers=22,
    heads=12,
    kv_heads=4,
    ffn=4096,
    seq=2048,
    batch=4,
    micro_batches=2,
)
CPU_DEFAULT = ModelConfig(
    vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32, batch=2, micro_batches=1
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight.type_as(x)


def _rotary(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = _rotate(q, cos[:s, None], sin[:s, None]), _rotate(k, cos[:s, None], sin[:s, None])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads or cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
            raise ValueError(f"heads {cfg.heads}/{cfg.kv_heads} do not divide dim {cfg.dim}")
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = _rotary(cfg.seq, cfg.head_dim)
        self.register_buffer("cos", cos, persistent=False)  # not part of the checkpoint
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


class Trainer:
    """The model, fused AdamW (on CUDA) and random token batches: ``step()`` is one step."""

    def __init__(self, cfg: ModelConfig, device: torch.device, seed: int) -> None:
        torch.manual_seed(seed)
        self.cfg, self.device = cfg, device
        with device:  # built where it trains: no 8 GB of CPU initialisation first
            self.model = Decoder(cfg)
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda or None)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def state(self) -> dict[str, object]:
        """What a trainer checkpoints: the model's and the optimizer's state dicts."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def step(self) -> None:
        cfg = self.cfg
        autocast = torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda")
        for _ in range(cfg.micro_batches):
            tokens = torch.randint(
                0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=self.device, generator=self.gen
            )
            with autocast:
                logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            (loss / cfg.micro_batches).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

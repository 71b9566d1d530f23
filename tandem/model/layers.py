"""Building blocks of Llama-family models, numerically as HF transformers computes them."""

from __future__ import annotations

import math

import torch
from torch import nn

# The fused kernels (kernels/fused.cpp) run at the vector width torch's own kernels run here
# (kernels/build.py), so they win at every row count: SiLU*mul ~1.6x faster at 16 rows and
# 1.2x at 2,048, RoPE 1.4x at 2,048 on an AMX Xeon. Either way the numbers are the same to
# the bit.


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = None  # kernels/fused.cpp, where the runner binds it (use_fused_kernels)
        self.sum_lanes = 8  # the vector width of torch's float sum here (torch_sum_lanes)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """weight * x / rms(x). Given the residual stream, x is first added to it (the layer's
        skip connection): returns (norm of the sum, the sum)."""
        if self.fused is not None:
            if residual is None:
                return self.fused.rms_norm(x, self.weight, self.eps, self.sum_lanes)
            normed = self.fused.add_rms_norm(x, residual, self.weight, self.eps, self.sum_lanes)
            return normed, residual  # residual was updated in place
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1 frequency-dependent scaling (transformers' _compute_llama3_parameters).
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling, self.dtype = (
            head_dim,
            max_positions,
            theta,
            scaling,
            dtype,
        )
        self.register_buffer(
            "cos", torch.empty(max_positions, head_dim, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "sin", torch.empty(max_positions, head_dim, dtype=dtype), persistent=False
        )
        # on the meta device the loader computes them after to_empty; computing them there
        # imports torch._dynamo (python meta kernels), ~1.5 s of every start
        if self.cos.device.type != "meta":
            self.init_tables()

    def init_tables(self) -> None:
        """(Re)compute the tables on the buffers' device, e.g. after `to_empty`."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        freqs = (
            torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None]
            * inv_freq[None, :]
        )
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        # rotate_half(x) * sin == roll(x, D/2) * sign * sin: fold the sign into the table
        half = self.head_dim // 2
        sign = torch.cat((-torch.ones(half, device=device), torch.ones(half, device=device)))
        self.cos = emb.cos().to(self.dtype)
        self.sin = (emb.sin() * sign).to(self.dtype)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for these positions, [T, 1, D] each: looked up once per step and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(
    x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fused=None
) -> torch.Tensor:
    """Rotate-half RoPE (as transformers applies it) on x: [T, heads, D]; with the fused
    kernel, in place."""
    cos, sin = rope
    if fused is not None:
        fused.rope_(x, cos, sin)
        return x
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = None  # kernels/fused.cpp, where the runner binds it (use_fused_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


def use_fused_kernels(model: nn.Module, fused) -> None:
    """Bind the C++ kernels of kernels/fused.cpp to every module with a fused form (those
    with a `fused` attribute): norms, activations, RoPE and the KV write. They compute what
    the torch path computes, rounding where it rounds, for float32 and bf16 on the CPU."""
    lanes = torch_sum_lanes(fused) if fused is not None else 8
    for m in model.modules():
        if not hasattr(m, "fused"):
            continue
        m.fused = fused
        if isinstance(m, RMSNorm):
            m.sum_lanes = lanes


def torch_sum_lanes(fused) -> int:
    """The vector width (8 or 16 floats) with which torch's own float sum ran here: the fused
    RMSNorm sums in that order, so its mean is torch's to the bit. Found by comparing on a
    probe, since it depends on the CPU and on which kernels torch dispatches to."""
    probe = torch.randn(4, 4096, generator=torch.Generator().manual_seed(0))
    want = probe.pow(2).sum(-1).tolist()
    for lanes in (8, 16):
        if all(fused.sum_squares(row, lanes) == w for row, w in zip(probe, want)):
            return lanes
    return 8  # neither: the norms then differ from the torch path in a float's last bit

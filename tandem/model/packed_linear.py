"""Linear layers with weights prepacked for oneDNN, for float32 on x86 CPUs.

torch's F.linear runs float32 through MKL, which takes a slow generic path on AMD CPUs; oneDNN
with a weight reordered once at load time is 1.3-2.7x faster for this project's shapes
(benchmarks/linear_backends.py) and made a whole decode step 1.75x faster at 32 running
requests on an AVX2 EPYC. (numpy's OpenBLAS, as fast in isolation, was 2x slower inside a
step: its threads fight torch's OpenMP pool.) Results agree with F.linear up to float32
rounding.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tandem import cpu_isa

log = logging.getLogger("tandem")


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """float32 anywhere oneDNN is; bfloat16 where the CPU computes it natively (AVX512-BF16,
    AMX): emulated, a prepacked bf16 weight gains nothing."""
    if not (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and cpu_isa.at_least("avx512_bf16")  # (oneDNN's own check reads the CPU, not the cap)
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @classmethod
    def of_weight(cls, weight: torch.Tensor) -> PackedLinear:
        """x @ weight^T, no bias: a weight that is not an nn.Linear's (a quantized layer's
        bf16 copy, quant.py)."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        return cls(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear in the model for a PackedLinear, and prepack each mixture of
    experts' experts (moe.SparseMoE.pack_experts); return how many linears."""
    count = 0
    for parent in list(model.modules()):
        if hasattr(parent, "pack_experts"):
            parent.pack_experts()
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                count += 1
    log.debug("packed %d linear layers for oneDNN", count)
    return count

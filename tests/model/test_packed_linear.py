"""Linear layers prepacked for oneDNN at load: float32 anywhere, bf16 where the CPU computes
it natively; the same products as F.linear up to rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem import LLM
from tandem.model.packed_linear import PackedLinear, packing_available

CPU = torch.device("cpu")
BF16_NATIVE = torch.ops.mkldnn._is_mkldnn_bf16_supported()
PACKED_DTYPES = [torch.float32] + ([torch.bfloat16] if BF16_NATIVE else [])


def test_bf16_is_packed_only_where_the_cpu_computes_it_natively():
    assert packing_available(torch.float32, CPU)
    assert packing_available(torch.bfloat16, CPU) == BF16_NATIVE
    assert not packing_available(torch.float16, CPU)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_a_packed_linear_computes_what_f_linear_does(dtype, rows):
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=True).to(dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    want = linear(x).float()
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == (rows, 1536)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: rounding of the output alone
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_runner_packs_its_projections_where_packing_pays(llama_path, dtype):
    llm = LLM(str(llama_path), dtype=dtype, kv_cache_memory=0.05)
    layer = llm.engine.runner.model.model.layers[0]
    packed = isinstance(layer.mlp.down_proj, PackedLinear)
    assert packed == packing_available(getattr(torch, dtype), CPU)

"""The C++ BGMV kernel: each token's own adapter update, as the plain torch computation."""

from __future__ import annotations

import pytest
import torch

from tandem.model import kernels

bgmv = kernels.lora_bgmv()
pytestmark = pytest.mark.skipif(bgmv is None, reason="C++ kernels not built on this machine")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("outs", [[96], [64, 32, 32], [128, 128]])
def test_bgmv_adds_each_tokens_own_adapter_update(dtype, tol, outs):
    torch.manual_seed(0)
    slots, tokens, fan_in, rank = 5, 11, 72, 8  # 72: a tail past the vector width
    x = torch.randn(tokens, fan_in).to(dtype)
    a = torch.randn(slots, len(outs) * rank, fan_in).to(dtype)
    bt = [torch.randn(slots, rank, o).to(dtype) for o in outs]
    which = torch.tensor([t % slots if t % 4 else -1 for t in range(tokens)])  # -1: no adapter
    y = torch.randn(tokens, sum(outs)).to(dtype)
    before = y.clone()
    want = y.float().clone()
    for t, s in enumerate(which.tolist()):
        if s >= 0:
            h = a[s].float() @ x[t].float()
            want[t] += torch.cat([h[k * rank : (k + 1) * rank] @ bt[k][s].float()
                                  for k in range(len(outs))])  # fmt: skip
    bgmv(y, x, a, bt, which)
    scale = want.abs().max()
    assert (y.float() - want).abs().max() / scale < tol
    untouched = which < 0
    assert torch.equal(y[untouched], before[untouched])  # tokens without an adapter

"""The grouped-matmul attention (bf16 on the CPU): a long chunk's queries go in blocks of rows
so their scores stay small, with each row's result the same to the bit."""

from __future__ import annotations

import pytest
import torch

from tandem.model import attention
from tandem.model.attention import (
    CAUSAL_LEN_MULTIPLE,
    _grouped_attention,
    causal_sdpa,
    grouped_attention,
    sdpa_attention,
)


def _case(b, q, ctx, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qt = torch.randn(b, q, 6, 32, generator=g).to(dtype)
    k = torch.randn(b, ctx, 2, 32, generator=g).to(dtype)
    v = torch.randn(b, ctx, 2, 32, generator=g).to(dtype)
    start = torch.tensor([ctx - q - i for i in range(b)])  # rows of different contexts
    mask = torch.arange(ctx)[None, None, :] <= (start[:, None] + torch.arange(q))[:, :, None]
    return qt, k, v, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,q,ctx", [(1, 100, 300), (2, 77, 200), (3, 40, 64)])
def test_blocks_of_query_rows_give_all_rows_at_once_to_the_bit(monkeypatch, dtype, b, q, ctx):
    qt, k, v, mask = _case(b, q, ctx, dtype)
    whole = _grouped_attention(qt, k, v, mask, 0.2)
    # scores of 16 rows (the least block) x ctx keys x 6 heads x b chunks: several blocks
    monkeypatch.setattr(attention, "SCORES_BYTES", 4 * b * 6 * ctx * 16)
    seen = []
    real = attention._grouped_attention
    monkeypatch.setattr(
        attention, "_grouped_attention", lambda *a: seen.append(a[0].shape[1]) or real(*a)
    )
    blocked = grouped_attention(qt, k, v, mask, 0.2)
    assert seen == [16] * (q // 16) + ([q % 16] if q % 16 else [])  # it did go in blocks
    assert torch.equal(blocked, whole)
    # and it is attention: the fused kernel agrees within the dtype's rounding
    close = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blocked, sdpa_attention(qt, k, v, mask, 0.2), **close)


def test_short_chunks_go_whole(monkeypatch):
    qt, k, v, mask = _case(1, 64, 128, torch.bfloat16)
    seen = []
    real = attention._grouped_attention
    monkeypatch.setattr(
        attention, "_grouped_attention", lambda *a: seen.append(a[0].shape[1]) or real(*a)
    )
    grouped_attention(qt, k, v, mask, 0.2)
    assert seen == [64]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [[64, 64, 64], [300, 7, 33, 1]])
def test_fresh_chunks_attend_as_under_the_causal_mask(dtype, lens):
    """causal_sdpa (chunks from position 0 over their own keys, is_causal, padded to a
    multiple of 16 rows) against the masked path each chunk takes otherwise: keys gathered,
    a [Q, L] causal mask. To the bit where no chunk needs padding."""
    g = torch.Generator().manual_seed(1)
    t = sum(lens)
    q = torch.randn(t, 6, 32, generator=g).to(dtype)
    k, v = (torch.randn(t, 2, 32, generator=g).to(dtype) for _ in range(2))
    got = causal_sdpa(q, k, v, lens, 0.2)
    want, at = [], 0
    for n in lens:
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        rows = slice(at, at + n)
        want.append(sdpa_attention(q[None, rows], k[None, rows], v[None, rows], mask, 0.2))
        at += n
    want = torch.cat(want, dim=1).reshape(t, 6 * 32)
    assert got.shape == want.shape
    if all(n % CAUSAL_LEN_MULTIPLE == 0 for n in lens):
        assert torch.equal(got, want)
    else:  # padded to the multiple: the kernel's blocks sum in another order
        close = (
            dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
        )
        torch.testing.assert_close(got, want, **close)
    # and a chunk does not see the next one's keys: changing them leaves it alone
    k2 = k.clone()
    k2[lens[0] :] += 1
    assert torch.equal(causal_sdpa(q, k2, v, lens, 0.2)[: lens[0]], got[: lens[0]])

"""The C++ decode kernel equals the torch path (sdpa over a gathered cache), never reads past
a row's context (unused slots hold NaN here), and steps aside when disabled or unbuildable."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import ScheduledRequest
from tandem.model import kernels
from tandem.model.attention import PagedAttention, forward_context, sdpa_attention
from tandem.model.kernels import build
from tandem.runner.input_batch import prepare_inputs

CPU = torch.device("cpu")


def paged_case(lens, block_size, kv_heads, group, head_dim, dtype=torch.float32, seed=0):
    """Caches holding each row's context in shuffled blocks, every other slot (block 0, the
    tail of each last block, unused blocks) NaN; block tables null-padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(needed) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), max(needed), dtype=torch.long)
    for row, (n, nb) in enumerate(zip(lens, needed)):
        tables[row, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
        slots = (
            tables[row].repeat_interleave(block_size) * block_size
            + torch.arange(max(needed) * block_size) % block_size
        )
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[slots[:n]] = torch.randn(
                n, kv_heads, head_dim, generator=g
            ).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def torch_path(q, k_cache, v_cache, tables, lens, scale):
    """What PagedAttention does without the kernel: gather, mask by length, sdpa (float32)."""
    b, bs = tables.shape[0], k_cache.shape[1]
    clean = [c.float().nan_to_num(0.0) for c in (k_cache, v_cache)]  # masked, but NaN * 0
    k, v = (c.index_select(0, tables.view(-1)).view(b, -1, *c.shape[2:]) for c in clean)
    mask = (torch.arange(tables.shape[1] * bs)[None, :] < lens[:, None])[:, None]  # [B, 1, L]
    return sdpa_attention(q.float()[:, None], k, v, mask, scale)[:, 0]  # [B, H, D]


LENS = {
    "one": [1],
    "single": [37],
    "ragged": [1, 2, 15, 16, 17, 31, 33, 48, 64, 5] + [3 * i + 1 for i in range(23)],  # 33
}


@pytest.mark.parametrize("lens", LENS.values(), ids=LENS.keys())
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8])  # 5, 8: heads in two passes
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_kernel_equals_torch_path_fp32(kernel, block_size, group, head_dim, lens):
    q, kc, vc, tables, ctx = paged_case(lens, block_size, 2, group, head_dim)
    scale = head_dim**-0.5
    out = kernel(q, kc, vc, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch_path(q, kc, vc, tables, ctx, scale), atol=1e-5, rtol=0)


def test_default_model_shapes_int32_lengths_and_strided_q(kernel):
    # H=9, KVH=3, D=64, block 16; q a view into a wider projection, lengths as int32
    lens = [256, 1, 100, 17] * 8
    q, kc, vc, tables, ctx = paged_case(lens, 16, 3, 3, 64, seed=1)
    wide = torch.randn(len(lens), 9 + 6, 64)
    wide[:, :9] = q
    out = kernel(wide[:, :9], kc, vc, tables, ctx.int(), 0.125)
    torch.testing.assert_close(out, torch_path(q, kc, vc, tables, ctx, 0.125), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_float32(kernel, dtype):
    q, kc, vc, tables, ctx = paged_case(LENS["ragged"], 16, 2, 4, 64, dtype=dtype, seed=2)
    out = kernel(q, kc, vc, tables, ctx, 0.125)
    assert out.dtype == dtype
    ref = torch_path(q, kc, vc, tables, ctx, 0.125)  # the same rounded inputs, in float32
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_bad_block_table_raises_instead_of_reading_wild_memory(kernel):
    q, kc, vc, tables, ctx = paged_case([5, 9], 4, 2, 2, 16)
    bad = tables.clone()
    bad[1, 2] = kc.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, kc, vc, bad, ctx, 0.25)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        kernel(q, kc, vc, tables, torch.tensor([5, 13]), 0.25)


def decode_and_prefill_step(block_size=4, kv_heads=2, heads=6, head_dim=16):
    """A PagedAttention layer and one step's inputs: three decodes and a prefill chunk."""
    torch.manual_seed(3)
    num_blocks = 16
    kv = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    kv.normal_()  # earlier steps' keys and values
    attn = PagedAttention(heads, kv_heads, head_dim)
    attn.k_cache, attn.v_cache = kv[0], kv[1]

    def req(rid, n, blocks):
        r = Request(rid, list(range(5, 5 + n)), SamplingParams())
        r.block_ids = blocks
        return r

    plan = [
        ScheduledRequest.of(req("a", 7, [3, 9]), 6, 1),
        ScheduledRequest.of(req("b", 1, [5]), 0, 1),
        ScheduledRequest.of(req("p", 10, [2, 7, 11]), 3, 7),
        ScheduledRequest.of(req("c", 13, [1, 4, 6, 8]), 12, 1),
    ]
    inputs = prepare_inputs(plan, block_size, CPU)
    t = inputs.input_ids.numel()
    qkv = [torch.randn(t, n, head_dim) for n in (heads, kv_heads, kv_heads)]
    return attn, kv, inputs.attn, qkv


def run_layer(attn, kv, meta, qkv):
    saved = kv.clone()
    with torch.inference_mode(), forward_context(meta):
        out = attn(*qkv)
    kv.copy_(saved)  # the next run writes the same slots from the same state
    return out


def test_layer_uses_kernel_for_decodes_and_matches_torch_path(kernel):
    attn, kv, meta, qkv = decode_and_prefill_step()
    rows = []

    def spy(q, *args):
        rows.append(q.shape[0])
        return kernel(q, *args)

    attn.decode_kernel = spy
    with_kernel = run_layer(attn, kv, meta, qkv)
    assert rows == [3], "the three decode rows go through the kernel, the prefill chunk does not"
    attn.decode_kernel = None
    torch.testing.assert_close(with_kernel, run_layer(attn, kv, meta, qkv), atol=1e-5, rtol=0)


def test_the_runner_gives_cpu_layers_the_kernel_unless_disabled(kernel, llama_path, monkeypatch):
    from tandem import LLM

    llm = LLM(str(llama_path), dtype="float32", kv_cache_memory=0.01)
    layers = llm.engine.runner.model.attention_layers()
    assert all(a.decode_kernel is not None for a in layers)
    monkeypatch.setenv("TANDEM_NO_CPP_KERNELS", "1")
    monkeypatch.setattr(build, "_load", lambda: pytest.fail("the kernel was loaded"))
    assert kernels.paged_decode_attention() is None
    llm = LLM(str(llama_path), dtype="float32", kv_cache_memory=0.01)
    assert all(a.decode_kernel is None for a in llm.engine.runner.model.attention_layers())


def test_a_cache_that_cannot_be_written_falls_back_and_logs_why(monkeypatch, caplog, tmp_path):
    (tmp_path / "a-file").write_text("")  # the extensions directory would be inside a file
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a-file" / "ext"))
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert build._load.__wrapped__() is None
    assert "the C++ attention kernel unavailable (NotADirectoryError" in caplog.text
    assert "using the torch path" in caplog.text


def test_kernel_takes_head_dims_that_are_multiples_of_its_vector_width_only(kernel):
    """The kernels build at torch's vector width here (16 floats on AVX-512, else 8); the
    runner binds the decode kernel only where head_dim is a multiple of it."""
    lanes = kernels.vec_lanes()
    assert lanes == (16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8)
    q, kc, vc, tables, ctx = paged_case([5, 9], 4, 2, 2, lanes)
    torch.testing.assert_close(
        kernel(q, kc, vc, tables, ctx, 0.5), torch_path(q, kc, vc, tables, ctx, 0.5),
        atol=1e-5, rtol=0,
    )  # fmt: skip
    q, kc, vc, tables, ctx = paged_case([5, 9], 4, 2, 2, lanes + 4)
    with pytest.raises(RuntimeError, match="multiple of"):
        kernel(q, kc, vc, tables, ctx, 0.5)

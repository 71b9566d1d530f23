"""The fused layer kernels (kernels/fused.cpp) compute exactly what the torch path computes:
every op equal to the bit, in float32 and bf16, at any row count and on strided inputs; a
whole model's tokens and logprobs unchanged by binding them; and the decode stack (a
decode-only step's layers in one C++ call) equal to the Python layers, bound only where it
can be. The grouped attention's softmax is the exception: within an ulp of bf16."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.model import kernels
from tandem.model.attention import grouped_attention
from tandem.model.kv_quant import quantize_kv
from tandem.model.layers import (
    RMSNorm,
    SiluAndMul,
    apply_rope,
    torch_sum_lanes,
    use_fused_kernels,
)
from tandem.model.quant import Int4Linear, QuantizedLinear

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 64, 300]


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _norm(hidden: int, dtype, fused=None) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = _randn(hidden, dtype=dtype, seed=1)
    if fused is not None:
        use_fused_kernels(norm, fused)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 100, 576, 4096])
def test_rms_norm_equals_the_torch_path_bit_for_bit(fused, dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype)
    assert torch.equal(_norm(hidden, dtype, fused)(x), _norm(hidden, dtype)(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 100])  # 100: no whole number of bf16 vectors
def test_add_rms_norm_adds_into_the_residual_in_place_and_norms_the_sum(fused, dtype, rows, hidden):  # fmt: skip
    x, residual = _randn(rows, hidden, dtype=dtype), _randn(rows, hidden, dtype=dtype, seed=2)
    want_normed, want_sum = _norm(hidden, dtype)(x, residual.clone())
    stream = residual.clone()
    normed, returned = _norm(hidden, dtype, fused)(x, stream)
    assert (
        returned is stream and torch.equal(stream, want_sum) and torch.equal(stream, x + residual)
    )
    assert torch.equal(normed, want_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_on_the_qk_view_of_a_fused_projection_equals_the_torch_path(fused, dtype, rows):  # fmt: skip
    heads, kv_heads, d = 9, 3, 64
    qkv = _randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)  # rows strided
    cos, sin = (_randn(rows, 1, d, dtype=dtype, seed=s) for s in (3, 4))
    want = apply_rope(qk, (cos, sin))
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    fused.rope_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # V untouched


@pytest.mark.parametrize("rows", [1, 64, 65, 2048])
@pytest.mark.parametrize("d", [64, 128, 48])  # 48: halves of no whole bf16 vector
def test_apply_rope_with_the_kernel_rotates_in_place_at_any_row_count(fused, rows, d):
    qk = _randn(rows, 4, d, dtype=torch.bfloat16)
    cos, sin = (_randn(rows, 1, d, dtype=torch.bfloat16, seed=s) for s in (3, 4))
    want = apply_rope(qk, (cos, sin))
    got = apply_rope(qk, (cos, sin), fused)
    assert torch.equal(got, want)
    assert got.data_ptr() == qk.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 100])  # 100: no whole number of bf16 vectors
def test_silu_and_mul_equals_the_torch_path_on_a_padded_projection_output(fused, dtype, rows, inter):  # fmt: skip
    padded = _randn(rows, 2 * inter + 64, dtype=dtype)  # as a quantized layer's [:, :out] view
    x = padded[:, : 2 * inter]
    want = SiluAndMul()(x)
    assert torch.equal(fused.silu_and_mul(x), want)
    act = SiluAndMul()
    use_fused_kernels(act, fused)
    assert torch.equal(act(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_puts_each_row_in_its_slot_as_index_copy_does(fused, dtype):
    blocks, block_size, kvh, d, rows = 6, 4, 3, 8, 5
    k_cache, v_cache = (torch.zeros(blocks, block_size, kvh, d, dtype=dtype) for _ in range(2))
    qkv = _randn(rows, 4 * kvh * d, dtype=dtype)
    k, v = (
        qkv[:, : kvh * d].view(rows, kvh, d),
        qkv[:, 2 * kvh * d : 3 * kvh * d].view(rows, kvh, d),
    )
    slots = torch.tensor([23, 0, 5, 6, 11])
    fused.write_kv(k_cache, v_cache, slots, k, v)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.view(-1, kvh, d).index_copy_(0, slots, k)
    want_v.view(-1, kvh, d).index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
def test_write_kv_stores_an_8_bit_caches_values_and_scales_as_quantize_kv_does(fused, dtype, storage):  # fmt: skip
    blocks, block_size, kvh, d, rows = 6, 4, 3, 64, 5
    k_cache, v_cache = (torch.zeros(blocks, block_size, kvh, d, dtype=storage) for _ in range(2))
    k_scales, v_scales = (torch.zeros(blocks, block_size, kvh) for _ in range(2))
    qkv = _randn(rows, 4 * kvh * d, dtype=dtype) * torch.logspace(-3, 2, rows)[:, None].to(dtype)
    qkv[1] = 0  # a zero vector: the scale's floor
    k, v = (qkv[:, i * kvh * d : (i + 1) * kvh * d].view(rows, kvh, d) for i in (0, 2))
    slots = torch.tensor([23, 0, 5, 6, 11])
    fused.write_kv(k_cache, v_cache, slots, k, v, k_scales, v_scales)
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        want_q, want_s = quantize_kv(x, storage)
        got_q = cache.view(-1, kvh, d)[slots]
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales.view(-1, kvh)[slots], want_s)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not k_scales.view(-1, kvh)[untouched].any()
    assert not k_cache.view(-1, kvh, d)[untouched].view(torch.uint8).any()


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(fused):
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.write_kv(k_cache, v_cache, torch.tensor([1, 8]), k, k)
    assert not k_cache.any() and not v_cache.any()


def test_a_dtype_the_kernels_do_not_run_is_refused_by_name(fused):
    x = torch.zeros(2, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        fused.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-5, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        fused.silu_and_mul(x)


def test_the_fused_norm_sums_in_the_order_of_torchs_own_sum(fused):
    lanes = torch_sum_lanes(fused)
    x = _randn(3, 5000, dtype=torch.float32, seed=7)
    assert [fused.sum_squares(row, lanes) for row in x] == x.pow(2).sum(-1).tolist()


def _generate(path: str, dtype: str, fused) -> list:
    """Greedy tokens and top-3 logprobs of a few prompts, on a fresh engine (no prefix cache
    shared between the two runs), with `fused` bound (None: the torch path)."""
    llm = LLM(path, dtype=dtype, kv_cache_memory=0.01)
    model = llm.engine.runner.model
    assert model.model.norm.fused is not None  # the runner bound the kernels
    use_fused_kernels(model, fused)
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11] * 5, [300, 12], [64] * 33]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
        for c in (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_model_generates_the_same_tokens_and_logprobs_with_and_without_the_fused_kernels(fused, checkpoints, arch, dtype):  # fmt: skip
    path = str(checkpoints[arch])
    assert _generate(path, dtype, fused) == _generate(path, dtype, None)


def _scores_and_mask(b, q, keys, prefix: bool, seed=0):
    """bf16 scores [b, 3, 2, q, keys] and a mask [b, q, keys]: causal rows after a cached
    prefix of a different length per row (each row's visible keys a prefix), or not."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(b, 3, 2, q, keys, generator=g) * 8).to(torch.bfloat16)
    start = torch.tensor([keys - q - 3 * i for i in range(b)])
    mask = torch.arange(keys)[None, None, :] <= (start[:, None] + torch.arange(q))[:, :, None]
    if not prefix:  # a window: keys too far back hidden as well
        mask &= torch.arange(keys)[None, None, :] > (start[:, None] + torch.arange(q) - 40)[:, :, None]  # fmt: skip
    return scores, mask


def _torch_softmax(scores, mask, scale):  # grouped_attention's own ops
    s = (scores * scale).float().masked_fill(~mask[:, None, None], float("-inf"))
    return torch.softmax(s, dim=-1).to(torch.bfloat16)


@pytest.mark.parametrize("prefix", [True, False], ids=["causal", "window"])
@pytest.mark.parametrize("b,q,keys", [(1, 1, 1), (2, 5, 77), (3, 64, 300), (1, 16, 1000)])
def test_the_softmax_is_the_torch_paths_within_an_ulp_and_hidden_keys_are_zero(fused, b, q, keys, prefix):  # fmt: skip
    scores, mask = _scores_and_mask(b, q, keys, prefix)
    want = _torch_softmax(scores, mask, 0.125)
    got = scores.clone()
    fused.masked_softmax_(got, mask, 0.125)
    ulp = want.float().abs() * 2**-7  # bf16 keeps 8 significant bits
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.99  # mostly the very same numbers
    assert (got.float()[~mask[:, None, None].expand_as(got)] == 0).all()


def test_a_row_that_sees_no_key_is_nan_as_torchs_softmax(fused):
    scores, mask = _scores_and_mask(1, 4, 20, True)
    mask[0, 2] = False
    got = scores.clone()
    fused.masked_softmax_(got, mask, 0.125)
    assert got[0, :, :, 2].isnan().all() and not got[0, :, :, [0, 1, 3]].isnan().any()
    assert _torch_softmax(scores, mask, 0.125)[0, :, :, 2].isnan().all()


def test_the_softmax_refuses_what_it_does_not_compute(fused):
    scores, mask = _scores_and_mask(1, 4, 20, True)
    with pytest.raises(RuntimeError, match="bf16"):
        fused.masked_softmax_(scores.float(), mask, 0.125)
    with pytest.raises(RuntimeError, match="mask"):
        fused.masked_softmax_(scores, mask[:, :2], 0.125)


def test_grouped_attention_with_the_fused_softmax_is_attention_and_blocks_give_the_whole(fused, monkeypatch):  # fmt: skip
    from tandem.model import attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 90, 6, 32, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 200, 2, 32, generator=g).to(torch.bfloat16) for _ in "kv")
    start = torch.tensor([110, 100])
    mask = torch.arange(200)[None, None, :] <= (start[:, None] + torch.arange(90))[:, :, None]
    whole = attention._grouped_attention(q, k, v, mask, 0.2, fused.masked_softmax_)
    monkeypatch.setattr(attention, "SCORES_BYTES", 4 * 2 * 6 * 200 * 16)  # blocks of 16 rows
    blocked = grouped_attention(q, k, v, mask, 0.2, fused.masked_softmax_)
    assert torch.equal(blocked, whole)
    ref = grouped_attention(q, k, v, mask, 0.2)  # torch's softmax
    torch.testing.assert_close(blocked, ref, atol=2e-2, rtol=2e-2)


def _bf16_generate(path: str, fused_softmax: bool) -> list:
    """Greedy tokens and top-3 logprobs on a fresh engine (nothing cached between runs)."""
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=0.01)
    layers = llm.engine.runner.model.attention_layers()
    # bound by the runner where chunks take neither the prefill kernel nor SDPA (AMX)
    grouped = functools.partial(grouped_attention, softmax=layers[0].fused.masked_softmax_)
    for layer in layers:
        layer.prefill_kernel = None  # chunks through the grouped path, whose softmax this is
        layer.attend = grouped if fused_softmax else grouped_attention
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11] * 5, [300, 12], [64] * 33]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_model_keeps_its_greedy_tokens_with_the_fused_softmax(fused, checkpoints, arch):
    path = str(checkpoints[arch])
    with_kernel, without = _bf16_generate(path, True), _bf16_generate(path, False)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(with_kernel, without):
        assert tokens == ref_tokens
        for got, want in zip(lps, ref_lps):
            assert got.keys() == want.keys()
            assert max(abs(got[t].logprob - lp.logprob) for t, lp in want.items()) < 1e-2


class CountingStack:
    """Wraps a model's DecodeStack, counting the steps it ran (not those it left to the
    Python layers)."""

    def __init__(self, stack) -> None:
        self.stack, self.ran = stack, 0

    def __call__(self, x, rope):
        out = self.stack(x, rope)
        self.ran += out is not None
        return out


# whether int4_gemm takes int8 activations here (AVX512-VNNI on its dot path)
INT8_ACTIVATIONS = kernels.dequant() is not None and kernels.dequant().int8_activations_here()
NO_INT8 = "int8 activations need AVX512-VNNI and AVX512-BF16 without AMX (the flag's refusal is tested there)"
THREE_PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11] * 5, [300, 12], [64] * 33]


def _int4_generate(path: str, dtype: str, stack: bool, prompts=THREE_PROMPTS, **kwargs) -> tuple[list, int]:  # fmt: skip
    llm = LLM(path, dtype=dtype, kv_cache_memory=0.01, quantization="int4", **kwargs)
    inner = llm.engine.runner.model.model
    assert inner.decode_stack is not None  # an int4 model gets one
    counting = inner.decode_stack = CountingStack(inner.decode_stack) if stack else None
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = [
        (c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
        for c in (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    ]
    return outs, counting.ran if counting else 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3"])
def test_the_decode_stack_runs_decode_steps_with_the_python_layers_exact_output(fused, checkpoints, arch, dtype):  # fmt: skip
    """qwen2: a bias on the fused qkv projection; llama3: head_dim != hidden / heads and
    tied embeddings."""
    with_stack, ran = _int4_generate(str(checkpoints[arch]), dtype, stack=True)
    without, _ = _int4_generate(str(checkpoints[arch]), dtype, stack=False)
    assert ran >= 10  # the decode-only steps; prefills and mixed steps ran in Python
    assert with_stack == without


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_the_decode_stack_runs_decode_steps_on_an_8_bit_cache_exactly(fused, checkpoints, kv, dtype):  # fmt: skip
    """The stack writes each step's K and V quantized, as the layers' write does, and its
    decode kernel reads the values with their scales."""
    path, kw = str(checkpoints["llama"]), {"kv_cache_dtype": kv}
    with_stack, ran = _int4_generate(path, dtype, True, **kw)
    without, _ = _int4_generate(path, dtype, False, **kw)
    assert ran >= 10 and with_stack == without


@pytest.mark.parametrize(
    "activations",
    ["none", pytest.param("int8", marks=pytest.mark.skipif(not INT8_ACTIVATIONS, reason=NO_INT8))],
)
def test_the_decode_stack_runs_steps_of_twenty_rows_exactly(fused, checkpoints, activations):
    """Past the int4 kernel's rows where int4_gemm runs (2 on AMX, 4 with AVX512-BF16): the
    stack's projections switch to it as the layers do, with their int8 activations where they
    take them; elsewhere the kernel's limit (32) covers them."""
    prompts = [[7 + i, 40 + i, 99, 3 * i + 1] for i in range(20)]
    path, kw = str(checkpoints["llama"]), {"activation_quantization": activations}
    with_stack, ran = _int4_generate(path, "bfloat16", True, prompts, **kw)
    without, _ = _int4_generate(path, "bfloat16", False, prompts, **kw)
    assert ran >= 10 and with_stack == without


def test_the_decode_stack_leaves_steps_past_the_int4_kernels_row_limit_to_the_layers(fused, checkpoints, monkeypatch):  # fmt: skip
    """Past the int4 kernel's rows (and int4_gemm's, where it runs) the int4 layers dequantize into
    slices for dense matmuls, which the stack lacks: it must not run those steps (3 rows
    here, limits 2)."""
    monkeypatch.setattr(QuantizedLinear, "KERNEL_MAX_ROWS", 2)
    monkeypatch.setattr(QuantizedLinear, "GEMM_KERNEL_MAX_ROWS", {"amx": 2, "dot": 2})
    monkeypatch.setattr(Int4Linear, "GEMM_MAX_ROWS", {"amx": 2, "dot": 2})  # nor int4_gemm
    with_stack, ran = _int4_generate(str(checkpoints["llama"]), "float32", stack=True)
    without, _ = _int4_generate(str(checkpoints["llama"]), "float32", stack=False)
    assert with_stack == without
    assert ran == 0  # every decode step had all three rows (ignore_eos, the same max_tokens)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # float weights
        {"quantization": "int8"},
        {"quantization": "int4", "enable_lora": True},
    ],
    ids=["float", "int8 weights", "lora"],
)
def test_no_decode_stack_where_it_would_not_compute_what_the_layers_do(fused, checkpoints, kwargs):  # fmt: skip
    llm = LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.01, **kwargs)
    assert llm.engine.runner.model.model.decode_stack is None

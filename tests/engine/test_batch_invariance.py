"""Batch-invariant output (--batch-invariant): a request's greedy tokens and their logprobs are
the same bits whether it runs alone or beside 1, 6 or 15 other requests, and whether its
prompt is computed in chunks of 512, 8 or 1 tokens, on every numeric path (float32, bf16,
HF int4 and int8 weights, an 8-bit KV cache, LoRA, the GGUF's own 4-bit blocks); speculative
decoding gives exactly the tokens and logprobs of decoding one token at a time."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.config import EngineConfig, resolve_batch_invariant
from tandem.model import kernels, quant
from tests.engine.test_spec_decode import NGRAM, repetitive_prompts
from tests.lora.conftest import build_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
# the request watched: long enough that chunks of 8 cut it five times
TARGET = [random.Random(7).randrange(5, 390) for _ in range(37)]
_rng = random.Random(8)
OTHERS = [[_rng.randrange(5, 390) for _ in range(_rng.randrange(3, 60))] for _ in range(15)]
PATHS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int4 weights": dict(dtype="bfloat16", quantization="int4"),
    "int8 weights": dict(dtype="float32", quantization="int8"),
    "int8 KV": dict(dtype="float32", kv_cache_dtype="int8"),
    "fp8 KV": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
}


def batch_with_target(size: int) -> tuple[list[list[int]], int]:
    """TARGET among size - 1 others, in the middle: (prompts, its index)."""
    at = size // 2
    others = OTHERS[: size - 1]
    return [*others[:at], TARGET, *others[at:]], at


def tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def assert_released(llm: LLM) -> None:
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.kv.usage == 0


def assert_same_bits_in_every_batch_and_chunking(make_llm, request_kw=None) -> None:
    """The target's output in batches of 1, 2, 7 and 16 under step budgets of 512, 8 and 1
    tokens: twelve runs, one answer to the bit."""
    reference = None
    for chunk in (512, 8, 1):
        llm = make_llm(max_num_batched_tokens=chunk)
        for size in (1, 2, 7, 16):
            prompts, at = batch_with_target(size)
            kw = request_kw(size, at) if request_kw else {}
            got = tokens_and_logprobs(llm.generate(prompts, GREEDY, use_tqdm=False, **kw)[at])
            reference = reference or got
            assert got == reference, f"batch of {size}, chunks of {chunk}"
        assert_released(llm)


@pytest.mark.parametrize("path", PATHS)
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_batch_or_chunks(checkpoints, path):
    def make(**kw):
        return LLM(str(checkpoints["llama"]), batch_invariant=True, kv_cache_memory=0.01,
                   **PATHS[path], **kw)  # fmt: skip

    assert_same_bits_in_every_batch_and_chunking(make)


def test_lora_rows_keep_their_bits_beside_other_adapters_and_the_base(checkpoints, tmp_path):
    base = checkpoints["llama"]
    adapters = [build_adapter(base, tmp_path / f"a{i}", seed=i, rank=4 * i) for i in (1, 2)]
    requests = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]

    def make(**kw):
        return LLM(str(base), batch_invariant=True, dtype="float32", enable_lora=True,
                   max_loras=2, max_lora_rank=8, kv_cache_memory=0.01, **kw)  # fmt: skip

    def lora_of_each(size, at):  # the target on the first adapter; others on both, or none
        return {"lora_request": [requests[0] if i == at else [None, *requests][i % 3]
                                 for i in range(size)]}  # fmt: skip

    assert_same_bits_in_every_batch_and_chunking(make, lora_of_each)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_decoding_gives_the_tokens_and_logprobs_of_plain_decoding(checkpoints, dtype):
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(str(checkpoints["llama"]), batch_invariant=True, dtype=dtype,
                  speculative_config=spec, kv_cache_memory=0.01)  # fmt: skip
        outs[spec is None] = [tokens_and_logprobs(o)
                              for o in llm.generate(prompts, params, use_tqdm=False)]  # fmt: skip
        if spec is not None:  # the guesses were checked, some taken
            assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
        assert_released(llm)
    assert outs[False] == outs[True]


def test_a_seeded_sampled_request_draws_the_same_tokens_in_any_batch(checkpoints):
    """Sampling reads invariant logits and, with a seed, the request's own generator."""
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=16,
                            logprobs=0)  # fmt: skip
    got = []
    for chunk, size in ((512, 1), (8, 16)):
        llm = LLM(str(checkpoints["llama"]), batch_invariant=True, dtype="bfloat16",
                  kv_cache_memory=0.01, max_num_batched_tokens=chunk)  # fmt: skip
        prompts, at = batch_with_target(size)
        got.append(tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False)[at]))
    assert got[0] == got[1]


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 33, 200, 513])
@pytest.mark.parametrize("layer", ["int4", "two int4 terms", "int4 + int8 activations", "int8"])
def test_a_quantized_layer_computes_a_row_alike_at_every_row_count(layer, m):
    """Without the flag these layers switch kernels by row count (few rows straight from the
    packed bytes, more through a dequantized block, past a few hundred oneDNN's matmul), and
    the sums of a row run in another order on each."""
    k, n = 576, 640
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    if layer == "int8":
        lin = quant.Int8Linear(k, n, *quant.quantize_int8(w))
    else:
        terms = ([quant.quantize_int4(w, 32)] if layer != "two int4 terms"
                 else quant.quantize_int8_groups(w, 32))  # fmt: skip
        lin = quant.Int4Linear(k, n, [quant.int4_term(*t) for t in terms], layer)
        if layer.endswith("activations") and not (lin.gemm == "dot" and lin.use_int8_activations()):
            pytest.skip("int8 activations need AVX512-VNNI and the dot path (no AMX)")
    lin.use_rows_invariant()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    y = lin(x)
    for r in {0, m // 2, m - 1}:
        assert torch.equal(y[r], lin(x[r : r + 1])[0]), f"row {r} of {m}"


def test_vllms_environment_variable_turns_it_on_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert not resolve_batch_invariant(EngineConfig())
    assert resolve_batch_invariant(EngineConfig(batch_invariant=True))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert resolve_batch_invariant(EngineConfig())
    with pytest.raises(ValueError, match="batch_invariant: a model split over ranks"):
        resolve_batch_invariant(EngineConfig(tensor_parallel_size=2))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT"):
        resolve_batch_invariant(EngineConfig())


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_the_default_models_replies_alone_equal_its_replies_in_a_batch_of_16(activations):
    """The case that showed it: the bundled model's greedy replies to 8 chat prompts, each
    alone and then inside a batch of 16, in its default dtype (7 of 8 differed without)."""
    if activations == "int8" and not (
        kernels.dequant() and kernels.dequant().int8_activations_here()
    ):
        pytest.skip("int8 activations need AVX512-VNNI and the dot path (no AMX)")
    llm = LLM(batch_invariant=True, activation_quantization=activations, kv_cache_memory=0.25,
              max_model_len=512)  # fmt: skip
    topics = ["the sea", "a red fox", "prime numbers", "bread", "the moon", "a violin", "rain",
              "chess", "trains", "volcanoes", "bees", "glass", "winter", "maps", "tea", "clocks"]  # fmt: skip
    chats = [[{"role": "user", "content": f"Write a short paragraph about {t}."}] for t in topics]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    alone = [tokens_and_logprobs(llm.chat([c], params, use_tqdm=False)[0]) for c in chats[:8]]
    batch = [tokens_and_logprobs(o) for o in llm.chat(chats, params, use_tqdm=False)[:8]]
    assert alone == batch
    assert_released(llm)

"""The prefill/decode handoff at the engine seams, in one process: a decode engine reserves,
a prefill engine computes the prompt and samples the first token, the KV of the tokens the
decode side lacks crosses the wire format layer by layer, and the decode engine commits and
decodes on. Greedy output equals a colocated engine's, token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.messages import EngineCoreRequest
from tandem.kv_transfer.wire import decode_layer, encode_layer

MAX_TOKENS = 12


def LLM_CONFIG(path):  # noqa: N802
    from tandem.core.model_config import ModelConfig

    return ModelConfig.from_folder(path)


def _engine(path, dtype="float32", block_size=4, kv_cache_dtype="auto"):
    return LLM(str(path), dtype=dtype, block_size=block_size, kv_cache_memory=0.01,
               kv_cache_dtype=kv_cache_dtype)  # fmt: skip


def handoff(
    prefill: LLM, decode: LLM, rid: str, prompt: list[int], inspect=None
) -> tuple[list[int], int]:
    """Greedy tokens the decode engine produces for `prompt`, and the KV bytes it received:
    each layer exported as the prefill cache stores it, through the wire format's frames,
    into the decode cache (as a prefill instance streams it)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = EngineCoreRequest(rid, prompt, params, arrival_time=0.0)
    held = decode.engine.reserve(copy.deepcopy(request))  # 1. reserve
    assert held is not None
    prefill.engine.add_request(copy.deepcopy(request))  # 2. prefill, sample the first token
    first = None
    while first is None:
        first = next(
            (o.new_token_ids[0] for o in prefill.engine.step() if o.request_id == rid), None
        )
    blocks, nbytes = prefill.engine.scheduler.requests[rid].block_ids, 0
    layers = prefill.model_config.num_layers
    for i in range(layers):
        k, v, scales = prefill.engine.runner.export_layer(blocks, i, held, len(prompt))
        frames = encode_layer(rid, i, layers, held, k, v, scales)
        nbytes += sum(memoryview(f).nbytes for f in frames[1:])
        header, k, v, scales = decode_layer([bytes(f) for f in frames])
        assert (header.request_id, header.layer, header.start) == (rid, i, held)
        decode.engine.receive_layer(rid, i, held, k, v, scales)
    if inspect is not None:  # (sender's blocks, receiver's blocks, first position sent)
        inspect(blocks, decode.engine.scheduler.reserved[rid].block_ids, held)
    prefill.engine.abort_requests([rid])
    tokens = [t for o in decode.engine.commit(rid, first) for t in o.new_token_ids]  # 3. admit
    while decode.engine.has_unfinished():
        tokens += [t for o in decode.engine.step() if o.request_id == rid for t in o.new_token_ids]
    for llm in (prefill, decode):
        llm.engine.step()  # release finished state
        llm.engine.scheduler.check_invariants()
        assert llm.engine.scheduler.kv.usage == 0
    return tokens, nbytes


def colocated(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("length", [3, 37])  # shorter than a block; many blocks
def test_handoff_equals_colocated_greedy(llama_path, length):
    prefill, decode, reference = _engine(llama_path), _engine(llama_path), _engine(llama_path)
    prompt = [(7 * i + 3) % 300 + 5 for i in range(length)]
    tokens, _ = handoff(prefill, decode, "r", prompt)
    assert tokens == colocated(reference, prompt)


def test_a_prefix_the_decode_side_holds_is_not_sent_again(llama_path):
    prefill, decode, reference = _engine(llama_path), _engine(llama_path), _engine(llama_path)
    turn1 = [(5 * i + 1) % 300 + 5 for i in range(40)]
    out1, bytes1 = handoff(prefill, decode, "t1", turn1)
    turn2 = turn1 + out1 + [9, 8, 7, 6, 5]  # the next turn: history plus a new message
    out2, bytes2 = handoff(prefill, decode, "t2", turn2)
    assert out2 == colocated(reference, turn2)
    held = decode.engine.scheduler.kv.stats.hits
    assert held >= 40 and bytes2 < len(turn2) * bytes1 / len(turn1) / 4  # about the suffix only


def test_a_heterogeneous_pair_matches_a_bf16_colocated_engine(llama_path):
    """Prefill in float32 with blocks of 16, decode in bfloat16 with blocks of 8: the KV is
    re-blocked and cast on import."""
    prefill = _engine(llama_path, "float32", 16)
    decode, reference = _engine(llama_path, "bfloat16", 8), _engine(llama_path, "bfloat16", 8)
    prompt = [(11 * i + 2) % 300 + 5 for i in range(29)]
    tokens, _ = handoff(prefill, decode, "h", prompt)
    assert tokens == colocated(reference, prompt)


def test_the_wire_refuses_a_frame_of_the_wrong_size():
    frames = encode_layer("r", 0, 1, 0, torch.zeros(3, 2, 4), torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="bytes"):
        decode_layer([frames[0], frames[1], b"short"])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_an_8_bit_pair_equals_an_8_bit_colocated_engine_and_sends_its_bytes(llama_path, kv):
    """Both caches 8-bit: the stored bytes and scales travel as they are (a quarter of
    float32's bytes, plus a float32 scale per token and KV head) and the decode side holds
    exactly what a colocated engine with that cache computes."""
    prompt = [(13 * i + 4) % 300 + 5 for i in range(37)]
    tokens, nbytes = handoff(_engine(llama_path, kv_cache_dtype=kv),
                             _engine(llama_path, kv_cache_dtype=kv), "q", prompt)  # fmt: skip
    assert tokens == colocated(_engine(llama_path, kv_cache_dtype=kv), prompt)
    _, float_bytes = handoff(_engine(llama_path), _engine(llama_path), "f", prompt)
    cfg = LLM_CONFIG(llama_path)
    values = 2 * cfg.num_layers * len(prompt) * cfg.num_kv_heads * cfg.head_dim
    assert float_bytes == 4 * values
    assert nbytes == values + 4 * values // cfg.head_dim  # a byte a value, 4 a scale


@pytest.mark.parametrize("prefill_kv, decode_kv", [("auto", "int8"), ("int8", "auto"),
                                                   ("int8", "fp8")])  # fmt: skip
def test_a_pair_of_other_kv_dtypes_stores_what_the_decode_side_computes(
    llama_path, prefill_kv, decode_kv
):
    """A float32 prefill instance feeding an int8 decode instance: the decode side quantizes
    on import as its own write does, so it decodes exactly as an int8 colocated engine. An
    8-bit sender's values arrive exactly: a float decode cache holds them dequantized, to the
    bit, and another 8-bit one requantizes them (its own rounding only)."""
    from tandem.model.kv_quant import dequantize_kv, quantize_kv, storage_dtype

    prompt = [(17 * i + 6) % 300 + 5 for i in range(29)]
    prefill, decode = (_engine(llama_path, kv_cache_dtype=prefill_kv),
                       _engine(llama_path, kv_cache_dtype=decode_kv))  # fmt: skip
    checked = []

    def inspect(sent_blocks, held_blocks, start):
        end = len(prompt)
        sent = prefill.engine.runner.export_kv(sent_blocks, start, end)  # [L, 2, T, H, D]
        held = decode.engine.runner.export_kv(held_blocks, start, end)
        if decode_kv == "auto":
            want = sent
        else:  # quantize_kv of what was sent, as the decode cache's own write stores it
            q, scale = quantize_kv(sent.flatten(0, 2), storage_dtype(decode_kv, torch.float32))
            want = dequantize_kv(q, scale, torch.float32).view(sent.shape)
        checked.append(torch.equal(held, want))

    tokens, _ = handoff(prefill, decode, "x", prompt, inspect)
    assert checked == [True]
    if prefill_kv == "auto":
        assert tokens == colocated(_engine(llama_path, kv_cache_dtype=decode_kv), prompt)


def test_a_decode_instance_fills_a_prefix_from_its_kv_tier_and_receives_only_the_rest(
    llama_path,
):
    prompt = [(5 * i + 1) % 300 + 5 for i in range(45)]
    decode = LLM(str(llama_path), dtype="float32", block_size=4, kv_cache_memory=0.01,
                 kv_offloading_size=0.01, kv_offload_min_tokens=8)  # fmt: skip
    colocated(decode, prompt[:41])  # computed here once: its blocks are in the host tier
    assert decode.engine.reset_prefix_cache() > 0  # ... and no longer in the pool
    seen = {}
    tokens, _ = handoff(_engine(llama_path), decode, "r", prompt,
                        inspect=lambda s, r, held: seen.update(held=held))  # fmt: skip
    assert seen["held"] == 40  # 10 blocks loaded from the tier: only positions 40.. sent
    assert tokens == colocated(_engine(llama_path), prompt)
    assert decode.engine.stats().kv_tier_loads.loaded_tokens == 40

"""The prefill/decode handoff at the engine seams, in one process: a decode engine reserves,
a prefill engine computes the prompt and samples the first token, the KV of the tokens the
decode side lacks crosses the wire format layer by layer, and the decode engine commits and
decodes on. Greedy output equals a colocated engine's, token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.disagg.wire import decode_layer, encode_layer
from tandem.engine.messages import EngineCoreRequest

MAX_TOKENS = 12


def _engine(path, dtype="float32", block_size=4):
    return LLM(str(path), dtype=dtype, block_size=block_size, kv_cache_memory=0.01)


def _over_the_wire(rid: str, start: int, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """kv [layers, 2, tokens, heads, dim] -> frames per layer -> the same tensor, and bytes."""
    layers, nbytes = [], 0
    for i in range(kv.shape[0]):
        frames = encode_layer(rid, i, kv.shape[0], start, kv[i, 0], kv[i, 1])
        nbytes += sum(memoryview(f).nbytes for f in frames[1:])
        header, k, v = decode_layer([bytes(f) for f in frames])
        assert (header.request_id, header.layer, header.start) == (rid, i, start)
        layers.append(torch.stack([k, v]))
    return torch.stack(layers), nbytes


def handoff(prefill: LLM, decode: LLM, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens the decode engine produces for `prompt`, and the KV bytes it received."""
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
    kv, nbytes = _over_the_wire(rid, held, prefill.engine.export_kv(rid, held, len(prompt)))
    prefill.engine.abort_requests([rid])
    decode.engine.receive_kv(rid, held, kv)
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


def test_each_layer_is_announced_once_its_kv_is_written(llama_path):
    """The per-layer hook a prefill instance sends with: when layer i is announced, its KV
    for this step is in the cache and layer i + 1's is not yet."""
    llm = _engine(llama_path)
    runner, seen = llm.engine.runner, []
    prompt = [(3 * i + 1) % 300 + 5 for i in range(9)]
    request = EngineCoreRequest("p", prompt, SamplingParams(max_tokens=2), arrival_time=0.0)
    llm.engine.add_request(request)
    blocks = lambda: llm.engine.scheduler.requests["p"].block_ids  # noqa: E731

    def on_layer(i):
        kv = runner.export_kv(blocks(), 0, len(prompt))  # [layers, 2, tokens, heads, dim]
        seen.append((i, bool(kv[i].abs().sum() > 0), bool(kv[i + 1 :].abs().sum() > 0)))

    runner.on_layer_written = on_layer
    llm.engine.step()
    runner.on_layer_written = None
    layers = llm.model_config.num_layers
    assert seen == [(i, True, False) for i in range(layers)]

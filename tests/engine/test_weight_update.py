"""Weight updates, an RL trainer's push to its rollout engine: a model of checkpoint A updated
with checkpoint B's tensors computes exactly what a model loaded from B computes, in every
weight form (float32, bf16, HF int4 and int8, tied embeddings); a bad update names the tensor
and changes nothing; KV computed under older weights is never matched again."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.model_config import default_model_path
from tests.conftest import build_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 99, 230, 41, 8, 77, 120, 64, 33, 210, 19, 50, 7, 300, 12, 90], [61, 62, 63]]
FORMS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int4 weights": dict(dtype="bfloat16", quantization="int4"),
    "int8 weights": dict(dtype="float32", quantization="int8"),
}


@pytest.fixture(scope="module")
def checkpoint_pairs(tmp_path_factory) -> dict[str, tuple]:
    """Per architecture, two checkpoints of one shape with different weights."""
    root = tmp_path_factory.mktemp("weights")
    return {
        arch: (build_checkpoint(root / f"{arch}-a", arch, seed=0),
               build_checkpoint(root / f"{arch}-b", arch, seed=1))
        for arch in ("llama", "llama3")
    }  # fmt: skip


def run(llm: LLM, prompts=PROMPTS):
    return replies(llm.generate([list(p) for p in prompts], GREEDY, use_tqdm=False))


def replies(outs):
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )  # fmt: skip
        for o in outs
    ]


def engine(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory=0.02, enable_prefix_caching=True, **kw)


@pytest.mark.parametrize("arch", ["llama", "llama3"])
@pytest.mark.parametrize("form", FORMS)
def test_a_model_updated_from_a_folder_computes_what_that_folder_loads_to(checkpoint_pairs, arch, form):  # fmt: skip
    a, b = checkpoint_pairs[arch]
    kw = FORMS[form]
    loaded_b = run(engine(b, **kw))
    llm = engine(a, **kw)
    before = run(llm)
    assert llm.update_weights(model_path=str(b), weight_version="step-1") > 0
    assert llm.weight_version == "step-1"
    after = run(llm)
    assert [t for t, _ in before] != [t for t, _ in loaded_b]  # the update has work to do
    assert after == loaded_b  # tokens and logprobs, to the bit


@pytest.mark.parametrize("form", ["float32", "int4 weights"])
def test_a_trainers_named_parameters_update_the_model(checkpoint_pairs, form):
    from transformers import AutoModelForCausalLM

    a, b = checkpoint_pairs["llama3"]  # tied embeddings: HF lists the matrix once
    trainer = AutoModelForCausalLM.from_pretrained(str(b), dtype=torch.float32)
    llm = engine(a, **FORMS[form])
    llm.update_weights(trainer.named_parameters())
    assert run(llm) == run(engine(b, **FORMS[form]))


def test_a_bad_tensor_is_named_and_no_weight_changes(checkpoint_pairs):
    a, b = checkpoint_pairs["llama"]
    llm = LLM(str(a), kv_cache_memory=0.02, enable_prefix_caching=False, dtype="float32")
    before = run(llm)
    good = dict(llm.engine.runner.read_weights(str(b)))
    name = "model.layers.1.self_attn.k_proj.weight"
    cases = {
        "shape": {**good, name: good[name][:, :-1]},
        "no such tensor": {**good, "model.layers.9.mlp.up_proj.weight": good[name]},
        "floating-point": {**good, name: good[name].to(torch.int32)},
    }
    for why, tensors in cases.items():
        with pytest.raises(ValueError, match=why) as e:
            llm.update_weights(tensors)
        assert "model.layers." in str(e.value)
    with pytest.raises(ValueError, match="model_path"):
        llm.update_weights(model_path=str(b / "nowhere"))
    assert run(llm) == before and llm.weight_version == "default"


def test_kv_cached_under_old_weights_is_never_matched_after_an_update(checkpoint_pairs):
    a, b = checkpoint_pairs["llama"]
    llm = engine(a, dtype="float32")
    run(llm)  # PROMPTS' blocks cached under A's weights
    core = llm.engine
    cached = core.scheduler.kv.cache.num_cached_blocks
    assert cached > 0
    core.update_weights(core.runner.read_weights(str(b)), "b", flush_cache=False)
    assert core.scheduler.kv.cache.num_cached_blocks == cached  # not flushed: still there
    outs = llm.generate([list(p) for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert replies(outs) == run(engine(b, dtype="float32"))
    outs = llm.generate([list(PROMPTS[0])], GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens > 0  # what B's weights computed is matched again
    core.scheduler.kv.check_invariants()


def test_a_running_request_recomputes_its_kv_when_asked(checkpoint_pairs):
    a, b = checkpoint_pairs["llama"]
    llm = engine(a, dtype="float32")
    core = llm.engine
    from tandem.engine.messages import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    params.eos_token_ids = ()
    core.add_request(EngineCoreRequest("r", PROMPTS[0], params, 0.0))
    tokens = []
    for _ in range(3):
        tokens += [t for o in core.step() for t in o.new_token_ids]
    core.update_weights(core.runner.read_weights(str(b)), recompute_kv=True)
    assert core.scheduler.requests["r"].num_computed_tokens == 0  # back to wait, KV dropped
    while core.has_unfinished():
        tokens += [t for o in core.step() for t in o.new_token_ids]
        core.scheduler.check_invariants()
    # the last tokens are B's greedy continuation of the prompt and A's first tokens
    ref = engine(b, dtype="float32").generate(
        [PROMPTS[0] + tokens[:3]],
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False,
    )  # fmt: skip
    assert tokens[3:] == ref[0].outputs[0].token_ids


def test_the_default_models_4bit_blocks_take_its_own_float_weights_back():
    """Pushing the GGUF's float weights (its converted folder's) requantizes them into the
    same Q4_1 and Q8_0 blocks: every nibble and byte as before, each scale and minimum within
    one bf16 rounding of its old value (they are stored in bf16, and computed again from the
    float values), and the greedy reply unchanged."""
    from tandem.model.quant import Int4Linear

    llm = LLM(kv_cache_memory=0.05)
    ids = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=12)
    before = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int4Linear)]
    old = [[(t.packed.clone(), t.scales_zeros.float()) for t in m.terms] for m in layers]
    assert llm.update_weights(model_path=str(llm.model_path)) > 100
    for m, terms in zip(layers, old):
        for t, (packed, sz) in zip(m.terms, terms):
            assert torch.equal(t.packed, packed), m.fmt
            new = t.scales_zeros.float()
            scale = torch.maximum(new[..., 0].abs(), sz[..., 0].abs())
            # a scale within a bf16 rounding; a minimum (zero = min + 8 scale) within those of
            # its two parts
            assert ((new[..., 0] - sz[..., 0]).abs() <= 2**-7 * scale).all(), m.fmt
            bound = 2**-7 * (new[..., 1].abs() + 16 * scale) + 1e-6
            assert ((new[..., 1] - sz[..., 1]).abs() <= bound).all(), m.fmt
    assert llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == before
    assert default_model_path().exists()


def test_sleep_level_2_gives_the_models_memory_back_and_wake_up_loads_it_again():
    from tandem.engine.builder import build_engine
    from tandem.engine.config import EngineConfig

    core, _ = build_engine(EngineConfig(kv_cache_memory=0.05))
    params = SamplingParams(temperature=0, max_tokens=8)
    from tandem.engine.messages import EngineCoreRequest

    def greedy(rid: str) -> list[int]:
        params.eos_token_ids = ()
        core.add_request(EngineCoreRequest(rid, [1, 504, 3458, 282, 4649, 314], params, 0.0))
        tokens = []
        while core.has_unfinished():
            tokens += [t for o in core.step() for t in o.new_token_ids]
        return tokens

    before = greedy("a")
    with pytest.raises(ValueError, match="level"):
        core.sleep(3)
    asleep = core.sleep(2)
    # the default model's 4-bit weights and tables are ~100 MB resident
    assert asleep["freed_bytes"] > 50 * 2**20, asleep
    assert core.runner.model is None and core.step() == []
    with pytest.raises(ValueError, match="asleep"):
        core.runner.update_weights({})
    assert core.wake_up()["weight_version"] == "default"
    assert greedy("b") == before


def test_the_offline_llm_sleeps_and_wakes_between_generate_calls(checkpoint_pairs):
    a, b = checkpoint_pairs["llama"]
    llm = engine(a, dtype="float32")
    before = run(llm)
    llm.update_weights(model_path=str(b), weight_version="b")
    assert llm.sleep(1)["level"] == 1
    llm.wake_up()
    assert run(llm) == run(engine(b, dtype="float32"))  # level 1 keeps the weights
    assert llm.sleep(2)["level"] == 2
    llm.wake_up()
    assert llm.weight_version == "default" and run(llm) == before  # level 2: the file's

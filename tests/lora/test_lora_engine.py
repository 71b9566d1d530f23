"""Multi-LoRA offline: each adapter's greedy output equals HF transformers + peft token for
token; a batch mixing adapters and the base gives each row what it gets alone; adapters
beyond the slots are swapped in and out; the prefix cache never serves one adapter's KV to
another; bad adapters are refused whole."""

from __future__ import annotations

import json

import pytest

from tandem import LLM, LoRARequest, SamplingParams
from tests.conftest import hf_greedy
from tests.engine.test_hf_parity import prompts_of_lengths
from tests.lora.conftest import build_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
IDS = {"all": 1, "attn": 2, "mlp": 3}


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, IDS[name], str(adapters[name]))


def lora_llm(checkpoints, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 0.01)
    return LLM(str(checkpoints["llama"]), dtype="float32", enable_lora=True, **kw)


def assert_all_released(llm: LLM) -> None:
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.kv.usage == 0
    llm.engine.runner.lora.check_invariants()


@pytest.mark.parametrize("name", ["all", "attn", "mlp"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_output_with_each_adapter_equals_peft(
    checkpoints, adapters, peft_models, name, block_size
):
    llm = lora_llm(checkpoints, block_size=block_size, max_lora_rank=16)
    prompts = prompts_of_lengths([3, 17, 40], seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora(adapters, name))
    for prompt, out in zip(prompts, outs):
        want, want_lps = hf_greedy(peft_models(name), prompt, 16)
        got = out.outputs[0]
        assert got.token_ids == want
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3
    assert_all_released(llm)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_batch_mixing_three_adapters_and_the_base_gives_each_row_its_own_output(
    checkpoints, hf_models, adapters, peft_models, path, monkeypatch
):
    if path == "torch":  # the batched-matmul layout used where the C++ kernel is not built
        monkeypatch.setenv("TANDEM_NO_CPP_KERNELS", "1")
    llm = lora_llm(checkpoints, max_loras=3, max_lora_rank=16)
    assert (llm.engine.runner.lora.kernel is None) == (path == "torch")
    prompts = prompts_of_lengths([5, 30, 12, 21, 9, 40, 3, 17], seed=2)
    names = ["all", None, "attn", "mlp", "mlp", "all", None, "attn"]
    requests = [lora(adapters, n) if n else None for n in names]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    for prompt, name, out in zip(prompts, names, outs):
        ref = peft_models(name) if name else hf_models("llama")
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 16)[0], f"adapter {name}"
    assert_all_released(llm)


def test_more_adapters_than_slots_are_swapped_through_them(checkpoints, adapters, peft_models):
    # One slot, three adapters in one call: the scheduler runs one adapter per step and the
    # runner swaps adapters in and out of the slot; every answer stays exact.
    llm = lora_llm(checkpoints, max_loras=1, max_lora_rank=16)
    prompts = prompts_of_lengths([6, 14, 9], seed=3)
    names = ["all", "attn", "mlp"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[lora(adapters, n) for n in names])  # fmt: skip
    for prompt, name, out in zip(prompts, names, outs):
        assert out.outputs[0].token_ids == hf_greedy(peft_models(name), prompt, 16)[0]
    manager = llm.engine.runner.lora
    assert len(manager.slot_of) == 1 and len(manager.adapters) == 3  # the rest in host memory
    assert_all_released(llm)


def test_the_prefix_cache_never_serves_one_adapters_kv_to_another(
    checkpoints, hf_models, adapters, peft_models
):
    llm = lora_llm(checkpoints, max_loras=2, block_size=4)
    prompt = prompts_of_lengths([33], seed=4)[0]
    kv = llm.engine.scheduler.kv
    runs = [("all", lora(adapters, "all")), ("attn", lora(adapters, "attn")), ("base", None),
            ("all", lora(adapters, "all"))]  # fmt: skip
    hits = []
    for name, request in runs:
        before = kv.stats.hits
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0]
        ref = hf_models("llama") if name == "base" else peft_models(name)
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 16)[0], name
        hits.append(kv.stats.hits - before)
    assert hits[:3] == [0, 0, 0]  # same tokens, other adapter: nothing shared
    assert hits[3] == 32  # the same adapter again: its own prompt blocks (8 of 4 tokens)


def test_an_adapter_in_use_cannot_be_unloaded_and_an_unloaded_one_is_refused(checkpoints, adapters):
    from tandem.engine.messages import EngineCoreRequest

    llm = lora_llm(checkpoints)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora(adapters, "all"))
    core = llm.engine
    core.add_request(EngineCoreRequest("x", [5, 6, 7], SamplingParams(max_tokens=4), 0.0,
                                       lora_id=1))  # fmt: skip
    with pytest.raises(ValueError, match="in use by 1 request"):
        llm.remove_lora(1)
    while core.has_unfinished():
        core.step()
    llm.remove_lora(1)
    assert 1 not in core.runner.lora.adapters and not core.runner.lora.slot_of
    with pytest.raises(ValueError, match="adapter 1 is not loaded"):
        core.add_request(EngineCoreRequest("y", [5, 6], SamplingParams(), 0.0, lora_id=1))


def write(folder, config: dict | None = None, weights: bytes | None = None):
    folder.mkdir()
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    if weights is not None:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


@pytest.fixture(scope="module")
def bad_adapters(checkpoints, adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    good_config = json.loads((adapters["all"] / "adapter_config.json").read_text())
    good_weights = (adapters["all"] / "adapter_model.safetensors").read_bytes()
    return {
        "rank 8 exceeds --max-lora-rank 4": adapters["all"],
        "trained for another base model": build_adapter(
            checkpoints["llama3"], root / "llama3", seed=5
        ),
        "has no adapter_config.json": write(root / "noconfig", None, good_weights),
        "not valid JSON": write(root / "badjson", None, good_weights),
        "use_dora=True is not supported": write(
            root / "dora", {**good_config, "use_dora": True}, good_weights
        ),
        "cannot read adapter_model.safetensors": write(root / "junk", good_config, b"\x00" * 64),
        "has no adapter_model.safetensors": write(root / "noweights", good_config),
    }


@pytest.mark.parametrize(
    "problem",
    [
        "rank 8 exceeds --max-lora-rank 4",
        "trained for another base model",
        "has no adapter_config.json",
        "not valid JSON",
        "use_dora=True is not supported",
        "cannot read adapter_model.safetensors",
        "has no adapter_model.safetensors",
    ],
)
def test_a_bad_adapter_is_refused_naming_the_problem_and_nothing_is_loaded(
    checkpoints, bad_adapters, problem
):
    folder = bad_adapters[problem]
    if problem == "not valid JSON":
        (folder / "adapter_config.json").write_text("{r: 8")
    llm = lora_llm(checkpoints, max_lora_rank=4 if "max-lora-rank" in problem else 16)
    with pytest.raises(ValueError, match=problem):
        llm.generate(
            [[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, str(folder))
        )
    assert llm.engine.lora_ids == set() and llm.engine.runner.lora.adapters == {}
    assert llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serves


def test_lora_requests_without_enable_lora_are_refused(checkpoints, adapters):
    llm = LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.01)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=lora(adapters, "all"))


def test_an_adapter_loaded_under_a_removed_ones_id_never_hits_its_kv(
    checkpoints, adapters, peft_models
):
    """remove_lora purges the radix blocks keyed by that id: a different adapter loaded under
    the same id recomputes the prompt and answers as its own weights say."""
    llm = lora_llm(checkpoints, max_loras=1, block_size=4)
    prompt = prompts_of_lengths([33], seed=5)[0]
    kv = llm.engine.scheduler.kv
    llm.generate([prompt], GREEDY, use_tqdm=False)  # the base model's blocks
    base = kv.cache.num_cached_blocks
    first = LoRARequest("all", 1, str(adapters["all"]))
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=first)
    assert kv.cache.num_cached_blocks == 2 * base  # (49 tokens: 12 full blocks each)
    llm.remove_lora(1)
    assert kv.cache.num_cached_blocks == base  # the adapter's went, the base's stay
    assert_all_released(llm)
    before = kv.stats.hits
    second = LoRARequest("attn", 1, str(adapters["attn"]))  # the same id, other weights
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=second)[0]
    assert kv.stats.hits == before  # nothing of the removed adapter's KV was served
    assert out.outputs[0].token_ids == hf_greedy(peft_models("attn"), prompt, 16)[0]
    assert_all_released(llm)


def test_an_adapters_kv_reaches_a_restarted_engine_through_a_disk_tier_under_another_id(
    checkpoints, adapters, tmp_path
):
    """The tiers name an adapter's KV by its weights, not by the id a process gave it: a
    restarted engine that loads the adapter under another id hits; another adapter and the
    base model never do; outputs equal an engine without tiers."""
    prompt = [(9 * i + 4) % 200 + 3 for i in range(45)]
    flags = dict(block_size=4, kv_disk_dir=str(tmp_path / "kv"), kv_offload_min_tokens=8)
    reference = lora_llm(checkpoints, max_loras=2).generate(
        [prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 1, str(adapters["all"]))
    )[0]
    first = lora_llm(checkpoints, max_loras=2, **flags)
    out = first.generate([prompt], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("all", 1, str(adapters["all"])))[0]  # fmt: skip
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    first.engine.kv_tiers.flush()
    restarted = lora_llm(checkpoints, max_loras=2, **flags)
    other = restarted.generate([prompt], GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("attn", 1, str(adapters["attn"])))[0]  # fmt: skip
    base = restarted.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # never its KV
    again = restarted.generate([prompt], GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("all", 2, str(adapters["all"])))[0]  # fmt: skip
    assert again.num_cached_tokens == 44  # all but the last token, loaded under id 2
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids

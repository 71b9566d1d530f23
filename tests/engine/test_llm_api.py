"""The offline LLM API: vLLM's shapes, sampling features, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(
        str(llama_path), dtype="float32", block_size=4, kv_cache_memory=0.01, max_model_len=256
    )


def assert_idle(llm):
    sched = llm.engine.scheduler
    sched.check_invariants()
    assert not sched.has_unfinished() and sched.kv.usage == 0


def test_generate_returns_vllm_shaped_outputs(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(
        ["Hello there", [5, 6, 7]],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == ["Hello there", None]
    assert outs[0].prompt_token_ids == tok.encode("Hello there") and outs[1].prompt_token_ids == [
        5,
        6,
        7,
    ]
    for o in outs:
        (c,) = o.outputs
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length" and o.finished
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_idle(llm)


def test_n_samples_are_distinct_reproducible_and_share_the_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    before = llm.engine.scheduler.kv.stats.hits
    first = llm.generate([list(range(10, 30))], params, use_tqdm=False)[0]
    again = llm.generate([list(range(10, 30))], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert llm.engine.scheduler.kv.stats.hits > before  # siblings reused the prompt's blocks
    assert_idle(llm)


def test_a_seeded_request_gives_the_same_tokens_in_any_batch(llm):
    seeded = SamplingParams(temperature=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[9, 8, 7, 6]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(
        [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6], [3] * 20], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone


def test_stop_strings_end_generation_and_are_excluded_from_text(llm):
    free = llm.generate(
        ["The quick"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    text = free[0].outputs[0].text
    stop = text[3:6]
    assert len(stop) == 3 and stop.strip()
    out = llm.generate(
        ["The quick"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        ["The quick"],
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == text[: text.index(stop) + 3]
    assert_idle(llm)


def test_stop_token_ids_end_generation_with_the_token_kept(llm):
    free = llm.generate(
        [[4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    ids = free[0].outputs[0].token_ids
    out = llm.generate(
        [[4, 5, 6]],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[ids[4]]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[4]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[4]


def test_logprobs_hold_the_sampled_token_and_the_top_k(llm):
    out = llm.generate(
        [[4, 5, 6]],
        SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        ranked = sorted(
            (lp.rank, lp.logprob) for t, lp in entry.items() if t != token or lp.rank <= 3
        )
        assert [r for r, _ in ranked][:3] == [1, 2, 3]
        assert all(a[1] >= b[1] for a, b in zip(ranked, ranked[1:]))
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))
    )


def test_chat_applies_the_checkpoints_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    expected = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert out.prompt_token_ids == expected


def test_incremental_detokenization_keeps_multibyte_characters_whole(llm):
    tok = llm.get_tokenizer()
    text = "naïve café 東京 🙂 and Héllo wörld"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(n=0), "n"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed=2**63), "seed"),
        (dict(top_k=2**64), "top_k"),
        (dict(n=257), "n"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_invalid_sampling_params_name_the_field_and_range(kwargs, field):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**kwargs)
    assert "must be" in str(e.value)


def test_a_prompt_longer_than_max_model_len_fails_before_anything_runs(llm):
    ok = [1, 2, 3]
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([ok, [7] * 300], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_idle(llm)  # the valid prompt was not left behind either
    assert llm.processor.num_unfinished == 0
    assert llm.generate([ok], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 10**6]], use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(max_tokens=2), "prompt: must not be empty"),
        ("hi", SamplingParams(max_tokens=2, logprobs=21), "logprobs.*max_logprobs"),
        (
            "hi",
            SamplingParams(max_tokens=2, stop_token_ids=[10**6], min_tokens=1),
            "stop_token_ids",
        ),
    ],
)
def test_requests_the_model_cannot_serve_are_refused_by_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["ok", prompt], params, use_tqdm=False)
    assert_idle(llm)


def test_max_logprobs_is_an_engine_setting(llama_path):
    llm = LLM(str(llama_path), dtype="float32", kv_cache_memory=0.01, max_logprobs=30)
    out = llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=25), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 25


def test_unknown_architecture_is_refused_by_name(llama_path, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(llama_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures.*GPT2LMHeadModel.*supported"):
        LLM(str(bad))


def test_missing_model_path_and_missing_weights_are_refused(llama_path, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    empty = tmp_path / "noweights"
    empty.mkdir()
    shutil.copy(llama_path / "config.json", empty)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(empty))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dtype="int3"), "dtype"),
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=100000), "max_model_len"),
    ],
)
def test_invalid_engine_settings_are_refused_by_name(llama_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(llama_path), **kwargs)


def test_seeded_sampler_state_is_released_by_a_step_that_schedules_nothing(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, ignore_eos=True)
    llm.generate(["Hello", "there"], params, use_tqdm=False)
    sampler = llm.engine.runner.sampler
    assert sampler._seeded  # the requests finished in the last step; nobody told the runner
    assert llm.engine.step() == []
    assert not sampler._seeded


@pytest.mark.parametrize("policy", ["priority", "slo"])
def test_every_scheduling_policy_gives_the_same_greedy_tokens(llama_path, policy):
    """Order, chunking and preemption change under priority and SLO scheduling; the tokens
    of a greedy request do not. A pool small enough to preempt, mixed priorities."""
    prompts = [[5 + i] * (3 + 7 * i) for i in range(8)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, ttft_ms=50.0 * (i + 1))
        for i in range(8)
    ]
    priority = [i % 3 for i in range(8)]

    def run(name):
        llm = LLM(str(llama_path), dtype="float32", block_size=4, num_kv_blocks=40,
                  max_num_batched_tokens=24, scheduling_policy=name)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
        assert_idle(llm)
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions

    ref, _ = run("fcfs")
    got, preemptions = run(policy)
    assert got == ref
    assert preemptions > 0


def test_loading_a_model_never_imports_torch_dynamo(llama_path):
    """Every start (each server's engine core, each test's LLM) pays for what loading imports:
    the model is built on the meta device, where a random init or the RoPE tables computed
    through torch's Python meta kernels import torch._dynamo (~1.5 s on 2 cores)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom tandem import LLM\n"
        f"LLM({str(llama_path)!r}, dtype='float32', kv_cache_memory=0.01)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"

"""A split model's KV leaves and re-enters the pool as one model's: the KV tiers store the
ranks' shares of each block and a restarted split instance loads them (greedy output as
computed), while another split never reads them; prefill/decode disaggregation between a
split instance and a whole one, either way round, answers as a colocated instance."""

from __future__ import annotations

import httpx
import pytest

from tandem import LLM, SamplingParams
from tests.conftest import build_checkpoint
from tests.disagg.conftest import ProxyProcess
from tests.server.conftest import Server

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONTEXT = [(13 * j) % 300 + 40 for j in range(64)]
POOL = dict(dtype="float32", block_size=4, num_kv_blocks=64, kv_offload_min_tokens=8)


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("split-kv")
    return build_checkpoint(root / "llama", "llama", num_hidden_layers=3,
                            num_attention_heads=8, num_key_value_heads=2)  # fmt: skip


def test_a_restarted_split_instance_loads_its_shares_from_the_disk_tier(eight_heads, tmp_path):
    with LLM(str(eight_heads), **POOL) as whole:
        want = whole.generate([CONTEXT + [1, 2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    flags = dict(POOL, kv_disk_dir=str(tmp_path / "kv"), tensor_parallel_size=2,
                 pipeline_parallel_size=2)  # fmt: skip
    with LLM(str(eight_heads), **flags) as first:
        assert first.generate([CONTEXT + [1, 2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want  # fmt: skip
        first.engine.kv_tiers.flush()
    with LLM(str(eight_heads), **flags) as restarted:
        got = restarted.generate([CONTEXT + [1, 2]], GREEDY, use_tqdm=False)[0]
        assert got.num_cached_tokens == 64  # the 16 full blocks, each from 4 ranks' shares
        assert got.outputs[0].token_ids == want
    other = dict(flags, pipeline_parallel_size=1)  # another split: another layout
    with LLM(str(eight_heads), **other) as tp_only:
        got = tp_only.generate([CONTEXT + [1, 2]], GREEDY, use_tqdm=False)[0]
        assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == want


def test_disaggregation_between_split_and_whole_instances_equals_one_whole_model(
    eight_heads, tmp_path
):
    with LLM(str(eight_heads), dtype="float32") as whole:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        (want,) = whole.generate([CONTEXT], params, use_tqdm=False)
    # a -tp 2 prefill instance feeding a whole decode instance, and the reverse with a
    # -tp 2 -pp 2 decode instance: the KV gathered by heads, then cut by heads and layers
    pairs = []
    for name, prefill, decode in (("tp-prefill", ["-tp", "2"], []),
                                  ("tp-pp-decode", [], ["-tp", "2", "-pp", "2"])):  # fmt: skip
        p = Server(eight_heads, ["--role", "prefill", *prefill], tmp_path, f"{name}-p")
        d = Server(eight_heads, ["--role", "decode", *decode], tmp_path, f"{name}-d")
        pairs.append(ProxyProcess([p], [d], tmp_path, f"{name}-proxy"))
    try:
        body = {"prompt": CONTEXT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}  # fmt: skip
        for proxy in pairs:
            proxy.wait_ready()
            got = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60).json()
            assert got["choices"][0]["text"] == want.outputs[0].text
            chosen = [next(iter(lp.values())).logprob for lp in want.outputs[0].logprobs]
            for a, b in zip(got["choices"][0]["logprobs"]["token_logprobs"], chosen):
                assert a == pytest.approx(b, abs=1e-4)
            assert proxy.metrics()["tandem:pd_requests_total:handoff"] == 1
    finally:
        for proxy in pairs:
            proxy.stop()
            for s in (*proxy.prefill, *proxy.decode):
                s.stop()

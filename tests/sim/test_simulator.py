"""`tandem sim`: the real engine loop and scheduler on virtual clocks. Exact against a hand
computation with a constant-time cost model, deterministic, torch-free, and built from the
very classes `tandem serve` runs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from tandem.core.cost_model import CostModel
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler
from tandem.engine.core import EngineCore
from tandem.router import policy
from tandem.sim.cluster import ClusterSpec
from tandem.sim.report import summarize
from tandem.sim.runner import SIM_TOKEN
from tandem.sim.simulator import Simulation
from tandem.sim.specs import HARDWARE, MODELS, ModelSpec, kv_capacity_tokens, roofline_cost_model
from tandem.sim.workload import SimRequest, mooncake_trace, multi_turn_requests, random_requests


def constant_cluster(tmp_path, seconds=0.01, count=1, router="round_robin", kv_tokens=4096):
    path = tmp_path / "cost.json"
    CostModel((seconds, 0.0, 0.0, 0.0, 0.0)).save(path)
    return ClusterSpec.from_dict(
        {"model": "llama-3-8b", "router": router, "groups": [
            {"name": "g", "cost_model": "cost.json", "kv_tokens": kv_tokens, "count": count,
             "price_per_hour": 3.6}]}, tmp_path)  # fmt: skip


def test_one_instance_with_a_constant_step_time_gives_the_hand_computed_latencies(tmp_path):
    # Steps of 10 ms. r0 (t=0): prefill 0-10 ms, then a token each step to 50 ms. r1 arrives
    # at 15 ms, during r0's second step, so its prefill is the third step (20-30 ms).
    requests = [SimRequest(0.0, tuple(range(10)), 5), SimRequest(0.015, tuple(range(50, 60)), 3)]
    sim = Simulation(constant_cluster(tmp_path), requests)
    r0, r1 = sim.run()
    assert r0.first_token == pytest.approx(0.01) and r0.finished == pytest.approx(0.05)
    assert r0.token_times == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert r1.first_token == pytest.approx(0.03) and r1.token_times == pytest.approx(
        [0.03, 0.04, 0.05]
    )
    result = summarize(sim, [r0, r1])
    assert result["mean_ttft_ms"] == pytest.approx((10 + 15) / 2)
    assert result["mean_tpot_ms"] == pytest.approx(10)
    assert result["mean_e2el_ms"] == pytest.approx((50 + 35) / 2)
    assert result["num_steps"] == 5 and result["simulated_seconds"] == pytest.approx(0.05)
    # one instance at $3.60/h for 50 ms, 8 output tokens
    assert result["cost_per_million_output_tokens"] == pytest.approx(3.6 * 0.05 / 3600 / 8 * 1e6)
    assert result["groups"]["g"]["utilization"] == pytest.approx(1.0)


def loaded_group(tmp_path, **fields):
    """The first group of a cluster file giving a profiled group these fields."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": "llama-3-8b", "groups": [
        {"cost_model": "cost.json", "kv_tokens": 4096, **fields}]}))  # fmt: skip
    return ClusterSpec.load(path).groups[0]


def test_a_groups_latency_delays_every_time_its_client_sees_and_nothing_else(tmp_path):
    requests = [SimRequest(0.0, tuple(range(10)), 5), SimRequest(0.015, tuple(range(50, 60)), 3)]
    plain = Simulation(constant_cluster(tmp_path), requests).run()
    spec = constant_cluster(tmp_path)
    spec = dataclasses.replace(spec, groups=[dataclasses.replace(spec.groups[0], latency_s=0.2)])
    late = Simulation(spec, requests).run()
    for a, b in zip(plain, late):
        assert b.first_token == pytest.approx(a.first_token + 0.2)
        assert b.token_times == pytest.approx([t + 0.2 for t in a.token_times])
    # and from the cluster file, in milliseconds
    assert loaded_group(tmp_path, latency_ms=200).latency_s == pytest.approx(0.2)


def test_a_groups_token_cost_lengthens_each_step_by_its_sampling_rows(tmp_path):
    # Steps of 10 ms plus 2 ms a sampled token. r0 alone: its prefill and each decode 12 ms.
    # r1 (t=15 ms) arrives during r0's second step (12-24 ms); from 24 ms both sample: 14 ms.
    requests = [SimRequest(0.0, tuple(range(10)), 5), SimRequest(0.015, tuple(range(50, 60)), 3)]
    spec = constant_cluster(tmp_path)
    spec = dataclasses.replace(spec, groups=[dataclasses.replace(spec.groups[0], token_s=0.002)])
    r0, r1 = Simulation(spec, requests).run()
    assert r0.token_times == pytest.approx([0.012, 0.024, 0.038, 0.052, 0.066])
    assert r1.token_times == pytest.approx([0.038, 0.052, 0.066])
    assert loaded_group(tmp_path, token_ms=2).token_s == pytest.approx(0.002)


def test_a_groups_step_cost_lengthens_every_step_and_adds_to_its_token_cost(tmp_path):
    # Steps of 10 ms, plus 1 ms a step and 2 ms a sampled token. r0 alone: 13 ms a step; r1
    # (t=15 ms) arrives during r0's second (13-26 ms); from 26 ms both sample: 15 ms a step.
    requests = [SimRequest(0.0, tuple(range(10)), 5), SimRequest(0.015, tuple(range(50, 60)), 3)]
    spec = constant_cluster(tmp_path)
    host = dataclasses.replace(spec.groups[0], step_s=0.001, token_s=0.002)
    r0, r1 = Simulation(dataclasses.replace(spec, groups=[host]), requests).run()
    assert r0.token_times == pytest.approx([0.013, 0.026, 0.041, 0.056, 0.071])
    assert r1.token_times == pytest.approx([0.041, 0.056, 0.071])
    assert loaded_group(tmp_path, step_ms=1).step_s == pytest.approx(0.001)


def test_a_groups_request_cost_lengthens_the_first_step_of_each_request_once(tmp_path):
    # Steps of 10 ms, plus 3 ms for each request a step schedules for the first time (its HTTP
    # and tokenization). r0's prefill: 13 ms, its decodes 10; r1 (t=15 ms) arrives during r0's
    # second step (13-23 ms), and the step that takes it in runs 13 ms; then 10 ms a step.
    requests = [SimRequest(0.0, tuple(range(10)), 5), SimRequest(0.015, tuple(range(50, 60)), 3)]
    spec = constant_cluster(tmp_path)
    host = dataclasses.replace(spec.groups[0], request_s=0.003)
    r0, r1 = Simulation(dataclasses.replace(spec, groups=[host]), requests).run()
    assert r0.token_times == pytest.approx([0.013, 0.023, 0.036, 0.046, 0.056])
    assert r1.token_times == pytest.approx([0.036, 0.046, 0.056])
    assert loaded_group(tmp_path, request_ms=3).request_s == pytest.approx(0.003)


def test_a_groups_step_scale_stretches_the_cost_models_time_before_its_host_costs(tmp_path):
    # Steps of 10 ms at scale 1.5: 15 ms, plus 1 ms a step (host costs are not scaled). r0
    # alone: 16 ms a step; r1 (t=20 ms) arrives during r0's second (16-32 ms), then both: 16 ms.
    requests = [SimRequest(0.0, tuple(range(10)), 4), SimRequest(0.020, tuple(range(50, 60)), 2)]
    spec = constant_cluster(tmp_path)
    slow = dataclasses.replace(spec.groups[0], step_scale=1.5, step_s=0.001)
    r0, r1 = Simulation(dataclasses.replace(spec, groups=[slow]), requests).run()
    assert r0.token_times == pytest.approx([0.016, 0.032, 0.048, 0.064])
    assert r1.token_times == pytest.approx([0.048, 0.064])
    assert loaded_group(tmp_path, step_scale=1.5).step_scale == 1.5


def noisy_cluster(tmp_path, noise, step_noise=True):
    CostModel((0.01, 0.0, 0.0, 0.0, 0.0), noise=noise).save(tmp_path / "noisy.json")
    return ClusterSpec.from_dict({"model": "llama-3-8b", "groups": [
        {"cost_model": "noisy.json", "kv_tokens": 4096, "step_noise": step_noise}]},
        tmp_path)  # fmt: skip


def test_steps_stray_as_the_profiles_runs_did_about_the_prediction_deterministically(tmp_path):
    noise = (0.8, 1.0, 1.0, 2.0)  # a profile's spread about its median: mean 1.2
    requests = [SimRequest(0.0, tuple(range(10)), 400)]

    def itl(cluster):
        (r,) = Simulation(cluster, requests).run()
        return [b - a for a, b in zip(r.token_times, r.token_times[1:])]

    steps = itl(noisy_cluster(tmp_path, noise))
    # each a drawn ratio over the spread's mean, x 10 ms: the slow tail stays, no bias
    assert {round(t, 9) for t in steps} == {round(0.01 * r / 1.2, 9) for r in noise}
    assert sum(steps) / len(steps) == pytest.approx(0.01, rel=0.1)
    assert itl(noisy_cluster(tmp_path, noise)) == steps  # seeded per instance: the same draws
    assert {round(t, 9) for t in itl(noisy_cluster(tmp_path, noise, step_noise=False))} == {0.01}


def pd_cluster(tmp_path, decode_kv=4096, bandwidth_gbs=1.31072, latency_ms=0.1):
    path = tmp_path / "cost.json"
    CostModel((0.01, 0.0, 0.0, 0.0, 0.0)).save(path)
    group = {"cost_model": "cost.json", "kv_tokens": 4096}
    return ClusterSpec.from_dict({"model": "llama-3-8b", "groups": [
        {**group, "name": "p", "role": "prefill"},
        {**group, "name": "d", "role": "decode", "kv_tokens": decode_kv}],
        "links": [{"from": "p", "to": "d", "bandwidth_gbs": bandwidth_gbs,
                   "latency_ms": latency_ms}]}, tmp_path)  # fmt: skip


def test_one_prefill_one_decode_with_a_constant_step_time_gives_the_hand_computed_latencies(
    tmp_path,
):
    # The prompt's 10 tokens of Llama-3-8B KV are 1.31 MB: 1 ms over 1.31 GB/s, 1/32 of it a
    # layer. The prefill step is 0-10 ms; its last layer lands 10 + 1/32 ms, +0.1 ms latency.
    sim = Simulation(pd_cluster(tmp_path), [SimRequest(0.0, tuple(range(10)), 3)])
    (r,) = sim.run()
    arrival = 0.010 + 0.001 / 32 + 0.0001
    assert r.instance == "d-0" and r.prefill_instance == "p-0"
    assert r.kv_bytes == 10 * 131072
    assert r.first_token == pytest.approx(arrival)
    assert r.token_times == pytest.approx([arrival, arrival + 0.01, arrival + 0.02])
    decode = sim.instances[1].core.scheduler
    assert decode.kv.usage == 0 and not decode.requests  # committed, decoded, released


def test_a_request_arriving_mid_decode_step_is_reserved_when_the_step_ends(tmp_path):
    # As the decode server's engine core reads messages between steps. A's prefill is 0-10
    # ms, its KV lands at 10.13 ms (as above) and it decodes in 10 ms steps from there. B
    # comes at 15 ms, mid-step: reserved at 20.13, prefilled 20.13-30.13, its KV lands at
    # 30.26, mid-step again: committed, and its first token seen, when that step ends.
    land = 0.001 / 32 + 0.0001
    requests = [SimRequest(0.0, tuple(range(10)), 5), SimRequest(0.015, tuple(range(50, 60)), 2)]
    sim = Simulation(pd_cluster(tmp_path), requests)
    a, b = records = sim.run()
    assert (a.reserved, a.prefilled, a.first_token) == pytest.approx((0.0, 0.010, 0.010 + land))
    assert b.reserved == pytest.approx(0.020 + land)
    assert b.prefilled == pytest.approx(0.030 + land)
    assert b.first_token == pytest.approx(0.040 + land)
    # the report's stages are the proxy's: reserve, prefill, first byte (means, ms)
    stages = summarize(sim, records)["pd_handoff_stage_ms"]
    assert stages["reserve"] == pytest.approx(1e3 * (0.0 + 0.005 + land) / 2)
    assert stages["prefill"] == pytest.approx(10.0)
    assert stages["first_byte"] == pytest.approx(1e3 * (land + 0.010) / 2)


def test_the_decode_side_cache_sends_only_the_missing_kv_and_a_full_decode_pool_waits(
    tmp_path,
):
    prefix = tuple(range(64))
    requests = [SimRequest(0.0, prefix + (100,), 2), SimRequest(1.0, prefix + (200,), 2)]
    sim = Simulation(pd_cluster(tmp_path), requests)
    first, second = sim.run()
    assert first.kv_bytes == 65 * 131072 and second.kv_bytes == 1 * 131072  # 4 blocks held
    # a decode pool of 80 tokens holds one such request at a time: the second waits for room
    burst = [SimRequest(0.0, tuple(range(i * 100, i * 100 + 60)), 4) for i in range(2)]
    sim = Simulation(pd_cluster(tmp_path, decode_kv=80), burst)
    a, b = sim.run()
    assert b.first_token > a.finished  # reserved only once the first left the decode pool
    assert not a.error and not b.error


def test_multi_turn_history_is_held_by_the_decode_cache_unless_it_is_off(tmp_path):
    # each turn resends the previous prompt and its (simulated) reply, then 64 new tokens
    requests = multi_turn_requests(3, 3, 64, 16, 10.0, 1.0, seed=0)
    assert [len(r.prompt) for r in requests[:3]] == [64] * 3  # first turns
    by_conversation = sorted(requests, key=lambda r: (r.prompt[:4], r.arrival))
    assert by_conversation[1].prompt[: 64 + 16] == by_conversation[0].prompt + (SIM_TOKEN,) * 16
    sent = {}
    for caching in (True, False):
        cluster = pd_cluster(tmp_path)
        groups = [g if g.role == "prefill" else dataclasses.replace(g, prefix_caching=caching)
                  for g in cluster.groups]  # fmt: skip
        result = summarize(*_run(dataclasses.replace(cluster, groups=groups), requests))
        sent[caching] = result["kv_transfer_bytes"] / 131072  # tokens of Llama-3-8B KV
        assert result["completed"] == 9
    assert sent[False] == sum(len(r.prompt) for r in requests)  # every prompt, whole
    # with the cache, a later turn sends its new tokens and what its held blocks do not cover
    assert sent[True] <= 3 * 64 + 6 * (64 + 16)


def _run(cluster, requests):
    sim = Simulation(cluster, requests)
    return sim, sim.run()


def test_the_simulator_runs_the_classes_tandem_serve_runs(tmp_path):
    sim = Simulation(constant_cluster(tmp_path, count=2, router="prefix_aware"), [])
    for inst in sim.instances:
        assert type(inst.core) is EngineCore
        assert type(inst.core.scheduler) is Scheduler
        assert type(inst.core.scheduler.kv) is KVCacheManager
    # the router's: its policy inside session affinity
    assert type(sim.policy) is policy.SessionAffinity
    assert type(sim.policy.inner) is policy.PrefixAware


def test_the_same_seed_gives_the_same_result_byte_for_byte(tmp_path):
    cluster = ClusterSpec.from_dict({"model": "llama-3-8b", "router": "least_load", "groups": [
        {"hardware": "H100", "count": 3, "price_per_hour": 2.5}]})  # fmt: skip

    def once(seed):
        sim = Simulation(cluster, random_requests(200, 256, 32, 30.0, seed, range_ratio=0.5))
        return json.dumps(summarize(sim, sim.run()), sort_keys=True)

    assert once(1) == once(1)
    assert once(1) != once(2)


@pytest.mark.parametrize("router", ["least_load", "prefix_aware"])
def test_instances_stepped_by_several_processes_give_the_one_process_result(router):
    cluster = ClusterSpec.from_dict({"model": "llama-3-8b", "router": router, "groups": [
        {"hardware": "H100", "count": 5, "price_per_hour": 2.5}]})  # fmt: skip
    requests = random_requests(300, 256, 32, 60.0, 3, range_ratio=0.5)

    def once(processes):
        sim = Simulation(cluster, requests, processes)
        return json.dumps(summarize(sim, sim.run()), sort_keys=True)

    one = once(1)
    assert json.loads(one)["completed"] == 300
    assert once(2) == one
    assert once(3) == one  # shards of two and one instances


def test_a_step_that_raises_in_another_process_fails_the_run_with_its_traceback(tmp_path):
    sim = Simulation(constant_cluster(tmp_path, count=2), [], processes=2)
    sim.requests = [SimRequest(0.001 * i, tuple(range(i, i + 8)), 2) for i in range(4)]

    def broken():
        raise ZeroDivisionError("a bug in the step")

    sim.instances[1].core.step = broken  # instance 1 is the second process's
    with pytest.raises(RuntimeError, match="shard failed(.|\n)*a bug in the step"):
        sim.run()


def test_round_robin_spreads_requests_over_instances(tmp_path):
    requests = [SimRequest(0.001 * i, tuple(range(i, i + 8)), 2) for i in range(6)]
    sim = Simulation(constant_cluster(tmp_path, count=3), requests)
    records = sim.run()
    assert [r.instance for r in records] == ["g-0", "g-1", "g-2"] * 2


def test_requests_sharing_a_trace_prefix_hit_the_radix_cache(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1050, "output_length": 4, "hash_ids": [1, 2, 9]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))  # fmt: skip
    requests = mooncake_trace(trace)
    assert requests[0].prompt[:1024] == requests[1].prompt[:1024]
    assert [r.arrival for r in requests] == [0.0, 0.5]
    sim = Simulation(constant_cluster(tmp_path, kv_tokens=8192), requests)
    sim.run()
    kv = sim.instances[0].core.scheduler.kv
    assert kv.stats.hits == 1024  # the second request found the two shared 512-token blocks


def test_roofline_model_reads_the_weights_once_a_step_and_divides_work_by_tp():
    spec, h100 = ModelSpec.load("llama-3-8b"), HARDWARE["H100"]
    assert spec.params == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B's published size
    one, two = roofline_cost_model(h100, spec, 1), roofline_cost_model(h100, spec, 2)
    weights = spec.params * 2 / (h100.mem_bandwidth_gbs * 1e9 * h100.bandwidth_efficiency)
    assert one.coef[0] == pytest.approx(0.002 + weights)
    assert two.coef[1] < one.coef[1] and two.coef[3] == pytest.approx(one.coef[3] / 2)
    assert one.info["source"].startswith("roofline (derived")
    with pytest.raises(ValueError, match="does not fit on 1 x H100"):
        kv_capacity_tokens(h100, ModelSpec.load("llama-3-70b"), 1)
    assert kv_capacity_tokens(h100, ModelSpec.load("llama-3-70b"), 4) > 100_000
    assert set(MODELS) >= {"llama-3-8b", "llama-3-70b", "qwen2.5-32b"}


@pytest.mark.parametrize(
    "data, field",
    [
        ({"groups": []}, "cluster.groups"),
        ({"groups": [{"hardware": "TPU9"}]}, r"groups\[0\].hardware"),
        ({"groups": [{"hardware": "H100", "count": 0}]}, r"groups\[0\].count"),
        ({"groups": [{"hardware": "H100", "role": "mixed"}]}, r"groups\[0\].role"),
        ({"groups": [{"hardware": "H100", "role": "prefill"}]}, "needs prefill and decode"),
        (
            {
                "groups": [
                    {"name": "p", "hardware": "H100", "role": "prefill"},
                    {"name": "d", "hardware": "H100", "role": "decode"},
                ]
            },
            "no link from 'p' to 'd'",
        ),  # fmt: skip
        ({"groups": [{"cost_model": "x.json"}]}, r"groups\[0\].kv_tokens"),
        ({"model": "gpt-9", "groups": [{"hardware": "H100"}]}, "model"),
        ({"groups": [{"hardware": "H100"}], "engine": {"warp": 9}}, "cluster.engine"),
        ({"groups": [{"hardware": "H100"}], "router": "random"}, "cluster.router"),
        ({"groups": [{"hardware": "H100"}], "prefill_router": "x"}, "cluster.prefill_router"),
        ({"groups": [{"hardware": "H100"}], "scheduling_policy": "edf"}, "scheduling_policy"),
        ({"groups": [{"hardware": "H100", "prefix_caching": "no"}]}, "prefix_caching"),
        ({"groups": [{"hardware": "H100", "step_noise": 1}]}, r"groups\[0\].step_noise"),
        ({"groups": [{"hardware": "H100", "latency_ms": -1}]}, r"groups\[0\].latency_ms"),
        ({"groups": [{"hardware": "H100", "token_ms": "1"}]}, r"groups\[0\].token_ms"),
        ({"groups": [{"hardware": "H100", "step_ms": -1}]}, r"groups\[0\].step_ms"),
        ({"groups": [{"hardware": "H100", "request_ms": -1}]}, r"groups\[0\].request_ms"),
        ({"groups": [{"hardware": "H100", "step_scale": 0}]}, r"groups\[0\].step_scale"),
        ({"groups": [{"hardware": {"name": "X", "bf16_tflops": 100}}]}, r"groups\[0\].hardware"),
        (
            {
                "groups": [
                    {
                        "hardware": {
                            "name": "X",
                            "bf16_tflops": 100,
                            "mem_bandwidth_gbs": 0,
                            "mem_gib": 80,
                        }
                    }
                ]
            },
            "mem_bandwidth_gbs",
        ),  # fmt: skip
    ],
)
def test_a_bad_cluster_names_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        ClusterSpec.from_dict(data)


def test_the_simulator_imports_no_torch():
    code = ("import sys, tandem.sim.cli, tandem.sim.simulator, tandem.sim.report;"
            "assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tandem_sim_run_prints_a_bench_summary_marked_simulated(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("model: llama-3-8b\ngroups:\n  - {hardware: A100, count: 2}\n")
    out = tmp_path / "r.json"
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "sim", "run", "--cluster", str(cluster),
         "--num-prompts", "40", "--request-rate", "10", "--random-input-len", "128",
         "--random-output-len", "16", "--save-result", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert run.stdout.startswith("SIMULATED")
    assert "Mean TTFT (ms)" in run.stdout and "utilisation" in run.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 40 and result["simulated"] is True


def test_any_accelerator_can_be_described_by_its_published_figures():
    b200 = {"name": "B200", "bf16_tflops": 2250, "mem_bandwidth_gbs": 8000, "mem_gib": 180,
            "interconnect_gbs": 900, "price_per_hour": 6.0}  # fmt: skip
    cluster = ClusterSpec.from_dict({"groups": [{"hardware": b200, "count": 2, "tp": 2}]})
    (group,) = cluster.groups
    assert group.hardware == "B200" and group.price_per_hour == 12.0  # per device x tp
    h100 = ClusterSpec.from_dict({"groups": [{"hardware": "H100", "tp": 2}]}).groups[0]
    decode = roofline_cost_model(HARDWARE["H100"], cluster.model, 2).coef[0]
    assert group.cost_model.coef[0] < decode == h100.cost_model.coef[0]  # more bandwidth
    assert group.kv_tokens > h100.kv_tokens  # more memory
    no_link = {k: v for k, v in b200.items() if k != "interconnect_gbs"}
    with pytest.raises(ValueError, match="interconnect_gbs"):
        ClusterSpec.from_dict({"groups": [{"hardware": no_link, "tp": 2}]})

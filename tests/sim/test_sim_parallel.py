"""Tensor and pipeline parallelism in the simulator: a model one device cannot hold fits
on tp x pp devices, every device is priced, and the step times say what tandem's engine
does with them: TP divides a step's weight reads, PP (one batch in flight, stages in turn)
holds the model but adds hand-offs, so `sim plan` picks TP where latency binds."""

from __future__ import annotations

from tandem.core.cost_model import StepShape
from tandem.sim.cluster import ClusterSpec
from tandem.sim.plan import Layout, Planner
from tandem.sim.report import simulate
from tandem.sim.specs import HARDWARE, ModelSpec, kv_capacity_tokens, roofline_cost_model
from tandem.sim.workload import random_requests

L40S, LLAMA_70B = HARDWARE["L40S"], ModelSpec.load("llama-3-70b")


def test_pipeline_stages_hold_a_model_one_device_cannot_and_pay_for_each_handoff():
    decode = StepShape(decode_rows=32, kv_tokens=32 * 1024)
    step = {
        (tp, pp): roofline_cost_model(L40S, LLAMA_70B, tp, pp=pp).predict(decode)
        for tp, pp in ((1, 1), (4, 1), (1, 4), (2, 2))
    }
    assert step[(4, 1)] < step[(2, 2)] < step[(1, 4)]  # weight reads divided by tp only
    assert step[(1, 4)] > step[(1, 1)]  # stages in turn: one device's time, plus hand-offs
    assert kv_capacity_tokens(L40S, LLAMA_70B, 1, pp=4) == kv_capacity_tokens(L40S, LLAMA_70B, 4)
    cluster = ClusterSpec.from_dict({"model": "llama-3-70b",
                                     "groups": [{"hardware": "L40S", "tp": 2, "pp": 2}]})  # fmt: skip
    assert cluster.groups[0].price_per_hour == 4 * L40S.price_per_hour


def test_plan_over_tp_and_pp_skips_what_does_not_fit_and_picks_tp_for_a_latency_slo():
    requests = random_requests(40, 256, 32, rate=2.0, seed=3)

    def evaluate(cluster: dict) -> dict:
        return simulate(ClusterSpec.from_dict(cluster), requests, {"tpot": 200.0})

    def price(cluster: dict) -> float:
        return sum(g.price_per_hour * g.count for g in ClusterSpec.from_dict(cluster).groups)

    planner = Planner({"model": "llama-3-70b"}, evaluate, 0.9, 2, price)
    best = planner.search(["L40S"], [1, 4], pps=(1, 4))
    assert "L40S tp1" in planner.skipped  # 140 GB of weights on one 48 GB device
    assert best.layout == Layout("L40S", 4, count=1)
    tp4, pp4 = planner.probes[Layout("L40S", 4, count=1)], planner.probes[Layout("L40S", 1, count=1, pp=4)]  # fmt: skip
    assert tp4.price_per_hour == pp4.price_per_hour  # four devices either way
    assert tp4.result["p99_tpot_ms"] < pp4.result["p99_tpot_ms"]


def test_a_mixture_of_experts_computes_its_active_parameters_and_reads_all_of_them():
    mixtral, qwen3 = ModelSpec.load("mixtral-8x7b"), ModelSpec.load("qwen3-30b-a3b")
    assert round(mixtral.params / 1e9, 1) == 46.7  # Mixtral 8x7B's published total
    assert round(qwen3.params / 1e9, 1) == 30.5
    assert 12.7e9 < mixtral.matmul_params < 12.9e9  # 2 of 8 experts (+ the head)
    h100 = HARDWARE["H100"]
    dense_like = ModelSpec(**{**qwen3.__dict__, "num_experts": 0, "intermediate_size": 8 * 768})
    moe, dense = roofline_cost_model(h100, qwen3), roofline_cost_model(h100, dense_like)
    assert moe.coef[1] < dense.coef[1] * 1.1  # ~ the same FLOPs per token as 8 experts
    assert moe.coef[0] > 5 * dense.coef[0]  # but every expert's weights read per step


def test_spreading_experts_over_devices_costs_two_all_to_alls_a_layer():
    qwen3, h100 = ModelSpec.load("qwen3-30b-a3b"), HARDWARE["H100"]
    split, spread = roofline_cost_model(h100, qwen3, 2), roofline_cost_model(h100, qwen3, 2, ep=True)  # fmt: skip
    rows = 48 * 2 * 8 * 2048 * 2 / 2  # layers x there-and-back x k x hidden x bytes x (tp-1)/tp
    assert abs(spread.coef[1] - split.coef[1] - rows / (h100.interconnect_gbs * 1e9)) < 1e-12
    assert spread.info["ep"] and "ep" not in split.info
    dense = roofline_cost_model(h100, ModelSpec.load("llama-3-8b"), 2, ep=True)
    assert "ep" not in dense.info  # no experts: nothing to spread
    layout = Layout("H100", 2, count=1, ep=True)
    assert layout.cluster({"model": "qwen3-30b-a3b"})["groups"][0]["ep"] is True
    assert layout.describe() == "1 x H100 tp2 ep"
    cluster = ClusterSpec.from_dict(layout.cluster({"model": "qwen3-30b-a3b"}))
    assert cluster.groups[0].cost_model.info["ep"]

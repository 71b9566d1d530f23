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

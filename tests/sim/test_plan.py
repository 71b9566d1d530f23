"""`tandem sim plan` and `tandem sim run --find-max-rate`: the search finds the least cluster
that meets the target and keeps every probe; multi-class workloads carry priority and SLOs
into the real scheduler."""

from __future__ import annotations

import json
import subprocess
import sys

from tandem.bench.workloads import RequestClass
from tandem.sim.cluster import ClusterSpec
from tandem.sim.plan import Layout, Planner
from tandem.sim.report import attained, simulate
from tandem.sim.workload import multi_class_requests


def scripted(attainment):
    """An evaluate that scores a cluster dict by a formula over its group counts."""

    def evaluate(cluster: dict) -> dict:
        ClusterSpec.from_dict(cluster)  # as the CLI's evaluate builds it (and may refuse it)
        counts = {g.get("role", "both"): g["count"] for g in cluster["groups"]}
        return {"slo_attainment": {"all": {"attainment": attainment(counts)}},
                "p99_ttft_ms": 1.0, "p99_tpot_ms": 1.0}  # fmt: skip

    return evaluate


def price(cluster: dict) -> float:
    return sum(g["count"] * (2.0 if g["hardware"] == "A100" else 3.0) for g in cluster["groups"])


def test_plan_finds_the_least_colocated_count_by_doubling_then_bisecting():
    evaluate = scripted(lambda c: min(1.0, c["both"] / 5))  # 5 instances reach 100%
    planner = Planner({"model": "llama-3-8b"}, evaluate, 0.9, 16, price)
    best = planner.search(["H100"], [1])
    assert best.layout == Layout("H100", 1, count=5) and best.price_per_hour == 15.0
    assert sorted(p.layout.count for p in planner.probes.values()) == [1, 2, 4, 5, 6, 8]


def test_plan_picks_the_cheapest_over_hardware_and_modes_and_keeps_a_frontier():
    def attainment(c):
        if "both" in c:
            return min(1.0, c["both"] / 6)
        return min(1.0, c["prefill"] / 2) * min(1.0, c["decode"] / 2)

    planner = Planner({"model": "llama-3-8b", "link": {"bandwidth_gbs": 50}}, scripted(attainment),
                      0.9, 8, price)  # fmt: skip
    best = planner.search(["H100", "A100"], [1], colocated=True, disaggregated=True)
    # 2P + 2D A100 at $8 beats 6 colocated A100s at $12 and any H100 cluster
    assert best.layout == Layout("A100", 1, prefill=2, decode=2, decode_hardware="A100")
    assert best.price_per_hour == 8.0
    front = planner.frontier()
    assert [p.price_per_hour for p in front] == sorted(p.price_per_hour for p in front)
    assert all(a.attainment < b.attainment for a, b in zip(front, front[1:]))
    assert best in front


def test_plan_gives_up_on_a_part_that_no_longer_helps():
    # decode instances beyond one change nothing while prefill is the bottleneck
    planner = Planner({"model": "llama-3-8b", "link": {"bandwidth_gbs": 50}},
                      scripted(lambda c: 0.1 * c["prefill"]), 0.9, 16, price)  # fmt: skip
    planner.search(["H100"], [1], colocated=False, disaggregated=True)
    decodes = {p.layout.decode for p in planner.probes.values()}
    assert decodes <= {1, 2}  # never doubled past the stall to 4, 8, ...


def test_plan_skips_hardware_that_cannot_hold_the_model():
    planner = Planner({"model": "llama-3-70b"}, scripted(lambda c: 1.0), 0.9, 4, price)
    planner.search(["L40S"], [1])
    assert "L40S tp1" in planner.skipped and "does not fit" in planner.skipped["L40S tp1"]


def test_multi_class_requests_carry_priority_and_slos_into_the_scheduler():
    classes = [RequestClass.parse("name=chat,share=0.3,input=64,output=16,priority=0,ttft=300"),
               RequestClass.parse("name=batch,share=0.7,input=1024,output=16,priority=5,ttft=60000")]  # fmt: skip
    requests = multi_class_requests(120, classes, 40.0, seed=1)
    assert {r.cls for r in requests} == {"chat", "batch"}
    chat = {}
    for policy in ("fcfs", "priority"):
        cluster = ClusterSpec.from_dict({"model": "llama-3-8b", "scheduling_policy": policy,
                                         "engine": {"max_num_batched_tokens": 2048},
                                         "groups": [{"hardware": "L40S"}]})  # fmt: skip
        result = simulate(cluster, requests)
        chat[policy] = result["slo_attainment"]["chat"]["attainment"]
        assert set(result["slo_attainment"]) == {"chat", "batch", "all"}
    assert chat["priority"] > chat["fcfs"]


def test_tandem_sim_run_finds_the_max_rate_and_plots_it(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("model: llama-3-8b\ngroups:\n  - {hardware: A100, count: 1}\n")
    out, png = tmp_path / "r.json", tmp_path / "sweep.png"
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "sim", "run", "--cluster", str(cluster),
         "--num-prompts", "60", "--random-input-len", "512", "--random-output-len", "32",
         "--goodput", "ttft:300", "--find-max-rate", "--request-rate", "2", "--max-probes", "6",
         "--save-result", str(out), "--plot", str(png)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "max rate with SLO attainment >= 90%" in run.stdout
    probes = json.loads(out.read_text())
    found = probes[0]["max_rate_found"]
    assert found is not None and png.stat().st_size > 0
    for p in probes:  # every probe at or below the answer met the target, the first above not
        assert (attained(p) >= 0.9) == (p["request_rate"] <= found)


def test_tandem_sim_plan_prints_the_frontier_and_the_cheapest(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "sim", "plan", "--hardware", "A100", "H100",
         "--max-instances", "4", "--mode", "colocated", "--request-rate", "8",
         "--num-prompts", "60", "--random-input-len", "512", "--random-output-len", "32",
         "--goodput", "ttft:500", "tpot:50", "--save-result", str(tmp_path / "p.json")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("SIMULATED") and "cheapest that meets it:" in run.stdout
    probes = json.loads((tmp_path / "p.json").read_text())
    best = min((p for p in probes if p["attainment"] >= 0.9), key=lambda p: p["price_per_hour"])
    assert f"cheapest that meets it: {best['cluster']} " in run.stdout

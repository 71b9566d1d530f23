"""A prefill/decode ratio that follows the load, in the simulator: the router's own policy
moves instances between the pools as the mix shifts from long prompts to long answers and
back, every request still completes, and the fleet serves the shifting mix better than the
split it started from."""

from __future__ import annotations

import pytest

from tandem.router.pd_ratio import PDRatioConfig
from tandem.sim.cluster import ClusterSpec
from tandem.sim.plan import Layout
from tandem.sim.report import attained, simulate, summarize
from tandem.sim.roles import RoleSimulation
from tandem.sim.workload import shifting_mix_requests

SLO = {"ttft": 2000.0, "tpot": 100.0}
BASE = {"model": "llama-3-8b", "router": "least_load", "engine": {"max_num_batched_tokens": 2048},
        "link": {"bandwidth_gbs": 25, "latency_ms": 0.1}}  # fmt: skip


def cluster(prefill: int, decode: int) -> ClusterSpec:
    return ClusterSpec.from_dict(Layout("L40S", prefill=prefill, decode=decode).cluster(BASE))


def test_the_ratio_follows_a_shifting_mix_and_beats_the_split_it_started_from():
    # 4 minutes: 90% of requests 8k-token prompts with 16-token answers at the ends, 10%
    # halfway, the rest 1k prompts with 1k answers
    requests = shifting_mix_requests(240, 2.5, (8192, 16), (1024, 1024), seed=0,
                                     range_ratio=0.5, slo=SLO)  # fmt: skip
    sim = RoleSimulation(cluster(1, 3), requests, PDRatioConfig(sustain=5.0, cooldown=10.0))
    records = sim.run()
    assert all(r.finished is not None and not r.error for r in records)
    to_prefill = [t for t, _, role, _ in sim.moves if role == "prefill"]
    to_decode = [t for t, _, role, _ in sim.moves if role == "decode"]
    assert to_prefill and min(to_prefill) < 60  # the prompts come first: prefill needs help
    assert to_decode and 60 < min(to_decode) < 180  # the answers grow toward the middle
    prefill_counts = [p for _, p, _ in sim.ratio]
    assert max(prefill_counts) >= 2 and prefill_counts[-1] < max(prefill_counts)
    assert all(p + d == 4 for _, p, d in sim.ratio)
    dynamic = attained(summarize(sim, records))
    static = attained(simulate(cluster(1, 3), requests))
    assert dynamic > static + 0.5  # one prefill instance drowns in the long prompts


def test_a_flipped_instance_finishes_what_it_holds_of_its_old_role():
    requests = shifting_mix_requests(60, 3.0, (8192, 16), (512, 256), seed=1, slo=SLO)
    sim = RoleSimulation(cluster(1, 3), requests, PDRatioConfig(sustain=0.0, cooldown=5.0))
    records = sim.run()
    moved = {name for _, name, _, _ in sim.moves}
    assert moved  # some instance changed role mid-run
    assert all(r.finished is not None and not r.error for r in records)
    # an instance that moved both served its clients' decodes and computed others' prompts
    decode_of = {r.instance for r in records}
    prefill_of = {r.prefill_instance for r in records}
    assert moved & decode_of & prefill_of


def test_a_colocated_cluster_has_no_ratio_to_move():
    colocated = ClusterSpec.from_dict({"model": "llama-3-8b", "groups": [{"hardware": "L40S"}]})
    with pytest.raises(ValueError, match="disaggregated"):
        RoleSimulation(colocated, [], PDRatioConfig())

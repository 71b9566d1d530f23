"""KV tiers in `tandem sim`: the real scheduler's loading state on a virtual clock, loads
timed by a tier's bandwidth and latency, a shared tier reused across instances."""

from __future__ import annotations

import pytest

from tandem.core.cost_model import CostModel
from tandem.sim.cluster import ClusterSpec
from tandem.sim.report import summarize
from tandem.sim.simulator import Simulation
from tandem.sim.workload import SimRequest

# Llama-3-8B: 131,072 KV bytes a token, so 64 tokens (4 blocks of 16) are 8,388,608 bytes:
# one millisecond at 8.388608 GB/s.
GBS = 8.388608
A, B = tuple(range(64)), tuple(range(1000, 1095))  # B and its token fill the pool


def cluster(tmp_path, count=1, **extra):
    CostModel((0.010, 0.001, 0.0, 0.0, 0.0)).save(tmp_path / "cost.json")  # 10 ms + 1 ms/token
    group = {"name": "g", "cost_model": "cost.json", "kv_tokens": 96, "count": count}
    return ClusterSpec.from_dict(
        {"model": "llama-3-8b", "engine": {"kv_offload_min_tokens": 16},
         "groups": [group | extra.pop("group", {})], **extra}, tmp_path)  # fmt: skip


def requests():
    # A's 64 tokens are computed, then B's 95 push them out of the 96-token pool; then A
    # comes back with 16 more tokens.
    return [SimRequest(0.0, A, 1), SimRequest(0.5, B, 1), SimRequest(1.0, A + tuple(range(16)), 1)]


def test_a_host_tier_loads_the_evicted_prefix_in_its_bandwidths_time(tmp_path):
    plain = Simulation(cluster(tmp_path), requests()).run()
    assert plain[2].first_token - 1.0 == pytest.approx(0.010 + 0.080)  # all 80 tokens computed
    tiered = cluster(tmp_path, group={"kv_offload_tokens": 1000, "kv_offload_gbs": GBS})
    sim = Simulation(tiered, requests())
    records = sim.run()
    # 1 ms to load 64 tokens, then a step computing the last 16: 10 + 16 ms
    assert records[2].first_token - 1.0 == pytest.approx(0.001 + 0.026)
    result = summarize(sim, records)
    assert result["groups"]["g"]["kv_loaded_tokens"] == 64
    assert result["groups"]["g"]["kv_load_timeouts"] == 0


def test_a_shared_tier_serves_another_instance_with_its_latency(tmp_path):
    shared = {"kv_remote": {"tokens": 10_000, "bandwidth_gbs": GBS / 2, "latency_ms": 3}}
    reqs = [SimRequest(0.0, A, 1), SimRequest(1.0, A + tuple(range(16)), 1)]
    sim = Simulation(cluster(tmp_path, count=2, router="round_robin", **shared), reqs)
    first, second = sim.run()
    assert first.instance != second.instance
    assert second.first_token - 1.0 == pytest.approx(0.003 + 0.002 + 0.026)
    assert sim.shared_tier.stats.hits == 4


def test_a_load_slower_than_its_timeout_is_computed_instead(tmp_path):
    slow = {"kv_remote": {"tokens": 10_000, "bandwidth_gbs": 0.001, "latency_ms": 0}}
    reqs = [SimRequest(0.0, A, 1), SimRequest(1.0, A + tuple(range(16)), 1)]
    sim = Simulation(cluster(tmp_path, count=2, router="round_robin", **slow), reqs)
    _, second = sim.run()
    # 8.4 s to load: given up at the 2 s timeout, then all 80 tokens computed
    assert second.first_token - 1.0 == pytest.approx(2.0 + 0.090)
    assert summarize(sim, [_, second])["groups"]["g"]["kv_load_timeouts"] == 1


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"kv_remote": {"tokens": 0, "bandwidth_gbs": 1}}, "kv_remote.tokens"),
        ({"kv_remote": {"tokens": 10, "bandwidth_gbs": 0}}, "kv_remote.bandwidth_gbs"),
        ({"kv_remote": {"tokens": 10, "bandwidth_gbs": 1, "size": 3}}, "cluster.kv_remote"),
        ({"group": {"kv_offload_tokens": -1}}, "kv_offload_tokens"),
        ({"group": {"kv_offload_gbs": 0}}, "kv_offload_gbs"),
    ],
)
def test_a_bad_tier_setting_is_refused_naming_it(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        cluster(tmp_path, **bad)

"""The router's autoscaling policy in the simulator: an autoscaled fleet grows with a daily
curve's peak and shrinks after it, serving every request, for fewer instance-seconds than a
fleet that stays at the peak's size; the policy object is the router's own."""

from __future__ import annotations

import pytest

from tandem.core.cost_model import CostModel
from tandem.router.autoscale import AutoscaleConfig, AutoscalePolicy
from tandem.sim.cluster import ClusterSpec
from tandem.sim.elastic import ElasticSimulation
from tandem.sim.workload import diurnal_requests

# steps of 10 ms plus 2 ms a row, at most 4 running: an instance serves ~2.6 requests/s of
# 32 in, 128 out
COST = (0.01, 0.002, 0.002, 0.0, 0.0)
POLICY = AutoscaleConfig(min_workers=1, max_workers=6, target_queue_per_worker=2, sustain=5,
                         up_cooldown=10, down_cooldown=20)  # fmt: skip


def cluster(tmp_path, count=1):
    CostModel(COST).save(tmp_path / "cost.json")
    return ClusterSpec.from_dict(
        {"model": "llama-3-8b", "router": "least_load", "engine": {"max_num_seqs": 4},
         "groups": [{"name": "g", "cost_model": "cost.json", "kv_tokens": 65536, "count": count}]},
        tmp_path,
    )  # fmt: skip


def test_the_diurnal_workload_swings_between_its_trough_and_peak_rates():
    requests = diurnal_requests(600, trough=1.0, peak=8.0, input_len=32, output_len=16, seed=1)
    first = sum(1 for r in requests if r.arrival < 60) / 60
    middle = sum(1 for r in requests if 270 <= r.arrival < 330) / 60
    assert first < 2.0 and 6.5 < middle < 9.5
    assert requests == diurnal_requests(600, 1.0, 8.0, 32, 16, seed=1)  # seeded


def test_an_autoscaled_fleet_follows_the_peak_and_costs_less_than_a_static_one(tmp_path):
    requests = diurnal_requests(600, trough=0.3, peak=6.0, input_len=32, output_len=128, seed=0)
    sim = ElasticSimulation(cluster(tmp_path), requests, POLICY, start_seconds=10)
    assert isinstance(sim.autoscale, AutoscalePolicy)  # the router's own
    records = sim.run()
    assert all(r.finished is not None and not r.error for r in records)
    peak = sim.peak_instances()
    assert 3 <= peak <= POLICY.max_workers  # 6 requests/s need at least 3
    ups = [a for a in sim.actions if "queue" in a[2]]
    downs = [a for a in sim.actions if "fewer" in a[2]]
    assert ups and downs and ups[0][0] < downs[0][0]
    assert len(sim.instances) - len(sim.stopped_at) == 1  # back down to one at the end
    static = peak * sim.end
    assert sim.instance_seconds(sim.end) < 0.8 * static


def test_an_elastic_cluster_has_one_colocated_group(tmp_path):
    CostModel(COST).save(tmp_path / "cost.json")
    pd = ClusterSpec.from_dict(
        {"model": "llama-3-8b", "groups": [
            {"name": "p", "role": "prefill", "cost_model": "cost.json", "kv_tokens": 4096},
            {"name": "d", "role": "decode", "cost_model": "cost.json", "kv_tokens": 4096}],
         "links": [{"from": "p", "to": "d", "bandwidth_gbs": 10}]}, tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="one colocated group"):
        ElasticSimulation(pd, [], POLICY)

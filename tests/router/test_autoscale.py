"""The autoscaling policy on a fake clock: when it adds workers, how many, when it removes
one, and what it never does (act on a blip, act inside a cooldown, pass min or max)."""

from __future__ import annotations

import pytest

from tandem.router.autoscale import (
    AttainmentWindow,
    AutoscaleConfig,
    AutoscalePolicy,
    FleetSignals,
)

CONFIG = AutoscaleConfig(min_workers=1, max_workers=4, target_queue_per_worker=4.0,
                         sustain=10.0, up_cooldown=30.0, down_cooldown=120.0)  # fmt: skip


def run(policy, signals, start=0.0, until=100.0, step=1.0):
    """Decisions each second while the signals hold: [(time, desired)] where it changes."""
    changes, t, last = [], start, None
    while t <= until:
        d = policy.decide(t, signals)
        if d.desired != last:
            changes.append((t, d.desired))
            last = d.desired
        t += step
    return changes


def test_a_fleet_below_its_minimum_is_raised_at_once():
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=2, max_workers=4))
    d = policy.decide(0.0, FleetSignals(serving=0))
    assert d.desired == 2 and "below min_workers" in d.reason


def test_a_queue_held_past_sustain_adds_the_workers_it_needs_capped_at_max():
    policy = AutoscalePolicy(CONFIG)
    busy = FleetSignals(serving=1, queued=10, load=12)  # 10 queued: 3 more at 4 each
    assert policy.decide(0.0, busy).desired == 1
    assert policy.decide(9.0, busy).desired == 1  # not yet held 10 s
    d = policy.decide(10.0, busy)
    assert d.desired == 4 and "queue 10.0 per worker > 4" in d.reason
    flood = FleetSignals(serving=2, queued=100, load=104)
    policy = AutoscalePolicy(CONFIG)
    policy.decide(0.0, flood)
    assert policy.decide(10.0, flood).desired == 4  # max_workers


def test_a_blip_shorter_than_sustain_changes_nothing():
    policy = AutoscalePolicy(CONFIG)
    busy, calm = FleetSignals(serving=1, queued=10, load=12), FleetSignals(serving=1, load=2)
    for t in range(0, 9):
        assert policy.decide(float(t), busy).desired == 1
    assert policy.decide(9.0, calm).desired == 1
    assert policy.decide(15.0, busy).desired == 1  # the clock restarted at 15
    assert policy.decide(25.0, busy).desired > 1


def test_no_second_scale_up_inside_the_cooldown_nor_while_a_worker_starts():
    policy = AutoscalePolicy(CONFIG)
    busy = FleetSignals(serving=1, queued=5, load=6)  # 5 queued: 2 more workers
    # the signals never show the fleet grown (as if its starts failed): each try waits out
    # the 30 s up cooldown from the last, its 10 s of sustain inside it
    changes = run(policy, busy, until=60.0)
    assert changes == [(0.0, 1), (10.0, 3), (11.0, 1), (40.0, 3), (41.0, 1)]
    starting = FleetSignals(serving=1, starting=1, queued=5, load=6)
    policy = AutoscalePolicy(CONFIG)
    assert run(policy, starting, until=100.0) == [(0.0, 2)]  # waits for the one starting


def test_slack_held_past_sustain_and_the_down_cooldown_removes_one_worker_never_below_min():
    policy = AutoscalePolicy(CONFIG)
    idle = FleetSignals(serving=3, load=2)  # 2 requests fit 2 workers at <= 2 each
    changes = run(policy, idle, until=140.0)
    # the first after 10 s of sustain; the next 120 s (the down cooldown) after it
    assert changes == [(0.0, 3), (10.0, 2), (11.0, 3), (130.0, 2), (131.0, 3)]
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=2, max_workers=4, sustain=0, down_cooldown=0))  # fmt: skip
    assert policy.decide(0.0, FleetSignals(serving=2, load=0)).desired == 2  # min_workers
    policy = AutoscalePolicy(AutoscaleConfig(min_workers=0, max_workers=4, sustain=0, down_cooldown=0))  # fmt: skip
    assert policy.decide(0.0, FleetSignals(serving=1, load=0)).desired == 1  # never the last


def test_a_busy_fleet_is_not_scaled_down():
    policy = AutoscalePolicy(AutoscaleConfig(sustain=0, down_cooldown=0))
    assert policy.decide(0.0, FleetSignals(serving=2, load=5)).desired == 2  # 5 > 4 / 2 on one
    assert policy.decide(1.0, FleetSignals(serving=2, load=1, queued=1)).desired == 2
    assert policy.decide(2.0, FleetSignals(serving=2, load=1, max_kv_usage=0.6)).desired == 2


def test_a_full_kv_cache_or_a_slow_predicted_ttft_is_pressure():
    kv = AutoscalePolicy(AutoscaleConfig(sustain=0, up_cooldown=0))
    d = kv.decide(0.0, FleetSignals(serving=1, load=3, max_kv_usage=0.95))
    assert d.desired == 2 and "KV cache 95% full" in d.reason
    ttft = AutoscalePolicy(AutoscaleConfig(sustain=0, up_cooldown=0, max_predicted_ttft=2.0))
    d = ttft.decide(0.0, FleetSignals(serving=2, load=3, predicted_ttft=3.5))
    assert d.desired == 3 and "predicted TTFT 3.50 s > 2 s" in d.reason
    assert ttft.decide(1.0, FleetSignals(serving=3, load=3, predicted_ttft=1.0)).desired == 3


def test_a_load_target_adds_workers_before_a_queue_forms_and_sets_the_scale_down_point():
    config = AutoscaleConfig(max_workers=8, target_load_per_worker=10, sustain=0, up_cooldown=0,
                             down_cooldown=0, scale_down_fraction=0.6)  # fmt: skip
    policy = AutoscalePolicy(config)
    d = policy.decide(0.0, FleetSignals(serving=2, load=35))  # nothing queued, 17.5 each
    assert d.desired == 4 and "load 17.5 per worker > 10" in d.reason  # ceil(35 / 10) = 4
    assert policy.decide(1.0, FleetSignals(serving=4, load=19)).desired == 4  # 19 / 3 > 6
    assert policy.decide(2.0, FleetSignals(serving=4, load=18)).desired == 3  # 18 / 3 <= 6


def test_a_class_missing_its_slo_adds_a_worker_and_blocks_a_scale_down():
    config = AutoscaleConfig(max_workers=4, target_load_per_worker=10, min_slo_attainment=0.9,
                             sustain=0, up_cooldown=0, down_cooldown=0)  # fmt: skip
    policy = AutoscalePolicy(config)
    d = policy.decide(0.0, FleetSignals(serving=2, load=4, slo_attainment=0.7))  # light load
    assert d.desired == 3 and "SLO attainment 70% < 90%" in d.reason
    light = FleetSignals(serving=3, load=2, slo_attainment=0.85)
    assert policy.decide(1.0, light).desired == 4  # still short: more
    assert policy.decide(2.0, FleetSignals(serving=4, load=2, slo_attainment=0.95)).desired == 3
    assert policy.decide(3.0, FleetSignals(serving=3, load=2, slo_attainment=None)).desired == 2


def test_a_lookahead_scales_up_for_the_load_the_trend_brings_but_down_only_on_today_s():
    def rising(config):
        policy = AutoscalePolicy(config)
        # the load climbs 0.25 requests a second; at t=120 it is 30, 7.5 per worker of 4
        return [policy.decide(float(t), FleetSignals(serving=4, load=t // 4)).desired
                for t in range(121)]  # fmt: skip

    base = dict(max_workers=8, target_load_per_worker=10, sustain=0, up_cooldown=0)
    rise = dict(base, min_workers=4)  # no scale-down in the low start
    assert set(rising(AutoscaleConfig(**rise))) == {4}  # never over 10 per worker as it is
    ahead = rising(AutoscaleConfig(**rise, lookahead=60, trend_window=120))
    assert ahead[:60] == [4] * 60  # half a window of samples before the trend is trusted
    # 60 s ahead the load is ~45: 5 workers first, more as the line climbs
    assert ahead[60:] != [4] * 61 and ahead[-1] >= 5

    def first_scale_down(**extra) -> int:
        policy = AutoscalePolicy(AutoscaleConfig(**base, down_cooldown=0, **extra))
        for t in range(200):  # the load falls from 40 by 0.25 a second
            if policy.decide(float(t), FleetSignals(serving=4, load=40 - t // 4)).desired < 4:
                return t
        return -1

    # the load fits 3 workers at 9 each (0.9 of 10) from t=52 (load 27); a falling trend
    # does not remove a worker sooner: the load it serves now is still there
    assert first_scale_down(scale_down_fraction=0.9) == 52
    assert first_scale_down(scale_down_fraction=0.9, lookahead=60, trend_window=60) == 52


def test_attainment_per_class_over_the_window_from_cumulative_counters():
    window = AttainmentWindow(window=60.0, min_requests=10)
    window.observe(0.0, {("w1", "chat"): (100, 100), ("w1", "batch"): (50, 10)})
    assert window.worst() == pytest.approx(0.2)  # counters at first sight count once
    window.observe(61.0, {("w1", "chat"): (120, 110), ("w1", "batch"): (55, 15)})
    # the last minute: chat 10 of 20; batch 5 finished, too few to judge
    assert window.worst() == pytest.approx(0.5)
    window.observe(62.0, {("w1", "chat"): (4, 4), ("w1", "batch"): (55, 15)})  # w1 restarted
    assert window.worst() == pytest.approx(14 / 24)
    window.observe(200.0, {("w1", "chat"): (4, 4), ("w1", "batch"): (55, 15)})
    assert window.worst() is None  # nothing finished in the last minute


@pytest.mark.parametrize(
    "field, value, message",
    [("min_workers", -1, "min_workers"), ("max_workers", 0, "max_workers"),
     ("target_queue_per_worker", 0, "target_queue_per_worker"), ("sustain", -1, "sustain"),
     ("max_predicted_ttft", 0, "max_predicted_ttft"),
     ("target_load_per_worker", 0, "target_load_per_worker"),
     ("scale_down_fraction", 1.0, "scale_down_fraction"),
     ("min_slo_attainment", 1.5, "min_slo_attainment"), ("lookahead", -1, "lookahead")],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        AutoscalePolicy(AutoscaleConfig(**{field: value}))


def test_the_pool_reads_each_class_s_slo_counters_from_a_worker_s_metrics():
    from tandem.router.policy import LeastLoad
    from tandem.router.pool import WorkerPool

    pool = WorkerPool(["http://w"], LeastLoad(), client=None)
    (worker,) = pool.workers.values()
    text = "\n".join([
        'tandem:slo_requests_total{model_name="m",engine="0",class="chat"} 12.0',
        'tandem:slo_met_total{model_name="m",engine="0",class="chat"} 9.0',
        'tandem:slo_requests_total{model_name="m",engine="0",class="batch"} 3.0',
        'tandem:slo_met_total{model_name="m",engine="0",class="batch"} 3.0',
        'tandem:num_requests_running{model_name="m",engine="0"} 2.0',
    ])  # fmt: skip
    pool._read_metrics(worker, text)
    assert worker.slo == {"chat": (12.0, 9.0), "batch": (3.0, 3.0)}
    assert worker.state.running == 2


def test_the_supervisor_hands_the_policy_every_signal_the_router_reads(tmp_path):
    from tandem.router.app import RouterMetrics
    from tandem.router.autoscale import ScaleDecision
    from tandem.router.supervisor import LocalSupervisor

    class Seen:  # a policy that records what it is shown and keeps the fleet as it is
        signals = None

        def decide(self, now, s):
            Seen.signals = s
            return ScaleDecision(s.serving + s.starting, "steady")

    read = FleetSignals(serving=2, queued=3, load=9, max_kv_usage=0.4, predicted_ttft=1.5,
                        slo_attainment=0.7)  # fmt: skip
    sup = LocalSupervisor("serve --port {port}", None, Seen(), RouterMetrics(), None, tmp_path,
                          signals=lambda: read)  # fmt: skip
    sup.step(0.0)
    assert Seen.signals == read  # every field, the SLO attainment included (none starting)

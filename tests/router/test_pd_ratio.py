"""The prefill/decode ratio policy on a fake clock: which pool gives an instance to which,
and what it never does (act on a blip, act inside its cooldown, empty a pool, swap the
imbalance, help a pool that needs none)."""

from __future__ import annotations

import pytest

from tandem.core.cost_model import CostModel
from tandem.router.pd_ratio import (
    PDRatioConfig,
    PDRatioPolicy,
    PoolSignals,
    decode_wait,
    prefill_wait,
)

CONFIG = PDRatioConfig(ttft_target=2.0, tpot_target=0.1, margin=1.5, sustain=10.0, cooldown=30.0)


def pools(prefill_wait: float, decode_wait: float, n_prefill=2, n_decode=4, kv=0.0):
    return PoolSignals(n_prefill, prefill_wait), PoolSignals(n_decode, decode_wait, kv)


def test_a_pressed_prefill_pool_takes_a_decode_instance_once_sustained():
    policy = PDRatioPolicy(CONFIG)
    busy = pools(6.0, 0.03)  # prefill 3x its TTFT target, decode 0.3x its TPOT target
    assert policy.decide(0.0, *busy) is None
    assert policy.decide(9.0, *busy) is None
    move = policy.decide(10.0, *busy)
    assert (move.source, move.target) == ("decode", "prefill")
    assert "prefill pressure 3.00 > 1.5 x decode pressure 0.30" in move.reason


def test_a_pressed_decode_pool_takes_a_prefill_instance():
    policy = PDRatioPolicy(CONFIG)
    busy = pools(0.2, 0.25, n_prefill=4, n_decode=2)
    policy.decide(0.0, *busy)
    move = policy.decide(10.0, *busy)
    assert (move.source, move.target) == ("prefill", "decode")


def test_a_full_decode_kv_cache_is_pressure_even_at_a_fast_step():
    policy = PDRatioPolicy(CONFIG)
    full = pools(0.2, 0.02, n_prefill=4, n_decode=2, kv=0.99)
    policy.decide(0.0, *full)
    assert policy.decide(10.0, *full).target == "decode"


def test_a_blip_shorter_than_sustain_moves_nothing():
    policy = PDRatioPolicy(CONFIG)
    for t in range(9):
        assert policy.decide(float(t), *pools(6.0, 0.03)) is None
    assert policy.decide(9.0, *pools(0.5, 0.03)) is None  # calm: the clock restarts
    assert policy.decide(15.0, *pools(6.0, 0.03)) is None
    assert policy.decide(25.0, *pools(6.0, 0.03)) is not None


def test_no_second_move_inside_the_cooldown():
    policy = PDRatioPolicy(CONFIG)
    busy = pools(6.0, 0.03)
    moves = [t for t in range(0, 100) if policy.decide(float(t), *busy) is not None]
    # 10 s of sustain, then each next move waits out 30 s of cooldown (its sustain inside it)
    assert moves == [10, 40, 70]


def test_a_pool_at_its_minimum_gives_nothing():
    policy = PDRatioPolicy(CONFIG)
    busy = pools(6.0, 0.03, n_decode=1)
    assert all(policy.decide(float(t), *busy) is None for t in range(60))
    roomy = PDRatioPolicy(PDRatioConfig(min_decode=3, sustain=0, cooldown=0))
    assert roomy.decide(0.0, *pools(6.0, 0.03, n_decode=3)) is None
    assert roomy.decide(1.0, *pools(6.0, 0.03, n_decode=4)) is not None


def test_pools_that_need_no_help_or_would_swap_the_imbalance_stay():
    policy = PDRatioPolicy(PDRatioConfig(sustain=0, cooldown=0))
    assert policy.decide(0.0, *pools(0.8, 0.001)) is None  # prefill 0.4x: under min_pressure
    assert policy.decide(1.0, *pools(2.4, 0.1)) is None  # 1.2x vs 1.0x: under the margin
    # prefill 1.6 on 2 instances vs decode 1.0 on 2: after a move, 1.07 vs 2.0: swapped
    assert policy.decide(2.0, *pools(3.2, 0.1, n_prefill=2, n_decode=2)) is None
    assert policy.decide(3.0, *pools(3.2, 0.05, n_prefill=2, n_decode=4)) is not None


@pytest.mark.parametrize(
    "field, value",
    [("ttft_target", 0), ("margin", 0.9), ("sustain", -1), ("min_prefill", 0), ("min_decode", 1.5)],
)
def test_a_bad_setting_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        PDRatioPolicy(PDRatioConfig(**{field: value}))


def test_waits_follow_the_cost_model():
    cost = CostModel((0.01, 0.001, 0.002, 0.0, 0.0))  # step, prefill token, decode row, ...
    # 4,096 tokens over 2 instances at ~1 ms a token (the step's 10 ms spread over a chunk)
    assert prefill_wait(cost, 2, 4096) == pytest.approx(2048 * (0.001 + 0.01 / 2048))
    assert prefill_wait(cost, 2, 0) == 0.0
    assert decode_wait(cost, 4, 10, 0) == pytest.approx(0.01 + 3 * 0.002)  # ceil(10 / 4) rows
    assert decode_wait(cost, 4, 0, 0) == pytest.approx(0.01 + 0.002)  # one row at least

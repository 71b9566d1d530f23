"""Priority and SLO-aware scheduling, and the cost model that drives it: a fake clock that
advances by the cost model's prediction for each plan, no model, no torch."""

from __future__ import annotations

import json
import random

import pytest

from tandem.core.cost_model import (
    FEATURES,
    CostModel,
    KernelRows,
    OnlineCostModel,
    StepShape,
    _features,
    noise_quantiles,
)
from tandem.core.policy import FCFSBatch, PriorityBatch
from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import SLOClass
from tandem.core.slo_policy import SLOBatch, SLOPolicyConfig
from tests.core.harness import EOS, Harness

# 10 ms a step, 1 ms per prefill token, 2 ms per decode row, nothing per KV entry read
COST = CostModel((0.010, 0.001, 0.002, 0.0, 0.0))
INTERACTIVE = SLOClass("interactive", priority=0, ttft_ms=300, tpot_ms=60, on_overload="shed")
BATCH = SLOClass("batch", priority=1, ttft_ms=60_000, tpot_ms=1_000, on_overload="demote")


_tokens = iter(range(1000, 10**9))


def _p(n: int) -> list[int]:
    """A prompt of n tokens no other prompt shares (so the prefix cache stays out of it)."""
    return [next(_tokens) for _ in range(n)]


def policies():
    return {"fcfs": FCFSBatch(), "priority": PriorityBatch(), "slo": SLOBatch(COST)}


def _harness(policy, batch=None, **kw) -> Harness:
    kw = {"num_blocks": 256, "block_size": 4, "max_num_batched_tokens": 512, **kw}
    return Harness(batch=batch or policies()[policy], cost_model=COST, **kw)


def _ttft(h: Harness, req, max_steps: int = 2000) -> float:
    """Step until req has its first token; the time it took since it arrived."""
    for _ in range(max_steps):
        if req.num_output_tokens or req.is_finished:
            break
        h.step()
    assert req.num_output_tokens, f"{req} got no token"
    return req.last_token_time - req.arrival_time


# ---- the cost model ---------------------------------------------------------------
def test_fit_recovers_known_coefficients():
    true = CostModel((0.004, 0.0003, 0.0015, 0.000002, 0.0000005))
    rng = random.Random(0)
    points = []
    for _ in range(200):
        n = rng.randrange(0, 2048)
        shape = StepShape(
            n, rng.randrange(0, 64), rng.randrange(0, 60_000), rng.randrange(0, n * n + 1)
        )
        points.append((shape, true.predict(shape) * (1 + rng.uniform(-0.01, 0.01))))
    fitted = CostModel.fit(points)
    for got, want in zip(fitted.coef, true.coef):
        assert got == pytest.approx(want, rel=0.05)
    assert fitted.mean_abs_error(points) < 0.01


def _steps_about_a_switch(true: CostModel, prefill_ranges) -> list:
    """300 steps timed at `true`'s prediction within 1%: prefill tokens none or drawn from one
    of `prefill_ranges` (on both sides of a kernel switch), under 24 decode rows."""
    rng = random.Random(0)
    points = []
    for _ in range(300):
        n = rng.choice([0, *(rng.randrange(lo, hi) for lo, hi in prefill_ranges)])
        shape = StepShape(n, rng.randrange(0 if n else 1, 24), rng.randrange(0, 20_000), n * n)
        points.append((shape, true.predict(shape) * (1 + rng.uniform(-0.01, 0.01))))
    return points


def test_fit_recovers_a_kernel_switch_at_a_known_row_count():
    # up to 32 rows a steeper per-row cost, past them a fixed 30 ms (quantized weights)
    true = CostModel(
        (0.004, 0.0003, 0.0015, 0.000002, 0.0000005, 0.002, 0.030), kernels=KernelRows(wide=32)
    )
    points = _steps_about_a_switch(true, [(0, 24), (0, 1024)])
    fitted = CostModel.fit(points, KernelRows(wide=32))
    for got, want in zip(fitted.coef, true.coef):
        assert got == pytest.approx(want, rel=0.1, abs=1e-7)
    assert fitted.mean_abs_error(points) < 0.01
    assert CostModel.fit(points).mean_abs_error(points) > 0.05  # the plain model cannot
    # a step of 33 rows pays the switch that a step of 32 does not
    assert true.predict(StepShape(33)) - true.predict(StepShape(32)) == pytest.approx(
        0.030 + 0.0003  # the switch, and one more prefill token
    )


def test_fit_recovers_the_dense_paths_own_switch_past_gemm_rows():
    # AMX: past 8 rows dense, 0.2 ms a row dearer up to 240 rows (a fused dequantize and
    # multiply per block), then the slices: 30 ms more a step, no extra per row
    kernels = KernelRows(wide=8, gemm=240)
    true = CostModel((0.004, 0.0001, 0.0002, 2e-6, 5e-7, 0.001, 0.002, 0, 0, 0, 0, 0,
                      0.0002, 0.030), kernels=kernels)  # fmt: skip
    points = _steps_about_a_switch(true, [(0, 240), (240, 2048)])
    fitted = CostModel.fit(points, kernels)
    for i in (12, 13):
        assert fitted.coef[i] == pytest.approx(true.coef[i], rel=0.1)
    error = fitted.mean_abs_error(points)
    assert error < 0.01  # the points' own noise
    assert CostModel.fit(points, KernelRows(wide=8)).mean_abs_error(points) > max(0.02, 4 * error)
    # a dense row costs 0.1 + 0.2 ms up to 240 rows, 0.1 ms past them, after a 30 ms step
    t = {n: true.predict(StepShape(n)) for n in (100, 101, 240, 241, 242)}
    assert t[101] - t[100] == pytest.approx(0.0003)
    assert t[241] - t[240] == pytest.approx(0.0001 + 0.030)
    assert t[242] - t[241] == pytest.approx(0.0001)
    # within the kernel's rows no dense term applies
    assert _features(StepShape(8), kernels)[12:] == (0, 0.0)


def test_fit_recovers_the_staircase_of_kernels_that_pass_over_the_weights_per_four_rows():
    # 2 ms a pass of 4 rows over the projections, 1.5 ms a pass of the head over the rows
    # that sample, 6 ms for the head once it turns dense past 10 of them
    kernels = KernelRows(wide=32, head=10, tile=4)
    true = CostModel((0.003, 0.0003, 0.0012, 2e-6, 5e-7, 0, 0.03, 0.001, 0, 0.002, 0.0015, 0.006),
                     kernels=kernels)  # fmt: skip
    prompt = Request("p", _p(1024), SamplingParams())
    rng = random.Random(0)
    points = []
    for _ in range(300):
        rows = rng.randrange(0, 33)
        shape = StepShape(decode_rows=rows, kv_tokens=rows * rng.randrange(64, 512))
        if not rows or rng.random() < 0.3:
            n = rng.choice([rng.randrange(1, 16), rng.randrange(16, 400)])
            shape = shape.with_row(prompt, rng.choice([0, 256]), n)
        points.append((shape, true.predict(shape) * (1 + rng.uniform(-0.01, 0.01))))
    fitted = CostModel.fit(points, kernels)
    for i in (6, 9, 10, 11):  # the wide step, a pass of the projections, of the head, dense head
        assert fitted.coef[i] == pytest.approx(true.coef[i], rel=0.1)
    error = fitted.mean_abs_error(points)
    assert error < 0.01  # the points' own noise
    assert CostModel.fit(points, KernelRows(wide=32)).mean_abs_error(points) > max(0.02, 4 * error)
    # a fifth decode row starts a second pass of the projections and of the head
    decodes = [StepShape(decode_rows=n) for n in (4, 5, 8, 10, 11)]
    t4, t5, t8, t10, t11 = (true.predict(s) for s in decodes)
    assert t5 - t4 == pytest.approx(0.0012 + 0.002 + 0.0015)
    assert t8 - t5 == pytest.approx(3 * 0.0012)  # the same passes
    # past 10 sampled rows the head is dense: its three passes give way to one fixed cost
    assert t11 - t10 == pytest.approx(0.0012 - 3 * 0.0015 + 0.006)
    # past 32 rows the projections are dense too: no passes, the wide step's fixed cost
    assert _features(StepShape(33), kernels)[9] == 0 and _features(StepShape(32), kernels)[9] == 8


def test_an_online_refit_keeps_the_costs_its_window_never_exercised():
    # the profile priced steps past 32 rows; a window of small decode steps says nothing of them
    kernels = KernelRows(wide=32, head=10, tile=4)
    prior = CostModel((0.004, 0.0003, 0.0015, 2e-6, 5e-7, 0, 0.03, 0.001, 0, 0.002, 0.0015, 0.006),
                      kernels=kernels)  # fmt: skip
    online = OnlineCostModel(prior, refit_every=8)
    for i in range(64):
        shape = StepShape(decode_rows=1 + i % 8, kv_tokens=256 * (1 + i % 8))
        online.observe(shape, 1.2 * prior.predict(shape))  # this host runs 20% slower
    assert online.model is not prior and online.model.kernels == kernels
    assert online.coef[6] == 0.03 and online.coef[11] == 0.006  # never seen: as they were
    shape = StepShape(decode_rows=6, kv_tokens=6 * 256)
    assert online.predict(shape) == pytest.approx(1.2 * prior.predict(shape), rel=0.02)


def test_fit_recovers_a_cost_per_prefill_chunk_and_per_pair_within_one():
    # 7 ms a chunk, and a chunk's own pairs dearer than those with earlier context
    true = CostModel((0.004, 0.0003, 0.0015, 2e-6, 4e-7, 0, 0, 0.007, 6e-7))
    prompt = Request("p", _p(1024), SamplingParams())  # its chunks are prefill rows
    rng = random.Random(0)
    points = []
    for _ in range(300):
        shape = StepShape(decode_rows=rng.randrange(0, 24))
        shape = shape.plus(kv_tokens=shape.decode_rows * rng.randrange(0, 1024))
        for _ in range(rng.choice([0, 1, 1, 2, 4])):
            shape = shape.with_row(prompt, rng.choice([0, 256]), rng.randrange(8, 256))
        if shape.prefill_tokens + shape.decode_rows:
            points.append((shape, true.predict(shape) * (1 + rng.uniform(-0.01, 0.01))))
    fitted = CostModel.fit(points)
    for got, want in zip(fitted.coef, true.coef):
        assert got == pytest.approx(want, rel=0.1, abs=1e-7)
    # the same tokens in four chunks: four chunk costs, a quarter of the own pairs
    one, four = StepShape.prompt(256), StepShape()
    for _ in range(4):
        four = four.with_row(prompt, 0, 64)
    assert four.prefill_tokens == one.prefill_tokens and four.prefill_rows == 4
    assert true.predict(four) - true.predict(one) == pytest.approx(
        3 * 0.007 - (one.chunk_own - four.chunk_own) * (4e-7 + 6e-7)
    )


def test_fit_never_returns_a_negative_cost():
    points = [(StepShape(n, 0, 0), 0.01) for n in (0, 100, 200)]  # prefill costs nothing
    assert all(c >= 0 for c in CostModel.fit(points).coef)


def test_cost_model_round_trips_through_a_file(tmp_path):
    model = CostModel((0.01, 0.001, 0.002, 1e-6, 2e-6), {"model": "tiny"})
    model.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == model
    switching = CostModel(
        (0.01, 0.001, 0.002, 1e-6, 2e-6, 0.003, 0.02), kernels=KernelRows(wide=32)
    )
    switching.save(tmp_path / "switch.json")
    assert CostModel.load(tmp_path / "switch.json") == switching
    # a file from before the kernel-switch terms: five features, read as no switch
    old = {"features": list(FEATURES[:5]), "coef": [0.01, 0.001, 0.002, 1e-6, 2e-6]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert CostModel.load(tmp_path / "old.json") == CostModel(tuple(old["coef"]))
    # one from before the chunk terms: seven features, read with no cost per chunk
    seven = {"features": list(FEATURES[:7]), "coef": [0.01, 0.001, 0.002, 1e-6, 2e-6, 0.003, 0.02],
             "wide_rows": 32}  # fmt: skip
    (tmp_path / "seven.json").write_text(json.dumps(seven))
    assert CostModel.load(tmp_path / "seven.json").coef == (*seven["coef"], *[0.0] * 7)
    staircase = CostModel((0.01,) * len(FEATURES), kernels=KernelRows(wide=32, head=10, tile=4))
    staircase.save(tmp_path / "staircase.json")
    assert CostModel.load(tmp_path / "staircase.json") == staircase
    # one from before the kernel passes: nine features, read with no cost per pass
    nine = {"features": list(FEATURES[:9]), "coef": [0.01] * 9, "wide_rows": 32}
    (tmp_path / "nine.json").write_text(json.dumps(nine))
    assert CostModel.load(tmp_path / "nine.json").coef == (*nine["coef"], *[0.0] * 5)
    # one from before the dense path's own switch: twelve features, no switch
    twelve = {"features": list(FEATURES[:12]), "coef": [0.01] * 12, "wide_rows": 32}
    (tmp_path / "twelve.json").write_text(json.dumps(twelve))
    assert CostModel.load(tmp_path / "twelve.json").coef == (*twelve["coef"], 0.0, 0.0)
    amx = CostModel((0.01,) * len(FEATURES), kernels=KernelRows(wide=8, head=4, tile=4, gemm=240))
    amx.save(tmp_path / "amx.json")
    assert CostModel.load(tmp_path / "amx.json") == amx
    for bad in ({"row_tile": 0}, {"head_rows": -1}, {"wide_rows": "32"}, {"gemm_rows": -1}):
        (tmp_path / "bad.json").write_text(json.dumps(staircase.to_dict() | bad))
        with pytest.raises(ValueError, match="cost_model.*rows must be an integer"):
            CostModel.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text('{"coef": [1]}')
    with pytest.raises(ValueError, match="cost_model"):
        CostModel.load(tmp_path / "bad.json")
    noisy = CostModel((0.01, 0.001, 0.002, 1e-6, 2e-6), noise=(0.9, 1.0, 1.4))
    noisy.save(tmp_path / "noisy.json")
    assert CostModel.load(tmp_path / "noisy.json") == noisy
    (tmp_path / "bad_noise.json").write_text(json.dumps({**noisy.to_dict(), "step_noise": [0]}))
    with pytest.raises(ValueError, match="step_noise"):
        CostModel.load(tmp_path / "bad_noise.json")


def test_noise_quantiles_pool_every_run_over_its_points_time():
    # ratios 0.5, 1, 1.5 (first point, typical 2 s) and 1, 2, 3 (second, typical 1 s)
    runs, typical = [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], [2.0, 1.0]
    assert noise_quantiles(runs, typical, n=3) == (1.0, 1.5, 3.0)  # the middle of each third
    assert noise_quantiles(runs, typical, n=6) == (0.5, 1.0, 1.0, 1.5, 2.0, 3.0)
    assert noise_quantiles([], [], n=4) == ()


def test_online_model_learns_from_observed_steps():
    online = OnlineCostModel(CostModel((1.0, 0.0, 0.0, 0.0, 0.0)), refit_every=16)
    rng = random.Random(1)
    for _ in range(64):
        shape = StepShape(rng.randrange(0, 512), rng.randrange(0, 16), rng.randrange(0, 4096))
        online.observe(shape, COST.predict(shape))
    probe = StepShape(500, 4, 0)
    assert online.predict(probe) == pytest.approx(COST.predict(probe), rel=1e-3)


def test_an_anchored_fit_keeps_what_its_points_cannot_tell_apart():
    prior = CostModel((0.02, 0.0005, 0.001, 0.0, 0.0))
    # decode steps of one size only: the constant and the per-row cost are inseparable
    points = [(StepShape(0, 4, 0), 0.024)] * 8
    anchored = CostModel.fit(points, anchor=prior, anchor_points=2.0)
    assert anchored.predict(StepShape(0, 4, 0)) == pytest.approx(0.024, rel=0.05)
    assert anchored.coef[0] == pytest.approx(0.02, rel=0.1)  # the prior's split, not 0 / 6 ms
    assert anchored.predict(StepShape(0, 16, 0)) == pytest.approx(0.036, rel=0.1)


def test_online_model_refits_early_then_every_refit_every_steps():
    online = OnlineCostModel(CostModel((1.0, 0.0, 0.0, 0.0, 0.0)), refit_every=32)
    fits, model = [], online.model
    for n in range(1, 129):
        shape = StepShape(n % 7 * 64, n % 5, n % 3 * 1000)
        online.observe(shape, COST.predict(shape))
        if online.model is not model:
            fits.append(n)
            model = online.model
    assert fits == [8, 16, 32, 64, 96, 128]  # the prior is a guess: replaced soon


def test_plan_shape_counts_prefill_tokens_decode_rows_and_context():
    h = _harness("fcfs")
    a = h.add(_p(10), max_tokens=3)
    plan, _ = h.step()
    # token i reads i + 1 entries; one chunk, all of its pairs its own
    assert StepShape.of(plan.scheduled) == StepShape(10, 0, 0, 55, 1, 55)
    b = h.add(_p(6), max_tokens=3)
    plan, _ = h.step()
    assert {s.request for s in plan.scheduled} == {a, b}
    assert StepShape.of(plan.scheduled) == StepShape(6, 1, 10, 21, 1, 21)  # a's decode reads 10
    c = h.add(_p(4), max_tokens=3)
    d = h.add(_p(3), max_tokens=3)
    plan, _ = h.step()
    assert {s.request for s in plan.scheduled} == {a, b, c, d}
    # two decodes (a at 11, b at 6), two chunks: 4 + 3 tokens, 10 + 6 pairs, all their own
    assert StepShape.of(plan.scheduled) == StepShape(7, 2, 17, 16, 2, 16)


# ---- priority -----------------------------------------------------------------------
def test_priority_serves_the_urgent_class_first():
    h = _harness("priority", max_num_batched_tokens=16)
    low = h.add(_p(32), priority=1)
    high = h.add(_p(8), priority=0)
    plan, _ = h.step()
    assert [s.request for s in plan.scheduled] == [high, low]
    assert plan.num_scheduled_tokens == {high.request_id: 8, low.request_id: 8}


def test_a_waiting_urgent_request_preempts_a_lower_class_when_blocks_are_short():
    h = _harness("priority", num_blocks=9)  # 8 usable blocks of 4 tokens
    low = h.add(_p(24), max_tokens=8, priority=5)  # 6 blocks
    h.step()
    high = h.add(_p(12), max_tokens=2, priority=0)  # needs 3 more than the 2 left
    plan, _ = h.step()
    assert plan.preempted_ids == [low.request_id]
    assert low.status == RequestStatus.PREEMPTED and not low.block_ids
    assert high in [s.request for s in plan.scheduled]
    h.run_to_completion()  # the victim recomputes (from its cached prefix) and finishes
    assert low.num_output_tokens == 8 and high.num_output_tokens == 2
    h.assert_pool_whole()


def test_fcfs_never_preempts_for_a_waiting_request():
    h = _harness("fcfs", num_blocks=9)
    low = h.add(_p(24), max_tokens=8, priority=5)
    h.step()
    high = h.add(_p(12), max_tokens=2, priority=0)
    plan, _ = h.step()
    assert not plan.preempted_ids and high not in [s.request for s in plan.scheduled]
    assert low.status == RequestStatus.RUNNING


# ---- SLO ------------------------------------------------------------------------------
def test_slo_meets_an_interactive_ttft_behind_a_burst_of_long_prompts_where_fcfs_does_not():
    ttfts = {}
    for policy in ("fcfs", "slo"):
        h = _harness(policy)
        for _ in range(6):
            h.add(_p(400), max_tokens=4, slo=BATCH, priority=1)  # 2.4 s of prefill
        h.step()
        chat = h.add(_p(16), max_tokens=4, slo=INTERACTIVE)
        ttfts[policy] = _ttft(h, chat)
        h.run_to_completion()
        h.assert_pool_whole()
    assert ttfts["slo"] <= INTERACTIVE.ttft_ms / 1000 < ttfts["fcfs"]


def test_slo_keeps_predicted_steps_inside_the_tightest_running_tpot():
    h = _harness("slo")
    chats = [h.add(_p(8), max_tokens=200, slo=INTERACTIVE) for _ in range(4)]
    h.step()
    limit = INTERACTIVE.tpot_ms / 1000 * SLOPolicyConfig().tpot_margin
    for _ in range(3):
        h.add(_p(400), max_tokens=2, slo=BATCH, priority=1)
    for _ in range(60):
        plan, _ = h.step()
        shape = StepShape.of(plan.scheduled)
        floor = COST.predict(StepShape(SLOPolicyConfig().min_prefill_tokens, 4, 0))
        assert COST.predict(shape) <= max(limit, floor) + 1e-9
    assert all(c.num_output_tokens > 50 for c in chats)
    batch_done = [r for r in h.sched.running if r.slo is BATCH]
    assert not h.sched.num_waiting or batch_done  # the prompts progress meanwhile


def test_loose_decodes_sit_out_steps_so_a_tight_tpot_holds_and_theirs_still_do():
    results = {}
    for wait in (None, 2.0):
        policy = SLOBatch(COST, SLOPolicyConfig(decode_wait_steps=wait))
        h = _harness("slo", policy, num_blocks=2048, max_num_seqs=64)
        batch = [h.add(_p(4), max_tokens=200, slo=BATCH, priority=1) for _ in range(30)]
        for _ in range(3):
            h.step()
        chat = h.add(_p(4), max_tokens=40, slo=INTERACTIVE)
        gaps, last = [], {r.request_id: h.clock() for r in batch}
        while not chat.is_finished:
            before = {r.request_id: r.num_output_tokens for r in batch}
            h.step()
            for r in batch:
                if r.num_output_tokens > before[r.request_id]:
                    gaps.append(h.clock() - last[r.request_id])
                    last[r.request_id] = h.clock()
        assert chat.status == RequestStatus.FINISHED_LENGTH, chat
        tpot = (chat.last_token_time - chat.first_scheduled_time) / chat.num_output_tokens
        results[wait] = (tpot, max(gaps))
        h.run_to_completion()
        h.assert_pool_whole()
    # 30 decode rows alone predict 70 ms a step, past the chat's 60 ms TPOT
    assert results[None][0] > INTERACTIVE.tpot_ms / 1000
    tpot, worst_gap = results[2.0]
    assert tpot <= INTERACTIVE.tpot_ms / 1000
    assert worst_gap <= BATCH.tpot_ms / 1000  # every batch token still inside its own TPOT


def _batch_decoding(h: Harness, n: int, max_tokens: int = 200) -> list:
    reqs = [h.add(_p(4), max_tokens=max_tokens, slo=BATCH, priority=1) for _ in range(n)]
    for _ in range(3):
        h.step()
    assert all(r.num_output_tokens for r in reqs)
    return reqs


def _gaps_until_first_token(h: Harness, reqs, chat) -> list[float]:
    """Step until `chat` has its first token; the gaps between tokens of the `reqs`."""
    last = {r.request_id: h.clock() for r in reqs}
    gaps = []
    while not (chat.num_output_tokens or chat.is_finished):
        before = {r.request_id: r.num_output_tokens for r in reqs}
        h.step()
        for r in reqs:
            if r.num_output_tokens > before[r.request_id]:
                gaps.append(h.clock() - last[r.request_id])
                last[r.request_id] = h.clock()
    return gaps


def test_lower_class_decodes_sit_out_so_an_interactive_prompt_meets_its_ttft():
    ttfts = {}
    for rescue in (False, True):
        policy = SLOBatch(COST, SLOPolicyConfig(preempt_for_ttft=rescue))
        h = _harness("slo", policy, num_blocks=4096, max_num_seqs=64)
        batch = _batch_decoding(h, 60, max_tokens=40)  # 60 rows: 130 of a 150 ms step limit
        chat = h.add(_p(120), max_tokens=4, slo=INTERACTIVE)  # 120 ms of prefill
        gaps = _gaps_until_first_token(h, batch, chat)
        assert chat.num_output_tokens == 1, chat
        ttfts[rescue] = chat.last_token_time - chat.arrival_time
        assert max(gaps) <= BATCH.tpot_ms / 1000  # the batch class still inside its TPOT
        assert not h.sched.num_preemptions  # sitting out a step is enough here: no recompute
        h.run_to_completion()
        assert all(r.num_output_tokens == 40 for r in batch)
        h.assert_pool_whole()
    # beside all 60 rows its chunks get 32 tokens a step (min_prefill_tokens): 4 steps
    assert ttfts[False] > INTERACTIVE.ttft_ms / 1000 >= ttfts[True]


def test_an_interactive_prompt_takes_a_batch_decodes_seat_when_none_would_free_in_time():
    outcomes = {}
    for rescue in (False, True):
        policy = SLOBatch(COST, SLOPolicyConfig(preempt_for_ttft=rescue))
        h = _harness("slo", policy, max_num_seqs=4)
        batch = _batch_decoding(h, 4)  # every seat taken, each for 197 more tokens
        chat = h.add(_p(16), max_tokens=4, slo=INTERACTIVE)
        for _ in range(40):
            h.step()
            if chat.num_output_tokens or chat.is_finished:
                break
        outcomes[rescue] = chat.status, chat.num_output_tokens
        if rescue:
            assert chat.last_token_time - chat.arrival_time <= INTERACTIVE.ttft_ms / 1000
            victims = [r for r in batch if r.num_preemptions]
            assert len(victims) == 1 and victims[0] is batch[-1]  # the least urgent: latest
        h.run_to_completion()
        assert all(r.num_output_tokens == 200 for r in batch)  # the victim recomputes, finishes
        h.assert_pool_whole()
    assert outcomes[False] == (RequestStatus.FINISHED_SHED, 0)  # waited for a seat, too late
    assert outcomes[True][1] >= 1


def test_a_decode_never_yields_to_a_prompt_of_its_own_class():
    h = _harness("slo", max_num_seqs=4)
    _batch_decoding(h, 4)
    late_batch = h.add(_p(16), max_tokens=4, slo=BATCH, priority=1)
    for _ in range(10):
        plan, _ = h.step()
        assert not plan.preempted_ids and late_batch.status == RequestStatus.WAITING


def test_a_hopeless_interactive_request_is_shed_and_a_batch_one_demoted():
    h = _harness("slo", max_num_batched_tokens=64)
    for _ in range(4):
        h.add(_p(400), max_tokens=2, slo=BATCH, priority=1)
    late = [
        h.add(_p(200), max_tokens=2, slo=INTERACTIVE) for _ in range(3)
    ]  # 200 ms of prefill each
    shed = []
    for _ in range(40):
        plan, _ = h.step()
        shed += plan.shed
    assert shed and all(r.status == RequestStatus.FINISHED_SHED for r in shed)
    assert set(shed) <= set(late)
    assert all(r.finish_reason == "shed" for r in shed)
    h.run_to_completion()
    h.assert_pool_whole()

    h = _harness("slo", max_num_batched_tokens=64)
    tight_batch = SLOClass("batch", priority=1, ttft_ms=50, on_overload="demote")
    reqs = [h.add(_p(300), max_tokens=2, slo=tight_batch, priority=1) for _ in range(3)]
    h.step()
    demoted = [r for r in reqs if r.priority > 1]
    assert demoted and all(r.slo.ttft_ms is None for r in demoted)
    h.run_to_completion()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)  # served, best effort


def test_aging_never_starves_a_lower_class():
    h = _harness("slo", SLOBatch(COST, SLOPolicyConfig(aging_s=1.0)),
                 max_num_batched_tokens=32, num_blocks=512)  # fmt: skip
    starving = h.add(_p(64), max_tokens=2, slo=BATCH, priority=1)
    for _ in range(400):  # a high class that alone could fill every step
        if len(h.sched.waiting) < 4:
            h.add(_p(32), max_tokens=1, slo=SLOClass("hi", priority=0))
        h.step()
        if starving.is_finished:
            break
    assert starving.is_finished


@pytest.mark.parametrize("policy", ["fcfs", "priority", "slo"])
@pytest.mark.parametrize("seed", range(4))
def test_no_block_leaks_under_any_policy(policy, seed):
    rng = random.Random(seed)
    h = _harness(policy, num_blocks=rng.randint(16, 48), max_num_batched_tokens=rng.randint(8, 64),
                 max_num_seqs=rng.randint(2, 8))  # fmt: skip
    classes = [INTERACTIVE, BATCH, SLOClass("plain")]
    live = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            cls = rng.choice(classes)
            n = rng.randint(1, 30)
            budget = h.sched.max_request_tokens - n
            if budget >= 1:
                prompt = [rng.randrange(3, 60) for _ in range(n)]
                live.append(h.add(prompt, max_tokens=rng.randint(1, min(budget, 12)), slo=cls,
                                  priority=cls.priority))  # fmt: skip
        elif op < 0.38 and live:
            h.sched.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_ABORTED)
        else:
            h.next_token = EOS if rng.random() < 0.1 else rng.randrange(3, 60)
            h.step()  # checks invariants and that every request reads its own KV
        live = [r for r in live if not r.is_finished]
    h.run_to_completion()
    h.assert_pool_whole()


@pytest.mark.parametrize("policy", ["priority", "slo"])
def test_the_same_stream_gives_the_same_schedule(policy):
    def run():
        rng = random.Random(7)
        h = _harness(policy, num_blocks=40, max_num_batched_tokens=48)
        plans = []
        for _ in range(120):
            if rng.random() < 0.3:
                cls = rng.choice([INTERACTIVE, BATCH])
                h.add(rng.randint(4, 60), max_tokens=rng.randint(1, 8), slo=cls,
                      priority=cls.priority)  # fmt: skip
            plan, _ = h.step()
            plans.append(
                [(s.request.request_id, s.start, s.num_new_tokens) for s in plan.scheduled]
            )
        return plans

    assert run() == run()

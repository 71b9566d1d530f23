"""The scheduler's part in multi-LoRA: at most max_loras adapters in a step, and prefix
cache keys that tell adapters apart. No torch."""

from __future__ import annotations

from tests.core.harness import Harness


def adapters_in(plan) -> set[int]:
    return {s.request.lora_id for s in plan.scheduled if s.request.lora_id}


def test_a_step_takes_at_most_max_loras_adapters_and_any_number_of_base_requests():
    h = Harness()
    h.sched.config = type(h.sched.config)(16, 64, 1024, max_loras=2)
    reqs = [h.add(5, lora_id=i % 4) for i in range(8)]  # adapters 0 (base), 1, 2, 3
    plan, _ = h.step()
    assert adapters_in(plan) == {1, 2}
    # base, 1, 2; the request of a third adapter waits, and FCFS lets nobody overtake it
    assert [s.request for s in plan.scheduled] == reqs[:3]
    plan, _ = h.step()
    assert adapters_in(plan) <= {1, 2, 3} and len(adapters_in(plan)) <= 2
    steps = h.run_to_completion()
    assert steps > 0 and all(r.is_finished for r in reqs)
    h.assert_pool_whole()


def test_the_same_prompt_under_another_adapter_matches_nothing_in_the_prefix_cache():
    h = Harness(block_size=4)
    prompt = list(range(100, 113))
    first = h.add(prompt, lora_id=1)
    h.run_to_completion()
    assert first.num_cached_tokens == 0
    for lora_id, cached in ((2, 0), (0, 0), (1, 12)):
        r = h.add(prompt, lora_id=lora_id)
        h.run_to_completion()
        assert r.num_cached_tokens == cached, f"adapter {lora_id}"
    h.assert_pool_whole()

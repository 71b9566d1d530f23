"""The scheduler's ledger, budget, limits, stop conditions and preemption. No torch."""

from __future__ import annotations

import sys

import pytest

from tandem.core.request import RequestStatus
from tests.core.harness import EOS, Harness


def test_core_never_imports_torch():
    import subprocess

    code = "import tandem.core.scheduler, tandem.core.radix_cache, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_then_decode_one_token_per_step():
    h = Harness(block_size=4)
    r = h.add(10, max_tokens=3)
    plan, _ = h.step()
    assert plan.num_scheduled_tokens == {r.request_id: 10}
    assert r.block_ids == [1, 2, 3]  # 10 tokens -> 3 blocks of 4, block 0 is the null block
    assert r.num_output_tokens == 1
    plan, _ = h.step()
    assert plan.num_scheduled_tokens == {r.request_id: 1}
    assert [s.start for s in plan.scheduled] == [10]
    plan, finished = h.step()
    assert finished == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [7, 7, 7]
    h.assert_pool_whole()


def test_chunked_prefill_splits_a_prompt_by_the_token_budget():
    h = Harness(max_num_batched_tokens=8)
    r = h.add(20, max_tokens=1)
    chunks = []
    while h.sched.has_unfinished():
        plan, _ = h.step()
        chunks.append([(s.start, s.num_new_tokens, s.sample) for s in plan.scheduled])
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert r.num_output_tokens == 1


def test_decodes_and_a_prefill_chunk_share_the_budget():
    h = Harness(max_num_batched_tokens=10)
    a, b = h.add(4, max_tokens=10), h.add(4, max_tokens=10)
    h.step()  # both prefill (8 tokens)
    c = h.add(30, max_tokens=1)
    plan, _ = h.step()
    assert plan.num_scheduled_tokens == {a.request_id: 1, b.request_id: 1, c.request_id: 8}


def test_running_requests_are_capped_by_max_num_seqs():
    h = Harness(max_num_seqs=2)
    reqs = [h.add(4, max_tokens=2) for _ in range(3)]
    plan, _ = h.step()
    assert set(plan.num_scheduled_tokens) == {reqs[0].request_id, reqs[1].request_id}
    assert h.sched.num_waiting == 1
    h.run_to_completion()
    assert all(r.num_output_tokens == 2 for r in reqs)


def test_eos_stops_unless_ignored_and_only_after_min_tokens():
    h = Harness()
    stops = h.add(4, max_tokens=10)
    ignores = h.add(4, max_tokens=3, ignore_eos=True)
    waits = h.add(4, max_tokens=10, min_tokens=2)
    h.next_token = EOS
    h.step()
    assert stops.status == RequestStatus.FINISHED_STOPPED and stops.output_token_ids == [EOS]
    assert not waits.is_finished  # 1 output < min_tokens 2
    h.step()
    assert waits.status == RequestStatus.FINISHED_STOPPED and waits.num_output_tokens == 2
    h.run_to_completion()
    assert ignores.status == RequestStatus.FINISHED_LENGTH and ignores.output_token_ids == [EOS] * 3


def test_stop_token_ids_finish_with_the_token_as_stop_reason():
    h = Harness()
    r = h.add(4, max_tokens=10, stop_token_ids=[42])
    h.step()
    h.step({r.request_id: 42})
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert r.finish_reason == "stop"


def test_max_model_len_ends_a_request_with_length():
    h = Harness(max_model_len=12)
    r = h.add(10, max_tokens=100)
    h.run_to_completion()
    assert r.num_tokens == 12 and r.finish_reason == "length"


def test_a_request_larger_than_the_whole_pool_is_refused_with_a_clear_error():
    h = Harness(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    with pytest.raises(ValueError, match="max_tokens"):
        h.add(10, max_tokens=10)
    assert h.sched.num_waiting == 0
    h.add(10, max_tokens=6)  # exactly 16 fits
    h.run_to_completion()
    h.assert_pool_whole()


def test_prompt_at_max_model_len_is_refused():
    h = Harness(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        h.add(8)


def test_duplicate_request_id_is_refused():
    h = Harness()
    r = h.add(4)
    dup = type(r)(r.request_id, [1, 2], r.sampling_params)
    with pytest.raises(ValueError, match="request_id"):
        h.sched.add_request(dup)


def test_preemption_takes_the_newest_and_it_recomputes_later():
    h = Harness(num_blocks=7, block_size=4, prefix_caching=False)  # 6 usable blocks
    old = h.add(8, max_tokens=8)  # grows to 16 tokens = 4 blocks
    new = h.add(8, max_tokens=8)
    h.step()  # both prefill: 2 + 2 blocks (plus room), 2 left
    assert len(old.block_ids) == 2 and len(new.block_ids) == 2
    preempted_at = None
    for i in range(12):
        plan, _ = h.step()
        if plan.preempted_ids:
            preempted_at = i
            assert plan.preempted_ids == [new.request_id]
            assert new.status == RequestStatus.PREEMPTED and new.block_ids == []
            assert new.num_computed_tokens == 0 and list(h.sched.waiting)[0] is new
            break
    assert preempted_at is not None
    h.run_to_completion()
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8
    assert new.num_preemptions >= 1 and h.sched.num_preemptions >= 1
    h.assert_pool_whole()


def test_abort_frees_blocks_of_running_and_waiting_requests():
    h = Harness(max_num_seqs=1)
    running, waiting = h.add(9, max_tokens=50), h.add(9, max_tokens=50)
    h.step()
    assert running.block_ids
    h.sched.finish_requests(
        [running.request_id, waiting.request_id, "unknown"], RequestStatus.FINISHED_ABORTED
    )
    assert running.finish_reason == "abort" and waiting.finish_reason == "abort"
    assert not h.sched.has_unfinished()
    h.assert_pool_whole()
    plan = h.sched.schedule()
    assert set(plan.finished_ids) == {running.request_id, waiting.request_id}


def test_priority_value_and_arrival_order_pick_the_victim():
    from tandem.core.policy import FCFSBatch

    h = Harness()
    a, b, c = h.add(4), h.add(4, priority=1), h.add(4)
    assert FCFSBatch().victim(a, [a, b, c]) is b
    assert FCFSBatch().victim(a, [a, c]) is c
    assert FCFSBatch().victim(h.add(4), [a, c]) is None  # a waiting request preempts nobody


def test_max_tokens_none_means_until_max_model_len():
    h = Harness(max_model_len=12)
    r = h.add(10, max_tokens=None)
    assert r.max_tokens == 2
    h.run_to_completion()
    assert r.num_tokens == 12 and r.finish_reason == "length"

"""reserve / commit / release: a decode instance admits a request whose prompt KV comes from
a prefill instance. No torch: the harness's fake KV store stands in for the transfer."""

from __future__ import annotations

from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import SamplingParams
from tests.core.harness import EOS, Harness


def _request(h: Harness, prompt, max_tokens=4) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, eos_token_ids=(EOS,))
    return Request(f"kv{len(h.sched.requests)}-{prompt[0]}", list(prompt), sp, h.clock())


def _arrive(h: Harness, req: Request, start: int) -> None:
    """The sender wrote positions [start, prompt) into the reserved blocks."""
    bs = h.kv.block_size
    for pos in range(start, req.num_prompt_tokens):
        h.kv_content[(req.block_ids[pos // bs], pos % bs)] = tuple(req.all_token_ids[: pos + 1])


def test_reserved_blocks_are_invisible_until_committed():
    h = Harness(block_size=4)
    prompt = list(range(300, 310))
    req = _request(h, prompt)
    assert h.sched.reserve(req) == 0
    assert req.status == RequestStatus.WAITING_FOR_KV and len(req.block_ids) == 3
    h.sched.check_invariants()
    other = h.add(prompt + [1, 2])  # the same prompt, while the KV is still in flight
    plan, _ = h.step()
    assert [s.request for s in plan.scheduled] == [other]
    assert plan.scheduled[0].start == 0  # it matched nothing: the reserved blocks are private
    assert req not in [s.request for s in plan.scheduled]  # waiting for KV is never scheduled

    _arrive(h, req, 0)
    h.sched.commit(req.request_id, 7)
    assert req.status == RequestStatus.RUNNING and req.output_token_ids == [7]
    plan, _ = h.step()  # decodes from the first token: one token at the end of the prompt
    assert (plan.num_scheduled_tokens[req.request_id], plan.scheduled[-1].start) == (1, 10)
    h.run_to_completion()
    assert req.num_output_tokens == 4
    third = h.add(prompt + [9])
    plan, _ = h.step()
    assert plan.scheduled[0].request is third
    assert plan.scheduled[0].start == 8  # committed blocks are cached for everyone now
    h.run_to_completion()
    h.assert_pool_whole()


def test_a_prefix_held_here_is_not_sent_again():
    h = Harness(block_size=4)
    system = list(range(400, 408))
    h.add(system + [1, 2, 3])
    h.run_to_completion()
    req = _request(h, system + [5, 6, 7, 8, 9])
    assert h.sched.reserve(req) == 8  # two blocks held: the sender sends from position 8
    _arrive(h, req, 8)
    h.sched.commit(req.request_id, 11)
    h.run_to_completion()  # the harness checks every read is the request's own prefix
    h.assert_pool_whole()


def test_release_and_abort_return_every_block():
    h = Harness(block_size=4)
    a, b = _request(h, range(500, 513)), _request(h, range(600, 606))
    h.sched.reserve(a), h.sched.reserve(b)
    assert h.kv.usage > 0
    h.sched.release(a.request_id)
    h.sched.finish_requests([b.request_id], RequestStatus.FINISHED_ABORTED)
    assert not h.sched.has_unfinished()
    h.assert_pool_whole()
    plan = h.sched.schedule()
    assert set(plan.finished_ids) == {a.request_id, b.request_id}  # the runner hears of both


def test_no_room_means_no_reservation():
    h = Harness(num_blocks=5, block_size=4, max_num_seqs=2)  # 4 usable blocks
    busy = h.add(12)
    h.step()  # busy holds 3 blocks
    assert h.sched.reserve(_request(h, range(800, 808))) is None  # needs 2, 1 is free
    h.sched.check_invariants()
    h.run_to_completion()
    assert busy.is_finished
    h.assert_pool_whole()

    h = Harness(max_num_seqs=1)
    h.add(4)
    h.step()
    assert h.sched.reserve(_request(h, range(700, 704))) is None  # no batch slot


def test_a_first_token_that_ends_the_request_finishes_it_at_commit():
    h = Harness(block_size=4)
    req = _request(h, range(900, 906))
    h.sched.reserve(req)
    _arrive(h, req, 0)
    h.sched.commit(req.request_id, EOS)
    assert req.status == RequestStatus.FINISHED_STOPPED and not h.sched.has_unfinished()
    h.assert_pool_whole()
    one = _request(h, range(950, 956), max_tokens=1)
    h.sched.reserve(one)
    h.sched.commit(one.request_id, 5)
    assert one.finish_reason == "length"
    h.assert_pool_whole()

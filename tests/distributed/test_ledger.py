"""The ledger a driver broadcasts carries everything a rank needs: the step inputs a rank
builds from it are the driver's own, tensor for tensor, for any mix of decodes, prefill
chunks, drafts and LoRA rows (hypothesis); it pickles to plain ints."""

from __future__ import annotations

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import ScheduledRequest, SchedulerOutput
from tandem.distributed.stage import ledger_of
from tandem.runner.input_batch import prepare_inputs

CPU, BLOCK = torch.device("cpu"), 4


@st.composite
def plans(draw):
    rows = []
    for i in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 40))
        start = draw(st.integers(0, length - 1))
        n = draw(st.integers(1, length - start))
        r = Request(f"r{i}", list(range(100 * i, 100 * i + length)), SamplingParams())
        r.lora_id = draw(st.sampled_from([0, 0, 1, 2]))
        r.block_ids = draw(st.permutations(range(1, 40)))[: -(-(length + 4) // BLOCK)]
        drafts = tuple(draw(st.lists(st.integers(0, 99), max_size=3))) if start + n == length else ()  # fmt: skip
        rows.append(ScheduledRequest.of(r, start, n + len(drafts), drafts))
    return SchedulerOutput(scheduled=rows)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_a_rank_builds_the_drivers_step_inputs_from_the_ledger(plan):
    ledger = pickle.loads(pickle.dumps(ledger_of(plan, BLOCK)))  # as it crosses to a rank
    mine, theirs = prepare_inputs(plan.scheduled, BLOCK, CPU), prepare_inputs(ledger, BLOCK, CPU)
    for name in ("input_ids", "positions", "sample_index"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name))
    assert torch.equal(mine.attn.slot_mapping, theirs.attn.slot_mapping)
    for a, b in zip(mine.attn.groups, theirs.attn.groups, strict=True):
        assert a.token_slice == b.token_slice and a.fresh_lens == b.fresh_lens
        for t in ("block_tables", "mask", "context_lens", "query_starts", "scatter_index"):
            x, y = getattr(a, t), getattr(b, t)
            assert (x is None and y is None) or torch.equal(x, y)
    lora = mine.token_lora_ids
    assert (lora is None and theirs.token_lora_ids is None) or (lora == theirs.token_lora_ids).all()
    for row in ledger:  # plain ints only: no Request, no tensor
        assert all(isinstance(t, int) for t in [*row.token_ids, *row.block_ids, row.start])

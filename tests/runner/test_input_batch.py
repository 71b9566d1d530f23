"""prepare_inputs against hand-computed positions, slots, block tables and masks."""

from __future__ import annotations

import torch

from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import ScheduledRequest
from tandem.runner.input_batch import prepare_inputs

CPU = torch.device("cpu")


def req(rid, tokens, blocks):
    r = Request(rid, tokens, SamplingParams())
    r.block_ids = blocks
    return r


def test_decodes_come_first_then_prefill_chunks_with_positions_and_slots():
    # block_size 4. "d": 6 tokens, computing position 5 in block 7 (its blocks [3, 7]).
    # "p": a 10-token prompt, chunk [4, 9) in blocks [5, 2, 9], not reaching the end.
    d = req("d", list(range(10, 16)), [3, 7])
    p = req("p", list(range(20, 30)), [5, 2, 9])
    plan = [ScheduledRequest.of(p, 4, 5), ScheduledRequest.of(d, 5, 1)]
    x = prepare_inputs(plan, 4, CPU)
    assert x.input_ids.tolist() == [15, 24, 25, 26, 27, 28]
    assert x.positions.tolist() == [5, 4, 5, 6, 7, 8]
    # pos 5 of d -> block 7 offset 1 = 29; p pos 4..7 -> block 2 (8..11), pos 8 -> block 9 (36)
    assert x.attn.slot_mapping.tolist() == [29, 8, 9, 10, 11, 36]
    assert x.sample_index.tolist() == [0]  # only d reaches its last token
    assert [s.request.request_id for s in x.sample_rows] == ["d"]

    single, chunk = x.attn.groups
    assert single.token_slice == slice(0, 1) and chunk.token_slice == slice(1, 6)
    assert single.block_tables.tolist() == [[3, 7]]
    assert single.mask.tolist() == [[[True] * 6 + [False] * 2]]  # keys 0..5 of 8
    assert chunk.block_tables.tolist() == [[5, 2, 9]]
    # query i (position 4 + i) sees keys 0 .. 4 + i of 12
    assert chunk.mask[0].int().tolist() == [[1] * (5 + i) + [0] * (7 - i) for i in range(5)]
    assert chunk.scatter_index is None
    assert single.fresh_lens is None and chunk.fresh_lens is None  # both have context


def test_chunks_in_one_bucket_are_padded_and_scattered():
    a = req("a", [1, 2, 3], [4])
    b = req("b", [5, 6, 7, 8], [6])
    x = prepare_inputs([ScheduledRequest.of(a, 0, 3), ScheduledRequest.of(b, 0, 4)], 4, CPU)
    (g,) = x.attn.groups  # query lengths 3 and 4 both round up to 4
    assert g.shape == (2, 4)
    assert g.scatter_index.tolist() == [0, 1, 2, 4, 5, 6, 7]  # a's fourth query slot is padding
    assert g.mask[0, 3].tolist() == [True, False, False, False]  # padding sees key 0 only
    assert g.mask[0, 1].tolist() == [True, True, False, False]
    assert g.block_tables.tolist() == [[4], [6]]
    assert x.sample_index.tolist() == [2, 6]
    assert g.fresh_lens == [3, 4]  # both start at 0: their keys are their own tokens


def test_chunks_of_very_different_lengths_get_their_own_groups():
    """A long chunk and short ones in one step: padding them together would multiply the
    attention work, so each power-of-two bucket is its own group."""
    long = req("long", list(range(40)), [1, 2, 3, 4, 5])
    short = [req(f"s{i}", list(range(40)) + [i, i], [1, 2, 3, 4, 5, 6 + i]) for i in range(3)]
    plan = [ScheduledRequest.of(long, 0, 40)] + [ScheduledRequest.of(r, 40, 2) for r in short]
    x = prepare_inputs(plan, 8, CPU)
    shapes = sorted(g.shape for g in x.attn.groups)
    assert shapes == [(1, 40), (3, 2)]
    fresh = {g.shape: g.fresh_lens for g in x.attn.groups}
    assert fresh == {(1, 40): [40], (3, 2): None}
    total = sum(g.token_slice.stop - g.token_slice.start for g in x.attn.groups)
    assert total == x.input_ids.numel() == 46


def test_block_tables_are_null_padded_to_the_longest_row():
    a = req("a", list(range(9)), [1, 2, 3])
    b = req("b", [1, 2], [8])
    x = prepare_inputs([ScheduledRequest.of(a, 8, 1), ScheduledRequest.of(b, 1, 1)], 4, CPU)
    (g,) = x.attn.groups
    assert g.block_tables.tolist() == [[1, 2, 3], [8, 0, 0]]
    assert g.mask[1, 0].tolist() == [True, True] + [False] * 10

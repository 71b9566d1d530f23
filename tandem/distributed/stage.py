"""A step on one rank: the ledger the driver broadcasts (plain ints), and the forward pass of
one pipeline stage of a tensor-parallel model.

Every rank builds the same StepInputs from the same rows (prepare_inputs is a pure function
of them), runs its layers on its heads and columns, and the logits meet on rank 0, which
alone samples: it holds the sampler's state, the grammars and the proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.scheduler import SchedulerOutput


@dataclass(slots=True)
class LedgerRow:
    """What a rank needs of one scheduled row: the plan's numbers, no Request object."""

    token_ids: list[int]
    start: int
    num_new_tokens: int
    sample: bool
    draft_token_ids: tuple[int, ...]
    block_ids: list[int]
    lora_id: int

    @property
    def request(self) -> LedgerRow:  # prepare_inputs reads block_ids and lora_id here
        return self


def ledger_of(plan: SchedulerOutput, block_size: int) -> list[LedgerRow]:
    rows = []
    for s in plan.scheduled:
        blocks = -(-(s.start + s.num_new_tokens) // block_size)
        rows.append(LedgerRow(s.token_ids, s.start, s.num_new_tokens, s.sample,
                              tuple(s.draft_token_ids), s.request.block_ids[:blocks],
                              s.request.lora_id))  # fmt: skip
    return rows


def stage_forward(model, inputs, ranks, vocab_size: int) -> torch.Tensor | None:
    """This rank's part of the forward pass; -> the sampled rows' logits on rank 0, else
    None. Stages pass on the hidden state and the residual stream, both [tokens, hidden]."""
    m = model.model
    rope = m.rotary.rows(inputs.positions)
    if ranks.first_stage:
        x, residual = m.embed(inputs.input_ids), None
    else:
        shape = (len(inputs.input_ids), model.config.hidden_size)
        x, residual = ranks.recv_activations(shape, m.norm.weight.dtype)
    for layer in m.layers:
        x, residual = layer(rope, x, residual)
    rows = len(inputs.sample_index)
    if not ranks.last_stage:
        ranks.send_activations(x, residual)
        return ranks.recv_logits(rows, vocab_size) if ranks.rank == 0 and rows else None
    if not rows:
        return None
    hidden = m.norm(x, residual)[0][inputs.sample_index]
    logits = ranks.gather_vocab(model.compute_logits(hidden), vocab_size)
    if logits is not None and ranks.rank != 0:  # the last stage's first rank, under PP
        ranks.send_logits(logits)
        return None
    return logits

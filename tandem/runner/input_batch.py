"""Turn a scheduler plan into the tensors of one forward pass. A pure function of the plan.

Rows are grouped for attention, and each group is padded to its longest query and context:
single-token rows (decodes) form one group; longer chunks (prefills) are bucketed by query
length and context length rounded up to powers of two, so padding never more than doubles
the attention work (one 1088-token chunk padded with fifteen 64-token ones would be 16x).
For a row computing positions [start, start + n):

    positions    start, start+1, ..., start+n-1
    slot         block_ids[pos // block_size] * block_size + pos % block_size
    keys seen    query i sees cached positions 0 .. start+i (its own included)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.scheduler import ScheduledRequest
from tandem.model.attention import AttentionGroup, AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    # [P] long: flat index of each position that samples: a sampling row's last token, or
    # with drafts its last 1 + len(drafts) tokens (the model's next token after each)
    sample_index: torch.Tensor
    sample_rows: list[ScheduledRequest]  # the rows that sample, in that order
    token_lora_ids: np.ndarray | None = None  # [T] each token's LoRA adapter (None: none)


def prepare_inputs(
    scheduled: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    one_query_rows: bool = False,
) -> StepInputs:
    """one_query_rows (batch-invariant steps): every token is a row of its own for attention,
    one group of single queries, each seeing its own keys through its request's blocks."""
    rows = sorted(scheduled, key=_bucket)  # stable: plan order within a bucket
    starts = np.array([s.start for s in rows], dtype=np.int64)
    lens = np.array([s.num_new_tokens for s in rows], dtype=np.int64)
    ends = np.cumsum(lens)

    input_ids = np.fromiter(
        (t for s in rows for t in s.token_ids),
        dtype=np.int64,
        count=int(ends[-1]),
    )
    decode_only = int(ends[-1]) == len(rows)
    positions = (
        starts.copy()
        if decode_only
        else np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)])
    )
    tables = _block_tables(rows, block_size)  # [R, max_blocks]
    row_of_token = np.repeat(np.arange(len(rows)), lens)
    slots = tables[row_of_token, positions // block_size] * block_size + positions % block_size

    if one_query_rows and not decode_only:  # each token a decode-like row
        ones = np.ones_like(positions)
        groups = [_group(slice(0, len(positions)), positions, ones, tables[row_of_token],
                         block_size, device)]  # fmt: skip
    else:
        groups = _bucket_groups(rows, starts, lens, ends, tables, block_size, device)

    lora_ids = [s.request.lora_id for s in rows]
    token_lora_ids = np.repeat(np.array(lora_ids), lens) if any(lora_ids) else None
    sample_flags = np.array([s.sample for s in rows], dtype=bool)
    # each sampling row's last 1 + len(drafts) positions, in row order
    per_row = np.array([1 + len(s.draft_token_ids) for s in rows])[sample_flags]
    last = ends[sample_flags]
    offsets = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    sample_index = np.repeat(last - per_row, per_row) + offsets
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return StepInputs(
        input_ids=to(input_ids),
        positions=to(positions),
        attn=AttentionMetadata(slot_mapping=to(slots), groups=groups),
        sample_index=to(sample_index),
        sample_rows=[s for s, f in zip(rows, sample_flags) if f],
        token_lora_ids=token_lora_ids,
    )


def _bucket_groups(rows, starts, lens, ends, tables, block_size, device) -> list[AttentionGroup]:
    """One attention group per run of rows in the same bucket (rows are sorted by it)."""
    groups, first = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or _bucket(rows[i]) != _bucket(rows[first]):
            tokens = slice(int(ends[first - 1]) if first else 0, int(ends[i - 1]))
            g = slice(first, i)
            groups.append(_group(tokens, starts[g], lens[g], tables[g], block_size, device))
            first = i
    return groups


def _bucket(s: ScheduledRequest) -> tuple[int, int]:
    """Rows in one bucket share an attention group: decodes together, chunks by the powers
    of two at or above their query and context lengths."""
    if s.num_new_tokens == 1:
        return (0, 0)
    return (_pow2(s.num_new_tokens), _pow2(s.start + s.num_new_tokens))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _block_tables(rows: list[ScheduledRequest], block_size: int) -> np.ndarray:
    """Each row's blocks covering positions up to start + n, null-padded (block 0)."""
    needed = [-(-(s.start + s.num_new_tokens) // block_size) for s in rows]
    tables = np.zeros((len(rows), max(needed)), dtype=np.int64)
    for i, (s, n) in enumerate(zip(rows, needed)):
        tables[i, :n] = s.request.block_ids[:n]
    return tables


def _group(token_slice, starts, lens, tables, block_size, device) -> AttentionGroup:
    b, q = len(starts), int(lens.max())
    ctx = starts + lens
    num_blocks = -(-int(ctx.max()) // block_size)
    keys = torch.arange(num_blocks * block_size)  # [L]
    qi = torch.arange(q)  # [Q]
    st, ln = torch.from_numpy(starts), torch.from_numpy(lens)
    mask = keys[None, None, :] <= (st[:, None] + qi[None, :])[:, :, None]  # [B, Q, L]
    valid = qi[None, :] < ln[:, None]  # [B, Q]
    mask &= valid[:, :, None]
    mask[:, :, 0] |= ~valid  # padded queries see key 0 so their softmax stays finite
    scatter = None
    if b > 1 and bool((lens != q).any()):
        scatter = (torch.arange(b)[:, None] * q + qi[None, :])[valid]
    return AttentionGroup(
        token_slice=token_slice,
        block_tables=torch.from_numpy(np.ascontiguousarray(tables[:, :num_blocks])).to(device),
        mask=mask.to(device),
        context_lens=torch.from_numpy(ctx).to(device),
        query_starts=st,
        scatter_index=None if scatter is None else scatter.to(device),
        fresh_lens=None if starts.any() else lens.tolist(),
    )

"""Turn a scheduler plan into the tensors of one forward pass. A pure function of the plan.

Rows are ordered single-token chunks (decodes) first, then longer chunks (prefills); each kind
is one attention group. For a row computing positions [start, start + n):

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
    sample_index: torch.Tensor  # [S] long: flat index of each sampling row's last token
    sample_rows: list[ScheduledRequest]  # the S rows that sample, in that order


def prepare_inputs(
    scheduled: list[ScheduledRequest], block_size: int, device: torch.device
) -> StepInputs:
    singles = [s for s in scheduled if s.num_new_tokens == 1]
    chunks = [s for s in scheduled if s.num_new_tokens > 1]
    rows = singles + chunks
    starts = np.array([s.start for s in rows], dtype=np.int64)
    lens = np.array([s.num_new_tokens for s in rows], dtype=np.int64)
    ends = np.cumsum(lens)

    input_ids = np.fromiter(
        (t for s in rows for t in s.request.all_token_ids[s.start : s.start + s.num_new_tokens]),
        dtype=np.int64,
        count=int(ends[-1]),
    )
    positions = (
        np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)])
        if chunks
        else starts.copy()
    )
    tables = _block_tables(rows, block_size)  # [R, max_blocks]
    row_of_token = np.repeat(np.arange(len(rows)), lens)
    slots = tables[row_of_token, positions // block_size] * block_size + positions % block_size

    groups = []
    if singles:
        groups.append(
            _group(
                slice(0, len(singles)),
                starts[: len(singles)],
                lens[: len(singles)],
                tables[: len(singles)],
                block_size,
                device,
            )
        )
    if chunks:
        k = len(singles)
        groups.append(
            _group(
                slice(len(singles), int(ends[-1])),
                starts[k:],
                lens[k:],
                tables[k:],
                block_size,
                device,
            )
        )

    sample_flags = [s.sample for s in rows]
    sample_index = (ends - 1)[np.array(sample_flags, dtype=bool)]
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return StepInputs(
        input_ids=to(input_ids),
        positions=to(positions),
        attn=AttentionMetadata(slot_mapping=to(slots), groups=groups),
        sample_index=to(sample_index),
        sample_rows=[s for s, f in zip(rows, sample_flags) if f],
    )


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
        scatter_index=None if scatter is None else scatter.to(device),
    )

"""One rank's part of a checkpoint (Megatron's split): q/k/v and gate/up by output rows
(column-parallel), o and down by input columns (row-parallel, their outputs summed by one
all-reduce each), the embedding and head by vocabulary rows; norms whole. A rank reads only
its slice of each tensor and builds only its stage's layers, so its memory is its share.
Quantizing after the load (int8, int4) then quantizes each rank's slice by its own groups."""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from tandem.core.model_config import ModelConfig
from tandem.distributed.layout import ParallelLayout, kv_heads_of, local_vocab, rank_config

_LAYER = re.compile(r"\.layers\.(\d+)\.")
COLUMN = ("q_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


class RankShard:
    """What rank `rank` of `layout` holds of a model of config `cfg`."""

    def __init__(self, cfg: ModelConfig, layout: ParallelLayout, rank: int) -> None:
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.tp, self.tp_rank = layout.tp, layout.tp_rank_of(rank)
        self.stage = layout.stage_of(rank)
        self.layers = layout.stage_layers(self.stage, cfg.num_layers)
        self.first_stage, self.last_stage = self.stage == 0, self.stage == layout.pp - 1
        self.vocab_rows = local_vocab(cfg.vocab_size, self.tp)

    def local_name(self, name: str) -> str | None:
        """Checkpoint tensor `name` as this rank's model names it (its stage's layers count
        from 0), or None for another stage's layer."""
        m = _LAYER.search(name)
        if m is None:
            return name
        i = int(m.group(1))
        if i not in self.layers:
            return None
        return f"{name[: m.start()]}.layers.{i - self.layers.start}.{name[m.end() :]}"

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's slice of checkpoint tensor `name`."""
        if self.tp == 1:
            return tensor
        part = name.split(".")[-2]
        if part in COLUMN:
            return tensor.chunk(self.tp, 0)[self.tp_rank]
        if part in ("k_proj", "v_proj"):
            heads = kv_heads_of(self.cfg, self.tp, self.tp_rank)
            d = self.cfg.head_dim
            return tensor[heads.start * d : heads.stop * d]
        if part in ROW and name.endswith("weight"):
            return tensor.chunk(self.tp, 1)[self.tp_rank]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self.vocab_slice(tensor)
        return tensor

    def vocab_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows [r * V/tp, (r + 1) * V/tp) of a [vocab, ...] tensor, zero rows past the end."""
        start = self.tp_rank * self.vocab_rows
        rows = tensor[start : start + self.vocab_rows]
        if len(rows) == self.vocab_rows:
            return rows
        pad = tensor.new_zeros((self.vocab_rows - len(rows), *tensor.shape[1:]))
        return torch.cat([rows, pad])

    def model_config(self) -> ModelConfig:
        """The config this rank's model is built from: its heads, columns, vocabulary rows
        and its stage's layers."""
        return dataclasses.replace(rank_config(self.cfg, self.tp), num_layers=len(self.layers))

    def wire(self, model, ranks) -> None:
        """Sum the row-parallel outputs and the embedding's rows over the stage's ranks."""
        if self.tp == 1:
            return
        for layer in model.model.layers:
            layer.self_attn.reduce = layer.mlp.reduce = ranks.all_reduce
        start = self.tp_rank * self.vocab_rows
        model.model.embed_tokens = VocabParallelEmbedding(
            model.model.embed_tokens, start, self.vocab_rows, ranks.all_reduce
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding holding rows [start, start + rows) of the vocabulary: other ids give
    zeros, and the sum over the ranks gives every id its row."""

    def __init__(self, inner: nn.Module, start: int, rows: int, reduce) -> None:
        super().__init__()
        self.inner, self.start, self.rows, self.reduce = inner, start, rows, reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = self.inner(torch.where(inside, local, 0))
        return self.reduce(x * inside[:, None].to(x.dtype))

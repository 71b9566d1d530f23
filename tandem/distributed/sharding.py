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
from tandem.distributed.experts import ExpertDispatch, held_by
from tandem.distributed.layout import ParallelLayout, kv_heads_of, local_vocab, rank_config
from tandem.model.moe import SparseMoE

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
COLUMN = ("q_proj", "gate_proj", "up_proj", "w1", "w3")
ROW = ("o_proj", "down_proj", "w2")


class RankShard:
    """What rank `rank` of `layout` holds of a model of config `cfg`."""

    def __init__(self, cfg: ModelConfig, layout: ParallelLayout, rank: int) -> None:
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.tp, self.tp_rank = layout.tp, layout.tp_rank_of(rank)
        self.stage = layout.stage_of(rank)
        self.layers = layout.stage_layers(self.stage, cfg.num_layers)
        self.first_stage, self.last_stage = self.stage == 0, self.stage == layout.pp - 1
        self.vocab_rows = local_vocab(cfg.vocab_size, self.tp)
        self.kv_heads = kv_heads_of(cfg, self.tp, self.tp_rank)  # the model's, this rank's
        self.held = None  # expert parallelism: the experts this rank holds (global ids)
        if layout.ep and cfg.moe is not None:
            self.held = held_by(cfg.moe.num_experts, self.tp, layout.expert_placement, self.tp_rank)  # fmt: skip

    def local_name(self, name: str) -> str | None:
        """Checkpoint tensor `name` as this rank's model names it (its stage's layers count
        from 0), or None for another stage's layer."""
        m = _LAYER.search(name)
        if m is None:
            return name
        i = int(m.group(1))
        if i not in self.layers:
            return None
        name = f"{name[: m.start()]}.layers.{i - self.layers.start}.{name[m.end() :]}"
        e = _EXPERT.search(name)
        if self.held is None or e is None:
            return name
        if int(e.group(1)) not in self.held:
            return None
        return f"{name[: e.start()]}.experts.{self.held.index(int(e.group(1)))}.{name[e.end() :]}"

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's slice of checkpoint tensor `name`."""
        if self.tp == 1:
            return tensor
        part = name.split(".")[-2]
        if name.endswith(("input_linear.weight", "output_linear.weight")):
            return self._stacked_experts(part, tensor)
        if _EXPERT.search(name) and self.held is not None:
            return tensor  # a whole expert (local_name kept only this rank's)
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

    def _stacked_experts(self, part: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint's experts stacked in one tensor (Granite: input_linear [E, 2I, H],
        gate rows then up; output_linear [E, H, I]): this rank's experts, or its columns."""
        if self.held is not None:
            return tensor[list(self.held)]
        t, tp = self.tp_rank, self.tp
        if part == "output_linear":
            return tensor.chunk(tp, 2)[t]
        gate, up = tensor.chunk(2, 1)
        return torch.cat([gate.chunk(tp, 1)[t], up.chunk(tp, 1)[t]], 1)

    def vocab_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows [r * V/tp, (r + 1) * V/tp) of a [vocab, ...] tensor, zero rows past the end."""
        start = self.tp_rank * self.vocab_rows
        rows = tensor[start : start + self.vocab_rows]
        if len(rows) == self.vocab_rows:
            return rows
        pad = tensor.new_zeros((self.vocab_rows - len(rows), *tensor.shape[1:]))
        return torch.cat([rows, pad])

    def gguf_specs(self, specs: dict[str, tuple]) -> dict[str, tuple]:
        """This rank's part of a GGUF's int4 layers (quantize._gguf_layers' specs, module
        name -> (in, out, terms, format), of the whole model): its stage's layers renumbered,
        each term cut by rows or by whole blocks of columns, the blocks' numbers as stored."""
        cfg, t, tp = self.cfg, self.tp_rank, self.tp
        q, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        heads = kv_heads_of(cfg, tp, t)
        mlp = cfg.intermediate_size // tp
        qkv_rows = [
            range(t * q // tp, (t + 1) * q // tp),
            range(q + heads.start * d, q + heads.stop * d),
            range(q + kv + heads.start * d, q + kv + heads.stop * d),
        ]
        out = {}
        for name, (k, n, terms, fmt) in specs.items():
            rows = cols = pad = None
            if name.startswith("layers."):
                _, i, attr = name.split(".")
                if int(i) not in self.layers:
                    continue
                name = f"layers.{int(i) - self.layers.start}.{attr}"
                if attr == "qkv_proj":
                    rows = qkv_rows
                elif attr == "gate_up_proj":
                    rows = [range(t * mlp, (t + 1) * mlp), range(n // 2 + t * mlp, n // 2 + (t + 1) * mlp)]  # fmt: skip
                else:  # o_proj, down_proj: row-parallel
                    cols = range(t * k // tp, (t + 1) * k // tp)
            else:  # lm_head, embedding: vocabulary rows
                start, pad = t * self.vocab_rows, self.vocab_rows
                rows = [range(start, min(start + self.vocab_rows, n))]
            if tp > 1:
                terms = [cut_term(term, k, n, rows, cols, name, pad) for term in terms]
                n = pad or (n if rows is None else sum(map(len, rows)))
                k = k if cols is None else len(cols)
            out[name] = (k, n, terms, fmt)
        return out

    def model_config(self) -> ModelConfig:
        """The config this rank's model is built from: its heads, columns, vocabulary rows
        and its stage's layers."""
        local = rank_config(self.cfg, self.tp, self.held)
        return dataclasses.replace(local, num_layers=len(self.layers))

    def wire(self, model, ranks) -> None:
        """Sum the row-parallel outputs and the embedding's rows over the stage's ranks."""
        if self.tp == 1:
            return
        for layer in model.model.layers:
            layer.self_attn.reduce = layer.mlp.reduce = ranks.all_reduce
            if self.held is not None and isinstance(layer.mlp, SparseMoE):
                layer.mlp.dispatch = ExpertDispatch(
                    ranks, self.cfg.moe.num_experts, self.layout.expert_placement
                )
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


def cut_term(term, k: int, n: int, rows, cols, name: str, pad_to: int | None = None):
    """An int4 term of a [n, k] weight cut to `rows` (ranges, in order; padded with zero
    rows to `pad_to`) or to the columns `cols` (whole groups): the same integers, scales and
    zeros, repacked."""
    from tandem.model.quant import int4_term, unpack_cpu_q

    q = unpack_cpu_q(term.packed, k)[:n]
    sz = term.scales_zeros.float()[:, :n]  # [k / group, n, 2]
    scale, zero = sz[..., 0].T, sz[..., 1].T  # [n, k / group]
    if rows is not None:
        index = torch.cat([torch.arange(r.start, r.stop) for r in rows])
        q, scale, zero = q[index], scale[index], zero[index]
    if cols is not None:
        g = term.group
        if cols.start % g or len(cols) % g:
            raise ValueError(
                f"quantization: {name}'s GGUF blocks of {g} columns do not split into "
                f"{len(cols)}-column shares; use a tensor_parallel_size whose share divides by {g}"
            )
        q = q[:, cols.start : cols.stop]
        scale, zero = (
            scale[:, cols.start // g : cols.stop // g],
            zero[:, cols.start // g : cols.stop // g],
        )
    if pad_to is not None and len(q) < pad_to:  # the last rank's vocabulary rows: zero weights
        extra = pad_to - len(q)
        q, scale, zero = (
            torch.cat([a, a.new_zeros((extra, a.shape[1]))]) for a in (q, scale, zero)
        )
    return int4_term(q, scale, zero)

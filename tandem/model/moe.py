"""The mixture-of-experts MLP (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE): a router picks each
token's top k experts; the tokens are sorted by expert and each expert multiplies its own
rows in one grouped matmul (torch._grouped_mm, which runs on the CPU), then the weighted
outputs are summed back per token. HF transformers' reference loops over the experts hit.

Where the runner prepacks weights for oneDNN (packed_linear.py), each expert's two matmuls
run on its prepacked weights instead, one call per expert hit over its rows: torch's CPU
grouped matmul multiplies a transposed weight view through MKL (float32) or reorders it each
call (bf16), 2-2.5x slower in float32 and 1.2-1.4x in bf16 at a real layer's shapes
(OLMoE's, Qwen3-30B-A3B's; benchmarks/moe.py on a 2-core Zen 4).

Where expert parallelism spreads the experts over ranks, `dispatch` (distributed/experts.py)
sends each pair (token, expert) to the rank holding the expert and back (all-to-all).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tandem.core.model_config import ModelConfig
from tandem.model.packed_linear import PackedLinear

# A checkpoint's per-expert tensor (once moe_param_name has renamed its block): expert index,
# then gate (w1, gate_proj), up (w3, up_proj) or down (w2, down_proj)
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# checkpoint names -> ours: Mixtral's and Granite's block is `block_sparse_moe`, Granite's
# experts come stacked (input_linear [E, 2I, H]: gate rows, then up; output_linear)
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".mlp.gate.weight", ".mlp.router.weight"),
    (".mlp.router.layer.weight", ".mlp.router.weight"),
    (".mlp.input_linear.weight", ".mlp.w13"),
    (".mlp.output_linear.weight", ".mlp.w2"),
)


def moe_param_name(name: str) -> str:
    """A checkpoint tensor's name as model/llama.py's MoE layers name it."""
    if ".layers." not in name:
        return name
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64), as transformers
    computes them: scores in float32 (softmax, or sigmoid), the top k, renormalized to sum to
    1 where the config says."""
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


def expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs sorted by expert: indexes into ids.flatten(), rows per expert [num_experts])."""
    flat = ids.flatten()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def grouped_experts(
    rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act
) -> torch.Tensor:
    """Each expert's MLP on its rows: rows [P, hidden] sorted by expert, counts [E] rows per
    expert; w13 [E, 2I, hidden] (gate rows, then up), w2 [E, hidden, I]. -> [P, hidden]."""
    if rows.shape[0] == 0:
        return rows.new_zeros(0, w2.shape[1])
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [P, 2I]
    return torch._grouped_mm(act(h), w2.transpose(1, 2), offs=offs)  # [P, hidden]


def packed_experts(rows: torch.Tensor, counts: torch.Tensor, packed, act) -> torch.Tensor:
    """grouped_experts on prepacked weights: packed[e] = (w13, w2) PackedLinears."""
    out = rows.new_empty(rows.shape[0], packed[0][1].out_features) if packed else rows
    start = 0
    for (w13, w2), n in zip(packed, counts.tolist()):
        if n:
            out[start : start + n] = w2(act(w13(rows[start : start + n])))
            start += n
    return out


def fused_experts(x, weights, ids, w13, w2, act, packed=None) -> torch.Tensor:
    """The routed experts' weighted sum for every token: x [T, hidden], weights and ids
    [T, k] (ids index the experts) -> [T, hidden]. packed: the experts prepacked (then w13
    and w2 are not read)."""
    order, counts = expert_order(ids, len(packed) if packed else w13.shape[0])
    tokens = order // ids.shape[1]
    rows = x[tokens]
    if packed:
        out = packed_experts(rows, counts, packed, act)
    else:
        out = grouped_experts(rows, counts, w13, w2, act)
    out = out * weights.flatten()[order, None]
    return x.new_zeros(x.shape).index_add_(0, tokens, out)


class ExpertMLP(nn.Module):
    """One dense SiLU MLP (Qwen2-MoE's shared expert): fused gate/up, down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.shard_sizes = {"gate_up_proj": [intermediate, intermediate]}

    def forward(self, x: torch.Tensor, act) -> torch.Tensor:
        return self.down_proj(act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, act: nn.Module) -> None:
        super().__init__()
        moe = cfg.moe
        self.moe, self.act = moe, act
        h, i = cfg.hidden_size, moe.intermediate_size
        self.held = moe.held_experts()
        self.router = nn.Linear(h, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(len(self.held), 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(len(self.held), h, i))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = ExpertMLP(h, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        # Tokens routed to each expert since the start (summed over layers by the runner, for
        # /metrics): what shows an operator the experts' imbalance.
        self.register_buffer("routed", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)  # fmt: skip
        self.reduce = None  # sums the ranks' partial outputs (tensor parallel), as LlamaMLP's
        self.dispatch = None  # experts on other ranks (distributed/experts.py); None: all here
        self.packed = None  # each expert's (w13, w2) prepacked for oneDNN, once pack_experts ran

    def pack_experts(self) -> None:
        """Prepack each expert's weights for oneDNN (the runner's pack_linears calls this
        where it packs): the stacked tensors are then released."""
        self.packed = [
            (PackedLinear.of_weight(self.w13[e].detach()), PackedLinear.of_weight(self.w2[e].detach()))
            for e in range(len(self.held))
        ]  # fmt: skip
        self.w13.data = self.w13.data.new_empty(0)
        self.w2.data = self.w2.data.new_empty(0)

    def init_tables(self) -> None:
        """Zero the counts, after the loader's `to_empty` (as RotaryEmbedding's tables)."""
        self.routed.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, ids = route(self.router(x), moe.top_k, moe.renormalize, moe.scoring)
        self.routed += torch.bincount(ids.flatten(), minlength=moe.num_experts)
        if self.dispatch is None:
            out = fused_experts(x, weights, ids, self.w13, self.w2, self.act, self.packed)
        else:
            out = self.dispatch(x, weights, ids, self.run_held)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x, self.act)
        return out if self.reduce is None else self.reduce(out)

    def run_held(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This module's experts on rows sorted by them (counts: rows per held expert)."""
        if self.packed:
            return packed_experts(rows, counts, self.packed, self.act)
        return grouped_experts(rows, counts, self.w13, self.w2, self.act)

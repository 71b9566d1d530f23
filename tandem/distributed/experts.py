"""Expert parallelism: a mixture of experts' experts spread whole over the tensor-parallel
ranks (vLLM's --enable-expert-parallel, EP size = TP size), each expert on one rank.

Attention stays tensor-parallel, so after its all-reduce every rank holds every token. Each
rank takes its own contiguous share of the tokens, sends each (token, expert) pair's row to
the rank holding the expert (all-to-all), runs its experts on the rows it receives (one
grouped matmul, model/moe.py), sends the outputs back (all-to-all) and sums them, weighted,
into its share's rows; the layer's all-reduce then gives every rank every row (the shared
expert's split outputs summed by the same all-reduce).
"""

from __future__ import annotations

import torch

from tandem.model.moe import expert_order


def expert_owners(num_experts: int, ranks: int, strategy: str) -> list[int]:
    """The rank holding each expert: linear (rank r holds the r-th contiguous range, the
    first ranks one more where they do not divide) or round_robin (expert e on e mod ranks)."""
    if strategy == "round_robin":
        return [e % ranks for e in range(num_experts)]
    base, extra = divmod(num_experts, ranks)
    return [r for r in range(ranks) for _ in range(base + (r < extra))]


def held_by(num_experts: int, ranks: int, strategy: str, rank: int) -> tuple[int, ...]:
    return tuple(e for e, r in enumerate(expert_owners(num_experts, ranks, strategy)) if r == rank)


class ExpertDispatch:
    """A MoE block's `dispatch` on one rank: (x [T, hidden], weights, ids [T, k], run_held)
    -> [T, hidden], the routed experts' weighted sum on this rank's share of the rows (zero
    elsewhere: the layer's all-reduce adds the other ranks' shares)."""

    def __init__(self, ranks, num_experts: int, strategy: str) -> None:
        self.ranks = ranks
        self.n, self.rank = ranks.layout.tp, ranks.tp_rank
        owners = expert_owners(num_experts, self.n, strategy)
        self.owner = torch.tensor(owners)
        local = [sum(1 for o in owners[:e] if o == owners[e]) for e in range(num_experts)]
        self.local = torch.tensor(local)  # an expert's index among its rank's experts
        self.num_held = owners.count(self.rank)

    def share(self, tokens: int) -> slice:
        return slice(tokens * self.rank // self.n, tokens * (self.rank + 1) // self.n)

    def __call__(self, x, weights, ids, run_held) -> torch.Tensor:
        rows = self.share(x.shape[0])
        mine, k = ids[rows].flatten(), ids.shape[1]
        dest = self.owner[mine]
        order = dest.argsort(stable=True)  # this share's pairs, grouped by the rank to run them
        send = torch.bincount(dest, minlength=self.n)
        recv = self.ranks.all_to_all(send, [1] * self.n, [1] * self.n)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        tokens = order // k
        got_rows = self.ranks.all_to_all(x[rows][tokens], recv_counts, send_counts)
        got_experts = self.ranks.all_to_all(self.local[mine[order]], recv_counts, send_counts)
        by_expert, counts = expert_order(got_experts, self.num_held)
        out = torch.empty_like(got_rows)
        out[by_expert] = run_held(got_rows[by_expert], counts)
        back = self.ranks.all_to_all(out, send_counts, recv_counts)  # in `order`'s order
        back = back * weights[rows].flatten()[order, None]
        result = x.new_zeros(x.shape)
        result[rows].index_add_(0, tokens, back)
        return result

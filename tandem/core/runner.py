"""The Runner protocol: what the engine loop asks of whatever computes a step.

    result = runner.execute(plan)   # plan: the scheduler's ledger of ints

A runner computes exactly the plan it is given and never decides what runs. The model runner
(tandem/runner) does it with a model and KV tensors; a simulated runner advances a virtual
clock by the cost model's step time; tests script one. The loop cannot tell them apart.

A runner that takes part in prefill/decode disaggregation also implements `KVTransferRunner`:
export and import the KV of a token range to and from block ids, in a layout-neutral form
([layers, 2, tokens, kv_heads, head_dim]), so instances that differ in block size or dtype
interoperate. The engine loop passes that object along without looking inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.core.scheduler import SchedulerOutput

# (token ids, logprobs, rank of the sampled token); ids[0] is the sampled token
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass
class RunnerOutput:
    # request id -> its new tokens: one, or with speculative decoding the drafts the model
    # agreed with and one more
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per new token
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, for benchmarks
    # request id -> why it failed, for a runner that fails one request and computes the rest
    # (a prefill instance whose decode side is unreachable); the engine finishes them.
    errors: dict[str, str] = field(default_factory=dict)
    # request id -> tokens a proposer guesses follow its new ones, for the next step to verify
    drafts: dict[str, list[int]] = field(default_factory=dict)


class KVTransferRunner(Protocol):
    def export_kv(self, block_ids: list[int], start: int, end: int): ...

    def import_kv(self, block_ids: list[int], start: int, kv) -> None: ...

    def export_layer(self, block_ids: list[int], layer: int, start: int, end: int): ...

    def import_layer(self, block_ids: list[int], layer: int, start: int, k, v) -> None: ...


class Runner(Protocol):
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Compute the plan's tokens, sample the rows that reach their last known token, and
        drop any per-request state of `plan.finished_ids`. An empty plan is valid: it only
        releases state."""
        ...


class RankFailed(RuntimeError):
    """A rank of a distributed runner died, stopped answering, or left the ranks out of step:
    no later step can run. The engine does not retry it; the engine core exits with it."""

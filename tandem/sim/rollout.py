"""RL rollouts on one simulated instance: synchronous against partial rollouts (APRIL's).

An RL step needs `batch` finished rollouts, then the engine idles for `update_s` while the
trainer trains and pushes weights. Output lengths have a long tail (lognormal, capped), so
in synchronous rollout a step waits for its longest rollout while the batch thins out to a
few rows, each step costing nearly what a full one does. Partial rollout keeps more in
flight (batch * (1 + over)), ends the step once `batch` have finished, and holds the rest
across the update with their KV (pause "keep") to finish in a later step, under newer
weights: the batch stays full. The real EngineCore and scheduler run on a virtual clock
with the roofline cost model of the hardware and model; the figure is finished rollout
tokens per second.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from tandem.core.clock import FakeClock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.engine.core import EngineCore
from tandem.engine.messages import EngineCoreRequest
from tandem.sim.runner import SIM_TOKEN, SimulatedRunner
from tandem.sim.specs import HARDWARE, MODELS, ModelSpec, kv_capacity_tokens, roofline_cost_model


@dataclass(frozen=True)
class RolloutSpec:
    model: str = "llama-3-8b"
    hardware: str = "H100"
    batch: int = 256  # finished rollouts an RL step trains on
    steps: int = 10
    prompt_len: int = 512
    median_output: int = 600  # the lognormal output lengths' median
    sigma: float = 1.0  # ... and spread: the long tail
    max_output: int = 8192
    update_s: float = 20.0  # the trainer's step and the weight push: the engine idles
    over: float = 0.5  # partial: in flight beyond the batch, as a share of it
    max_num_seqs: int = 512
    seed: int = 0


@dataclass
class RolloutResult:
    mode: str
    seconds: float  # virtual
    tokens: int  # output tokens of the rollouts the trainer got
    rollouts: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _engine(spec: RolloutSpec) -> tuple[EngineCore, FakeClock]:
    model = ModelSpec.from_config(spec.model, MODELS[spec.model])
    hw = HARDWARE[spec.hardware]
    cost = roofline_cost_model(hw, model)
    block = 16
    kv = KVCacheManager(1 + kv_capacity_tokens(hw, model, 1) // block, block, False)
    clock = FakeClock()
    config = SchedulerConfig(spec.max_num_seqs, 8192, spec.prompt_len + spec.max_output + 1)
    scheduler = Scheduler(config, kv, clock, cost_model=cost)
    return EngineCore(scheduler, SimulatedRunner(cost, clock), clock, (SIM_TOKEN + 1,)), clock


def _lengths(spec: RolloutSpec):
    rng = random.Random(spec.seed)
    mu = math.log(spec.median_output)
    while True:
        yield max(1, min(spec.max_output, int(rng.lognormvariate(mu, spec.sigma))))


def simulate(spec: RolloutSpec, mode: str) -> RolloutResult:
    """mode: "sync" or "partial"."""
    core, clock = _engine(spec)
    lengths, ids = _lengths(spec), itertools.count()
    wanted = {}  # request id -> its output length
    in_flight = spec.batch if mode == "sync" else int(spec.batch * (1 + spec.over))
    tokens = rollouts = 0
    for _ in range(spec.steps):
        for _ in range(in_flight - len(wanted)):  # top up (sync: the whole batch, afresh)
            rid, n = f"r{next(ids)}", next(lengths)
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            core.add_request(EngineCoreRequest(rid, [SIM_TOKEN] * spec.prompt_len, params, clock()))  # fmt: skip
            wanted[rid] = n
        finished = 0
        while finished < spec.batch:
            for out in core.step():
                if out.finish_reason is not None:
                    tokens += wanted.pop(out.request_id)
                    finished += 1
        rollouts += finished
        clock.advance(spec.update_s)  # paused ("keep": the unfinished hold their KV)
    return RolloutResult(mode, clock(), tokens, rollouts)


def compare(spec: RolloutSpec) -> tuple[RolloutResult, RolloutResult]:
    return simulate(spec, "sync"), simulate(spec, "partial")

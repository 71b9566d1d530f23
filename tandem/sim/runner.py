"""SimulatedRunner: the Runner the simulator gives each instance's EngineCore. A step takes
what the cost model predicts for its plan, on the instance's virtual clock; every row that
samples gets one token. The engine loop cannot tell it from the model runner.

With `noise` (a profile's spread of single runs, CostModel.noise), each step's time is the
prediction times one of those ratios over their mean, drawn by a generator seeded per
instance: real steps stray from their shape's typical time, and near saturation queueing is
made of the slow ones, while on average they take the prediction. Same seed, same draws:
still deterministic.

`step_seconds` and `token_seconds` are what each step and each sampled token cost the
instance's host outside the runner (the engine loop's schedule, update and messages; a front
end on the same cores receiving each step's outputs, detokenizing and streaming them): the
cost model times the runner alone, and on a CPU server this work takes the same cores, so
every step ends that much later, and one with more rows that sample later still.
`request_seconds` is what each request costs the host once (receiving it over HTTP,
tokenizing its prompt): charged to the first step that schedules it, it delays that step and
every request waiting behind it; under load these land while other requests' steps run.
`scale` stretches the cost model's time itself: an instance whose steps run slower than its
profile's (a prefill server exporting and sending KV from inside its steps)."""

from __future__ import annotations

import random

from tandem.core.clock import FakeClock
from tandem.core.runner import RunnerOutput
from tandem.core.scheduler import SchedulerOutput

SIM_TOKEN = 1  # what simulated requests "generate"; they run with ignore_eos to their length


class SimulatedRunner:
    def __init__(
        self,
        cost_model,
        clock: FakeClock,
        noise: tuple[float, ...] = (),
        seed: int = 0,
        token_seconds: float = 0.0,
        step_seconds: float = 0.0,
        scale: float = 1.0,
        request_seconds: float = 0.0,
    ) -> None:
        self.cost_model, self.clock = cost_model, clock
        # centred on their mean: the profile's time is its runs' median, and a right tail (a
        # slow run now and then) puts their mean above it; served steps summed to 0.96-1.00x
        # the median predictions, so draws spread about the prediction without raising it
        mean = sum(noise) / len(noise) if noise else 1.0
        self.noise, self._rng = tuple(r / mean for r in noise), random.Random(seed)
        self.token_seconds, self.step_seconds = token_seconds, step_seconds
        self.scale, self.request_seconds = scale, request_seconds
        self._seen: set[str] = set()  # requests whose arrival the host has paid for
        self.busy_seconds = 0.0  # virtual seconds spent computing, for utilisation

    # KV tiers (sim/tiers.py time the loads): no bytes to move
    def export_blocks(self, block_ids: list[int]) -> list[None]:
        return [None] * len(block_ids)

    def import_blocks(self, block_ids: list[int], payloads) -> None:
        pass

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self._seen.difference_update(plan.finished_ids)  # an empty plan may end requests too
        if plan.is_empty:
            return RunnerOutput()
        seconds = self.cost_model.predict(plan.shape) * self.scale
        if self.noise:
            seconds *= self.noise[int(self._rng.random() * len(self.noise))]
        sampled = {s.request.request_id: [SIM_TOKEN] for s in plan.scheduled if s.sample}
        seconds += self.step_seconds + self.token_seconds * len(sampled)
        if self.request_seconds:
            arrived = {s.request.request_id for s in plan.scheduled} - self._seen
            self._seen |= arrived
            seconds += self.request_seconds * len(arrived)
        self.clock.advance(seconds)
        self.busy_seconds += seconds
        return RunnerOutput(sampled=sampled)

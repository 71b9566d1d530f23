"""A Runner for the real engine loop with no model: each request "samples" the next token of
its script, and each step advances a fake clock by a scripted step time. No torch."""

from __future__ import annotations

from collections.abc import Callable

from tandem.core.clock import FakeClock
from tandem.core.runner import RunnerOutput
from tandem.core.scheduler import SchedulerOutput


class ScriptedRunner:
    def __init__(
        self,
        clock: FakeClock,
        scripts: dict[str, list[int]],
        step_seconds: Callable[[SchedulerOutput], float] = lambda plan: 0.0,
    ) -> None:
        self.clock, self.scripts, self.step_seconds = clock, scripts, step_seconds
        self.poison: set[str] = set()  # requests that make execute() raise, as a bug would
        self.state: set[str] = set()  # per-request state, as a seeded sampler keeps
        self.released: list[str] = []
        self.plans: list[list[tuple[str, int, int, bool]]] = []

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        for rid in plan.finished_ids:
            self.state.discard(rid)
            self.released.append(rid)
        self.plans.append(
            [(s.request.request_id, s.start, s.num_new_tokens, s.sample) for s in plan.scheduled]
        )
        if self.poison & {s.request.request_id for s in plan.scheduled}:
            raise RuntimeError("index out of range (poisoned input)")
        self.clock.advance(self.step_seconds(plan))
        sampled = {}
        for s in plan.scheduled:
            rid = s.request.request_id
            self.state.add(rid)
            if s.sample:
                sampled[rid] = [self.scripts[rid][s.request.num_output_tokens]]
        return RunnerOutput(sampled)

"""SimulatedRunner: the Runner the simulator gives each instance's EngineCore. A step takes
what the cost model predicts for its plan, on the instance's virtual clock; every row that
samples gets one token. The engine loop cannot tell it from the model runner."""

from __future__ import annotations

from tandem.core.clock import FakeClock
from tandem.core.runner import RunnerOutput
from tandem.core.scheduler import SchedulerOutput

SIM_TOKEN = 1  # what simulated requests "generate"; they run with ignore_eos to their length


class SimulatedRunner:
    def __init__(self, cost_model, clock: FakeClock) -> None:
        self.cost_model, self.clock = cost_model, clock
        self.busy_seconds = 0.0  # virtual seconds spent computing, for utilisation

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if plan.is_empty:
            return RunnerOutput()
        seconds = self.cost_model.predict(plan.shape)
        self.clock.advance(seconds)
        self.busy_seconds += seconds
        return RunnerOutput(
            sampled={s.request.request_id: [SIM_TOKEN] for s in plan.scheduled if s.sample}
        )

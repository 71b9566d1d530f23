"""An autoscaled fleet in the simulator: the router's own `AutoscalePolicy` (router/
autoscale.py) adds and removes instances of a colocated group as the load moves, so a
policy is judged on an hour of simulated traffic against a static fleet before it touches
real workers.

Every `interval` simulated seconds the policy sees what the router would (serving instances,
those starting, requests queued and running, the fullest KV cache) and its decision is
carried out as `tandem router --autoscale` does: a new instance serves `start_seconds` after
it is asked for (a cold start: process, weights, warm-up), a removed one (the least loaded)
takes no new requests and stops once its own have finished. Instance-seconds count from the
ask to the stop: what the fleet is billed.
"""

from __future__ import annotations

import gc

from tandem.router.autoscale import AutoscaleConfig, AutoscalePolicy, FleetSignals
from tandem.sim.cluster import ClusterSpec
from tandem.sim.simulator import Instance, Record, Simulation, check_drained, in_flight
from tandem.sim.workload import SimRequest


class ElasticSimulation(Simulation):
    def __init__(self, cluster: ClusterSpec, requests: list[SimRequest], config: AutoscaleConfig,
                 start_seconds: float = 60.0, interval: float = 1.0) -> None:  # fmt: skip
        if len(cluster.groups) != 1 or cluster.groups[0].role != "both":
            raise ValueError("an autoscaled cluster has one colocated group")
        super().__init__(cluster, requests, 1)
        self.policy_config = config
        self.autoscale = AutoscalePolicy(config)
        self.start_seconds, self.interval = start_seconds, interval
        self.group = cluster.groups[0]
        self.ready_at: dict[str, float] = {}  # instance -> when it serves
        self.asked_at: dict[str, float] = {}  # instance -> when it was asked for (billed from)
        self.stopped_at: dict[str, float] = {}
        self.draining: set[str] = set()
        self.actions: list[tuple[float, int, str]] = []  # (when, desired, reason)
        for inst in self.instances:  # the group's count: the fleet at the start
            self.ready_at[inst.name] = self.asked_at[inst.name] = 0.0

    # ---- the fleet ------------------------------------------------------------------------------
    def serving(self, now: float) -> list[Instance]:
        return [i for i in self.instances if i.name not in self.stopped_at
                and i.name not in self.draining and self.ready_at[i.name] <= now]  # fmt: skip

    def _new_instance(self, now: float) -> None:
        inst = Instance(f"{self.group.name}-{len(self.instances)}", self.group, self.cluster)
        inst.index = len(self.instances)
        inst.clock.now = now + self.start_seconds
        self.instances.append(inst)
        self._versions.append(0)
        self.by_name[inst.name] = inst
        self.asked_at[inst.name], self.ready_at[inst.name] = now, now + self.start_seconds

    def _tick(self, now: float) -> None:
        for name in list(self.draining):
            inst = self.by_name[name]
            if not inst.core.has_unfinished():
                self.draining.discard(name)
                self.stopped_at[name] = max(now, inst.clock())
        serving = [i.observe() for i in self.serving(now)]
        starting = sum(1 for i in self.instances if i.name not in self.stopped_at and self.ready_at[i.name] > now)  # fmt: skip
        signals = FleetSignals(
            serving=len(serving), starting=starting,
            queued=sum(s.waiting for s in serving), load=sum(s.running + s.waiting for s in serving),
            max_kv_usage=max((s.kv_usage for s in serving), default=0.0),
        )  # fmt: skip
        decision = self.autoscale.decide(now, signals)
        fleet = signals.serving + starting
        if decision.desired > fleet:
            for _ in range(decision.desired - fleet):
                self._new_instance(now)
            self.actions.append((now, decision.desired, decision.reason))
        elif decision.desired < fleet and serving:
            victim = min(self.serving(now), key=lambda i: i.observe().load)
            self.draining.add(victim.name)
            self.actions.append((now, decision.desired, decision.reason))

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> list[Record]:
        collecting = gc.isenabled()
        gc.disable()
        try:
            tick = 0.0
            for n, req in enumerate(self.requests):
                while tick <= req.arrival:
                    self.advance(tick)
                    self._tick(tick)
                    tick += self.interval
                self.advance(req.arrival)
                rid = f"r{n}"
                target = self._route(self.policy, self.serving(req.arrival) or self._any(), req)
                self.records[rid] = Record(req, target.name)
                self._add(target, in_flight(req), rid, max(req.arrival, self.ready_at[target.name]))  # fmt: skip
            while any(i.core.has_unfinished() for i in self.instances) or self.draining:
                self.advance(tick)
                self._tick(tick)
                tick += self.interval
            check_drained(self.instances)
            self.end = tick
        finally:
            if collecting:
                gc.enable()
        return [self.records[f"r{n}"] for n in range(len(self.requests))]

    def _any(self) -> list[Instance]:
        """No instance serving yet (all starting): the first to come up takes it, queued."""
        live = [i for i in self.instances if i.name not in self.stopped_at and i.name not in self.draining]  # fmt: skip
        return [min(live, key=lambda i: self.ready_at[i.name])]

    def instance_seconds(self, until: float) -> float:
        """Instance-seconds billed up to `until` (an instance still up counts to it)."""
        return sum(self.stopped_at.get(i.name, until) - self.asked_at[i.name] for i in self.instances)  # fmt: skip

    def peak_instances(self) -> int:
        events = sorted([(t, 1) for t in self.asked_at.values()] + [(t, -1) for t in self.stopped_at.values()])  # fmt: skip
        up = peak = 0
        for _, d in events:
            up += d
            peak = max(peak, up)
        return peak

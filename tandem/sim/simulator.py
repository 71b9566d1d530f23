"""The simulator: the real `EngineCore`, scheduler, block allocator, radix cache and policies
of every instance, each on its own virtual clock with a `SimulatedRunner`, and the real
router policy in front of them.

Each instance's clock is when it is next free. The loop takes whichever comes first, the next
arrival or the earliest step of an instance with work: an arrival is routed (the policy sees
each instance's running and waiting counts and KV usage, as the router reads them from
/metrics) and added, raising an idle instance's clock to the arrival; a step runs through
`EngineCore.step()` and its tokens are stamped with the instance's clock after it. A request
that arrives during a step waits for the next, as in the real engine. Deterministic: no wall
clock, no threads, seeded workloads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tandem.core.clock import FakeClock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.engine.builder import build_batch_policy
from tandem.engine.core import EngineCore
from tandem.engine.messages import EngineCoreRequest
from tandem.router.policy import RouteRequest, WorkerState, build_policy
from tandem.sim.cluster import ClusterSpec, GroupSpec
from tandem.sim.runner import SimulatedRunner
from tandem.sim.workload import SimRequest

DEFAULT_ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16}
MAX_MODEL_LEN = 131072


@dataclass
class Record:
    """What a client would have seen of one request."""

    request: SimRequest
    instance: str = ""
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    error: str = ""


class Instance:
    def __init__(self, name: str, group: GroupSpec, cluster: ClusterSpec) -> None:
        settings = DEFAULT_ENGINE | cluster.engine
        self.name, self.group = name, group
        self.clock = FakeClock()
        block_size = settings["block_size"]
        kv = KVCacheManager(1 + group.kv_tokens // block_size, block_size)
        config = SchedulerConfig(
            settings["max_num_seqs"], settings["max_num_batched_tokens"], MAX_MODEL_LEN
        )
        cost = group.cost_model
        scheduler = Scheduler(
            config, kv, self.clock, build_batch_policy(cluster.scheduling_policy, cost), cost
        )
        self.runner = SimulatedRunner(cost, self.clock)
        self.core = EngineCore(scheduler, self.runner, self.clock)
        self.state = WorkerState(name, name)

    @property
    def has_work(self) -> bool:
        return self.core.has_unfinished() and not self.core.stalled

    def observe(self) -> WorkerState:
        s = self.core.scheduler
        self.state.running, self.state.waiting = s.num_running, s.num_waiting
        self.state.kv_usage = s.kv.usage
        return self.state


class Simulation:
    def __init__(self, cluster: ClusterSpec, requests: list[SimRequest]) -> None:
        self.cluster = cluster
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.instances = [
            Instance(f"{g.name}-{i}", g, cluster) for g in cluster.groups for i in range(g.count)
        ]
        self.policy = build_policy(cluster.router, cluster.groups[0].cost_model)
        self.records: dict[str, Record] = {}
        self.num_steps = 0

    def run(self) -> list[Record]:
        arrivals = list(reversed(self.requests))
        ids = itertools.count()
        while True:
            ready = [(i.clock(), n, i) for n, i in enumerate(self.instances) if i.has_work]
            step = min(ready, key=lambda x: (x[0], x[1])) if ready else None
            if arrivals and (step is None or arrivals[-1].arrival <= step[0]):
                self._arrive(arrivals.pop(), f"r{next(ids)}")
            elif step is not None:
                self._step(step[2])
            else:
                break
        stuck = [i.name for i in self.instances if i.core.has_unfinished()]
        if stuck:  # only a request larger than an instance's pool could do this
            raise RuntimeError(f"instances {stuck} hold requests they can never run")
        return [self.records[f"r{n}"] for n in range(len(self.requests))]

    def _arrive(self, req: SimRequest, rid: str) -> None:
        route = RouteRequest(" ".join(map(str, req.prompt)))
        workers = [i.observe() for i in self.instances]
        target = self.policy.rank(workers, route)[0]
        self.policy.routed(target, route)
        inst = next(i for i in self.instances if i.state is target)
        record = self.records[rid] = Record(req, inst.name)
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        if not inst.core.has_unfinished():  # idle until now
            inst.clock.now = max(inst.clock.now, req.arrival)
        try:
            inst.core.add_request(EngineCoreRequest(rid, list(req.prompt), params, req.arrival))
        except ValueError as e:  # refused as the engine refuses it (too long for the pool)
            record.error = str(e)

    def _step(self, inst: Instance) -> None:
        self.num_steps += 1
        for out in inst.core.step():
            record = self.records[out.request_id]
            now = inst.clock()
            if out.new_token_ids:
                if record.first_token is None:
                    record.first_token = now
                record.token_times += [now] * len(out.new_token_ids)
            if out.finish_reason is not None:
                record.finished = now
                record.error = out.error or ""

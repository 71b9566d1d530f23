"""The simulator: the real `EngineCore`, scheduler, block allocator, radix cache and policies
of every instance, each on its own virtual clock with a `SimulatedRunner`, and the real
router policy in front of them.

Each instance's clock is when it is next free. The loop takes whichever comes first, the next
arrival or the earliest step of an instance with work: an arrival is routed (the policy sees
each instance's running and waiting counts and KV usage, as the router reads them from
/metrics) and added, raising an idle instance's clock to the arrival; a step runs through
`EngineCore.step()` and its tokens are stamped with the instance's clock after it. A request
that arrives during a step waits for the next, as in the real engine. Deterministic: no wall
clock, no threads, seeded workloads. A colocated cluster runs the same steps in the same
order per instance through `shards.py` (`advance` up to each arrival), on a process per core.

Disaggregated clusters run the proxy's three-stage handoff on the same objects: a decode
instance reserves (`EngineCore.reserve`: its radix cache says how much of the prompt it
holds; no room, and the request waits at the proxy until a step there frees some) between
its steps, as its engine core reads messages (one arriving mid-step waits for it), a prefill
instance computes the prompt with `kv_transfer` (max_tokens 1), and the missing KV crosses
the link layer by layer, overlapped with the prefill step: it has all arrived at
max(step end + one layer's transfer, step start + the whole transfer) + latency, when the
decode instance commits (`EngineCore.commit`) and the client sees the first token. Each
record keeps when it was reserved and prefilled: the report's handoff stages.

A group's `latency_s` (HTTP, tokenization, a proxy's hops: what a request spends outside the
engine's steps) is added to every time its clients see; its steps stray from the cost model's
time as its profile's runs did (SimulatedRunner's noise) unless the group turns that off.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import heapq
import itertools
import zlib
from array import array
from dataclasses import dataclass, field

from tandem.core.clock import FakeClock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.core.slo import SLOClass
from tandem.engine.builder import build_batch_policy
from tandem.engine.core import EngineCore
from tandem.engine.messages import EngineCoreRequest, KVTransferParams
from tandem.router.policy import RouteRequest, WorkerState, build_policy
from tandem.sim.cluster import ClusterSpec, GroupSpec
from tandem.sim.runner import SimulatedRunner
from tandem.sim.tiers import SimKVTiers, SimTier, TierSpec
from tandem.sim.workload import SimRequest

DEFAULT_ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16}
MAX_MODEL_LEN = 131072


@dataclass
class Record:
    """What a client would have seen of one request."""

    request: SimRequest
    instance: str = ""
    first_token: float | None = None
    token_times: array = field(default_factory=lambda: array("d"))  # an hour: tens of millions
    finished: float | None = None
    error: str = ""
    prefill_instance: str = ""  # disaggregated: where its prompt was computed
    kv_bytes: int = 0  # disaggregated: prompt KV sent to its decode instance
    reserved: float | None = None  # disaggregated: its decode instance reserved room
    prefilled: float | None = None  # disaggregated: its prefill step ended, its KV sent

    def observe(self, out, now: float) -> None:
        """An output of its engine (EngineCoreOutput), seen at `now`."""
        if out.new_token_ids:
            if self.first_token is None:
                self.first_token = now
            if len(out.new_token_ids) == 1:
                self.token_times.append(now)
            else:
                self.token_times.extend([now] * len(out.new_token_ids))
        if out.finish_reason is not None:
            self.finished = now
            self.error = out.error or ""


class Instance:
    def __init__(self, name: str, group: GroupSpec, cluster: ClusterSpec, shared_tier=None) -> None:
        settings = DEFAULT_ENGINE | cluster.engine
        self.name, self.group = name, group
        self.role = group.role  # prefill | decode | both; sim/roles.py moves it between pools
        self.clock = FakeClock()
        block_size = settings["block_size"]
        self.tiers = _kv_tiers(group, block_size, self.clock, settings, cluster, shared_tier)
        hasher = self.tiers.hasher if self.tiers else None
        kv = KVCacheManager(
            1 + group.kv_tokens // block_size, block_size, group.prefix_caching, hasher=hasher
        )
        config = SchedulerConfig(
            settings["max_num_seqs"], settings["max_num_batched_tokens"], MAX_MODEL_LEN
        )
        cost = group.cost_model
        policy = build_batch_policy(cluster.scheduling_policy, cost)
        scheduler = Scheduler(config, kv, self.clock, policy, cost, kv_source=self.tiers)
        noise = cost.noise if group.step_noise else ()
        self.runner = SimulatedRunner(cost, self.clock, noise, zlib.crc32(name.encode()),
                                      group.token_s, group.step_s, group.step_scale,
                                      group.request_s)  # fmt: skip
        self.core = EngineCore(scheduler, self.runner, self.clock, kv_tiers=self.tiers)
        self.state = WorkerState(name, name)
        self.backlog: list[tuple[SimRequest, str]] = []  # decode: waiting for room to reserve
        self.index = 0  # its place in the simulation's list (the ready heap's tie-break)
        self.remote = False  # stepped by another process (shards.py): `state` is its report

    @property
    def has_work(self) -> bool:
        return self.core.has_unfinished() and not self.core.stalled

    def observe(self) -> WorkerState:
        if self.remote:
            return self.state
        s = self.core.scheduler
        self.state.running, self.state.waiting = s.num_running, s.num_waiting
        self.state.kv_usage = s.kv.usage
        return self.state


def _kv_tiers(group: GroupSpec, block_size: int, clock, settings, cluster, shared):
    """The instance's KV tiers: its own host tier, then the cluster's shared one."""
    tiers = []
    if group.kv_offload_tokens and group.prefix_caching:
        spec = TierSpec("host", group.kv_offload_tokens, group.kv_offload_gbs)
        tiers.append(SimTier(spec, block_size, cluster.model.kv_bytes_per_token()))
    if shared is not None and group.prefix_caching:
        tiers.append(shared)
    if not tiers:
        return None
    min_tokens = settings.get("kv_offload_min_tokens", 256)
    return SimKVTiers(tiers, block_size, clock, min_tokens)


class Simulation:
    def __init__(
        self, cluster: ClusterSpec, requests: list[SimRequest], processes: int = 1
    ) -> None:
        self.cluster = cluster
        # A colocated cluster's instances may step in parallel, unless a shared KV tier
        # makes them meet at every load and store.
        self.processes = processes if cluster.kv_remote is None else 1
        self.requests = sorted(requests, key=lambda r: r.arrival)
        shared = None
        if cluster.kv_remote is not None:
            block_size = (DEFAULT_ENGINE | cluster.engine)["block_size"]
            shared = SimTier(cluster.kv_remote, block_size, cluster.model.kv_bytes_per_token())
        self.shared_tier = shared
        self.instances = [
            Instance(f"{g.name}-{i}", g, cluster, shared)
            for g in cluster.groups
            for i in range(g.count)
        ]
        self.front = [i for i in self.instances if i.role != "prefill"]  # clients see
        self.prefill = [i for i in self.instances if i.role == "prefill"]
        self.by_name = {i.name: i for i in self.instances}
        self.policy = build_policy(cluster.router, cluster.groups[0].cost_model)
        self.prefill_policy = build_policy(
            cluster.prefill_router, self.prefill[0].group.cost_model if self.prefill else None
        )
        self.kv_bytes_per_token = cluster.model.kv_bytes_per_token()
        self.records: dict[str, Record] = {}
        self.num_steps = 0
        self._events: list[tuple[float, int, str, tuple]] = []  # (time, seq, kind, payload)
        self._seq = itertools.count()
        # Instances with a step to run, as (clock, index, version): an instance is re-entered
        # whenever something changes it (`_touch`), and only its latest entry counts.
        self._ready: list[tuple[float, int, int]] = []
        self._versions = [0] * len(self.instances)
        for n, inst in enumerate(self.instances):
            inst.index = n

    def run(self) -> list[Record]:
        # An hour of traffic keeps millions of objects alive and makes a few hundred reference
        # cycles a minute: the collector's full passes, rescanning every live object, took
        # ~20% of such a run. The collector resumes when the run ends.
        collecting = gc.isenabled()
        gc.disable()
        try:
            if self.prefill:
                self._run_events()
            else:  # instances meet only at the router: see shards.py
                from tandem.sim.shards import run_colocated

                run_colocated(self, self.processes)
        finally:
            if collecting:
                gc.enable()
        return [self.records[f"r{n}"] for n in range(len(self.requests))]

    def _run_events(self) -> None:
        for n, req in enumerate(self.requests):
            self._push(req.arrival, "arrive", (req, f"r{n}"))
        ready = self._ready
        while True:
            self._drop_superseded()
            if self._events and (not ready or self._events[0][0] <= ready[0][0]):
                when, _, kind, payload = heapq.heappop(self._events)
                if kind == "arrive":
                    self._arrive(*payload)
                elif kind == "reserve":
                    self._queue_reserve(when, *payload)
                elif kind == "tick":  # a policy's look at the cluster (sim/roles.py)
                    self._tick(when)
                else:
                    self._commit(when, *payload)
            elif ready:
                self._step(self.instances[heapq.heappop(ready)[1]])
            else:
                break
        check_drained(self.instances)

    def _drop_superseded(self) -> None:
        ready = self._ready
        while ready and ready[0][2] != self._versions[ready[0][1]]:
            heapq.heappop(ready)

    def advance(self, until: float) -> None:
        """Run every step that starts before `until`, earliest first (a request arriving at
        `until` sees the instances after them, as in the event loop)."""
        ready = self._ready
        while True:
            self._drop_superseded()
            if not ready or ready[0][0] >= until:
                return
            self._step(self.instances[heapq.heappop(ready)[1]])

    def _touch(self, inst: Instance) -> None:
        n = inst.index
        self._versions[n] += 1
        if inst.has_work:
            heapq.heappush(self._ready, (inst.clock(), n, self._versions[n]))

    def _push(self, when: float, kind: str, payload: tuple) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload))

    def _route(self, policy, instances: list[Instance], req: SimRequest) -> Instance:
        # the prompt as text only for a policy that reads it (drawing it costs ~0.1 ms)
        route = RouteRequest(" ".join(map(str, req.prompt)) if policy.reads_text else "")
        target = policy.rank([i.observe() for i in instances], route)[0]
        policy.routed(target, route)
        return next(i for i in instances if i.state is target)

    def route_arrival(self, req: SimRequest, rid: str) -> Instance:
        """Where the request goes; its record starts here (with the lazy prompt: the report
        needs only its length)."""
        inst = self._route(self.policy, self.front, req)
        self.records[rid] = Record(req, inst.name)
        return inst

    def add_arrival(self, inst: Instance, req: SimRequest, rid: str) -> None:
        self._add(inst, in_flight(req), rid, req.arrival)

    def _arrive(self, req: SimRequest, rid: str) -> None:
        inst = self.route_arrival(req, rid)
        req = in_flight(req)
        # its engine core reads the request between steps: mid-step, when that step ends
        self._push(max(inst.clock(), req.arrival), "reserve", (inst, req, rid))

    def _queue_reserve(self, now: float, inst: Instance, req: SimRequest, rid: str) -> None:
        if inst.backlog or not self._reserve(inst, req, rid, now):  # in order
            inst.backlog.append((req, rid))

    def _add(self, inst: Instance, req: SimRequest, rid: str, now: float, kv_transfer=None):
        if not inst.core.has_unfinished():  # idle until now
            inst.clock.now = max(inst.clock.now, now)
        try:
            inst.core.add_request(core_request(req, rid, kv_transfer))
        except ValueError as e:  # refused as the engine refuses it (too long for the pool)
            self.records[rid].error = str(e)
        self._touch(inst)

    def _reserve(self, decode: Instance, req: SimRequest, rid: str, now: float) -> bool:
        """Stages 1 and 2 of the handoff; False: no room on the decode instance yet."""
        try:
            held = decode.core.reserve(core_request(req, rid))
        except ValueError as e:
            self.records[rid].error = str(e)
            return True
        self._touch(decode)
        if held is None:
            return False
        prefill = self._route(self.prefill_policy, self.prefill, req)
        record = self.records[rid]
        record.prefill_instance, record.reserved = prefill.name, now
        record.kv_bytes = (len(req.prompt) - held) * self.kv_bytes_per_token
        self._add(prefill, req, rid, now, KVTransferParams(decode.name, rid, held))
        return True

    def _step(self, inst: Instance) -> None:
        self.num_steps += 1
        start = inst.clock()
        outputs = inst.core.step()
        now = inst.clock()
        seen = now + inst.group.latency_s
        records = self.records
        for out in outputs:
            record = records[out.request_id]
            if record.instance == inst.name:  # its client's request (colocated or decode)
                record.observe(out, seen)
            elif out.new_token_ids:  # a prompt computed for a decode instance: its KV crosses
                record.prefilled = now
                self._prefilled(inst, record)
                self._push(self._kv_arrival(inst, out.request_id, start, now), "commit",
                           (out.request_id, out.new_token_ids[0]))  # fmt: skip
            elif out.finish_reason is not None:
                record.error = out.error or "prefill failed"
                self._prefilled(inst, record)  # done with it, if not well
        while inst.backlog and self._reserve(inst, *inst.backlog[0], now):
            inst.backlog.pop(0)
        self._touch(inst)

    def _prefilled(self, prefill: Instance, record: Record) -> None:
        """A prompt's prefill is done (sim/roles.py counts what each instance has queued)."""

    def _tick(self, now: float) -> None:
        """A policy's periodic look at the cluster, where a subclass pushes "tick" events
        (sim/roles.py)."""

    def _kv_arrival(self, prefill: Instance, rid: str, start: float, end: float) -> float:
        record = self.records[rid]
        decode = self.by_name[record.instance]
        link = self.cluster.links.get((prefill.group.name, decode.group.name))
        if link is None:  # an instance that changed role (sim/roles.py): the cluster's link
            link = next(iter(self.cluster.links.values()))
        whole = link.transfer_seconds(record.kv_bytes)
        last_layer = whole / self.cluster.model.num_layers
        return max(end + last_layer, start + whole) + link.latency_s

    def _commit(self, when: float, rid: str, first_token: int) -> None:
        decode = self.by_name[self.records[rid].instance]
        if not decode.core.has_unfinished() or decode.core.stalled:  # idle until the KV came
            decode.clock.now = max(decode.clock.now, when)
        seen = max(when, decode.clock()) + decode.group.latency_s
        for out in decode.core.commit(rid, first_token):
            self.records[out.request_id].observe(out, seen)
        self._touch(decode)


def in_flight(req: SimRequest) -> SimRequest:
    """The request with its prompt's ids drawn (made once, while it is in flight)."""
    if isinstance(req.prompt, (tuple, list)):
        return req
    return dataclasses.replace(req, prompt=tuple(req.prompt))


def check_drained(instances: list[Instance]) -> None:
    stuck = [i.name for i in instances if i.core.has_unfinished() or i.backlog]
    if stuck:  # only a request larger than an instance's pool could do this
        raise RuntimeError(f"instances {stuck} hold requests they can never run")


def core_request(req: SimRequest, rid: str, kv_transfer=None) -> EngineCoreRequest:
    """What the front end would send for it: its prompt, run to its output length, with
    its class's priority and SLO targets."""
    ttft, tpot = req.slo.get("ttft"), req.slo.get("tpot")
    params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0,
                            ttft_ms=ttft, tpot_ms=tpot)  # fmt: skip
    priority = 0 if req.priority is None else req.priority
    slo = _slo_class(req.cls, priority, ttft, tpot)
    return EngineCoreRequest(rid, list(req.prompt), params, req.arrival, priority, slo,
                             kv_transfer)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _slo_class(name: str, priority: int, ttft_ms, tpot_ms) -> SLOClass:
    return SLOClass(name, priority, ttft_ms, tpot_ms)

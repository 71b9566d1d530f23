"""A disaggregated cluster whose prefill/decode ratio follows the load: the router's own
`PDRatioPolicy` (router/pd_ratio.py) moves instances between the pools as `tandem router
--pd-ratio auto` does, so the policy is judged on simulated traffic against every static
ratio before it touches real workers.

Every `interval` simulated seconds the policy sees what the router would: per pool its
instances, the prompt tokens queued on the prefill instances (sent, no first token yet: the
router's `pending_prefill_tokens`) and sent in the last minute, and the decode instances' running rows, KV tokens and
fullest KV cache, each priced by the cluster's cost model. A move is a worker's `/role`
flip: the instance leaves its pool at once (no new requests of its old role), takes the other
role's requests from then on, and finishes what it holds beside them; its radix cache stays.
"""

from __future__ import annotations

from tandem.router.pd_ratio import (
    PDRatioConfig,
    PDRatioPolicy,
    PoolSignals,
    RateWindow,
    pool_signals,
)
from tandem.sim.cluster import ClusterSpec
from tandem.sim.simulator import Instance, Record, Simulation
from tandem.sim.workload import SimRequest


class RoleSimulation(Simulation):
    def __init__(self, cluster: ClusterSpec, requests: list[SimRequest], config: PDRatioConfig,
                 interval: float = 1.0) -> None:  # fmt: skip
        if not cluster.disaggregated:
            raise ValueError("a prefill/decode ratio needs a disaggregated cluster")
        super().__init__(cluster, requests, 1)
        self.roles = PDRatioPolicy(config)
        self.interval = interval
        self.cost = cluster.groups[0].cost_model
        self.pending = {i.name: 0 for i in self.instances}  # prompt tokens queued to prefill
        self.sent = RateWindow()  # prompt tokens sent to prefill, per second of the last minute
        self.moves: list[tuple[float, str, str, str]] = []  # (when, instance, to role, reason)
        self.ratio: list[tuple[float, int, int]] = []  # (when, prefill, decode) at each look

    def run(self) -> list[Record]:
        self._push(0.0, "tick", ())
        return super().run()

    def _reserve(self, decode: Instance, req: SimRequest, rid: str, now: float) -> bool:
        before = len(self.records[rid].prefill_instance)
        done = super()._reserve(decode, req, rid, now)
        record = self.records[rid]
        if record.prefill_instance and not before:  # sent to prefill: its uncached tokens queue
            tokens = record.kv_bytes // self.kv_bytes_per_token
            self.pending[record.prefill_instance] += tokens
            self.sent.add(now, tokens)
        return done

    def _prefilled(self, prefill: Instance, record: Record) -> None:
        self.pending[prefill.name] -= record.kv_bytes // self.kv_bytes_per_token

    def signals(self, now: float) -> tuple[PoolSignals, PoolSignals]:
        prefill = [i for i in self.instances if i.role == "prefill"]
        decode = [i for i in self.instances if i.role == "decode"]
        return pool_signals(self.cost, len(prefill), sum(self.pending[i.name] for i in prefill),
                            self.sent.rate(now), len(decode),
                            sum(i.core.scheduler.num_running for i in decode),
                            sum(int(i.core.scheduler.kv.usage * i.group.kv_tokens) for i in decode),
                            max((i.core.scheduler.kv.usage for i in decode), default=0.0))  # fmt: skip

    def _tick(self, now: float) -> None:
        prefill, decode = self.signals(now)
        self.ratio.append((now, prefill.instances, decode.instances))
        move = self.roles.decide(now, prefill, decode)
        if move is not None:
            pool = [i for i in self.instances if i.role == move.source]
            # the least loaded changes role: the fewest requests of its old role to finish
            inst = min(pool, key=lambda i: (i.observe().load, self.pending[i.name], i.index))
            inst.role = move.target
            self.front = [i for i in self.instances if i.role != "prefill"]
            self.prefill = [i for i in self.instances if i.role == "prefill"]
            self.moves.append((now, inst.name, move.target, move.reason))
        if self._events or any(i.core.has_unfinished() or i.backlog for i in self.instances):
            self._push(now + self.interval, "tick", ())

"""`tandem router --prefill ... --decode ... --pd-ratio auto`: the prefill/decode split follows
the load. Every `interval` seconds the router's `PDRatioPolicy` (router/pd_ratio.py, the one
`tandem sim` judges in sim/roles.py) reads the proxy's pools: the prompt tokens sent to the
prefill instances and not yet answered, and those sent over the last minute; the decode
instances' running requests and fullest KV cache from their /metrics, each priced by the
cost model. A move takes the least loaded instance of the calmer pool out of it (no new
requests of its old role), asks it to switch (`POST /role`: it must run with
--enable-role-switching), and puts it in the other pool; what it holds of its old role
finishes there, its prefix cache kept. A worker that refuses or cannot be reached goes back
to its pool, and the failure is counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from tandem.router.pd_ratio import PDRatioConfig, PDRatioPolicy, PoolSignals, pool_signals

log = logging.getLogger("tandem")


class RoleBalancer:
    def __init__(self, proxy, config: PDRatioConfig, cost_model, admin_key: str | None = None,
                 interval: float = 1.0) -> None:  # fmt: skip
        self.proxy, self.cost_model, self.interval = proxy, cost_model, interval
        self.policy = PDRatioPolicy(config)
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.pools = {"prefill": proxy.prefill_pool, "decode": proxy.decode_pool}
        self._task: asyncio.Task | None = None

    def signals(self, now: float) -> tuple[PoolSignals, PoolSignals]:
        prefill, decode = self.pools["prefill"].healthy(), self.pools["decode"].healthy()
        return pool_signals(self.cost_model, len(prefill),
                            sum(w.pending_prefill_tokens for w in prefill),
                            self.proxy.prefill_sent.rate(now), len(decode),
                            sum(w.running for w in decode), 0,
                            max((w.kv_usage for w in decode), default=0.0))  # fmt: skip

    async def step(self, now: float) -> bool:
        """One look at the pools; True if an instance moved."""
        move = self.policy.decide(now, *self.signals(now))
        if move is None:
            return False
        source, target = self.pools[move.source], self.pools[move.target]
        healthy = source.healthy()
        if not healthy:
            return False
        worker = min(healthy, key=lambda w: (w.load, w.pending_prefill_tokens))
        source.remove(worker.id)  # no new requests of its old role from here
        why = await self._switch(worker.url, move.target)
        if why is not None:
            source.add(worker.url)
            self.proxy.metrics.role_moves.labels(move.target, "failed").inc()
            log.warning("router: %s could not switch to %s: %s", worker.url, move.target, why)
            return False
        target.add(worker.url)
        self.proxy.metrics.role_moves.labels(move.target, "moved").inc()
        log.info("router: %s moved to the %s pool (%s)", worker.url, move.target, move.reason)
        return True

    async def _switch(self, url: str, role: str) -> str | None:
        try:
            r = await self.proxy.client.post(f"{url}/role", json={"role": role},
                                             headers=self.headers, timeout=10.0)  # fmt: skip
        except httpx.HTTPError as e:
            return type(e).__name__
        return None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.step(time.monotonic())
            except Exception:  # a bug here must not stop the router's routing
                log.exception("router: the prefill/decode ratio step failed")

"""Replay simulated requests against a real engine: the `EngineCore` step loop `tandem
serve` runs, fed each request at its arrival time on the wall clock, with every token
stamped when its step returns. What the simulator predicts for the same requests is then
directly comparable (benchmarks/sim_validation.py, tests/sim/test_validation.py)."""

from __future__ import annotations

import time

from tandem.sim.simulator import Record, core_request
from tandem.sim.workload import SimRequest


def replay(core, requests: list[SimRequest]) -> list[Record]:
    """Run `requests` (sorted by arrival) through `core`; their records, in order."""
    records = [Record(r) for r in requests]
    pending = list(enumerate(requests))
    start = time.perf_counter()
    while pending or core.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival <= now:
            n, req = pending.pop(0)
            core.add_request(core_request(req, str(n)))
        if not core.has_unfinished():
            time.sleep(max(0.0, pending[0][1].arrival - now))
            continue
        outputs = core.step()
        now = time.perf_counter() - start
        for out in outputs:
            records[int(out.request_id)].observe(out, now)
    return records

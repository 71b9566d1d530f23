"""A colocated cluster's simulation, on one process or several.

Colocated instances meet only at the router, which reads their running and waiting counts
and KV usage when a request arrives; between two arrivals each instance steps on its own
clock, touching nothing of the others. So the instances are dealt into shards (instance n to
shard n mod k), each stepped by its own process, and at each arrival every shard runs the
steps that start before it (the event loop runs those first too), reports its instances'
states, and the router in the main process places the request; the owner adds it with the
next message. Only the interleaving of steps across instances differs from one process,
and nothing reads it: the records are the same to the byte (a test holds them equal).
Disaggregated clusters keep the event loop: their instances meet at every handoff.

Per arrival a shard costs one message each way; an hour at 50 requests/s is 180,000 of them
against millions of steps, so two processes run nearly twice as fast (benchmarks/sim_speed.py).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import traceback

from tandem.sim.simulator import Instance, Record, Simulation, check_drained


def default_processes() -> int:
    """One per core this process may use (a shard is a busy loop: more would only wait)."""
    return len(os.sched_getaffinity(0))


def run_colocated(sim: Simulation, processes: int = 1) -> None:
    """Run every request of `sim` (no prefill instances) to the end, filling `sim.records`."""
    k = max(1, min(processes, len(sim.instances)))
    shard_of = [n % k for n in range(len(sim.instances))]
    for inst in sim.instances:
        inst.remote = shard_of[inst.index] != 0
    workers = [_start(sim, shard, k) for shard in range(1, k)]
    adds: list[list] = [[] for _ in range(k)]  # arrivals each shard adds at its next sync
    try:
        for n, req in enumerate(sim.requests):
            _sync(sim, workers, adds, req.arrival)
            rid = f"r{n}"
            inst = sim.route_arrival(req, rid)
            adds[shard_of[inst.index]].append((inst.index, req, rid))
        _sync(sim, workers, adds, math.inf)
        for conn, _ in workers:
            conn.send(None)
            _merge(sim, _receive(conn))
        check_drained([i for i in sim.instances if not i.remote])
    finally:
        for conn, proc in workers:
            conn.close()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for inst in sim.instances:
            inst.remote = False


def _start(sim: Simulation, shard: int, k: int):
    ctx = multiprocessing.get_context("fork")  # the shard starts from this very simulation
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(sim, shard, k, there), daemon=True)
    proc.start()
    there.close()
    return here, proc


def _sync(sim: Simulation, workers, adds: list[list], until: float) -> None:
    """Every shard adds the arrivals routed to it and steps its instances up to `until`;
    the router sees their states."""
    for shard, (conn, _) in enumerate(workers, 1):
        conn.send((adds[shard], until))
        adds[shard] = []
    _add(sim, adds[0])  # meanwhile, this process's own shard
    adds[0] = []
    sim.advance(until)
    for conn, _ in workers:
        for index, running, waiting, kv_usage in _receive(conn):
            state = sim.instances[index].state
            state.running, state.waiting, state.kv_usage = running, waiting, kv_usage


def _serve(sim: Simulation, shard: int, k: int, conn) -> None:
    """A shard's process: add what it is sent, step to the time it is sent, report."""
    mine = [i for i in sim.instances if i.index % k == shard]
    for inst in mine:
        inst.remote = False  # here they are stepped, and observed as the router would
    try:
        while (message := conn.recv()) is not None:
            arrivals, until = message
            for index, req, rid in arrivals:
                sim.records[rid] = Record(req, sim.instances[index].name)
            _add(sim, arrivals)
            sim.advance(until)
            conn.send(("ok", [_report(i) for i in mine]))
        check_drained(mine)
        conn.send(("ok", _results(sim, mine)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _report(inst: Instance) -> tuple[int, int, int, float]:
    """What the router reads of an instance (index, running, waiting, KV usage)."""
    state = inst.observe()
    return inst.index, state.running, state.waiting, state.kv_usage


def _add(sim: Simulation, arrivals: list) -> None:
    for index, req, rid in arrivals:
        sim.add_arrival(sim.instances[index], req, rid)


def _results(sim: Simulation, mine: list[Instance]) -> dict:
    """What the main process needs of this shard: its records' times, its instances' busy
    seconds, its step count."""
    records = {
        rid: (r.first_token, r.token_times, r.finished, r.error) for rid, r in sim.records.items()
    }
    busy = {i.index: i.runner.busy_seconds for i in mine}
    return {"records": records, "busy": busy, "steps": sim.num_steps}


def _merge(sim: Simulation, results: dict) -> None:
    for rid, (first, times, finished, error) in results["records"].items():
        record = sim.records[rid]
        record.first_token, record.token_times = first, times
        record.finished, record.error = finished, error
    for index, busy in results["busy"].items():
        sim.instances[index].runner.busy_seconds = busy
    sim.num_steps += results["steps"]


def _receive(conn):
    try:
        status, payload = conn.recv()
    except EOFError:
        raise RuntimeError("a simulation shard's process died") from None
    if status == "error":
        raise RuntimeError(f"a simulation shard failed:\n{payload}")
    return payload

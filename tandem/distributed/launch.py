"""Starting the ranks and watching them: a TCP store on the driver's host (the rendezvous),
worker processes for this node's other ranks (or Ray actors placing them on a cluster),
start-up bounded and naming the rank that is missing, and a liveness check the driver runs
before each step and while idle, so a dead rank fails the server instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from tandem.core.runner import RankFailed
from tandem.distributed.layout import ParallelLayout

log = logging.getLogger("tandem")


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet, and how the world is laid out over nodes."""

    layout: ParallelLayout
    master_addr: str
    master_port: int
    nnodes: int = 1
    node_rank: int = 0
    timeout: float = 30.0  # a collective's bound
    start_timeout: float = 120.0  # joining, and loading the model, each

    @property
    def ranks_per_node(self) -> int:
        return self.layout.world_size // self.nnodes

    def node_ranks(self, node: int) -> list[int]:
        n = self.ranks_per_node
        return list(range(node * n, (node + 1) * n))

    def node_of(self) -> list[int]:
        return [r // self.ranks_per_node for r in range(self.layout.world_size)]


def rendezvous_of(config) -> Rendezvous:
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    port = config.master_port
    if config.nnodes == 1 and not port:
        port = free_port(config.master_addr)
    return Rendezvous(layout, config.master_addr, port or 29500, config.nnodes,
                      config.node_rank, config.distributed_timeout,
                      config.distributed_start_timeout)  # fmt: skip


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_store(rdv: Rendezvous, is_master: bool) -> dist.TCPStore:
    try:
        return dist.TCPStore(rdv.master_addr, rdv.master_port, None, is_master,
                             timedelta(seconds=rdv.start_timeout), wait_for_workers=False)  # fmt: skip
    except Exception as e:
        where = f"{rdv.master_addr}:{rdv.master_port}"
        raise ValueError(
            f"master_port: cannot {'listen' if is_master else 'reach the driver'} on {where} "
            f"for the ranks' rendezvous: {e}"
        ) from None


class WorkerProcesses:
    """This node's worker ranks as child processes (the `mp` backend, and headless nodes)."""

    def __init__(self, config, rdv: Rendezvous, ranks: list[int], binds: dict[int, list[int]]):
        self.procs: dict[int, subprocess.Popen] = {}
        spec = json.dumps(dataclasses.asdict(config))
        for rank in ranks:
            cmd = [sys.executable, "-m", "tandem.distributed.worker", "--rank", str(rank),
                   "--master-addr", rdv.master_addr, "--master-port", str(rdv.master_port),
                   "--parent-pid", str(os.getpid()), "--config", spec]  # fmt: skip
            if binds.get(rank):
                cmd += ["--cpus", ",".join(map(str, binds[rank]))]
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def check(self) -> None:
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise RankFailed(f"rank {rank} (pid {p.pid}) {how}")

    def wait(self) -> int:
        """Until every worker exits; -> the first non-zero exit code, else 0."""
        codes = [p.wait() for p in self.procs.values()]
        return next((c for c in codes if c), 0)

    def stop(self, grace: float = 5.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_for_ranks(store, rdv: Rendezvous, key: str, what: str, check) -> None:
    """Until every rank but 0 has set `key/<rank>` (or one set `failed/<rank>`), within
    rdv.start_timeout; `check()` raises if a watched rank died first."""
    deadline = time.monotonic() + rdv.start_timeout
    waiting = list(range(1, rdv.layout.world_size))
    while waiting:
        for rank in list(waiting):
            if store.check([f"failed/{rank}"]):
                raise ValueError(f"rank {rank} failed to start: {store.get(f'failed/{rank}').decode()}")  # fmt: skip
            if store.check([f"{key}/{rank}"]):
                waiting.remove(rank)
        if not waiting:
            return
        try:
            check()
        except RankFailed as e:
            raise ValueError(f"{e} before it could {what}") from None
        if time.monotonic() > deadline:
            nodes = sorted({r // rdv.ranks_per_node for r in waiting})
            raise ValueError(
                f"ranks {waiting} (node {', '.join(map(str, nodes))}) did not {what} within "
                f"{rdv.start_timeout:g} s (distributed_start_timeout); the driver waits at "
                f"{rdv.master_addr}:{rdv.master_port}"
            )
        time.sleep(0.05)


def new_key() -> str:
    return uuid.uuid4().hex[:12]


def run_headless(config) -> int:
    """`tandem serve --headless --node-rank N`: this node's ranks only, until they exit
    (when the driver on node 0 stops them, or is gone); -> their exit code."""
    import signal

    from tandem.distributed.placement import cpu_binds

    rdv = rendezvous_of(config)
    ranks = rdv.node_ranks(config.node_rank)
    workers = WorkerProcesses(config, rdv, ranks, cpu_binds(config.cpu_threads_bind, ranks))
    log.info("headless node %d: ranks %s, joining %s:%d", config.node_rank, ranks,
             rdv.master_addr, rdv.master_port)  # fmt: skip

    def stop(signum, frame):
        workers.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return workers.wait()

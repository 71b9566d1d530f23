"""The `ray` backend: ranks past 0 as Ray actors, one CPU bundle each of a placement group,
on the cluster this process joins (`ray start --head` here, `ray start --address` on the
others; RAY_ADDRESS names it, else the local one). Ray only places the processes: the
ranks then meet and compute on torch.distributed, as with `mp`."""

from __future__ import annotations

import logging
import os

from tandem.core.runner import RankFailed

log = logging.getLogger("tandem")


def _rank_actor():
    import ray

    @ray.remote(num_cpus=1)
    class RankActor:
        def run(self, config: dict, rank: int, master_addr: str, master_port: int) -> int:
            from tandem.distributed.worker import run_rank
            from tandem.engine.config import EngineConfig
            from tandem.logs import setup_logging

            setup_logging(f"rank{rank}")
            return run_rank(EngineConfig(**config), rank, master_addr, master_port)

    return RankActor


class RayWorkers:
    def __init__(self, config, rdv) -> None:
        import dataclasses

        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            try:
                ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ValueError(
                    f"distributed_executor_backend ray: no Ray cluster at {address} ({e}); "
                    "start one with `ray start --head` (and `ray start --address` on the "
                    "other nodes), or set RAY_ADDRESS"
                ) from None
        n = rdv.layout.world_size - 1
        self.group = placement_group([{"CPU": 1}] * n, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=rdv.start_timeout)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise ValueError(
                f"distributed_executor_backend ray: the cluster has no room for {n} ranks of "
                f"one CPU each within {rdv.start_timeout:g} s (its resources: "
                f"{ray.available_resources()})"
            )
        # the ranks reach the driver's store at this node's address as Ray sees it
        master = rdv.master_addr
        if len(ray.nodes()) > 1:
            master = ray.util.get_node_ip_address()
        spec = dataclasses.asdict(config)
        actor = _rank_actor()
        self.actors, self.runs = {}, {}
        for i, rank in enumerate(range(1, rdv.layout.world_size)):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)
            a = actor.options(scheduling_strategy=strategy).remote()
            self.actors[rank] = a
            self.runs[rank] = a.run.remote(spec, rank, master, rdv.master_port)

    def check(self) -> None:
        refs = list(self.runs.values())
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for rank, ref in self.runs.items():
            if ref in done:
                try:
                    how = f"exited with code {self.ray.get(ref)}"
                except Exception as e:  # the actor died (its process killed, its node lost)
                    how = f"died: {type(e).__name__}"
                raise RankFailed(f"rank {rank} (Ray actor) {how}")

    def stop(self, grace: float = 5.0) -> None:
        refs = list(self.runs.values())
        self.ray.wait(refs, num_returns=len(refs), timeout=grace)  # after the stop message
        for a in self.actors.values():
            self.ray.kill(a)
        self.ray.util.remove_placement_group(self.group)
        self.actors, self.runs = {}, {}

"""A trainer's weights over torch.distributed, as SGLang's rollout engine takes them
(`/init_weights_update_group`, then `/update_weights_from_distributed` per push).

The handshake, exactly: the trainer is rank 0 of a group of 1 + the server's ranks (a whole
model here: one, at rank `rank_offset`, usually 1). It sends `/init_weights_update_group`
(without waiting for the answer) and then calls

    torch.distributed.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                                         world_size=2, rank=0)

which hosts the rendezvous; the engine core joins the same init_method at its rank. Per push,
it sends `/update_weights_from_distributed {names, dtypes, shapes}` (again without waiting)
and then `torch.distributed.broadcast(tensor, src=0)` for each tensor in the order of
`names`. The core receives every tensor before writing any (so a push that fails halfway,
or names a tensor the model lacks, leaves the old weights), off its step loop: requests keep
running while the bytes arrive. A trainer that dies mid-broadcast breaks the group: the
core tears it down and says so; a new `/init_weights_update_group` starts over.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def parse_dtype(name: str) -> torch.dtype:
    """ "bfloat16" or "torch.bfloat16" -> torch.bfloat16; a ValueError for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtypes: {name!r} is not a floating-point torch dtype")
    return dtype


class WeightSyncGroup:
    """This process's place in a trainer's group (the process's default torch.distributed
    group: a whole model uses none of its own)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend: nccl needs CUDA; on the CPU use gloo")
        if not 1 <= rank_offset < world_size:
            raise ValueError(
                f"rank_offset: {rank_offset} must be in [1, world_size) (the trainer is rank 0)"
            )
        if world_size != rank_offset + 1:
            raise ValueError(
                f"world_size: {world_size}, but this server has one rank (rank_offset + 1 = "
                f"{rank_offset + 1})"
            )
        if dist.is_initialized():
            raise ValueError(
                "a weight update group is open already: destroy_weights_update_group first"
            )
        self.backend, self.rank = backend, rank_offset
        self.broken = False  # a broadcast failed: the group was torn down
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://{master_address}:{master_port}",
                world_size=world_size, rank=rank_offset,
                timeout=datetime.timedelta(seconds=timeout_s),
            )  # fmt: skip
        except Exception as e:
            raise ValueError(
                f"master_address: joining the trainer's group at {master_address}:{master_port} "
                f"failed: {type(e).__name__}: {e}"
            ) from None

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], on_tensor=None) -> dict:  # fmt: skip
        """Every tensor the trainer broadcasts, in order; -> name -> tensor. `on_tensor(name,
        tensor)` sees each as it arrives (the first error it raises is raised once all have:
        the trainer's broadcast must complete). On a broken broadcast the group is torn down
        (its state is unknown) and the ValueError says what broke."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes"
            )
        kinds = [parse_dtype(d) for d in dtypes]
        tensors, error = {}, None
        for i, (name, dtype, shape) in enumerate(zip(names, kinds, shapes)):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            try:
                dist.broadcast(t, src=0)
            except Exception as e:
                self.broken = True
                self.close()
                raise ValueError(
                    f"names: the broadcast of {name!r} ({i + 1} of {len(names)}) failed, the "
                    f"trainer gone or stalled ({type(e).__name__}: {e}); the weight update "
                    "group is closed and the old weights stay"
                ) from None
            tensors[name] = t
            if on_tensor is not None and error is None:
                try:
                    on_tensor(name, t)
                except Exception as e:  # received on regardless, then refused
                    error = e
        if error is not None:
            raise error
        return tensors

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group: nothing more to release
                pass

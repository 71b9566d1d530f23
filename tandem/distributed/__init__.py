"""Tensor and pipeline parallelism: one scheduler, a driver runner on rank 0 and worker
ranks, on torch.distributed (gloo on the CPU) with a shared-memory all-reduce on one host.
See docs/distributed.md."""

"""A rank past 0: join the rendezvous, load this rank's share of the model, then run each
step the driver sends until it says stop. Started by the driver (`mp`), by a headless node,
or inside a Ray actor; it never outlives its driver (a closed connection or its parent's
death ends it)."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist

from tandem.logs import setup_logging

log = logging.getLogger("tandem")


def run_rank(config, rank: int, master_addr: str, master_port: int, cpus=None) -> int:
    """The whole life of rank `rank`; -> its exit code."""
    from tandem.distributed.groups import Ranks
    from tandem.distributed.launch import open_store, rendezvous_of
    from tandem.distributed.placement import use_cpus
    from tandem.runner.builder import build_model_runner

    rdv = dataclasses.replace(
        rendezvous_of(config), master_addr=master_addr, master_port=master_port
    )
    use_cpus(cpus)
    store = open_store(rdv, is_master=False)
    store.set(f"joined/{rank}", f"{socket.gethostname()} {os.getpid()}")
    key = store.get("shm_key").decode()
    ranks = Ranks(rdv.layout, rank, dist.PrefixStore("pg", store), rdv.timeout, rdv.node_of(), key)
    try:
        loaded = build_model_runner(config, rank=rank, ranks=ranks)
    except Exception as e:
        log.exception("rank %d: loading the model failed", rank)
        store.set(f"failed/{rank}", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")  # fmt: skip
        return 1
    store.set(f"loaded/{rank}", "1")
    try:
        return serve_steps(loaded, ranks)
    finally:
        ranks.close()


def serve_steps(loaded, ranks) -> int:
    from tandem.distributed.kv_shards import CALLS
    from tandem.distributed.stage import stage_forward
    from tandem.model.attention import forward_context
    from tandem.runner.input_batch import prepare_inputs

    runner, vocab = loaded.runner, loaded.model_config.vocab_size
    while True:
        try:
            message = ranks.receive()
        except Exception as e:  # the driver is gone
            log.error("rank %d: the driver is gone (%s); exiting", ranks.rank, e)
            return 1
        if message[0] == "stop":
            return 0
        if message[0] == "ping":  # an idle driver making sure this rank still answers
            continue
        if message[0] == "call":  # the driver reads or writes the KV as one model's
            _, name, args = message
            try:
                ranks.gather_parts(CALLS[name](runner, loaded.shard, *args))
            except Exception:
                log.exception("rank %d: %s failed; exiting (the ranks are out of step)", ranks.rank, name)  # fmt: skip
                return 1
            continue
        inputs = prepare_inputs(message[1], runner.block_size, runner.device)
        try:
            with torch.inference_mode(), forward_context(inputs.attn):
                stage_forward(runner.model, inputs, ranks, vocab)
        except Exception:
            log.exception("rank %d: a step failed; exiting (the ranks are out of step)", ranks.rank)  # fmt: skip
            return 1


def _die_with_parent() -> None:
    """SIGKILL when the driver's process dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a tandem rank past 0 (started by the driver)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--cpus", default="", help="CPUs to run on, comma separated")
    args = p.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent_pid:  # it died before the line above took effect
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when ranks stop
    setup_logging(f"rank{args.rank}")
    from tandem.engine.config import EngineConfig

    config = EngineConfig(**json.loads(args.config))
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    try:
        return run_rank(config, args.rank, args.master_addr, args.master_port, cpus)
    except Exception as e:
        log.error("rank %d: %s", args.rank, e)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""A trainer process as RL frameworks write one, for the tests: it pushes a transformers
model's weights to a tandem server over torch.distributed with the plain calls
runner/weight_sync.py documents (init_process_group at rank 0, one broadcast per tensor, the
HTTP calls sent from a thread without waiting). --die-after N exits mid-push, after N
tensors; --bad-name names the first tensor wrongly. Prints one JSON line: the HTTP answers.

    python -m tests.server.rl_trainer URL MODEL_FOLDER PORT [--version V] [--die-after N]
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import httpx
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def send():
        r = httpx.post(url, json=body, timeout=120)
        answer.update(status=r.status_code, body=r.json())

    thread = threading.Thread(target=send)
    thread.start()
    return thread, answer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("port", type=int)
    p.add_argument("--version", default="trained-1")
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bad-name", action="store_true", help="name the first tensor wrongly")
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    thread, init = post_in_background(
        f"{args.url}/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1,
         "world_size": 2, "group_name": "test", "backend": "gloo", "timeout_s": 60},
    )  # fmt: skip
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", world_size=2, rank=0
    )
    thread.join()
    params = list(model.named_parameters())
    if args.bad_name:
        params[0] = ("model.nope.weight", params[0][1])
    thread, update = post_in_background(
        f"{args.url}/update_weights_from_distributed",
        {"names": [n for n, _ in params], "dtypes": [str(t.dtype) for _, t in params],
         "shapes": [list(t.shape) for _, t in params], "weight_version": args.version,
         "timeout_s": 60},
    )  # fmt: skip
    for i, (_, t) in enumerate(params):
        if args.die_after is not None and i == args.die_after:
            print(json.dumps({"init": init, "died_after": i}), flush=True)
            os._exit(0)  # mid-push, the group and the HTTP call left behind
        dist.broadcast(t.detach().contiguous(), src=0)
    thread.join()
    print(json.dumps({"init": init, "update": update}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

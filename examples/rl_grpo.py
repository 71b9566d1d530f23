"""A small GRPO loop: a transformers model trains in this process on a toy reward while
`tandem serve --enable-rl-endpoints` produces its rollouts, and the trained weights are
pushed to the server over torch.distributed after every step.

The reward (--reward) is brevity by default: 1 - the answer's tokens / --max-tokens, so an
answer that ends sooner scores more (an answer cut at the limit scores 0); or, with
`--reward word`, 1 when the answer names the --target word, else 0. Each step
samples --group answers to each prompt (temperature 1, vLLM's `return_token_ids`, so the
trainer scores exactly the tokens sampled), normalizes the rewards within each group
(GRPO's advantage), takes one policy-gradient step on the answers' log-likelihoods, and
pushes the new weights (/pause_generation, /update_weights_from_distributed with one
broadcast per tensor, /continue_generation). The server runs the default model on its
4-bit blocks: each push is quantized again into them.

    python examples/rl_grpo.py                    # starts `tandem serve` itself
    python examples/rl_grpo.py --url http://127.0.0.1:8000 --steps 12
    python examples/rl_grpo.py --model tiny-llama-folder --steps 2   # the test's short run
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "Name one animal that people keep as a pet. Answer in a few words.",
    "Which animal would you like to have at home? Answer briefly.",
    "Say the name of a small furry animal.",
    "What is your favourite pet? One short sentence.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """The HTTP call on a thread: its answer comes once the collective after it is done."""
    answer: dict = {}

    def send():
        r = httpx.post(url, json=body, timeout=600)
        answer.update(status=r.status_code, body=r.json())

    thread = threading.Thread(target=send)
    thread.start()
    return thread, answer


class WeightPusher:
    """Rank 0 of the group the server joins: runner/weight_sync.py's handshake."""

    def __init__(self, url: str) -> None:
        self.url = url
        port = free_port()
        thread, answer = post_in_background(
            f"{url}/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
             "world_size": 2, "backend": "gloo", "group_name": "grpo"},
        )  # fmt: skip
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
        thread.join()
        if answer["status"] != 200:
            raise RuntimeError(f"init_weights_update_group: {answer}")

    def push(self, model, version: str) -> None:
        params = [(n, p.detach().contiguous()) for n, p in model.named_parameters()]
        httpx.post(f"{self.url}/pause_generation", json={"mode": "in_place"}, timeout=60)
        thread, answer = post_in_background(
            f"{self.url}/update_weights_from_distributed",
            {"names": [n for n, _ in params], "dtypes": [str(p.dtype) for _, p in params],
             "shapes": [list(p.shape) for _, p in params], "weight_version": version},
        )  # fmt: skip
        for _, p in params:
            dist.broadcast(p, src=0)
        thread.join()
        httpx.post(f"{self.url}/continue_generation", timeout=60)
        if answer["status"] != 200:
            raise RuntimeError(f"update_weights_from_distributed: {answer}")

    def close(self) -> None:
        httpx.post(f"{self.url}/destroy_weights_update_group", timeout=60)
        dist.destroy_process_group()


def rollouts(url: str, prompts: list[list[int]], group: int, max_tokens: int) -> list[dict]:
    """--group sampled answers to each prompt: [{prompt, tokens, text, version}]."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompts, "n": group, "temperature": 1.0,
            "max_tokens": max_tokens, "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/completions: {r.status_code} {r.text}")
    out = r.json()
    return [
        {"prompt": c["prompt_token_ids"], "tokens": c["token_ids"], "text": c["text"],
         "version": out["usage"].get("weight_version")}
        for c in sorted(out["choices"], key=lambda c: c["index"])
    ]  # fmt: skip


def score(sample: dict, args) -> float:
    if args.reward == "word":
        return float(args.target in sample["text"].lower())
    return 1 - len(sample["tokens"]) / args.max_tokens


def advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO's: each reward less its group's mean, over the group's deviation."""
    out = []
    for i in range(0, len(rewards), group):
        g = rewards[i : i + group]
        mean, std = statistics.fmean(g), statistics.pstdev(g)
        out += [(r - mean) / (std + 1e-4) for r in g]
    return out


def policy_loss(model, samples: list[dict], adv: list[float]) -> torch.Tensor:
    """-sum(A * mean log p(answer tokens)) over the samples, batched with padding."""
    rows = [s["prompt"] + s["tokens"] for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # padded on the right
    attention, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
    for i, (row, s) in enumerate(zip(rows, samples)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        mask[i, len(s["prompt"]) : len(row)] = 1  # the answer's tokens
    logits = model(ids, attention_mask=attention).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = mask[:, 1:]
    per_sample = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return -(torch.tensor(adv) * per_sample).mean()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running `tandem serve --enable-rl-endpoints`")
    ap.add_argument("--model", default=None, help="HF folder (default: the bundled model's)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group", type=int, default=8, help="answers sampled per prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--reward", choices=["short", "word"], default="short")
    ap.add_argument("--target", default="cat", help="--reward word: the word it asks for")
    ap.add_argument("--json", default=None, help="write each step's figures here")
    args = ap.parse_args(argv)
    from tandem.model.loader import resolve_model

    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    torch.manual_seed(0)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )  # fmt: skip
        for p in PROMPTS[: args.prompts]
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    server = None
    if args.url is None:
        from tandem.bench.servers import tandem_server

        log = Path(tempfile.mkdtemp()) / "serve.log"
        port = free_port()
        server = tandem_server(port, args.model, ["--enable-rl-endpoints"], log)
        server.__enter__()
        server.wait_ready(600)
        args.url = server.base_url
    pusher = WeightPusher(args.url)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    history = []
    try:
        pusher.push(model, "grpo-0")  # the trainer's float weights, in place of the file's
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            samples = rollouts(args.url, prompts, args.group, args.max_tokens)
            assert all(s["version"] in (None, f"grpo-{step - 1}") for s in samples)
            rewards = [score(s, args) for s in samples]
            t1 = time.perf_counter()
            optimizer.zero_grad()
            loss = policy_loss(model, samples, advantages(rewards, args.group))
            loss.backward()
            optimizer.step()
            t2 = time.perf_counter()
            pusher.push(model, f"grpo-{step}")
            t3 = time.perf_counter()
            reward = statistics.fmean(rewards)
            history.append({"step": step, "reward": reward, "rollout_s": t1 - t0,
                            "train_s": t2 - t1, "push_s": t3 - t2})  # fmt: skip
            print(f"step {step:3d}  reward {reward:.3f}  rollouts {t1 - t0:5.1f} s  "
                  f"train {t2 - t1:5.1f} s  push {t3 - t2:5.1f} s", flush=True)  # fmt: skip
    finally:
        pusher.close()
        if server is not None:
            server.__exit__(None, None, None)
    if args.json:
        Path(args.json).write_text(json.dumps(history))
    return 0


if __name__ == "__main__":
    sys.exit(main())

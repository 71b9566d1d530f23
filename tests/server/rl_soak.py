"""An RL soak: random control calls (pause in every mode, resume, weight updates between two
checkpoints, prefix cache resets, sleep and wake) against a server under concurrent greedy
requests, checking what a rollout engine owes its trainer:

- every control call answers within its timeout, never with a 5xx;
- no request is lost or hangs: each ends, with its tokens or finish_reason "abort";
- no stale KV: a request that no weight update overlapped returns exactly the greedy tokens
  of the weights its usage.weight_version names (HF transformers' greedy, computed here);
- the engine never dies.

Used by tests/server/test_rl_soak.py (a short run) and benchmarks/rl_soak.py (1,000 calls).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

SHARED = [7 + (i * 13) % 200 for i in range(40)]  # a prefix every prompt shares (2+ blocks)
MAX_TOKENS = 8


def soak_prompts(n: int = 6) -> list[list[int]]:
    return [SHARED + [11 + i, 29 + 3 * i, 5 + 7 * i] for i in range(n)]


def hf_references(folders: dict[str, str], prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """version name -> each prompt's greedy tokens under that checkpoint (HF generate)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    refs = {}
    for name, folder in folders.items():
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            refs[name] = [
                hf.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist()
                for p in prompts
            ]
    return refs


@dataclass
class SoakReport:
    calls: Counter = field(default_factory=Counter)  # (call, status) -> count
    requests: Counter = field(default_factory=Counter)  # outcome -> count
    stale: list = field(default_factory=list)  # (version, prompt index, got, expected)
    bad_calls: list = field(default_factory=list)  # (call, status, body)
    hung: int = 0
    engine_dead: bool = False

    @property
    def ok(self) -> bool:
        return not (self.stale or self.bad_calls or self.hung or self.engine_dead)


class Soak:
    def __init__(self, url: str, folders: dict[str, str], seed: int = 0) -> None:
        self.url, self.folders = url, folders
        self.rng = random.Random(seed)
        self.prompts = soak_prompts()
        self.refs = hf_references(folders, self.prompts)
        self.report = SoakReport()
        # weight updates begun and ended (odd: one is under way): a request is checked only
        # if none was under way when it was sent and none began or ended before it came back
        self.updates = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    # ---- the requests --------------------------------------------------------------
    def worker(self, wid: int) -> None:
        rng = random.Random(wid)
        while not self.stop.is_set():
            i = rng.randrange(len(self.prompts))
            body = {"prompt": self.prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            with self.lock:
                updates_before = self.updates
            try:
                r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
            except httpx.TimeoutException:
                with self.lock:
                    self.report.hung += 1
                continue
            with self.lock:
                self._check(i, r, updates_before)

    def _check(self, i: int, r: httpx.Response, updates_before: int) -> None:
        if r.status_code != 200:
            self.report.requests[f"http {r.status_code}"] += 1
            if r.status_code >= 500:
                self.report.bad_calls.append(("completion", r.status_code, r.text[:300]))
            return
        out = r.json()
        choice = out["choices"][0]
        self.report.requests[choice["finish_reason"]] += 1
        if choice["finish_reason"] != "length" or self.updates != updates_before:
            return  # ended by a pause, or lived through an update (off-policy by design)
        if updates_before % 2:
            return  # sent while an update was under way
        version = out["usage"]["weight_version"].split("-")[0]
        expected = self.refs[version][i]
        if choice["token_ids"] != expected:
            self.report.stale.append((version, i, choice["token_ids"], expected))

    # ---- the control calls ---------------------------------------------------------
    def call(self) -> None:
        kind = self.rng.choice(
            ["pause", "pause", "resume", "resume", "update", "update", "reset", "sleep",
             "wake", "version"]
        )  # fmt: skip
        if kind == "pause":
            mode = self.rng.choice(["abort", "wait", "keep"])
            if self.rng.random() < 0.5:
                sg = {"abort": "abort", "wait": "in_place", "keep": "retract"}[mode]
                return self._post("pause_generation", "/pause_generation", {"mode": sg, "timeout_s": 60})  # fmt: skip
            return self._post(f"pause {mode}", f"/pause?mode={mode}", {"timeout_s": 60})
        if kind == "resume":
            path = self.rng.choice(["/resume", "/continue_generation"])
            return self._post("resume", path, None)
        if kind == "update":
            name = self.rng.choice(sorted(self.folders))
            with self.lock:
                self.updates += 1
                n = self.updates
            body = {"model_path": self.folders[name], "weight_version": f"{name}-{n}",
                    "flush_cache": self.rng.random() < 0.5,
                    "recompute_kv": self.rng.random() < 0.3, "timeout_s": 60}  # fmt: skip
            # (asleep at level 2, an update is a 400 saying so: the weights are gone)
            self._post("update", "/update_weights_from_disk", body, ok=(200, 400), why="asleep")
            with self.lock:
                self.updates += 1  # (ended: a request sent from now on is checked)
            return None
        if kind == "reset":
            return self._post("reset", "/reset_prefix_cache", None, ok=(200, 409))
        if kind == "sleep":
            level = self.rng.choice([1, 2])
            # (level 2's wake-up loads the file's weights as version "default": requests
            # are held while asleep, so none runs across it)
            return self._post(f"sleep {level}", f"/sleep?level={level}", None, ok=(200, 409))
        if kind == "wake":
            return self._post("wake", "/wake_up", None)
        r = httpx.get(f"{self.url}/get_weight_version", timeout=30)
        self.report.calls[("version", r.status_code)] += 1
        return None

    def _post(self, name: str, path: str, body, ok=(200,), why: str = "") -> None:
        """A control call; a status outside `ok` (or a 4xx whose message lacks `why`, where
        given) is a bad call."""
        try:
            r = httpx.post(f"{self.url}{path}", json=body, timeout=90)
        except httpx.TimeoutException:
            self.report.bad_calls.append((name, "timeout", ""))
            return
        self.report.calls[(name, r.status_code)] += 1
        expected = r.status_code in ok and (r.status_code < 400 or why in r.text)
        if r.status_code == 409 or (r.status_code == 400 and "wait cannot end" in r.text):
            expected = True  # not now, said so: a reset or sleep with KV held, a wait held
        if not expected:
            self.report.bad_calls.append((name, r.status_code, r.text[:300]))

    def run(self, calls: int, streams: int = 16, gap_s: float = 0.05) -> SoakReport:
        threads = [threading.Thread(target=self.worker, args=(w,), daemon=True) for w in range(streams)]  # fmt: skip
        for t in threads:
            t.start()
        for _ in range(calls):
            self.call()
            time.sleep(self.rng.uniform(0, gap_s))
        # leave it serving: no pause, awake, a version the references know
        self._post("resume", "/resume", None)
        self._post("wake", "/wake_up", None)
        self.stop.set()
        deadline = time.monotonic() + 150
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.report.hung += sum(t.is_alive() for t in threads)
        try:
            health = httpx.get(f"{self.url}/health", timeout=10).status_code
        except httpx.TransportError:
            health = None
        self.report.engine_dead = health != 200
        return self.report

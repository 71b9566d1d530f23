"""A short RL soak through a real server (tests/server/rl_soak.py): random pause, resume,
weight updates between two checkpoints, resets, sleep and wake under 16 concurrent greedy
requests. Every call answers in time without a 5xx, no request is lost or hangs, every
request no update overlapped returns exactly HF's greedy tokens for the version its usage
names (no stale KV), and the engine lives."""

from __future__ import annotations

import pytest

from tests.conftest import build_checkpoint
from tests.server.rl_soak import Soak


@pytest.mark.slow
def test_random_control_calls_under_load_lose_nothing_and_never_serve_stale_kv(rl_server, llama_path, tmp_path):  # fmt: skip
    other = build_checkpoint(tmp_path / "b", "llama", seed=5)
    soak = Soak(rl_server.url, {"default": str(llama_path), "b": str(other)}, seed=1)
    report = soak.run(calls=80, streams=16)
    assert report.ok, report
    assert report.requests["length"] > 50, report.requests  # the requests ran
    called = {name for name, status in report.calls if status == 200}
    assert {"update", "resume", "wake"} <= called and any(n.startswith("pause") for n in called)

"""examples/rl_grpo.py end to end, shortened: the example starts `tandem serve
--enable-rl-endpoints` on a tiny checkpoint, trains the same checkpoint with transformers in
its own process for two GRPO steps, and pushes the weights over torch.distributed after each;
every rollout carries the version of the weights it was sampled with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_grpo_example_trains_and_pushes_for_two_steps(llama_path, tmp_path):
    out = tmp_path / "history.json"
    cmd = [sys.executable, str(ROOT / "examples" / "rl_grpo.py"), "--model", str(llama_path),
           "--steps", "2", "--group", "3", "--prompts", "2", "--max-tokens", "6",
           "--reward", "word", "--target", "a", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    history = json.loads(out.read_text())
    assert [h["step"] for h in history] == [1, 2]
    assert all(0 <= h["reward"] <= 1 and h["push_s"] > 0 for h in history)
    assert "step   2" in done.stdout

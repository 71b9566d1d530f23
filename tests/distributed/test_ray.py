"""The `ray` backend: a real local Ray cluster (`ray start --head`, from PyPI's ray) places
the ranks past 0 as actors; they meet on torch.distributed and compute what one rank does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.core.sampling_params import SamplingParams
from tandem.engine.llm import LLM
from tests.conftest import build_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PROMPTS = [[5 + (i * 37 + j * 11) % 390 for j in range(3 + i % 29)] for i in range(64)]
RAY = str(Path(sys.executable).with_name("ray"))


def _gcs_port() -> int:
    """A free port above Ray's own worker ports (10002-19999), which a port below would clash
    with (`ray start` refuses it)."""
    for port in range(20_000 + os.getpid() % 5_000, 30_000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-30000")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A one-node cluster of 2 CPUs, stopped afterwards; RAY_ADDRESS points at it."""
    port = _gcs_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--num-cpus", "2",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                   check=True, capture_output=True, env=env, timeout=120)  # fmt: skip
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    yield os.environ["RAY_ADDRESS"]
    import ray

    ray.shutdown()
    subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env, timeout=120)
    if before is None:
        os.environ.pop("RAY_ADDRESS")
    else:
        os.environ["RAY_ADDRESS"] = before


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-model")
    return build_checkpoint(root / "llama", "llama", num_attention_heads=8, num_key_value_heads=2)


def test_ranks_placed_by_ray_match_one_rank(ray_head, eight_heads):
    path = eight_heads
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)

    def run(**kw):
        with LLM(str(path), dtype="float32", num_kv_blocks=512, **kw) as llm:
            return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    whole = run()
    split = run(tensor_parallel_size=2, distributed_executor_backend="ray")
    for a, b in zip(split, whole):
        assert a.token_ids == b.token_ids
        for got, want in zip(a.logprobs, b.logprobs):
            for token, lp in want.items():
                assert abs(got[token].logprob - lp.logprob) < 1e-4
    import ray

    assert ray.is_initialized() and len(ray.nodes()) == 1
    assert not ray.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
    )  # the ranks' placement group is given back


def test_a_cluster_without_room_for_the_ranks_fails_the_start_within_its_bound(
    ray_head, eight_heads
):
    started = time.monotonic()
    with pytest.raises(ValueError, match="no room for 3 ranks of one CPU each within 3 s"):
        LLM(str(eight_heads), dtype="float32", tensor_parallel_size=4,
            distributed_executor_backend="ray", distributed_start_timeout=3)  # fmt: skip
    assert time.monotonic() - started < 30  # the 2-CPU cluster never hangs the start
    import ray

    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups)

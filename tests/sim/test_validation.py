"""The simulator against the real engine on this machine, with a loose bound so drift is
caught (benchmarks/sim_validation.py holds the tight comparison through real servers): a
profile fitted on the tiny checkpoint, then the same timed requests through the real
EngineCore and ModelRunner on the wall clock and through `tandem sim` on the profile."""

from __future__ import annotations

import pytest

from tandem.core.cost_model import CostModel
from tandem.engine.builder import build_engine
from tandem.engine.config import EngineConfig
from tandem.runner.profile import ProfileGrid, profile_steps
from tandem.sim.cluster import ClusterSpec
from tandem.sim.replay import replay
from tandem.sim.report import summarize
from tandem.sim.simulator import Simulation
from tandem.sim.workload import SimRequest

BLOCKS = 256
GRID = ProfileGrid(prefill_tokens=(0, 16, 64, 160), prefill_context=(0, 64),
                   decode_rows=(0, 1, 4, 12), decode_context=(32, 160))  # fmt: skip
BOUND = 0.5  # |simulated / real - 1| for mean TTFT and mean TPOT


def workload(vocab: int) -> list[SimRequest]:
    """24 requests in bursts of 4, 150 ms apart: prefills queue behind each other and decodes
    batch, so both the prefill and the decode terms of the profile matter."""
    out = []
    for i in range(24):
        prompt = tuple((7 * i + 3 * j) % (vocab - 10) + 10 for j in range(60 + 25 * (i % 5)))
        out.append(SimRequest(0.15 * (i // 4) + 0.004 * (i % 4), prompt, 12 + i % 7))
    return out


def small_checkpoint(folder):
    """A 19M-parameter Llama: big enough that a step is mostly model, as with real models
    (the parity checkpoints' steps are mostly Python, which a step-time profile does not
    see)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import build_tokenizer

    folder.mkdir(parents=True)
    tok = build_tokenizer(folder)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=len(tok),
                         max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.mark.slow
def test_a_profiled_simulation_tracks_the_real_engine_on_this_machine(tmp_path):
    model = small_checkpoint(tmp_path / "small")
    config = EngineConfig(model=str(model), num_kv_blocks=BLOCKS, max_num_batched_tokens=512,
                          enable_prefix_caching=False)  # each run computes every prompt  # fmt: skip
    core, loaded = build_engine(config)
    vocab = loaded.model_config.vocab_size
    profile = CostModel.fit(profile_steps(core, GRID, vocab, repeats=3))
    requests = workload(vocab)
    # warm-up: first-call costs are not what a profile measures (nor are first writes to KV
    # pages, which ran a first replay 2x slow before profile_steps mapped the pool)
    replay(core, requests)
    # Each run's steps, timed and as the profile prices them: this host's speed swings by 2x
    # for seconds at a time, a swing the profile may have missed. A run is compared with a
    # simulation on the profile scaled to the speed its own steps ran at, so the check is the
    # simulator's model of the engine (its queueing, batching, token accounting), not the
    # host's speed at that moment.
    steps: list[tuple[float, float]] = []
    observe = core.scheduler.observe_step
    core.scheduler.observe_step = lambda plan, sec: (
        steps.append((sec, profile.predict(plan.shape))), observe(plan, sec))  # fmt: skip
    runs = []
    for _ in range(2):
        steps.clear()
        records = replay(core, requests)
        runs.append((records, sum(t for t, _ in steps) / sum(p for _, p in steps)))

    for records, speed in runs:
        scaled = CostModel(tuple(c * speed for c in profile.coef), kernels=profile.kernels)
        scaled.save(tmp_path / "cost.json")
        cluster = ClusterSpec.from_dict({
            "model": "smollm2-135m", "engine": {"max_num_batched_tokens": 512},
            "groups": [{"name": "local", "cost_model": "cost.json", "kv_tokens": BLOCKS * 16,
                        "prefix_caching": False}],
        }, tmp_path)  # fmt: skip
        sim = Simulation(cluster, requests)
        simulated, measured = summarize(sim, sim.run()), summarize(sim, records)
        assert measured["completed"] == simulated["completed"] == len(requests)
        assert 0.5 < speed < 2, f"the run's steps took {speed:.2f}x the profile's prediction"
        for key in ("mean_ttft_ms", "mean_tpot_ms"):
            real = measured[key]
            error = simulated[key] / real - 1
            info = f"{key}: simulated {simulated[key]:.2f} vs real {real:.2f} (speed {speed:.2f})"
            assert abs(error) < BOUND, info

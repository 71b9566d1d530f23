"""`tandem profile`: real steps over the grid, a fitted cost model saved as JSON, and its
held-out error reported."""

from __future__ import annotations

from tandem.cli import main
from tandem.core.cost_model import CostModel, StepShape
from tests.model.test_quantized_weights import QUANT_ROWS


def test_profile_fits_and_saves_a_cost_model(llama_path, tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = main(["profile", str(llama_path), "-o", str(out), "--repeats", "2", "--dtype",
               "float32", "--kv-cache-memory", "0.05"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "held-out mean absolute error" in printed and "4-fold" in printed
    model = CostModel.load(out)
    assert all(c >= 0 for c in model.coef)
    assert model.info["points"] >= 30 and 0 <= model.info["held_out_mean_abs_error"] < 1
    small, big = StepShape(0, 1, 64), StepShape(512, 32, 16384, 131328)
    assert 0 < model.predict(small) < model.predict(big)
    # the spread of single runs, for the simulator: each over its point's fastest run
    assert len(model.noise) == 20 and list(model.noise) == sorted(model.noise)
    assert model.noise[0] == 1.0  # a point's fastest run is its time
    assert "a single run of a step" in printed


def test_profile_times_the_grid_it_is_given_with_the_statistic_asked_for(llama_path, tmp_path):
    out = tmp_path / "cost.json"
    grid = ["--prefill-tokens", "0,16,48", "--prefill-chunks", "1,2", "--prefill-context", "0",
            "--decode-rows", "0,1,3", "--decode-context", "16"]  # fmt: skip
    rc = main(["profile", str(llama_path), "-o", str(out), "--repeats", "2", "--dtype",
               "float32", "--kv-cache-memory", "0.05", "--statistic", "median", *grid])  # fmt: skip
    assert rc == 0
    model = CostModel.load(out)
    info = model.info
    assert model.noise[0] <= 1.0 <= model.noise[-1]  # runs on both sides of their median
    # (0 prefill: 1 or 3 decodes) + (16 or 48 prefill in 1 or 2 chunks: 0, 1 or 3 decodes)
    assert info["points"] == 2 + 2 * 2 * 3 and info["statistic"] == "median"


def test_profile_refuses_a_grid_that_is_not_a_list_of_counts(llama_path, tmp_path, capsys):
    rc = main(["profile", str(llama_path), "-o", str(tmp_path / "c.json"), "--decode-rows", "1,x"])
    assert rc == 2 and "decode_rows" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_profile_times_the_grid_in_passes_so_noise_cannot_inflate_all_runs_of_one_point(
    llama_path,
):
    from tandem.engine.builder import build_engine
    from tandem.engine.config import EngineConfig
    from tandem.runner.profile import STEADY_RUNS, ProfileGrid, profile_steps

    config = EngineConfig(model=str(llama_path), dtype="float32", kv_cache_memory=0.05)
    core, loaded = build_engine(config)
    order, execute = [], core.runner.execute
    core.runner.execute = lambda plan: (order.append(StepShape.of(plan.scheduled)), execute(plan))[1]  # fmt: skip
    grid = ProfileGrid(prefill_tokens=(0, 16), prefill_chunks=(1,), prefill_context=(0,),
                       decode_rows=(1, 2), decode_context=(16,))  # fmt: skip
    points = profile_steps(core, grid, loaded.model_config.vocab_size, repeats=2)
    shapes = [s for s, _ in points]
    assert len(shapes) == 4 and len(set(shapes)) == 4  # 0 or 16 prefill tokens, 1 or 2 decodes

    # a warm-up pass, then one pass per repeat, where a decode-only step is timed after
    # STEADY_RUNS untimed runs of itself, as decode steps follow one another in a real run
    def one_pass(steady):
        return [s for s in shapes for _ in range(1 + (0 if s.prefill_tokens else steady))]

    assert order[: 3 * len(shapes) + 4 * STEADY_RUNS] == one_pass(0) + one_pass(STEADY_RUNS) * 2
    timed = [(order.count(s) - 1) / (1 + (0 if s.prefill_tokens else STEADY_RUNS)) for s in shapes]
    assert all(n in range(2, 3 * 2 + 1) for n in timed)  # more runs only if unsettled
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_usable_blocks


def test_profile_times_steps_on_a_kv_pool_whose_pages_are_all_mapped(llama_path):
    # a fresh pool maps its pages as steps first touch them: a one-off cost of page faults
    # the profile must not count as a step's time
    from tandem.engine.builder import build_engine
    from tandem.engine.config import EngineConfig
    from tandem.runner.profile import ProfileGrid, profile_steps
    from tests.runner.test_kv_pool import resident_bytes

    config = EngineConfig(model=str(llama_path), dtype="float32", kv_cache_memory=0.05)
    core, loaded = build_engine(config)
    pool = core.runner.kv_cache
    assert resident_bytes(pool) < pool.nbytes // 4  # nothing written yet
    grid = ProfileGrid(prefill_tokens=(16,), prefill_chunks=(1,), prefill_context=(0,),
                       decode_rows=(0,), decode_context=(16,))  # fmt: skip
    profile_steps(core, grid, loaded.model_config.vocab_size, repeats=2)
    assert resident_bytes(pool) >= pool.nbytes  # more than the few blocks the steps used


def test_profile_of_quantized_weights_fits_the_kernels_passes_over_the_weights(
    llama_path, tmp_path, capsys
):
    out = tmp_path / "cost.json"
    grid = ["--prefill-tokens", "0,40", "--prefill-chunks", "1", "--prefill-context", "0",
            "--decode-rows", "0,1,4,5,8,12", "--decode-context", "16"]  # fmt: skip
    rc = main(["profile", str(llama_path), "-o", str(out), "--repeats", "2", "--quantization",
               "int4", "--kv-cache-memory", "0.05", *grid])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    model = CostModel.load(out)
    # int4 projections on torch's CPU kernels, 4 rows a pass, dense past 32 rows; the 8-bit
    # head (two int4 terms, so two passes a tile) dense past 10; where int4_gemm makes dense
    # cheaper, past 2 rows and 1 and its own switch at 240 (AMX), past 4 and 2 up to 512
    # (AVX512-BF16)
    assert model.kernels == QUANT_ROWS  # this CPU's, as the quantized layers' tests know them
    assert "ms/pass of 4 rows over the weights" in printed
    assert "on the grid's decode steps" in printed and "without the passes" in printed

"""`tandem profile`: real steps over the grid, a fitted cost model saved as JSON, and its
held-out error reported."""

from __future__ import annotations

from tandem.cli import main
from tandem.core.cost_model import CostModel, StepShape


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

"""`tandem sim rollout`: RL rollouts priced on the real scheduler and a roofline cost model.
With a long tail of output lengths, synchronous rollout waits each step for its longest
rollouts while the batch thins out; partial rollout (APRIL's: more in flight, the unfinished
held across the update) keeps the batch full and finishes more tokens per second. Every RL
step gets its batch either way, and a seed gives the same run twice."""

from __future__ import annotations

import dataclasses

from tandem.sim.rollout import RolloutSpec, compare, simulate

SMALL = RolloutSpec(batch=24, steps=4, median_output=150, max_output=1024, update_s=1.0)


def test_partial_rollout_finishes_more_tokens_per_second_under_a_long_tail():
    sync, partial = compare(SMALL)
    assert sync.rollouts == SMALL.steps * SMALL.batch  # every step waits for its whole batch
    assert partial.rollouts >= SMALL.steps * SMALL.batch
    assert partial.tokens_per_s > 1.3 * sync.tokens_per_s


def test_without_a_tail_the_gain_is_only_the_larger_batch():
    flat = dataclasses.replace(SMALL, sigma=0.0)
    sync, partial = compare(flat)
    assert 0.95 < partial.tokens_per_s / sync.tokens_per_s < 1.3
    long_tail = compare(SMALL)
    assert partial.tokens_per_s / sync.tokens_per_s < long_tail[1].tokens_per_s / long_tail[0].tokens_per_s  # fmt: skip


def test_a_seed_gives_the_same_run():
    assert simulate(SMALL, "partial") == simulate(SMALL, "partial")
    other = simulate(dataclasses.replace(SMALL, seed=1), "partial")
    assert other != simulate(SMALL, "partial")


def test_the_cli_prints_both_modes_and_the_ratio(capsys):
    from tandem.cli import main

    args = ["sim", "rollout", "--batch", "8", "--steps", "2", "--max-output", "256"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sync" in out and "partial" in out and "the finished tokens per second" in out

"""`tandem profile [MODEL]`: time engine steps on this hardware over a grid of plan shapes,
fit the step-latency cost model, report its error on held-out points (k-fold: each point
predicted by a fit that never saw it), and save it as JSON for `tandem serve --cost-model`."""

from __future__ import annotations

import argparse
import platform
import random
from dataclasses import replace

from tandem.runner.profile import STATISTICS, ProfileGrid


def add_parser(sub) -> None:
    from tandem.engine.config import add_engine_args

    p = sub.add_parser("profile", help="fit the step-latency cost model on this hardware")
    p.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: bundled)")
    p.add_argument("--output", "-o", default="cost_model.json", help="where to save the model")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per point (at least; see --statistic)"
    )
    p.add_argument(
        "--statistic",
        choices=STATISTICS,
        default="min",
        help="a point's time: the fastest run (the clean cost) or the median (what a long run "
        "of steps meets on a shared machine)",
    )
    p.add_argument("--folds", type=int, default=4, help="cross-validation folds (held-out error)")
    g = p.add_argument_group("grid (comma-separated values; every combination is timed)")
    for name, values in vars(ProfileGrid()).items():
        g.add_argument(f"--{name.replace('_', '-')}", default=",".join(map(str, values)))
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from tandem.core.cost_model import CostModel, KernelRows, noise_quantiles
    from tandem.engine.builder import build_engine
    from tandem.engine.config import engine_config_from_args
    from tandem.runner.profile import profile_steps

    if args.folds < 2:
        raise ValueError(f"folds must be >= 2, got {args.folds}")
    if args.repeats < 2:
        raise ValueError(f"repeats must be >= 2, got {args.repeats}")
    grid = ProfileGrid(**{name: _ints(name, getattr(args, name)) for name in vars(ProfileGrid())})
    config = engine_config_from_args(args, args.model)
    core, loaded = build_engine(config)
    print(f"profiling {loaded.model_path.name} ({loaded.dtype} on {loaded.device})")
    runs: list[list[float]] = []
    print(f"{'prefill':>8} {'chunks':>7} {'decodes':>8} {'decode kv':>10} {'chunk pairs':>12} "
          f"{'ms':>9}")  # fmt: skip
    points = profile_steps(
        core,
        grid,
        loaded.model_config.vocab_size,
        args.repeats,
        lambda s, t: print(
            f"{s.prefill_tokens:>8} {s.prefill_rows:>7} {s.decode_rows:>8} {s.kv_tokens:>10} "
            f"{s.chunk_kv:>12} "
            f"{t * 1e3:>9.2f}"
        ),
        statistic=args.statistic,
        runs=runs,
    )
    kernels = loaded.kernel_rows  # where the quantized layers change kernels
    # k-fold: each point is predicted once by a model that never saw it
    shuffled = random.Random(0).sample(points, len(points))
    folds = [shuffled[i :: args.folds] for i in range(args.folds)]
    held_out_error = _held_out_error(folds, kernels)
    final = CostModel.fit(points, kernels)
    info = {
        "model": str(loaded.model_path),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "device": str(loaded.device),
        "cpu": platform.processor() or platform.machine(),
        "points": len(points),
        "statistic": args.statistic,
        "folds": args.folds,
        "held_out_mean_abs_error": held_out_error,
        "fit_mean_abs_error": final.mean_abs_error(points),
    }
    # how far single runs stray from a point's time: the simulator draws its steps from it
    noise = noise_quantiles(runs, [t for _, t in points])
    final = CostModel(final.coef, info, kernels, noise)
    final.save(args.output)
    c = final.coef
    print(
        f"step = {c[0] * 1e3:.3f} ms + {c[1] * 1e6:.2f} us/prefill token + "
        f"{c[2] * 1e3:.3f} ms/decode row + {c[3] * 1e9:.2f} ns/decode KV token + "
        f"{c[4] * 1e9:.2f} ns/prefill attention pair + {c[7] * 1e3:.3f} ms/prefill chunk + "
        f"{c[8] * 1e9:.2f} ns/pair within a chunk"
        + (
            f" + {c[5] * 1e3:.3f} ms/row up to {kernels.wide} rows + {c[6] * 1e3:.3f} ms past them"
            if kernels.wide is not None
            else ""
        )
        + (
            f" + {c[9] * 1e3:.3f} ms/pass of {kernels.tile} rows over the weights"
            if kernels.tile is not None
            else ""
        )
        + (
            f" + {c[10] * 1e3:.3f} ms/pass of the head up to {kernels.head} sampled rows + "
            f"{c[11] * 1e3:.3f} ms past them"
            if kernels.head is not None
            else ""
        )
        + (
            f" + {c[12] * 1e3:.3f} ms/dense row up to {kernels.gemm} rows + "
            f"{c[13] * 1e3:.3f} ms past them"
            if kernels.gemm is not None
            else ""
        )
    )
    one_chunk = [[(replace(s, prefill_rows=0, chunk_own=0), t) for s, t in f] for f in folds]
    print(
        f"held-out mean absolute error: {held_out_error:.1%} "
        f"({args.folds}-fold over {len(points)} points); "
        f"{_held_out_error(one_chunk, kernels):.1%} without the per-chunk terms"
        + (
            f", {_held_out_error(folds, KernelRows(kernels.wide)):.1%} without the passes over "
            f"the weights, {_held_out_error(folds, KernelRows()):.1%} without any kernel terms"
            if kernels != KernelRows()
            else ""
        )
    )
    if kernels.tile is not None and any(s.prefill_tokens == 0 for s, _ in points):
        decodes = lambda s: s.prefill_tokens == 0  # noqa: E731
        print(
            f"on the grid's decode steps: {_held_out_error(folds, kernels, decodes):.1%}, "
            f"{_held_out_error(folds, KernelRows(kernels.wide), decodes):.1%} without the passes"
        )
    mean = sum(noise) / len(noise)
    print(
        f"a single run of a step: {noise[0]:.2f}x to {noise[-1]:.2f}x its point's time "
        f"(2.5th to 97.5th percentile), {mean:.2f}x on average"
    )
    print(f"saved to {args.output}")
    return 0


def _held_out_error(folds, kernels, only=lambda shape: True) -> float:
    """Mean relative error of each point (of those `only` picks) predicted by a fit on the
    other folds."""
    from tandem.core.cost_model import CostModel

    errors = []
    for i, test in enumerate(folds):
        train = [p for j, fold in enumerate(folds) if j != i for p in fold]
        model = CostModel.fit(train, kernels)
        errors += [model.mean_abs_error([p]) for p in test if only(p[0])]
    return sum(errors) / len(errors)


def _ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of integers >= 0")
    return values

"""The step-latency cost model: seconds for one engine step from the shape of its plan.

    step seconds = c0 + c_prefill * prefill tokens + c_decode * decode rows
                 + c_kv * KV tokens read + c_chunk * chunk attention
                 + c_narrow * min(rows, wide) + c_wide * (rows > wide)
                 + c_rows * prefill chunks + c_own * chunks' own attention
                 + c_tiles * kernel tiles + c_head * head tiles + c_head_wide * (head dense)

"KV tokens read" is the context decode rows read (one query against every earlier token: a
memory-bound read of their KV); "chunk attention" is the (query, key) pairs of prefill chunks,
n * start against earlier KV plus n * (n + 1) / 2 of their own (many queries share each read:
compute-bound, quadratic, and the prefill path pads to power-of-two buckets). Keeping the two
apart is what lets one model fit a CPU profile and an accelerator's roofline alike. The
narrow/wide terms are for a runner that changes kernels with the step's rows (prefill tokens
plus decode rows): on quantized weights, up to `wide` rows the weight-only kernels cost
more per row, past them each weight is dequantized for a dense matmul, a fixed cost a step
pays once (measured on the default model's GGUF blocks, 2-core EPYC: 33 prefill tokens took
55 ms, 32 took 79). The chunk terms price a loaded step's several prefill chunks: each is
its own padded attention call, and a chunk's pairs with itself cost more than those with
earlier context (on the default model: 384 prompt tokens in one chunk 246 ms, in four 146
ms; a model without these terms over-predicted the four by 39% and under-predicted four
16-token chunks by 22%). The last three are the weight-only kernels' staircase
(`KernelRows`): torch's CPU kernels compute 4 rows per pass over the weights, each pass
reading and dequantizing every weight again (one 1536x576 Q4_1 projection: 26 us at 4 rows,
49 at 5), and the output head, run on the rows that sample, turns dense sooner than the
body (on the default model a decode step of 5 rows took 16.6 ms, of 4 11.3; a fit without
these terms was off by up to 15% on decode steps of 1 to 32 rows, with them by 6%). The
model is linear in these, fitted by least squares on relative error (`tandem profile`, or
online from the steps the engine runs), and serialized as a small JSON file. The SLO
scheduler asks it whether a batch keeps every running request inside its TPOT; the router
and the simulator ask it how long a step takes. Pure Python, no torch.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

FEATURES = ("const", "prefill_tokens", "decode_rows", "kv_tokens", "chunk_kv", "narrow_rows",
            "wide_step", "prefill_rows", "chunk_own", "kernel_tiles", "head_tiles",
            "head_wide", "gemm_rows", "sliced_step")  # fmt: skip
Coef = tuple[float, ...]
# Files saved before a feature was added name a prefix of FEATURES: the rest read as zeros.
SAVED_FEATURES = (FEATURES[:5], FEATURES[:7], FEATURES[:9], FEATURES[:12], FEATURES)


@dataclass(frozen=True)
class KernelRows:
    """Where a runner on weight-only quantized kernels changes cost with a step's rows (None:
    it does not). Past `wide` rows (prefill tokens plus decode rows) the projections
    dequantize their weights once for a dense matmul; past `head` sampled rows the output
    head does. Up to them, each pass of the kernel computes `tile` rows and reads and
    dequantizes every weight again: a step's cost is a staircase in its rows. Where the
    dense path itself changes past `gemm` rows (int4_gemm: a fused dequantize-and-multiply per
    block up to them, dearer per row; dequantized slices past them, dearer per step), a
    dense step's rows up to `gemm` cost extra per row, and a step past them a constant."""

    wide: int | None = None
    head: int | None = None
    tile: int | None = None
    gemm: int | None = None

    def __post_init__(self) -> None:
        for name, least in (("wide", 0), ("head", 0), ("tile", 1), ("gemm", 0)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= least):
                raise ValueError(
                    f"cost model: {name} rows must be an integer >= {least}, got {value!r}"
                )


def chunk_kv(n: int) -> int:
    """KV entries a chunk of n new tokens reads of its own (causal)."""
    return n * (n + 1) // 2


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0  # tokens of rows still in their prompt (or several at once)
    decode_rows: int = 0  # rows computing one output token
    kv_tokens: int = 0  # context tokens decode rows read (KV earlier steps wrote)
    chunk_kv: int = 0  # attention pairs of prefill chunks: earlier context and their own
    # Prefill chunks (each its own padded attention call: ~7 ms a chunk on the default model
    # on this CPU, whatever its size) and their own pairs alone (causal within the chunk:
    # padded to a bucket, dearer per pair than the earlier context's).
    prefill_rows: int = 0
    chunk_own: int = 0

    @classmethod
    def of(cls, scheduled: Iterable) -> StepShape:
        """The shape of a plan's `scheduled` rows (ScheduledRequest)."""
        prefill = decode = kv = chunk = rows = own = 0
        for s in scheduled:  # with_row's arithmetic, unrolled: the simulator's hottest loop
            start, n = s.start, s.num_new_tokens
            if n == 1 and start >= s.request.num_prompt_tokens:
                decode += 1
                kv += start
            else:
                prefill += n
                rows += 1
                pairs = n * (n + 1) // 2
                own += pairs
                chunk += n * start + pairs
        return cls(prefill, decode, kv, chunk, rows, own)

    def with_row(self, request, start: int, n: int) -> StepShape:
        if n == 1 and start >= request.num_prompt_tokens:
            return self.plus(decode_rows=1, kv_tokens=start)
        own = chunk_kv(n)
        return self.plus(prefill_tokens=n, chunk_kv=n * start + own, prefill_rows=1, chunk_own=own)

    @classmethod
    def prompt(cls, n: int, decode_rows: int = 0) -> StepShape:
        """A step computing an n-token prompt in one chunk beside `decode_rows` decodes."""
        return cls(n, decode_rows, 0, chunk_kv(n), 1 if n else 0, chunk_kv(n))

    def plus(
        self,
        prefill_tokens: int = 0,
        decode_rows: int = 0,
        kv_tokens: int = 0,
        chunk_kv: int = 0,
        prefill_rows: int = 0,
        chunk_own: int = 0,
    ) -> StepShape:
        return StepShape(
            self.prefill_tokens + prefill_tokens,
            self.decode_rows + decode_rows,
            self.kv_tokens + kv_tokens,
            self.chunk_kv + chunk_kv,
            self.prefill_rows + prefill_rows,
            self.chunk_own + chunk_own,
        )

    @property
    def sampled_rows(self) -> int:
        """Rows the output head runs on: every decode row and prefill chunk (a chunk short of
        its prompt's end samples nothing, but a step holds at most one such)."""
        return self.decode_rows + self.prefill_rows

    def features(self) -> tuple[float, ...]:
        return (1.0, self.prefill_tokens, self.decode_rows, self.kv_tokens, self.chunk_kv)


@dataclass(frozen=True)
class CostModel:
    # seconds per step, prefill token, decode row, KV token, chunk KV entry, row up to
    # kernels.wide, step past them, prefill chunk, own pair of a chunk, kernel tile, head
    # tile, dense head, dense row up to kernels.gemm, step past them (fewer given: zeros)
    coef: Coef
    info: dict | None = None  # where it came from: hardware, model, fit error
    kernels: KernelRows = KernelRows()  # where the runner's kernels change (default: nowhere)
    # How far one run of a step strays from the fitted time, as equally likely ratios (each a
    # run's seconds over its profile point's): empty for a model with no measured spread.
    noise: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.coef) in {len(names) for names in SAVED_FEATURES}:
            padding = (0.0,) * (len(FEATURES) - len(self.coef))
            object.__setattr__(self, "coef", (*self.coef, *padding))
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"cost model: expected {len(FEATURES)} coefficients, got {self.coef}")

    def predict(self, shape: StepShape) -> float:
        return sum(map(operator.mul, self.coef, _features(shape, self.kernels)))

    @property
    def seconds_per_prefill_token(self) -> float:
        return self.coef[1]

    @classmethod
    def fit(
        cls,
        points: Sequence[tuple[StepShape, float]],
        kernels: KernelRows = KernelRows(),
        anchor: CostModel | None = None,
        anchor_points: float = 0.0,
        ridge: float = 1e-9,
    ) -> CostModel:
        """Least squares on relative error over (shape, seconds) points, so a 30 ms decode
        step counts as much as a 1 s prefill. Coefficients are kept non-negative (a step
        never gets faster with more work): a negative one is dropped and the rest refitted.
        With an `anchor`, each coefficient is pulled toward the anchor's as if it were
        `anchor_points` more points: what a few steps cannot tell apart (a handful of
        decode steps of one size say nothing of the per-row cost) stays where it was. A feature
        none of the points has (no step past the wide rows in a window of decodes; a runner
        whose kernels never switch) keeps the anchor's coefficient, or none."""
        if len(points) < 2:
            raise ValueError(f"cost model: need at least 2 measured steps, got {len(points)}")
        a, b, counts = _normal_equations(
            [_features(shape, kernels) for shape, _ in points], [seconds for _, seconds in points]
        )
        seen = [i for i, n in enumerate(counts) if n]
        active = list(seen)
        pull = None if anchor is None else (anchor.coef, anchor_points / len(points))
        while True:
            coef = _least_squares(a, b, active, ridge, pull)
            negative = [i for i in active if coef[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: coef[i]))
        if anchor is not None:
            coef = [c if i in seen else anchor.coef[i] for i, c in enumerate(coef)]
        return cls(tuple(coef), kernels=kernels)

    def mean_abs_error(self, points: Sequence[tuple[StepShape, float]]) -> float:
        """Mean of |predicted - measured| / measured."""
        return sum(abs(self.predict(s) - t) / t for s, t in points) / len(points)

    # ---- files ---------------------------------------------------------------
    def to_dict(self) -> dict:
        k = self.kernels
        return {"features": list(FEATURES), "coef": list(self.coef), "wide_rows": k.wide,
                "head_rows": k.head, "row_tile": k.tile, "gemm_rows": k.gemm, "info": self.info or {},
                "step_noise": list(self.noise)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """A saved model; one saved before some features existed (SAVED_FEATURES) reads with
        zeros for them."""
        names, coef = data.get("features"), data.get("coef", ())
        known = [list(f) for f in SAVED_FEATURES]
        if names not in known or not isinstance(coef, list) or len(coef) != len(names):
            raise ValueError(f"cost model: expected coefficients for {list(FEATURES)}")
        kernels = KernelRows(data.get("wide_rows"), data.get("head_rows"), data.get("row_tile"),
                             data.get("gemm_rows"))  # fmt: skip
        noise = data.get("step_noise", [])
        if not (isinstance(noise, list) and all(isinstance(r, (int, float)) and r > 0
                                                 for r in noise)):  # fmt: skip
            raise ValueError(f"cost model: step_noise must be a list of ratios > 0, got {noise!r}")
        return cls(tuple(float(c) for c in coef), data.get("info") or None, kernels,
                   tuple(float(r) for r in noise))  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"cost_model: cannot read {str(path)!r}: {e}") from None


class OnlineCostModel:
    """A cost model fitted as the engine runs, from the steps it times: it starts from a
    prior, refits as the points double, then every `refit_every` steps over the last
    `window` of them, anchored to the model it replaces (early windows hold a few steps of
    one or two shapes, which cannot tell the constant from the per-row costs)."""

    def __init__(
        self,
        prior: CostModel,
        window: int = 512,
        refit_every: int = 32,
        anchor_points: float = 2.0,
    ) -> None:
        self.model = prior  # its kernels carry over to every refit
        self.window, self.refit_every = window, refit_every
        self.anchor_points = anchor_points  # the model in place counts as this many points
        self._points: list[tuple[StepShape, float]] = []
        self._since_fit = 0

    def predict(self, shape: StepShape) -> float:
        return self.model.predict(shape)

    @property
    def seconds_per_prefill_token(self) -> float:
        return self.model.seconds_per_prefill_token

    @property
    def coef(self) -> Coef:
        return self.model.coef

    def switches_kernels_at(self, kernels: KernelRows) -> None:
        """The runner, once loaded, says where its kernels change (CostModel.kernels)."""
        self.model = replace(self.model, kernels=kernels)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0:
            return
        self._points.append((shape, seconds))
        del self._points[: -self.window]
        self._since_fit += 1
        # the prior is a guess: refit at 8, 16, 32... points, then every refit_every steps
        due = min(self.refit_every, max(8, len(self._points) - self._since_fit))
        if self._since_fit >= due and len(self._points) >= 8:
            self._since_fit = 0
            self.model = CostModel.fit(self._points, self.model.kernels, self.model,
                                       self.anchor_points)  # fmt: skip


def noise_quantiles(runs: Iterable[Sequence[float]], typical: Iterable[float], n: int = 20):
    """The spread of repeated runs as n equally likely ratios: every run's seconds over its
    point's `typical` seconds, pooled, at the quantiles (i + 0.5) / n."""
    ratios = sorted(t / mid for times, mid in zip(runs, typical) for t in times)
    if not ratios:
        return ()
    return tuple(ratios[min(len(ratios) - 1, int((i + 0.5) / n * len(ratios)))] for i in range(n))


def _features(shape: StepShape, kernels: KernelRows) -> tuple[float, ...]:
    """The values FEATURES names, for a runner whose kernels change where `kernels` says."""
    wide, head, tile, gemm = kernels.wide, kernels.head, kernels.tile, kernels.gemm
    # float weights and rooflines change no kernels: the simulator's hot path, kept short
    if wide is None and head is None and tile is None and gemm is None:
        return (*shape.features(), 0, 0, shape.prefill_rows, shape.chunk_own, 0, 0, 0, 0, 0)
    rows, sampled = shape.prefill_tokens + shape.decode_rows, shape.sampled_rows
    narrow, past = (0, 0) if wide is None else (min(rows, wide), rows > wide)
    tiles = -(-rows // tile) if tile and not past else 0  # passes over the weights
    head_past = head is not None and sampled > head
    head_tiles = -(-sampled // tile) if tile and head is not None and not head_past else 0
    dense = past or wide is None
    gemm_rows = min(rows, gemm) if gemm is not None and dense else 0
    sliced = gemm is not None and rows > gemm
    return (*shape.features(), narrow, float(past), shape.prefill_rows, shape.chunk_own, tiles,
            head_tiles, float(head_past), gemm_rows, float(sliced))  # fmt: skip


# A prior for a small model on a CPU, replaced as soon as real steps are timed.
DEFAULT_PRIOR = CostModel((0.02, 0.0005, 0.001, 1e-6, 2e-6), {"source": "prior"})


def _normal_equations(features, seconds):
    """Over rows x = features / seconds (relative error: each row scaled by 1/t), the sums
    x x^T and x least squares solves from, and how many rows have each feature: built once a
    fit, over each row's nonzero features only (a decode step has no prefill terms)."""
    n = len(FEATURES)
    a, b, counts = [[0.0] * n for _ in range(n)], [0.0] * n, [0] * n
    for f, t in zip(features, seconds):
        x = [(i, v / t) for i, v in enumerate(f) if v]
        for i, xi in x:
            counts[i] += 1
            b[i] += xi
            row = a[i]
            for j, xj in x:
                row[j] += xi * xj
    return a, b, counts


def _least_squares(gram, sums, active: list[int], ridge: float, pull=None) -> list[float]:
    """Solve the normal equations (`gram`, `sums` from _normal_equations) over the `active`
    features (Gaussian elimination); `pull` = (coefficients, weight) adds
    weight * (c_i - anchor_i)^2 times the data's own curvature in each direction."""
    k = len(active)
    a = [[gram[fi][fj] for fj in active] for fi in active]
    b = [sums[fi] for fi in active]
    if pull is not None:
        anchor, weight = pull
        for i, fi in enumerate(active):
            b[i] += weight * a[i][i] * anchor[fi]
            a[i][i] += weight * a[i][i]
    for i in range(k):
        a[i][i] += ridge * (1.0 + a[i][i])
    for col in range(k):  # elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    solution = [0.0] * k
    for r in range(k - 1, -1, -1):
        if abs(a[r][r]) < 1e-300:
            continue
        solution[r] = (b[r] - sum(a[r][c] * solution[c] for c in range(r + 1, k))) / a[r][r]
    coef = [0.0] * len(FEATURES)
    for i, fi in enumerate(active):
        coef[fi] = solution[i]
    return coef

"""`tandem bench serve`: build the workload, run it at each point (rate x concurrency),
report, save and plot. `compare` reuses `prepare` and `run_points` per server."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench import metrics
from tandem.bench.arrivals import parse_rates
from tandem.bench.client import RequestSpec, auth_headers, first_model, make_client, send
from tandem.bench.results import build_result, format_summary, format_sweep, rate_value, save_json
from tandem.bench.runner import RunConfig, RunResult, run_workload
from tandem.bench.server_counters import read_spec_counters, spec_summary
from tandem.bench.workloads import LengthRange, RequestClass, Session, num_requests

READY_CHECK_POINT = 1 << 20  # the workload index of the ready check: one no run reaches


@dataclass
class Prepared:
    """What stays the same from server to server: the workloads and how to measure them.

    Point i of a run (a rate, a concurrency, a max-rate probe) sends its own prompts, drawn
    with seed + i: were every point to resend point 0's prompts, a server's prefix cache
    would serve them from the second point on and the figures would measure cache hits."""

    build: Callable[[int], list[Session]]  # seed -> workload
    seed: int
    tokenizer: object
    tokenizer_id: str
    rates: list[float]
    concurrencies: list[int | None]
    goodput: dict[str, float]
    classes: list[RequestClass]
    percentiles: list[float]
    _workloads: dict[int, list[Session]] = field(default_factory=dict)

    def workload(self, point: int = 0) -> list[Session]:
        seed = self.seed + point
        if seed not in self._workloads:
            self._workloads[seed] = self.build(seed)
        return self._workloads[seed]

    @property
    def sessions(self) -> list[Session]:
        return self.workload(0)


@dataclass
class Point:
    result: dict  # the JSON document of one run
    run: RunResult


def prepare(args: argparse.Namespace) -> Prepared:
    tokenizer_id, tokenizer = load_tokenizer(args.tokenizer or _local_model(args.model))
    classes = [RequestClass.parse(s) for s in args.cls or []]
    percentiles = sorted({float(p) for p in args.metric_percentiles.split(",")} | {99.0})
    prep = Prepared(
        build=lambda seed: build_workload(args, tokenizer, classes, seed),
        seed=args.seed,
        tokenizer=tokenizer,
        tokenizer_id=tokenizer_id,
        rates=parse_rates(args.request_rate),
        concurrencies=_parse_concurrency(args.max_concurrency),
        goodput=metrics.parse_slos(args.goodput or []),
        classes=classes,
        percentiles=percentiles,
    )
    prep.workload(0)  # fail on a bad dataset before any server starts
    return prep


def _local_model(model: str | None) -> str | None:
    return model if model and Path(model).exists() else None


def _parse_concurrency(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    values = [int(x) for x in text.split(",") if x.strip()]
    if any(v < 1 for v in values):
        raise ValueError(f"max concurrency: {text!r} has a value below 1")
    return values


def load_tokenizer(path: str | None) -> tuple[str, object]:
    """The model's own tokenizer: an HF folder or a GGUF (tandem's default model if None)."""
    from tandem.engine.tokenizer import load_tokenizer as load
    from tandem.model.loader import resolve_model

    folder = resolve_model(path)
    return str(path or folder), load(folder)


def build_workload(args, tokenizer, classes: list[RequestClass], seed: int) -> list[Session]:
    from tandem.bench import sharegpt, workloads

    name, n = args.dataset_name, args.num_prompts
    inp = LengthRange.around(args.random_input_len, args.random_range_ratio)
    out = LengthRange.around(args.random_output_len, args.random_range_ratio)
    if name == "random":
        return workloads.random_workload(tokenizer, n, inp, out, seed)
    if name == "sharegpt":
        return sharegpt.sharegpt_workload(
            tokenizer, n, args.dataset_path, args.sharegpt_output_len, seed
        )
    if name == "shared-prefix":
        return workloads.shared_prefix_workload(
            tokenizer, n, args.prefix_groups, args.prefix_len, inp, out, seed
        )
    if name == "multi-turn":
        conversations = max(1, n // args.turns)
        return workloads.multi_turn_workload(tokenizer, conversations, args.turns, inp, out, seed)
    if name == "json-schema":
        return workloads.json_schema_workload(tokenizer, n, inp, out, seed)
    if name == "multi-class":
        return workloads.multi_class_workload(tokenizer, n, classes, seed)
    if name == "custom":
        if not args.dataset_path:
            raise ValueError("dataset: --dataset-name custom needs --dataset-path FILE.jsonl")
        return workloads.prompts_workload(
            tokenizer, args.dataset_path, n, args.custom_output_len, seed
        )
    raise ValueError(f"dataset: unknown --dataset-name {name!r}")


def request_spec(args, base_url: str, model: str) -> RequestSpec:
    import json

    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    return RequestSpec(
        url=base_url.rstrip("/") + endpoint,
        model=model,
        chat=chat,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=json.loads(args.extra_body) if args.extra_body else {},
        headers=auth_headers(args.api_key),
        send_class=args.send_slo_class,
    )


async def wait_ready(spec: RequestSpec, session: Session, timeout: float) -> None:
    """One request of the workload, retried until the server answers it (vLLM does the same
    before a run); it is not counted."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with make_client(timeout=600) as client:
        while True:
            r = await send(client, spec, session.requests[0])
            if r.success:
                return
            if asyncio.get_running_loop().time() > deadline or r.error.startswith("HTTP"):
                raise ValueError(f"server: the test request to {spec.url} failed: {r.error}")
            await asyncio.sleep(1.0)


async def run_points(args, prep: Prepared, base_url: str, label: str = "") -> list[Point]:
    """Every rate x concurrency point of the run, then the max-rate search if asked."""
    if args.model and not _local_model(args.model):
        model = args.model
    else:  # a server just started may not answer yet: wait for it as for the test request
        model = await first_model(base_url, auth_headers(args.api_key), args.ready_timeout)
    spec = request_spec(args, base_url, model)
    if args.ready_timeout > 0:
        # A prompt from outside every point, so the check warms no cache for the run.
        await wait_ready(spec, prep.workload(READY_CHECK_POINT)[0], args.ready_timeout)
    points: list[Point] = []
    for concurrency in prep.concurrencies:
        for rate in prep.rates:
            points.append(await run_point(args, prep, spec, rate, concurrency, label, len(points)))
    if args.find_max_rate:
        points += await search_max_rate(args, prep, spec, label, first=len(points))
    return points


async def run_point(
    args, prep: Prepared, spec: RequestSpec, rate, concurrency, label, index: int = 0
) -> Point:
    cfg = RunConfig(
        request_rate=rate,
        burstiness=args.burstiness,
        max_concurrency=concurrency,
        duration=args.duration,
        seed=args.seed,
        think_time=args.think_time,
        request_timeout=args.request_timeout,
        progress=not args.disable_tqdm,
    )
    count = lambda text: len(prep.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    sessions = prep.workload(index)
    base_url = spec.url.rsplit("/v1/", 1)[0]
    before = await read_spec_counters(base_url, spec.headers)
    run = await run_workload(sessions, spec, cfg, count)
    summary = metrics.summarize(run.results, run.duration, prep.percentiles, prep.goodput or None)
    summary |= spec_summary(before, await read_spec_counters(base_url, spec.headers))
    class_slos = {c.name: c.slo for c in prep.classes if c.slo}
    attain = None
    if prep.goodput or class_slos:
        attain = metrics.attainment(run.results, class_slos, prep.goodput or None)
    meta = {
        "backend": args.backend,
        "label": label or args.label,
        "base_url": base_url,
        "model_id": spec.model,
        "tokenizer_id": prep.tokenizer_id,
        "dataset_name": args.dataset_name,
        "num_prompts": num_requests(sessions) if args.duration is None else None,
        "request_rate": rate_value(rate),
        "burstiness": args.burstiness,
        "max_concurrency": concurrency,
        "seed": prep.seed + index,
        "goodput": prep.goodput or None,
    }
    result = build_result(meta, summary, run, attain, args.save_detailed)
    print(format_summary(result, prep.percentiles, goodput=bool(prep.goodput)))
    return Point(result, run)


async def search_max_rate(
    args, prep: Prepared, spec: RequestSpec, label: str, first: int = 0
) -> list[Point]:
    from tandem.bench.search import find_max_rate

    if not prep.goodput and not any(c.slo for c in prep.classes):
        raise ValueError("--find-max-rate needs SLOs: --goodput ttft:MS ... or classes with SLOs")
    probes: list[Point] = []

    async def probe(rate: float) -> float:
        point = await run_point(
            args, prep, spec, rate, prep.concurrencies[0], label, first + len(probes)
        )
        point.result["search_probe"] = True
        probes.append(point)
        return point.result["slo_attainment"]["all"]["attainment"]

    start = next((r for r in prep.rates if math.isfinite(r)), 1.0)
    found = await find_max_rate(probe, args.slo_target, start, args.max_probes)
    print(
        f"max rate with SLO attainment >= {args.slo_target:.0%}: "
        + (f"{found.max_rate:.3g} req/s" if found.max_rate else "none of the rates probed")
    )
    for p in probes:
        p.result["max_rate_found"] = found.max_rate
    return probes


def report(args, points: list[Point], name: str) -> None:
    """Save JSON (one vLLM-style file per point, plus a list for a sweep) and plots."""
    from tandem.bench import plots

    if len(points) > 1:
        print(format_sweep([p.result for p in points]))
    if not (args.save_result or args.plot):
        return
    out = Path(args.result_dir)
    # --result-filename is the file itself inside --result-dir (an absolute one stays as it is)
    target = out / args.result_filename if args.result_filename else out / f"{name}.json"
    base = target.stem
    if args.save_result:
        ext = target.suffix or ".json"
        for p in points:  # one point: exactly the target; a sweep: a file per point beside it
            path = target.with_name(f"{base}{_point_suffix(p, len(points))}{ext}")
            save_json(p.result, target if len(points) == 1 else path)
        if len(points) > 1:
            save_json(
                {"points": [p.result for p in points]}, target.with_name(f"{base}-sweep.json")
            )
        print(f"results saved as {target.parent}/{base}*")
    if args.plot:
        runs = {_point_label(p): p.run.results for p in points}
        plots.latency_cdfs(runs, out / f"{base}-cdf.png", title=base)
        finite = [p.result for p in points if p.result["request_rate"] != "inf"]
        if len(finite) > 1:
            plots.sweep({args.label or "run": finite}, out / f"{base}-sweep.png", title=base)
        print(f"plots saved under {out}/{base}-*.png")


def _point_label(p: Point) -> str:
    r = p.result
    return f"rate {r['request_rate']}" + (
        f", c={r['max_concurrency']}" if r["max_concurrency"] else ""
    )


def _point_suffix(p: Point, n: int) -> str:
    if n == 1:
        return ""
    r = p.result
    return f"-rate{r['request_rate']}" + (
        f"-c{r['max_concurrency']}" if r["max_concurrency"] else ""
    )


def default_name(args) -> str:
    return f"bench-{args.dataset_name}-{args.label or args.backend}"


def run(args: argparse.Namespace) -> int:
    prep = prepare(args)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    print(
        f"workload: {args.dataset_name}, {num_requests(prep.sessions)} requests, seed {args.seed}"
    )
    points = asyncio.run(run_points(args, prep, base_url))
    report(args, points, default_name(args))
    return 1 if report_failures(points) else 0


def report_failures(points: list[Point]) -> bool:
    """Print the first errors of every point whose requests all failed; True if any did."""
    failed = False
    for p in points:
        results = p.run.results
        if results and not any(r.success for r in results):
            failed = True
            print(f"error: all {len(results)} requests failed at {_point_label(p)}; first errors:")
            for err in list(dict.fromkeys(r.error for r in results))[:3]:
                print(f"  {err}")
    return failed

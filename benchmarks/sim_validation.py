"""`tandem sim` against the real thing: this machine's fitted profile (`tandem profile`) in
the simulator vs the real engine and servers, on the same seeded requests (the bench's own
prompts, tokenized as the server tokenizes them, at the arrival times it draws), at several
request rates:

    python benchmarks/sim_validation.py [--rates 0.5,1.5,2.5] [--num-prompts 60]

Three modes: `engine`, the real EngineCore and ModelRunner in-process on the wall clock (no
HTTP; every core, profiled so); `served`, `tandem serve` pinned to one core (`taskset`,
OMP_NUM_THREADS=1, as an instance on its own device) with the bench client on the other; and
`1p1d`, prefill and decode servers pinned to a core each behind `tandem proxy` (the proxy
and the client beside the prefill server, so the decode server has its core as the served
mode's has), profiled on one core. Each rate point is profiled right before and right after
its run, on the shapes the workload's steps have, and simulated with the mean of the two: this machine is shared,
its speed drifts by tens of percent over minutes, and profiles bracketing a whole mode's
runs (as the first versions took them) were up to 36% apart. Each rate gets its own seed,
so no prompt is cached from an earlier point. Runs, like the profile, are timed on mapped KV
pages: the engine maps its pool first, the servers first take prompts enough to cycle theirs
(a fresh pool's first writes are page faults; see warm_pool). Prints mean and p99 TTFT and
mean TPOT, real and simulated, the simulation's error, and each point's simulated
utilisation. In engine mode the same requests are also
simulated with a cost model fitted on the steps the real run ran (`engine-own`): near
saturation queueing turns the host's drift into larger latency errors, and this second
figure separates what the simulator gets wrong from what the host did.

Each step's simulated time is drawn from the spread of the profile's single runs (its
step_noise; the `fixed` rows take the fitted time exactly). The profile runs on a quiet core;
a server's steps share theirs with its API process and spread wider, so in served mode the
`loaded` rows draw each step's time from the spread of the server's own steps in the
calibration burst instead (TANDEM_STEP_LOG: each step's shape and seconds, over the
profile's prediction for that shape, which the simulated runner centres on their mean; seeds
no point uses). In engine mode the simulated group's token_ms is the engine loop's own time
per sampled token (schedule and update, measured in its warm-up). A server's host time outside
its model steps (its API process taking each step's outputs and streaming them, its engine
core's loop and messages: CPU time of both processes, less the core's in model steps, read
from /proc and /metrics) is fitted as step_ms per step plus token_ms per sampled token plus
request_ms per request (its HTTP and tokenization, on the same core) over three calibration
runs, in non-negative least squares: CALIBRATION requests one at a time, BURST at a
concurrency of 8, and CALIBRATION more one at a time with one output token each. What the
one-at-a-time requests take beyond their simulated steps (HTTP, tokenization, the proxy's hops
and the decode side's KV import) is the fixed cost the simulated front group gets as
latency_ms. The prefill server's steps also run longer than its profile's (it sends each
layer's KV from inside them, and shares its core): its group's step_scale, its logged steps in
the calibration burst over the profile's prediction for their shapes.

Every tandem server logs its steps (the served one's, 1p1d's prefill and decode server's): for
each rate the script prints the gaps between a server's steps and how their seconds compare
with the profile's prediction (in all, prefill steps, decode-only steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pd_disagg import free_port  # noqa: E402

BLOCKS, BLOCK = 2048, 16  # the KV pool both the servers and the simulated instances get
BATCHED = 2048  # max_num_batched_tokens (vLLM server's default)
KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")
STATISTIC = "median"  # of a profile point's repeats: what a run of many steps meets
CALIBRATION, CALIBRATION_POINT = 8, 100  # requests timed one at a time, and their seed offset
BURST = 24  # calibration requests sent 8 at a time (seed offset CALIBRATION_POINT + 2)
WARM_LEN = 1024  # prompt tokens of the requests that cycle a server's KV pool once
WARM_POINT = 200  # their seed offset


GRID = [
    "--prefill-tokens",
    "0,64,160,288,384,768",
    "--prefill-context",
    "0",
    "--decode-rows",
    "0,1,4,5,8,12",
    "--decode-context",
    "128,384",
]  # the shapes this workload's steps have; 768: two prompts prefilled in one step (priced
# 11-14% under by a grid that stopped at 384, as the server's step log showed)


def profile(path: Path, cores: str | None, threads: int | None):
    """`tandem profile` on the workload's shapes, as the servers will run (cores, threads)."""
    from tandem.core.cost_model import CostModel

    cmd = [sys.executable, "-m", "tandem.cli", "profile", "-o", str(path), *GRID,
           "--statistic", STATISTIC]  # fmt: skip
    env = dict(os.environ)
    if cores:
        cmd = ["taskset", "-c", cores, *cmd]
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"profiling: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return CostModel.load(path)


def bracketed(before, after, path: Path) -> tuple[Path, float]:
    """The mean of the profiles taken before and after a run (the machine is shared and
    drifts), and how far apart they are over the grid's decode and prefill steps."""
    from tandem.core.cost_model import CostModel, StepShape

    shapes = [StepShape.prompt(p, d).plus(kv_tokens=d * c)
              for p in (0, 64, 192, 384) for d in (0, 1, 4, 12) for c in (128, 384) if p or d]  # fmt: skip
    drift = sum(abs(after.predict(s) / before.predict(s) - 1) for s in shapes) / len(shapes)
    mean = CostModel(tuple((a + b) / 2 for a, b in zip(before.coef, after.coef)),
                     {"source": "mean of the profiles before and after a run", "drift": drift},
                     before.kernels,
                     tuple((a + b) / 2 for a, b in zip(before.noise, after.noise)))  # fmt: skip
    mean.save(path)
    return path, drift


def bench(url: str, out: Path, name: str, args, rate: float, point: int, cores=None,
          extra=()) -> dict:  # fmt: skip
    cmd = ["taskset", "-c", cores] if cores else []
    cmd += [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
           "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(out),
           "--result-filename", f"{name}.json", "--request-rate", str(rate),
           "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", str(args.range_ratio),
           "--seed", str(args.seed + point), *extra]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def warm_pool(url: str, out: Path, mode: str, args, cores) -> None:
    """Prompts enough to cycle the servers' whole KV pool once (seeded apart from every
    point). A server's pool maps its pages as they are first written, each a page fault:
    steps on fresh blocks ran up to 10x slow in a profile, which times steady state (pages
    mapped, as a server's are once traffic has been through its pool), as the runs must."""
    n = BLOCKS * BLOCK // WARM_LEN + 4
    print(f"{mode}: {n} prompts of {WARM_LEN} tokens through the KV pool", flush=True)
    bench(url, out, f"{mode}-warm-up", args, float("inf"), WARM_POINT, cores,
          ["--num-prompts", str(n), "--random-input-len", str(WARM_LEN),
           "--random-output-len", "1", "--random-range-ratio", "0", "--max-concurrency", "4"])  # fmt: skip


def logged_steps(path: Path | None) -> list:
    """(StepShape, start, seconds) of each model step a server's step log holds
    (TANDEM_STEP_LOG: a JSON line a step, the shape's fields, then start and seconds)."""
    from tandem.core.cost_model import StepShape

    if path is None or not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(StepShape(*row[:-2]), row[-2], row[-1]) for row in rows]


def step_gaps(steps) -> dict:
    """Milliseconds between one logged step's end and the next one's start (logged_steps):
    the engine loop's own time, its API process on the same core and, at low load, idle
    waits for requests."""
    import statistics

    gaps = sorted(1e3 * (b[1] - a[1] - a[2]) for a, b in zip(steps, steps[1:]))
    if not gaps:
        return {}
    at = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))]  # noqa: E731
    return {"steps": len(steps), "mean": statistics.fmean(gaps), "p50": at(0.5),
            "p90": at(0.9), "p99": at(0.99), "max": gaps[-1]}  # fmt: skip


def step_ratios(steps, cost: Path) -> dict:
    """How a run's logged steps (logged_steps) compare with the profile's predictions: the
    ratio of their summed seconds, in all and for steps with and without prefill tokens, and
    the 10th / 50th / 90th percentile and largest ratio of single steps."""
    from tandem.core.cost_model import CostModel

    model = CostModel.load(cost)
    pairs = [(s.prefill_tokens > 0, t, model.predict(s)) for s, _, t in steps]
    ratio = lambda ps: sum(t for _, t, _ in ps) / max(1e-9, sum(p for *_, p in ps))  # noqa: E731
    each = sorted(t / p for _, t, p in pairs if p > 0)
    at = lambda q: each[min(len(each) - 1, int(q * len(each)))]  # noqa: E731
    return {"ratio": ratio(pairs), "ratios": [at(0.1), at(0.5), at(0.9), each[-1]] if each else [],
            "prefill_ratio": ratio([x for x in pairs if x[0]]),
            "decode_ratio": ratio([x for x in pairs if not x[0]])}  # fmt: skip


def loaded_noise(steps, cost: Path) -> tuple[float, ...]:
    """The spread of a server's steps under load about the profile's prediction, in the form
    of the profile's own step_noise (20 equally likely ratios, which the runner centres on
    their mean): the host costs (step_ms, token_ms) carry the mean of what load adds; this,
    how unevenly it lands."""
    from tandem.core.cost_model import CostModel, noise_quantiles

    model = CostModel.load(cost)
    return noise_quantiles([[t] for *_, t in steps], [model.predict(s) for s, *_ in steps])


def with_noise(cost: Path, noise: tuple[float, ...], path: Path) -> Path:
    from tandem.core.cost_model import CostModel

    model = CostModel.load(cost)
    info = {**(model.info or {}), "step_noise": "the calibration burst's steps (loaded_noise)"}
    CostModel(model.coef, info, model.kernels, noise).save(path)
    return path


def calibrate(url: str, out: Path, mode: str, args, cores, point: int, servers,
              step_log: Path | None = None) -> tuple:  # fmt: skip
    """CALIBRATION requests one at a time (no queueing), then BURST eight at a time, on seeds
    no point uses. Returns the real TTFTs of the first, the requests to simulate them with
    (spaced so none overlaps another), and each server's host time, steps and sampled tokens
    in each run (host_usage), and the burst's model steps from `step_log` (a server's
    TANDEM_STEP_LOG; none without). What the one-at-a-time requests take beyond their
    simulated prefill is the fixed cost outside the engine's steps (HTTP, tokenization, the
    proxy's hops), the simulated group's latency_ms; the host times give its step_ms,
    token_ms and request_ms (with a third run, CALIBRATION more one at a time with one output
    token each)."""
    before = host_usage(servers)
    # --ready-timeout 0: no test request, so the servers' counters hold these requests alone
    real = bench(url, out, f"{mode}-calibration", args, float("inf"), point, cores,
                 ["--max-concurrency", "1", "--num-prompts", str(CALIBRATION),
                  "--ready-timeout", "0"])  # fmt: skip
    middle, logged = host_usage(servers), len(logged_steps(step_log))
    bench(url, out, f"{mode}-burst", args, float("inf"), point + 2, cores,
          ["--max-concurrency", "8", "--num-prompts", str(BURST), "--ready-timeout", "0"])  # fmt: skip
    after, burst = host_usage(servers), logged_steps(step_log)[logged:]
    # CALIBRATION more one at a time, one token each: mostly what a request costs the host
    # once (HTTP, tokenization), beside the two runs' mostly per-step and per-token costs
    bench(url, out, f"{mode}-arrivals", args, float("inf"), point + 1, cores,
          ["--max-concurrency", "1", "--num-prompts", str(CALIBRATION), "--random-output-len",
           "1", "--random-range-ratio", "0", "--ready-timeout", "0"])  # fmt: skip
    last = host_usage(servers)
    usage = [[tuple(b - a for a, b in zip(x, y)) for x, y in zip(first, second)]
             for first, second in ((before, middle), (middle, after), (after, last))]  # fmt: skip
    requests = sim_requests(args, 1.0, point, CALIBRATION)
    spaced = [dataclasses.replace(r, arrival=60.0 * i) for i, r in enumerate(requests)]
    return real, spaced, [list(runs) for runs in zip(*usage)], burst


def host_usage(servers) -> list[tuple[float, float, float, float, float]]:
    """Per tandem server, cumulative: (seconds of CPU its API and engine-core processes took
    outside model steps, steps, sampled tokens, seconds its model steps took, their CPU
    seconds): /proc for the processes' CPU, the server's /metrics for the core's time and CPU
    in model steps and the counts."""
    import httpx

    tick, usage = os.sysconf("SC_CLK_TCK"), []

    def cpu(pid: int) -> float:  # utime + stime
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    for server in servers:
        pid = server.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = cpu(pid) + sum(cpu(int(c)) for c in children)
        metrics = {}
        for line in httpx.get(f"{server.base_url}/metrics", trust_env=False).text.splitlines():
            if line.startswith("tandem:") and " " in line:
                name, value = line.rsplit(" ", 1)
                metrics[name.split("{")[0]] = float(value)
        usage.append((total - metrics["tandem:engine_execute_cpu_seconds_total"],
                      metrics["tandem:engine_steps_total"],
                      metrics["tandem:generation_tokens_total"],
                      metrics["tandem:engine_execute_seconds_total"],
                      metrics["tandem:engine_execute_cpu_seconds_total"]))  # fmt: skip
    return usage


def handoff_stages(url: str) -> dict[str, tuple[float, float]]:
    """The proxy's cumulative tandem:pd_handoff_stage_seconds: {stage: (sum, count)}."""
    import httpx

    stages: dict[str, tuple[float, float]] = {}
    for line in httpx.get(f"{url}/metrics", trust_env=False).text.splitlines():
        name, _, value = line.partition(" ")
        kind = name.split("{")[0].removeprefix("tandem:pd_handoff_stage_seconds_")
        if kind in ("sum", "count") and 'stage="' in name:
            stage = name.split('stage="')[1].split('"')[0]
            total, n = stages.get(stage, (0.0, 0.0))
            add = float(value)
            stages[stage] = (total + add, n) if kind == "sum" else (total, n + add)
    return stages


def staged_bench(url: str, *bench_args) -> dict:
    """A bench run through the proxy, with the mean of each handoff stage in it (ms): where
    its TTFT went, to set beside the simulated stages."""
    before = handoff_stages(url)
    real = bench(url, *bench_args)
    means = real["pd_handoff_stage_ms"] = {}
    for stage, (total, n) in handoff_stages(url).items():
        was_total, was_n = before.get(stage, (0.0, 0.0))
        if n > was_n:
            means[stage] = 1e3 * (total - was_total) / (n - was_n)
    return real


def host_costs(runs) -> dict:
    """{step_ms, token_ms, request_ms} >= 0 fitting host seconds = step_ms * steps + token_ms
    * tokens + request_ms * requests over the three calibration runs [(host seconds, steps,
    tokens, ...)] of CALIBRATION, BURST and CALIBRATION requests, in least squares (exact
    where the three allow it; where that needs a negative cost, the best fit with that cost
    at 0: non-negative least squares, by trying each subset of the three)."""
    import itertools

    import numpy as np

    a = np.array([(steps, tokens, n) for (_, steps, tokens, *_), n in
                  zip(runs, (CALIBRATION, BURST, CALIBRATION))], float)  # fmt: skip
    h = np.array([run[0] for run in runs], float)
    best = (float("inf"), np.zeros(3))
    for size in (3, 2, 1):
        for keep in map(list, itertools.combinations(range(3), size)):
            costs = np.zeros(3)
            costs[keep] = np.linalg.lstsq(a[:, keep], h, rcond=None)[0]
            residual = float(np.linalg.norm(a @ costs - h))
            if (costs >= 0).all() and residual < best[0] - 1e-12:
                best = (residual, costs)
    return dict(zip(("step_ms", "token_ms", "request_ms"), (1e3 * best[1]).tolist()))


def sim_requests(args, rate: float, point: int, n: int | None = None):
    """The bench's requests for this rate (n of them, else --num-prompts), as the simulator
    takes them."""
    from tandem.bench.serve import build_workload, load_tokenizer
    from tandem.sim.workload import from_bench

    _, tokenizer = load_tokenizer(None)
    ns = argparse.Namespace(dataset_name="random", num_prompts=n or args.num_prompts,
                            random_input_len=args.input_len, random_output_len=args.output_len,
                            random_range_ratio=args.range_ratio)  # fmt: skip
    sessions = build_workload(ns, tokenizer, [], args.seed + point)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=True)  # noqa: E731
    return from_bench(sessions, encode, rate, 1.0, args.seed + point)


def engine_runner(args, rates: list[float]):
    """The real EngineCore and ModelRunner in this process (the engine loop `tandem serve`
    runs, without HTTP), warmed up; a function running one rate's requests through it,
    summarized as a bench run is, with the (shape, seconds) of every step it ran; and where
    the runner switches kernels."""
    from tandem.bench import metrics
    from tandem.engine.builder import build_engine
    from tandem.engine.config import EngineConfig
    from tandem.engine.heap import freeze_startup_heap
    from tandem.sim.replay import replay
    from tandem.sim.report import to_results

    core, loaded = build_engine(EngineConfig(num_kv_blocks=BLOCKS, max_num_batched_tokens=BATCHED))
    freeze_startup_heap("engine")  # as the served engine core does: no full-collection stalls
    core.runner.map_kv_pool()  # steady state, as the profile times it (see warm_pool)
    steps, observe = [], core.scheduler.observe_step
    core.scheduler.observe_step = lambda plan, sec: (steps.append((plan.shape, sec)), observe(plan, sec))  # fmt: skip
    # warm-up, on a seed no point uses, whole: before the pool was mapped up front its first
    # writes ran a replay 2x slow (tests/sim/test_validation.py); the rest warms up too. It
    # also measures the engine loop's own time per sampled token (schedule and update: what
    # the cost model, timing the runner, leaves out), the simulated group's token_ms.
    loop = [0.0, 0]

    def timed_step(step=core.step):
        outputs = step()
        if outputs:
            loop[0] += core.last_step_timings["schedule"] + core.last_step_timings["update"]
            loop[1] += len(outputs)
        return outputs

    core.step = timed_step
    replay(core, sim_requests(args, max(rates), len(rates)))
    del core.step  # the class's own step again

    def run(i: int, rate: float) -> tuple[dict, list]:
        steps.clear()
        requests = sim_requests(args, rate, i)
        records = replay(core, requests)
        end = max(r.finished for r in records)
        return metrics.summarize(to_results(records), end - requests[0].arrival), list(steps)

    return run, loaded.kernel_rows, 1e3 * loop[0] / max(1, loop[1])


def own_steps(steps, kernels, path: Path, profiled: Path) -> Path:
    """A cost model fitted on the steps a real run ran (what the profile would be had the host
    held one speed), their spread about it, and how much slower than the profile they were."""
    from tandem.core.cost_model import CostModel, noise_quantiles

    model = CostModel.load(profiled)
    slower = sum(t for _, t in steps) / sum(model.predict(s) for s, _ in steps) - 1
    own = CostModel.fit(steps, kernels)
    noise = noise_quantiles([[t] for _, t in steps], [own.predict(s) for s, _ in steps])
    info = {"source": "the run's own steps", "vs_profile": slower}
    CostModel(own.coef, info, kernels, noise).save(path)
    print(f"{len(steps)} steps ran {slower:+.0%} against the profile's prediction", flush=True)
    return path


def busiest(sim: dict) -> float:
    """The simulated utilisation of the busiest group (a 1p1d pair: its prefill or decode)."""
    return max(g["utilization"] for g in sim["groups"].values())


def mean_error(rows) -> float:
    """Mean |simulated / real - 1| over the KEYS of (mode, rate, real, simulated, ...) rows."""
    errors = [abs(row[3][k] / row[2][k] - 1) for row in rows for k in KEYS]
    return sum(errors) / len(errors)


def simulate(cluster: dict, base: Path, requests) -> dict:
    from tandem.sim.cluster import ClusterSpec
    from tandem.sim.report import simulate

    return simulate(ClusterSpec.from_dict(cluster, base), requests)


def main() -> None:
    from tandem.bench.servers import ManagedServer, tandem_server
    from tandem.core.cost_model import CostModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="0.5,1.5,2.5")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="engine,served,1p1d")
    ap.add_argument(
        "--link-gbs", type=float, default=4.0, help="loopback KV transfer (kv_transfer.py)"
    )
    ap.add_argument("--result-dir", default="bench-results/sim-validation")
    args = ap.parse_args()
    out = profiles = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    if not (shutil.which("taskset") and (os.cpu_count() or 1) >= 2):
        raise SystemExit("needs taskset and two cores: instances are pinned to one core each")
    # how each mode's instances run, and so how its profile is taken: (cores, torch threads)
    how = {"engine": (None, None), "served": ("1", 1), "1p1d": ("1", 1)}
    engine = ["--num-kv-blocks", str(BLOCKS), "--max-num-batched-tokens", str(BATCHED),
              "--disable-uvicorn-access-log"]  # fmt: skip
    group = {"kv_tokens": BLOCKS * BLOCK}

    def cluster(mode: str, cost: Path, host=None, noise: bool = True) -> dict:
        """The simulated mode; `host`: its groups' host costs ({name: {latency_ms, step_ms,
        token_ms, step_scale}})."""
        host, groups, links = host or {}, [{"name": "local"}], []
        if mode == "1p1d":
            groups = [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]
            links = [{"from": "p", "to": "d", "bandwidth_gbs": args.link_gbs, "latency_ms": 0.2}]
        groups = [group | g | {"cost_model": str(cost), "step_noise": noise}
                  | host.get(g["name"], {}) for g in groups]  # fmt: skip
        return {"model": "smollm2-135m", "groups": groups, "links": links,
                "engine": {"max_num_batched_tokens": BATCHED, "block_size": BLOCK}}  # fmt: skip

    def pin(server, core: str):
        server.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server.cmd = ["taskset", "-c", core, *server.cmd]
        return server

    def measure(mode: str):
        """The mode's real runs, one per rate, each followed by a profile (point i is
        bracketed by profiles i and i + 1; a new seed each rate, so nothing is cached from an
        earlier point): the runs' results, the profiles, the engine's steps per run and where
        its kernels switch (engine mode), and the calibration (served modes)."""
        taken, reals = [profile(profiles / f"{mode}-0.json", *how[mode])], []

        def each_rate(run_one) -> None:
            for i, rate in enumerate(rates):
                reals.append(run_one(i, rate))
                taken.append(profile(profiles / f"{mode}-{i + 1}.json", *how[mode]))

        if mode == "engine":  # the real EngineCore in this process, no HTTP
            run_engine, wide, token_ms = engine_runner(args, rates)
            each_rate(run_engine)
            return [r for r, _ in reals], taken, [steps for _, steps in reals], wide, token_ms
        if mode == "served":  # one core for the server, the other for the client
            servers = [pin(tandem_server(free_port(), None, engine, out / "served.log"), "1")]
        else:
            p = pin(tandem_server(free_port(), None, [*engine, "--role", "prefill"],
                                  out / "p.log"), "0")  # fmt: skip
            d = pin(tandem_server(free_port(), None, [*engine, "--role", "decode"],
                                  out / "d.log"), "1")  # fmt: skip
            port = free_port()
            cmd = [sys.executable, "-m", "tandem.cli", "proxy", "--host", "127.0.0.1",
                   "--port", str(port), "--prefill", p.base_url, "--decode", d.base_url]  # fmt: skip
            proxy = ManagedServer("proxy", cmd, f"http://127.0.0.1:{port}", out / "proxy.log")
            servers = [p, d, pin(proxy, "0")]  # the proxy beside the prefill server
        tandems = servers[:2] if mode == "1p1d" else servers  # (prefill, decode), no proxy
        # each tandem server's own steps (TANDEM_STEP_LOG), by role
        logs = ({r: out / f"1p1d-{r}-steps.jsonl" for r in ("p", "d")} if mode == "1p1d"
                else {"": out / "served-steps.jsonl"})  # fmt: skip
        for s, log in zip(tandems, logs.values()):
            log.unlink(missing_ok=True)
            s.env["TANDEM_STEP_LOG"] = str(log)
        # the calibration burst's steps: the served server's (their spread) or the prefill
        # server's (how much longer than the profile's they run)
        step_log = logs.get("", logs.get("p"))
        for s in servers:
            s.start()
        try:
            for s in servers:
                s.wait_ready(600)
            client, url = "0", servers[-1].base_url  # 1p1d: beside the prefill server
            warm_pool(url, out, mode, args, client)
            for n in (1, 0):  # the first warms the servers up (its own prompts: no cache hit)
                calibration = calibrate(url, out, mode, args, client, CALIBRATION_POINT + 3 * n,
                                        tandems, step_log)  # fmt: skip
            (out / f"{mode}-calibration-usage.json").write_text(json.dumps(calibration[2]))
            run = staged_bench if mode == "1p1d" else bench

            def logged_run(i: int, rate: float) -> dict:
                first = {role: len(logged_steps(log)) for role, log in logs.items()}
                real = run(url, out, f"{mode}-{rate:g}", args, rate, i, client)
                real["steps"] = {role: logged_steps(log)[first[role]:] for role, log in logs.items()}  # fmt: skip
                return real

            each_rate(logged_run)
        finally:
            for s in reversed(servers):
                s.stop()
        return reals, taken, [], None, calibration

    def calibration_costs(mode: str, cost: Path, calibration) -> dict:
        """Host costs of the mode's groups ({name: {latency_ms, step_ms, token_ms,
        request_ms, step_scale}}). The engine's: no HTTP, and its loop's measured time per
        token (engine_runner). The servers': step_ms, token_ms and request_ms from their host
        time in the calibration runs (host_costs); a prefill server's step_scale, how much
        longer than its profile's its model steps ran (the KV it sends, the core it shares);
        the front group's latency_ms, what the requests timed one at a time (just before the
        first rate: priced with its profiles) took beyond their simulated steps."""
        if mode == "engine":
            print(f"engine: its loop took {calibration:.2f} ms a sampled token", flush=True)
            return {"local": {"token_ms": calibration}}
        real, spaced, usage, _ = calibration
        names = ["p", "d"] if mode == "1p1d" else ["local"]
        host = {name: host_costs(runs) for name, runs in zip(names, usage)}
        for name, runs in zip(names, usage):
            print(f"{mode} {name}: host " + ", ".join(
                f"{1e3 * h / max(1, n):.2f} ms a step ({t / max(1, n):.1f} tokens a step)"
                for h, n, t, *_ in runs) + " -> step_ms {step_ms:.2f}, token_ms {token_ms:.2f}, "
                "request_ms {request_ms:.2f}".format(**host[name]), flush=True)  # fmt: skip
        if mode == "1p1d":
            # The prefill server's steps run longer than its profile's: it exports and sends
            # each layer's KV from inside them, and it shares its core with the client and
            # the proxy streaming the decode side's tokens, and the machine with a busy decode
            # server. Its step_scale: its own logged steps in the burst over what the profile
            # says the same shapes take. (The CPU time of its steps one at a time over the
            # profile's, times their wall over CPU time in the burst, as earlier versions took
            # it, missed a tenth: 1.15 where the rate runs' steps ran 1.20-1.28x a profile.)
            steps = calibration[3]
            ratio = step_ratios(steps, cost)["ratio"]
            alone = simulate(cluster(mode, cost, noise=False), ROOT, spaced)["groups"]["p"]
            (*_, cpu), (*_, burst_wall, burst_cpu) = usage[0][:2]
            host["p"]["step_scale"] = ratio
            print(f"1p1d p: {len(steps)} steps in the burst ran {ratio:.2f}x the profile's "
                  f"prediction -> step_scale {ratio:.2f} (its steps' CPU one at a time "
                  f"{cpu / alone['busy_seconds']:.2f}x the profile's; in the burst their wall "
                  f"{burst_wall / burst_cpu:.2f}x their CPU time)", flush=True)  # fmt: skip
        sim = simulate(cluster(mode, cost, host, noise=False), ROOT, spaced)
        latency = max(0.0, real["mean_ttft_ms"] - sim["mean_ttft_ms"])
        host[names[-1]]["latency_ms"] = latency
        print(f"{mode}: {latency:.0f} ms a request outside the engine's steps "
              f"({real['mean_ttft_ms']:.0f} ms real TTFT one at a time, "
              f"{sim['mean_ttft_ms']:.0f} simulated)", flush=True)  # fmt: skip
        return host

    rows, untimed, drifts, hosts, stages, gaps = [], [], {}, {}, [], []
    for mode in modes:
        reals, taken, runs, wide, calibration = measure(mode)
        costs = [bracketed(taken[i], taken[i + 1], profiles / f"{mode}-{rate:g}.json")
                 for i, rate in enumerate(rates)]  # fmt: skip
        drifts[mode] = [drift for _, drift in costs]
        host = hosts[mode] = calibration_costs(mode, costs[0][0], calibration)
        burst = calibration[3] if mode == "served" else []
        if burst:  # the served server's steps in the calibration burst: their spread
            noise = loaded_noise(burst, costs[0][0])
            quiet = CostModel.load(costs[0][0]).noise
            print(f"{mode}: {len(burst)} steps in the burst; spread (10th / 50th / 90th / "
                  f"largest ratio) {noise[2]:.2f} / {noise[10]:.2f} / {noise[17]:.2f} / {noise[-1]:.2f}, the "
                  f"profile's {quiet[2]:.2f} / {quiet[10]:.2f} / {quiet[17]:.2f} / {quiet[-1]:.2f}",
                  flush=True)  # fmt: skip
        for i, (rate, real, (cost, _)) in enumerate(zip(rates, reals, costs)):
            for role, steps in real.get("steps", {}).items():
                if steps:
                    name = f"{mode} {role}".strip()
                    gaps.append((name, rate, {**step_gaps(steps), **step_ratios(steps, cost)}))
            real = {k: real[k] for k in KEYS}
            variants = [(mode, cost, True), (f"{mode} fixed", cost, False)]
            if burst:  # each step's time drawn from the spread under load instead
                loaded = with_noise(cost, noise, profiles / f"{mode}-{rate:g}-loaded.json")
                variants.append((f"{mode} loaded", loaded, True))
            for name, priced, noisy in variants:
                sim = simulate(cluster(mode, priced, host, noisy), ROOT,
                               sim_requests(args, rate, i))  # fmt: skip
                rows.append((name, rate, real, {k: sim[k] for k in KEYS}, busiest(sim)))
                print(name, rate, real, rows[-1][3], flush=True)
                if mode == "1p1d" and name == mode:
                    stages.append((rate, reals[i]["pd_handoff_stage_ms"],
                                   sim["pd_handoff_stage_ms"]))  # fmt: skip
            # what the host costs and step_scale are worth: the same point without them
            bare = {name: {"latency_ms": h.get("latency_ms", 0.0)} for name, h in host.items()}
            sim = simulate(cluster(mode, cost, bare), ROOT, sim_requests(args, rate, i))
            untimed.append((mode, rate, real, {k: sim[k] for k in KEYS}))
            if mode == "engine":  # the same requests, priced by the run's own steps
                own = own_steps(runs[i], wide, profiles / f"engine-{rate:g}-own.json", cost)
                sim = simulate(cluster(mode, own, host), ROOT, sim_requests(args, rate, i))
                rows.append(("engine-own", rate, real, {k: sim[k] for k in KEYS}, busiest(sim)))

    print(f"\n{args.num_prompts} requests a point, random {args.input_len} in / {args.output_len} "
          f"out (range ratio {args.range_ratio}), seed {args.seed}; {os.cpu_count()} cores")  # fmt: skip
    head = f"{'mode':<14} {'rate':>5} {'busy':>5}" + "".join(
        f" {k.replace('_ms', ''):>22}" for k in KEYS
    )
    print(head + "\n" + " " * 26 + "".join(f" {'real / sim / err':>22}" for _ in KEYS))
    worst: dict[str, float] = {}
    for mode, rate, real, sim, busy in rows:
        cells = ""
        for k in KEYS:
            err = sim[k] / real[k] - 1
            worst[mode] = max(worst.get(mode, 0.0), abs(err))
            cells += f" {real[k]:>7.0f} {sim[k]:>7.0f} {err:>+6.0%}"
        print(f"{mode:<14} {rate:>5g} {busy:>5.0%}{cells}")
    print("largest error: " + ", ".join(f"{m} {e:.0%}" for m, e in worst.items())
          + " (target: within 15%)")  # fmt: skip
    for mode in dict.fromkeys(row[0] for row in untimed):
        with_host = [r for r in rows if r[0] == mode]
        print(
            f"{mode}: mean absolute error {mean_error(with_host):.1%} with step_ms, token_ms, "
            f"request_ms and step_scale, "
            f"{mean_error([r for r in untimed if r[0] == mode]):.1%} without"
        )
    print("'fixed': every step takes the profile's time; the other rows draw each step's time "
          "from the spread of the profile's single runs (its step_noise), 'loaded' from the "
          "spread of the served server's own steps in the calibration burst; 'busy': the simulated "
          "share of time its busiest instance computes (near 100% queueing turns any error in "
          "step time into a far larger one in latency)")  # fmt: skip
    for mode, host in hosts.items():
        source = ("the engine loop's, measured in its warm-up" if mode == "engine" else
                  f"from {CALIBRATION} requests one at a time and {BURST} eight at a time")  # fmt: skip
        print(f"{mode}: " + "; ".join(
            f"{name} " + ", ".join(f"{k} {v:.2f}" for k, v in h.items())
            for name, h in host.items()) + f" (the host's time outside the engine's steps: {source})")  # fmt: skip
    for mode, rate, g in gaps:
        print(f"{mode} {rate:g} req/s: {g['steps']} steps; ms between them (the server's "
              f"step log) mean {g['mean']:.1f}, median {g['p50']:.1f}, p90 {g['p90']:.1f}, "
              f"p99 {g['p99']:.1f}, largest {g['max']:.1f}; seconds over the profile's "
              f"prediction {g['ratio']:.2f}x in all (10th / 50th / 90th / largest step "
              + " / ".join(f"{r:.2f}" for r in g["ratios"]) + "), prefill steps "
              f"{g['prefill_ratio']:.2f}x, decode-only {g['decode_ratio']:.2f}x", flush=True)  # fmt: skip
    for rate, real, sim in stages:
        print(f"1p1d {rate:g} req/s, mean ms a handoff stage (the proxy's, real / sim): " + ", ".join(
            f"{k} {real.get(k, 0):.0f} / {sim[k]:.0f}" for k in sim))  # fmt: skip
    if "engine-own" in worst:
        print("engine-own: the engine's requests simulated with a cost model fitted on that run's "
              "own steps (the host's speed while it ran, not the profile's)")  # fmt: skip
    for mode, drift in drifts.items():
        print(
            f"{mode}: the profiles before and after each rate's run differ by "
            + ", ".join(f"{d:.0%}" for d in drift)
            + " on average (the machine's own drift; each point is simulated with their mean)"
        )
    doc = {"drift": drifts, "host": hosts,
           "points": [{"mode": m, "rate": r, "real": a, "simulated": b, "simulated_busy": u}
                      for m, r, a, b, u in rows],
           "without_host_costs": [{"mode": m, "rate": r, "simulated": b}
                                for m, r, _, b in untimed],
           "pd_handoff_stage_ms": [{"rate": r, "real": a, "simulated": b}
                                   for r, a, b in stages],
           "step_gaps_ms": [{"mode": m, "rate": r, **g} for m, r, g in gaps]}  # fmt: skip
    (out / "validation.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()

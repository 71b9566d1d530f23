"""`tandem router --worker URL... [--policy ...]`, or `--prefill URL... --decode URL...` for PD
mode (`tandem proxy` is the same front end in PD mode): see router/app.py."""

from __future__ import annotations

import argparse
import logging

from tandem.engine.heap import freeze_startup_heap
from tandem.logs import setup_logging
from tandem.server.security import Access, AccessPolicy
from tandem.server.security_flags import add_security_args, client_tls, key_ring, uvicorn_tls


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: this machine only; 0.0.0.0 for all)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000)
    add_security_args(p, "/v1 and /workers (passed on to the workers)")
    p.add_argument("--worker-ca-certs", default=None,
                   help="CA certificates to check https:// workers against (a private CA)")  # fmt: skip
    p.add_argument("--worker-ssl-certfile", default=None,
                   help="a client certificate (PEM) for workers that require one (mutual TLS)")  # fmt: skip
    p.add_argument("--worker-ssl-keyfile", default=None,
                   help="the private key of --worker-ssl-certfile")  # fmt: skip
    p.add_argument("--stream-timeout", type=float, default=60.0,
                   help="longest silence inside a worker's streamed answer")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="longest a worker may take to its first token (a non-streamed answer: "
                   "to all of it)")  # fmt: skip
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )


def add_pd(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--prefill", nargs="+", required=required, metavar="URL",
                   help="PD mode: prefill instances (tandem serve --role prefill)")  # fmt: skip
    p.add_argument("--decode", nargs="+", required=required, metavar="URL",
                   help="PD mode: decode instances (tandem serve --role decode)")  # fmt: skip
    p.add_argument("--reserve-timeout", type=float, default=10.0,
                   help="PD mode: seconds a decode instance gets to reserve (stage 1)")  # fmt: skip
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="PD mode: seconds a prefill instance gets to compute and send the KV")  # fmt: skip
    from tandem.router.pd_ratio import PDRatioConfig

    d = PDRatioConfig()
    r = p.add_argument_group("PD mode: a prefill/decode ratio that follows the load")
    r.add_argument("--pd-ratio", default="static", choices=["static", "auto"],
                   help="auto: move instances between the pools by their predicted waits "
                   "(instances need --enable-role-switching)")  # fmt: skip
    r.add_argument("--pd-ttft-target", type=float, default=d.ttft_target,
                   help="seconds: the prefill pool's predicted wait is judged against it")  # fmt: skip
    r.add_argument("--pd-tpot-target", type=float, default=d.tpot_target,
                   help="seconds: ... the decode pool's predicted step time")  # fmt: skip
    r.add_argument("--pd-margin", type=float, default=d.margin,
                   help="one pool's pressure over the other's before an instance moves")  # fmt: skip
    r.add_argument("--pd-sustain", type=float, default=d.sustain,
                   help="seconds the imbalance must hold before a move")  # fmt: skip
    r.add_argument("--pd-cooldown", type=float, default=d.cooldown,
                   help="seconds after a move before the next")  # fmt: skip
    r.add_argument("--pd-cost-model", default=None,
                   help="a cost model from `tandem profile` to price the waits (default: a prior)")  # fmt: skip
    r.add_argument("--worker-admin-key", default=None,
                   help="the instances' admin key, for POST /role (if they have one)")  # fmt: skip


def add_parser(sub) -> None:
    from tandem.router.autoscale import AutoscaleConfig
    from tandem.router.policy import POLICIES

    p = sub.add_parser("router", help="route requests across tandem serve workers")
    p.add_argument("--worker", nargs="+", default=[], metavar="URL", help="worker URLs")
    p.add_argument("--worker-file", default=None,
                   help="a file of worker URLs (one per line), re-read while running")  # fmt: skip
    p.add_argument("--policy", default="prefix_aware", choices=POLICIES)
    p.add_argument("--cost-model", default=None,
                   help="cost policy: a cost model from `tandem profile` (default: a prior)")  # fmt: skip
    p.add_argument("--probe-interval", type=float, default=1.0,
                   help="seconds between health probes of a worker")  # fmt: skip
    p.add_argument("--eject-after", type=int, default=2,
                   help="failed probes or 5xx answers in a row that eject a worker")  # fmt: skip
    p.add_argument("--max-attempts", type=int, default=3,
                   help="workers a request may be tried on before it fails")  # fmt: skip
    p.add_argument("--retry-deadline", type=float, default=30.0,
                   help="seconds after arrival within which a retry may start")  # fmt: skip
    p.add_argument("--enable-worker-updating", action="store_true",
                   help="without --admin-api-key: open POST and DELETE /workers to API keys")  # fmt: skip
    a = p.add_argument_group("autoscaling (local workers the router starts and stops)")
    a.add_argument("--autoscale", action="store_true",
                   help="start and stop workers from --worker-command by the router's signals")  # fmt: skip
    a.add_argument("--worker-command", default=None,
                   help="the command of one worker, {port} where it listens, e.g. "
                   "'tandem serve MODEL --port {port}'")  # fmt: skip
    d = AutoscaleConfig()
    a.add_argument("--min-workers", type=int, default=d.min_workers)
    a.add_argument("--max-workers", type=int, default=d.max_workers)
    a.add_argument("--target-queue-per-worker", type=float, default=d.target_queue_per_worker,
                   help="scale up while the mean queue per worker stays above this")  # fmt: skip
    a.add_argument("--target-load-per-worker", type=float, default=d.target_load_per_worker,
                   help="scale up while the mean requests running or waiting per worker stay "
                   "above this (before a queue forms); also where the fleet shrinks to")  # fmt: skip
    a.add_argument("--max-kv-usage", type=float, default=d.max_kv_usage,
                   help="scale up while a worker's KV cache stays fuller than this (0-1)")  # fmt: skip
    a.add_argument("--max-predicted-ttft", type=float, default=d.max_predicted_ttft,
                   help="seconds: scale up while the cost model's TTFT on the best worker "
                   "stays above this (cost policy)")  # fmt: skip
    a.add_argument("--min-slo-attainment", type=float, default=d.min_slo_attainment,
                   help="0-1: scale up while the worst SLO class's attainment over the last "
                   "minute (the workers' own counters) stays below this")  # fmt: skip
    a.add_argument("--scale-lookahead", type=float, default=d.lookahead,
                   help="seconds: judge the load targets on the load projected this far ahead "
                   "on its trend over the last 2 minutes (a worker's cold start; 0: off)")  # fmt: skip
    a.add_argument("--scale-sustain", type=float, default=d.sustain,
                   help="seconds a signal must hold before the autoscaler acts")  # fmt: skip
    a.add_argument("--scale-up-cooldown", type=float, default=d.up_cooldown)
    a.add_argument("--scale-down-cooldown", type=float, default=d.down_cooldown)
    a.add_argument("--worker-start-timeout", type=float, default=300.0,
                   help="seconds a started worker gets to become healthy and warm")  # fmt: skip
    a.add_argument("--worker-api-key", default=None,
                   help="a key the started workers take (their --api-key), for the warm-up "
                   "request before they get traffic")  # fmt: skip
    a.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds a worker being removed gets to finish its requests")  # fmt: skip
    add_common(p)
    add_pd(p, required=False)


def run(args: argparse.Namespace) -> int:
    import httpx

    setup_logging("router")
    keys, tls = key_ring(args), uvicorn_tls(args)
    worker_tls = client_tls(args.worker_ca_certs, args.worker_ssl_certfile, args.worker_ssl_keyfile)
    pd = bool(getattr(args, "prefill", None) or getattr(args, "decode", None))
    client = httpx.AsyncClient(
        verify=worker_tls or True,
        timeout=None,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
    if pd:
        from tandem.disagg.proxy import Proxy, ProxyConfig
        from tandem.router.app import pd_app

        config = ProxyConfig(
            tuple(u.rstrip("/") for u in args.prefill or ()),
            tuple(u.rstrip("/") for u in args.decode or ()),
            args.reserve_timeout,
            args.prefill_timeout,
            args.stream_timeout,
            args.request_timeout,
        )
        proxy = Proxy(config, client)
        if args.pd_ratio == "auto":
            proxy.balancer = _balancer(args, proxy)
        access = Access(keys, AccessPolicy(admin=()), args.max_request_bytes)
        app, pool, closing = pd_app(proxy, access), proxy, None
        what = f"PD mode: prefill {config.prefill}, decode {config.decode}"
        if proxy.balancer is not None:
            what += ", the ratio following the load (--pd-ratio auto)"
    else:
        from tandem.core.cost_model import CostModel
        from tandem.router.app import Router, RouterConfig, plain_app
        from tandem.router.policy import build_policy
        from tandem.router.pool import WorkerPool

        if not args.worker and not args.worker_file and not args.autoscale:
            raise ValueError("router: give --worker URL..., --worker-file, --autoscale, or --prefill/--decode")  # fmt: skip
        if args.autoscale and not args.worker_command:
            raise ValueError("autoscale: give --worker-command (with {port}) to start workers from")  # fmt: skip
        for name in ("probe_interval", "retry_deadline", "request_timeout", "stream_timeout"):
            if not getattr(args, name) > 0:
                raise ValueError(f"{name} must be > 0 (seconds), got {getattr(args, name)!r}")
        if args.max_attempts < 1 or args.eject_after < 1:
            raise ValueError("max_attempts and eject_after must be >= 1")
        cost = CostModel.load(args.cost_model) if args.cost_model else None
        policy = build_policy(args.policy, cost)
        pool = WorkerPool(args.worker, policy, client, args.probe_interval,
                          eject_after=args.eject_after, watch_file=args.worker_file)  # fmt: skip
        config = RouterConfig(args.max_attempts, args.retry_deadline, args.request_timeout,
                              args.stream_timeout, worker_tls)  # fmt: skip
        router = Router(pool, config, client)
        if args.autoscale:
            router.supervisor = _supervisor(args, router, client)
        policy = AccessPolicy(user=("/v1", "/workers", "/open_session", "/close_session"),
                              admin=("/workers",),
                              admin_methods=("POST", "DELETE"),
                              admin_open=args.enable_worker_updating,
                              admin_flag="--enable-worker-updating")  # fmt: skip
        access = Access(keys, policy, args.max_request_bytes)
        app, closing = plain_app(router, access), router.aclose
        what = f"{args.policy} over {len(pool.workers)} workers"
        if router.supervisor is not None:
            pool = _Supervised(pool, router.supervisor)
            what += f", autoscaling {args.min_workers}-{args.max_workers} local workers"
    return _serve(app, pool, args, what, keys.requires_key, tls, closing)


def _balancer(args, proxy):
    from tandem.core.cost_model import DEFAULT_PRIOR, CostModel
    from tandem.disagg.roles import RoleBalancer
    from tandem.router.pd_ratio import PDRatioConfig

    config = PDRatioConfig(ttft_target=args.pd_ttft_target, tpot_target=args.pd_tpot_target,
                           margin=args.pd_margin, sustain=args.pd_sustain,
                           cooldown=args.pd_cooldown)  # fmt: skip
    cost = CostModel.load(args.pd_cost_model) if args.pd_cost_model else DEFAULT_PRIOR
    return RoleBalancer(proxy, config, cost, args.worker_admin_key)


def _supervisor(args, router, client):
    import tempfile
    from pathlib import Path

    from tandem.router.autoscale import AutoscaleConfig, AutoscalePolicy
    from tandem.router.supervisor import LocalSupervisor

    config = AutoscaleConfig(
        min_workers=args.min_workers, max_workers=args.max_workers,
        target_queue_per_worker=args.target_queue_per_worker,
        target_load_per_worker=args.target_load_per_worker, max_kv_usage=args.max_kv_usage,
        max_predicted_ttft=args.max_predicted_ttft, sustain=args.scale_sustain,
        min_slo_attainment=args.min_slo_attainment, lookahead=args.scale_lookahead,
        up_cooldown=args.scale_up_cooldown, down_cooldown=args.scale_down_cooldown,
    )  # fmt: skip
    for name in ("worker_start_timeout", "drain_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"{name} must be > 0 (seconds), got {getattr(args, name)!r}")
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-workers-"))
    logging.getLogger("tandem").info("router: started workers log to %s", log_dir)
    return LocalSupervisor(
        args.worker_command, router.pool, AutoscalePolicy(config), router.metrics, client,
        log_dir, args.worker_start_timeout, args.drain_timeout, signals=router.fleet_signals,
        api_key=args.worker_api_key,
    )  # fmt: skip


class _Supervised:
    """The pool and its autoscaler, started and stopped together (the autoscaler's workers
    stop with the router)."""

    def __init__(self, pool, supervisor) -> None:
        self.pool, self.supervisor = pool, supervisor

    def start(self) -> None:
        self.pool.start()
        self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop()
        await self.pool.stop()


def _serve(app, pool, args, what: str, requires_key: bool, tls: dict, closing=None) -> int:
    import uvicorn

    from tandem.server.cli import _listen, run_event_loop, warn_if_exposed

    sock = _listen(args.host, args.port)
    warn_if_exposed(args.host, requires_key, bool(tls), "tandem router")
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=args.timeout_keep_alive,
            **tls,
        )
    )

    async def main() -> None:
        if pool is not None:
            pool.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            if pool is not None:
                await pool.stop()
            if closing is not None:
                await closing()

    logging.getLogger("tandem").info("router on %s:%d: %s", args.host, args.port, what)
    freeze_startup_heap("router")  # it relays every streamed token: no full-collection stalls
    try:
        run_event_loop(main())
    finally:
        sock.close()
    return 0

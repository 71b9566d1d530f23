"""`tandem router --worker URL... [--policy ...]`, or `--prefill URL... --decode URL...` for PD
mode (`tandem proxy` is the same front end in PD mode): see router/app.py."""

from __future__ import annotations

import argparse
import logging
import os

from tandem.engine.heap import freeze_startup_heap
from tandem.logs import setup_logging


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: this machine only; 0.0.0.0 for all)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 and /workers, and pass it on to the "
        "workers (default: $TANDEM_API_KEY)",
    )
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


def add_parser(sub) -> None:
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
    add_common(p)
    add_pd(p, required=False)


def run(args: argparse.Namespace) -> int:
    import httpx

    setup_logging("router")
    pd = bool(getattr(args, "prefill", None) or getattr(args, "decode", None))
    client = httpx.AsyncClient(
        timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)
    )
    if pd:
        from tandem.disagg.proxy import Proxy, ProxyConfig
        from tandem.router.app import pd_app

        config = ProxyConfig(
            tuple(u.rstrip("/") for u in args.prefill or ()),
            tuple(u.rstrip("/") for u in args.decode or ()),
            args.api_key,
            args.reserve_timeout,
            args.prefill_timeout,
            args.stream_timeout,
            args.request_timeout,
        )
        proxy = Proxy(config, client)
        app, pool, closing = pd_app(proxy), proxy, None
        what = f"PD mode: prefill {config.prefill}, decode {config.decode}"
    else:
        from tandem.core.cost_model import CostModel
        from tandem.router.app import Router, RouterConfig, plain_app
        from tandem.router.policy import build_policy
        from tandem.router.pool import WorkerPool

        if not args.worker and not args.worker_file:
            raise ValueError("router: give --worker URL..., --worker-file, or --prefill/--decode")
        for name in ("probe_interval", "retry_deadline", "request_timeout", "stream_timeout"):
            if not getattr(args, name) > 0:
                raise ValueError(f"{name} must be > 0 (seconds), got {getattr(args, name)!r}")
        if args.max_attempts < 1 or args.eject_after < 1:
            raise ValueError("max_attempts and eject_after must be >= 1")
        cost = CostModel.load(args.cost_model) if args.cost_model else None
        policy = build_policy(args.policy, cost)
        pool = WorkerPool(args.worker, policy, client, args.probe_interval,
                          eject_after=args.eject_after, watch_file=args.worker_file)  # fmt: skip
        config = RouterConfig(args.api_key, args.max_attempts, args.retry_deadline,
                              args.request_timeout, args.stream_timeout)  # fmt: skip
        router = Router(pool, config, client)
        app, closing = plain_app(router), router.aclose
        what = f"{args.policy} over {len(pool.workers)} workers"
    return _serve(app, pool, args, what, closing)


def _serve(app, pool, args, what: str, closing=None) -> int:
    import uvicorn

    from tandem.server.cli import _listen, run_event_loop, warn_if_exposed

    sock = _listen(args.host, args.port)
    warn_if_exposed(args.host, args.api_key, "tandem router")
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level=args.uvicorn_log_level, lifespan="off", timeout_graceful_shutdown=5
        )  # fmt: skip
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

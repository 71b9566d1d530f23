"""`tandem proxy --prefill URL [URL...] --decode URL [URL...]`: the OpenAI-compatible front end
of a disaggregated deployment (see disagg/proxy.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os


def add_parser(sub) -> None:
    p = sub.add_parser(
        "proxy", help="front prefill and decode instances (prefill/decode disaggregation)"
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (tandem serve --role prefill)")  # fmt: skip
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (tandem serve --role decode)")  # fmt: skip
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1, and pass it on to the instances "
        "(default: $TANDEM_API_KEY)",
    )
    p.add_argument("--reserve-timeout", type=float, default=10.0,
                   help="seconds a decode instance gets to reserve (stage 1)")  # fmt: skip
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds a prefill instance gets to compute and send the KV (stage 2)")  # fmt: skip
    p.add_argument("--stream-timeout", type=float, default=60.0,
                   help="longest gap between two chunks of a decode instance's answer")  # fmt: skip
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tandem.disagg.proxy import Proxy, ProxyConfig, build_proxy_app
    from tandem.server.cli import _listen

    config = ProxyConfig(
        tuple(u.rstrip("/") for u in args.prefill),
        tuple(u.rstrip("/") for u in args.decode),
        args.api_key,
        args.reserve_timeout,
        args.prefill_timeout,
        args.stream_timeout,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    sock = _listen(args.host, args.port)
    server = uvicorn.Server(
        uvicorn.Config(
            build_proxy_app(Proxy(config)),
            log_level=args.uvicorn_log_level,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
    )
    logging.getLogger("tandem").info(
        "proxy on %s:%d: prefill %s, decode %s", args.host, args.port, config.prefill, config.decode
    )
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    return 0

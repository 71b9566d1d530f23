"""`tandem serve [MODEL]`: the OpenAI-compatible HTTP server, with vLLM's flag names.

The engine core runs in its own process (see tandem/engine/core_proc.py). On SIGTERM or
SIGINT the server drains: new requests get 503, requests in flight get --shutdown-timeout
seconds to finish, the rest are aborted; then the core stops and the process exits 0.
A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

import uvicorn

log = logging.getLogger("tandem")


def add_parser(sub) -> None:
    from tandem.engine.config import add_engine_args

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    p.add_argument(
        "model", nargs="?", default=None, help="HF folder or .gguf file (default: bundled SmolLM2)"
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model; the first one is reported (default: MODEL)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 (default: $TANDEM_API_KEY)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="most sequences waiting for a place in the running batch; past it, new requests "
        "get 503 with Retry-After (default: no limit)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.config import engine_config_from_args

    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError(f"max_waiting must be an integer >= 1, got {args.max_waiting}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {args.shutdown_timeout}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = engine_config_from_args(args, args.model)
    return asyncio.run(_serve(args, config))


async def _serve(args: argparse.Namespace, config) -> int:
    from tandem.engine.async_llm import AsyncLLM
    from tandem.server.app import ServerState, build_app
    from tandem.server.metrics import Metrics
    from tandem.server.serving import Serving

    loop = asyncio.get_running_loop()
    starting = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a signal while loading: stop, exit 0
        loop.add_signal_handler(sig, starting.cancel)
    try:
        engine = await AsyncLLM.start(config)  # raises ValueError (exit 2) if the core fails
    except asyncio.CancelledError:
        log.info("stopped while starting")
        return 0
    try:
        names = args.served_model_name or [_default_name(args.model)]
        metrics = Metrics(names[0])
        engine.observer = metrics
        state = ServerState(Serving(engine, names, args.max_waiting), metrics, args.api_key)
        server = _Server(
            uvicorn.Config(
                build_app(state),
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                lifespan="off",
                timeout_graceful_shutdown=5,
            )
        )
        shutdown = _Shutdown(server, state, engine, args.shutdown_timeout)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.on_signal)
        log.info("serving %s (engine core pid %d)", names[0], engine.core_pid)
        await server.serve()
        return 0 if server.started else 1
    finally:
        await engine.shutdown()


def _default_name(model: str | None) -> str:
    if model is not None:
        return model
    from tandem.core.model_config import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


class _Server(uvicorn.Server):
    """uvicorn.Server without its own signal handling: ours drains before exiting."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _Shutdown:
    def __init__(self, server, state, engine, timeout: float) -> None:
        self.server, self.state, self.engine, self.timeout = server, state, engine, timeout
        self.task: asyncio.Task | None = None

    def on_signal(self) -> None:
        if self.task is None:
            log.info("shutting down: draining %d requests", self.state.in_flight)
            self.task = asyncio.create_task(self.drain())
        else:
            log.info("second signal: aborting requests in flight")
            self.timeout = 0

    async def drain(self) -> None:
        from tandem.engine.async_llm import RequestAbortedError

        self.state.draining = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        while self.state.in_flight and loop.time() - start < self.timeout:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            log.warning("aborting %d requests still in flight", self.state.in_flight)
            self.engine.abort_all(
                RequestAbortedError("the server shut down before the request finished")
            )
            grace = loop.time() + 2.0
            while self.state.in_flight and loop.time() < grace:
                await asyncio.sleep(0.02)
        self.server.should_exit = True

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
import errno
import ipaddress
import logging
import signal
import socket

import uvicorn

from tandem.engine.heap import freeze_startup_heap
from tandem.logs import setup_logging
from tandem.server.security_flags import add_security_args, key_ring, uvicorn_tls

log = logging.getLogger("tandem")
DEAD_LINGER_S = 1.0  # after the engine dies, /health answers 503 this long, then we exit 1


def add_parser(sub) -> None:
    from tandem.engine.config import add_engine_args

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    p.add_argument(
        "model", nargs="?", default=None, help="HF folder or .gguf file (default: bundled SmolLM2)"
    )
    p.add_argument(
        "--model", dest="model_flag", metavar="MODEL", default=None, help="the same, as vLLM's flag"
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: this machine only; 0.0.0.0 for all)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model; the first one is reported (default: MODEL)",
    )
    add_security_args(p, "/v1")
    p.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="without --admin-api-key: open /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "to API keys (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 does the same)",
    )
    p.add_argument(
        "--enable-rl-endpoints",
        action="store_true",
        help="the control endpoints of an RL rollout engine (/update_weights_from_disk, "
        "/pause_generation, /reset_prefix_cache, ...: docs/rl.md); with --admin-api-key only "
        "the admin key may call them, else any API key (vLLM's VLLM_SERVER_DEV_MODE=1 does "
        "the same)",
    )
    p.add_argument(
        "--allowed-local-path",
        action="append",
        default=None,
        metavar="DIR",
        help="runtime LoRA loads only from under DIR (repeat for several); a path elsewhere "
        "is a 403 (default: any path, for whoever may load)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="with --enable-lora: PEFT adapters to load at start, as name=path or vLLM's "
        '{"name": ..., "path": ...}; each is a model name clients can ask for',
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
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one (default: the tokenizer's own)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a "
        "folder holding a generation_config.json",
    )
    p.add_argument(
        "--slo-classes",
        default=None,
        help="a JSON or YAML list of SLO classes (name, priority, ttft_ms, tpot_ms, weight, "
        "on_overload: keep|shed|demote) that requests pick with `slo_class`",
    )
    p.add_argument(
        "--cache-salt-per-api-key",
        action="store_true",
        help="make every API key its own cache tenant: requests share cached KV only with "
        "requests of the same key (and the same cache_salt, where they send one), so no key "
        "can observe another's prompts through cache hits or their timing",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests send tool_choice "auto" (the default with tools): the model '
        "decides, and --tool-call-parser reads its calls",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes, llama3_json, mistral, pythonic, or a "
        "name registered by --tool-parser-plugin",
    )
    p.add_argument(
        "--tool-parser-plugin",
        default=None,
        metavar="FILE",
        help="a Python file that registers tool parsers (@register_tool_parser(NAME) from "
        "tandem.tool_calls.parsers on a ToolParser subclass)",
    )
    logging_group = p.add_mutually_exclusive_group()
    logging_group.add_argument(
        "--enable-log-requests", dest="log_requests", action="store_true", default=False,
        help="log each request's size and sampling settings",
    )  # fmt: skip
    logging_group.add_argument(
        "--disable-log-requests", dest="log_requests", action="store_false",
        help="do not log requests (default; accepted for vLLM's scripts)",
    )  # fmt: skip
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_engine_args(p)


def _check_tool_flags(args: argparse.Namespace) -> None:
    from tandem.tool_calls.parsers import PARSERS, load_plugin

    if args.tool_parser_plugin:
        load_plugin(args.tool_parser_plugin)
    if args.tool_call_parser is not None and args.tool_call_parser not in PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {sorted(PARSERS)}, got {args.tool_call_parser!r}"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")


def run(args: argparse.Namespace) -> int:
    from tandem.engine.config import engine_config_from_args

    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"model: given twice ({args.model!r} and --model {args.model_flag!r})")
    model = args.model or args.model_flag
    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError(f"max_waiting must be an integer >= 1, got {args.max_waiting}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {args.shutdown_timeout}")
    _check_tool_flags(args)
    setup_logging()
    config = engine_config_from_args(args, model)
    if config.headless:  # a node of a split model that only computes: no server here
        from tandem.distributed.launch import run_headless

        return run_headless(config)
    if args.slo_classes is not None:
        from tandem.core.slo import load_slo_classes

        args.slo_classes = load_slo_classes(args.slo_classes)
    if args.chat_template is not None:
        from tandem.engine.tokenizer import load_chat_template

        args.chat_template = load_chat_template(args.chat_template)
    args.keys, args.tls = key_ring(args), uvicorn_tls(args)  # bad values fail before loading
    sock = _listen(args.host, args.port)  # before the model loads: a taken port fails at once
    warn_if_exposed(args.host, args.keys.requires_key, bool(args.tls), "tandem serve")
    try:
        return run_event_loop(_serve(args, config, model, sock))
    finally:
        sock.close()


def run_event_loop(main):
    """asyncio.run on uvloop where it is installed (uvicorn[standard] brings it): uvicorn's
    serve() runs on whatever loop it is given, and the stdlib's costs a front end that relays
    every request more (the router's p50 overhead 3.14 -> 2.70 ms with a model worker, 1.43 ->
    1.16 against an instant one, `python benchmarks/router.py --only-overhead`)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def warn_if_exposed(host: str, requires_key: bool, tls: bool, what: str) -> None:
    """Say where the server listens; warn when it is reachable from other machines and asks
    for no key, or takes keys and prompts over plain HTTP."""
    log = logging.getLogger("tandem")
    if _is_loopback(host):
        log.info("%s listens on %s only (this machine); --host 0.0.0.0 opens it to all", what, host)
        return
    if not requires_key:
        log.warning(
            "%s listens on %s, reachable from other machines, and requires no API key: "
            "anyone who can reach it can use it (set --api-key or TANDEM_API_KEY)", what, host
        )  # fmt: skip
    if not tls:
        log.warning(
            "%s listens on %s without TLS: keys and prompts cross the network in clear text "
            "(set --ssl-certfile and --ssl-keyfile, or put a TLS proxy in front)", what, host
        )  # fmt: skip


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket uvicorn will serve on, bound now."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        field = "port" if e.errno == errno.EADDRINUSE else "host"
        raise ValueError(f"{field}: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def _serve(args: argparse.Namespace, config, model: str | None, sock) -> int:
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.generation_config import sampling_defaults
    from tandem.server.app import ServerState, build_app
    from tandem.server.errors import APIError
    from tandem.server.lora import parse_lora_modules
    from tandem.server.metrics import Metrics
    from tandem.server.rl import POST_PATHS, rl_endpoints_enabled
    from tandem.server.security import Access, AccessPolicy, runtime_lora_updating
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
        if args.chat_template is not None:
            engine.tokenizer.chat_template = args.chat_template
        names = args.served_model_name or [_default_name(model)]
        metrics = Metrics(names[0])
        engine.observer = metrics
        serving = Serving(
            engine,
            names,
            args.max_waiting,
            sampling_defaults(args.generation_config, engine.model_path),
            args.log_requests,
            args.slo_classes,
            args.tool_call_parser,
            args.enable_auto_tool_choice,
            args.cache_salt_per_api_key,
        )
        for name, path in parse_lora_modules(args.lora_modules):
            try:
                await serving.loras.load(name, path, names)
            except APIError as e:
                raise ValueError(f"--lora-modules {name}: {e.message}") from None
            log.info("LoRA adapter %s loaded from %s", name, path)
        state = ServerState(serving, metrics)
        rl = rl_endpoints_enabled(args.enable_rl_endpoints)
        engine.report_weight_version = rl
        access = Access(
            args.keys,
            AccessPolicy(
                user=("/v1", "/open_session", "/close_session"),
                admin_open=runtime_lora_updating(args.enable_runtime_lora_updating),
                flagged=(
                    ("/role", "--enable-role-switching", config.enable_role_switching),
                    *((path, "--enable-rl-endpoints", True) for path in POST_PATHS if rl),
                ),
            ),
            args.max_request_bytes,
            args.allowed_local_path,
        )
        server = _Server(
            uvicorn.Config(
                build_app(state, access, rl_endpoints=rl),
                timeout_keep_alive=args.timeout_keep_alive,
                **args.tls,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                lifespan="off",
                timeout_graceful_shutdown=5,
            )
        )
        shutdown = _Shutdown(server, state, engine, args.shutdown_timeout)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.on_signal)
        engine.on_dead = shutdown.on_engine_dead
        if engine.dead:  # died while we were setting up
            shutdown.on_engine_dead(engine.dead)
        freeze_startup_heap("API server")
        log.info(
            "serving %s on %s:%d (engine core pid %d)",
            names[0],
            args.host,
            args.port,
            engine.core_pid,
        )
        await server.serve(sockets=[sock])
        if engine.dead:
            log.error("exiting: the engine core died (%s)", engine.dead)
            return 1
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
            await self._flush(2.0)
        self.server.should_exit = True

    def on_engine_dead(self, reason: str) -> None:
        """The core is gone: every request has its error; let them reach their clients, then
        exit non-zero so a supervisor restarts the server."""
        if self.task is None:
            self.task = asyncio.create_task(self._exit_dead())

    async def _exit_dead(self) -> None:
        await self._flush(2.0)
        await asyncio.sleep(DEAD_LINGER_S)  # probes and retrying clients see 503, not a reset
        self.server.should_exit = True

    async def _flush(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)

"""The FastAPI app: routes, the gates in front of them (draining; keys and limits, in
security.py), error mapping."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem import __version__
from tandem.engine.async_llm import RequestError
from tandem.server.chat import chat_prompt, create_chat_completion
from tandem.server.completions import create_completion
from tandem.server.errors import (
    APIError,
    bad_request,
    error_response,
    server_error,
    unavailable,
)
from tandem.server.metrics import Metrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    RoleRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    parse,
)
from tandem.server.security import Access, AccessGate, check_allowed_path
from tandem.server.serving import Serving, api_error
from tandem.server.sessions import CloseSessionRequest, OpenSessionRequest
from tandem.server.streaming import json_response

log = logging.getLogger("tandem")
_UNGATED = ("/metrics", "/openapi.json")  # answer even while draining
# Endpoints that parse their own bodies (for OpenAI-style errors): their schemas for /openapi.json
_BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
    "/role": RoleRequest,
    "/open_session": OpenSessionRequest,
    "/close_session": CloseSessionRequest,
}


@dataclass
class ServerState:
    serving: Serving
    metrics: Metrics
    draining: bool = False
    in_flight: int = 0  # requests inside the app, streaming responses until their last byte


class Gate:
    """Pure ASGI middleware: 503 while draining, in-flight counting."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNGATED:
            return await self.app(scope, receive, send)
        if self.state.draining:
            error = unavailable("The server is shutting down.")
            return await error.response()(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def build_app(
    state: ServerState, access: Access | None = None, rl_endpoints: bool = False
) -> FastAPI:
    serving = state.serving
    engine = serving.engine
    access = access or Access()
    app = FastAPI(title="tandem", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(AccessGate, access=access, registry=state.metrics.registry)
    app.add_middleware(Gate, state=state)  # outermost: a draining server refuses first
    _add_error_handlers(app)
    app.openapi = lambda: _openapi(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(serving, request)

    if rl_endpoints:
        from tandem.server.rl import add_rl_routes

        add_rl_routes(app, engine)

    @app.post("/open_session")  # SGLang's: the new session's id, as a JSON string
    async def open_session(request: Request) -> Response:
        req = parse(OpenSessionRequest, await request.body())
        return json_response(serving.open_session(req, request.scope))

    @app.post("/close_session")  # SGLang's: an empty 200
    async def close_session(request: Request) -> Response:
        req = parse(CloseSessionRequest, await request.body())
        serving.sessions.close(req.session_id, request.scope.get("tandem.key"))
        return Response()

    @app.get("/v1/models")
    async def models() -> Response:
        def entry(name: str, root: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": serving.created,
                    "owned_by": "tandem", "root": root, "parent": parent,
                    "max_model_len": engine.max_model_len,
                    "quantization": engine.quantization}  # fmt: skip

        data = [entry(name, engine.model_path, None) for name in serving.served_names]
        data += [entry(a.name, a.path, serving.model_name) for a in serving.loras.adapters.values()]
        return json_response({"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = parse(LoadLoRAAdapterRequest, await request.body())
        path = check_allowed_path(req.lora_path, access.allowed_local_paths, "lora_path")
        await serving.loras.load(req.lora_name, path, serving.served_names)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = parse(UnloadLoRAAdapterRequest, await request.body())
        await serving.loras.unload(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.get("/role")
    async def role() -> Response:
        return json_response({"role": serving.role,
                              "switchable": engine.config.enable_role_switching})  # fmt: skip

    @app.post("/role")
    async def switch_role(request: Request) -> Response:
        """A prefill or decode instance (--enable-role-switching) takes the other role's
        requests from now on, turning its old role's away as busy (503: a router tries
        another instance); what it holds of the old role finishes beside the new; its prefix
        cache is kept. The router moves it between its pools (--pd-ratio auto)."""
        req = parse(RoleRequest, await request.body())
        if not engine.config.enable_role_switching:
            raise APIError(409, "role: this instance cannot switch roles: start it with "
                           "--role prefill|decode --enable-role-switching", param="role")  # fmt: skip
        previous, serving.role = serving.role, req.role
        if previous != req.role:
            log.info("role: %s -> %s", previous, req.role)
            state.metrics.on_role_switch(req.role)
        return json_response({"role": req.role, "previous": previous})

    # Which process answers at this address: a router that sees the id change knows the
    # worker restarted (its prefix cache is empty) though its URL stayed the same.
    identity = {"instance_id": uuid.uuid4().hex[:16], "started": round(time.time(), 3)}

    @app.get("/health")
    async def health() -> Response:
        if engine.dead:
            raise unavailable(f"the engine is dead: {engine.dead}")
        return json_response({"status": "ok", **identity})

    @app.get("/ping")
    async def ping() -> Response:  # SageMaker's and vLLM's alias of /health
        return await health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__, **identity})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await request.body())
        serving.check_model(req.model)
        if req.messages is not None:
            ids = chat_prompt(serving, req.messages, req.add_generation_prompt).token_ids
        elif req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=special)
        else:
            raise bad_request("prompt: give a prompt or messages", "prompt")
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        return json_response(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await request.body())
        serving.check_model(req.model)
        vocab = engine.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is out of range [0, {vocab})", "tokens")
        return json_response({"prompt": serving.tokenizer.decode(req.tokens)})

    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, with the request bodies our handlers parse themselves."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                    }
                },
            }
        app.openapi_schema = doc
    return app.openapi_schema


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error_response(_: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> Response:
        return api_error(e).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> Response:
        return server_error(f"internal error: {type(e).__name__}: {e}").response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> Response:
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, headers=e.headers)

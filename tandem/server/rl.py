"""The control endpoints RL frameworks drive a rollout engine with, in SGLang's and vLLM's
names, behind `--enable-rl-endpoints` (vLLM's VLLM_SERVER_DEV_MODE=1 too): new weights from
disk, pause and resume, prefix cache resets, the weight version.

A thin layer: each endpoint is one AsyncLLM call that runs in the engine core between two
steps (engine/core_proc.py's control calls), with a timeout. Bad input is a 400 naming the
field; a call the engine cannot honour now (a reset while requests hold KV) a 409 saying
why, never a 200 that did nothing; one past its timeout a 504.

    POST /update_weights_from_disk {model_path, weight_version?, flush_cache=true,
                                    abort_all_requests=false, recompute_kv=false}
    POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
                                     group_name, backend}
    POST /update_weights_from_distributed {names, dtypes, shapes, weight_version?, ...}
    POST /destroy_weights_update_group   (runner/weight_sync.py: the trainer's handshake)
    POST /pause_generation {mode: abort|retract|in_place}   POST /continue_generation
    POST /pause?mode=abort|wait|keep                         POST /resume   GET /is_paused
    POST /reset_prefix_cache (and SGLang's /flush_cache)     GET /get_weight_version
    POST /sleep?level=1|2   POST /wake_up   GET /is_sleeping  (vLLM's; SGLang's
    POST /release_memory_occupation and /resume_memory_occupation are level 2 and wake_up)
"""

from __future__ import annotations

import asyncio
import os
from typing import Literal

from fastapi import FastAPI, Request, Response
from pydantic import Field

from tandem.server.errors import APIError, bad_request
from tandem.server.protocol import _Model, parse
from tandem.server.streaming import json_response

DEFAULT_TIMEOUT_S = 300.0  # a control call's, unless its body says (timeout_s)
POST_PATHS = (
    "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/pause_generation", "/continue_generation", "/pause",
    "/resume", "/reset_prefix_cache", "/flush_cache", "/sleep", "/wake_up",
    "/release_memory_occupation", "/resume_memory_occupation",
)  # fmt: skip


def rl_endpoints_enabled(flag: bool) -> bool:
    return flag or os.environ.get("VLLM_SERVER_DEV_MODE") == "1"


class _Call(_Model):
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=86_400)


class UpdateWeightsFromDiskRequest(_Call):
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False  # SGLang's: end the requests in flight first
    recompute_kv: bool = False  # requests held across the update compute their KV anew


class InitWeightsUpdateGroupRequest(_Call):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = 1
    world_size: int = 2
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateWeightsFromDistributedRequest(_Call):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    weight_version: str | None = None
    flush_cache: bool = True
    recompute_kv: bool = False


class PauseGenerationRequest(_Call):
    # SGLang's: abort ends them; in_place holds them with their KV; retract holds them and
    # drops their KV (computed anew on continue)
    mode: Literal["abort", "retract", "in_place"] = "abort"


_SGLANG_MODES = {"abort": ("abort", False), "retract": ("keep", True), "in_place": ("keep", False)}


def add_rl_routes(app: FastAPI, engine) -> None:
    """engine: the server's AsyncLLM."""

    async def call(work, timeout_s: float) -> dict:
        try:
            return await work
        except asyncio.TimeoutError:
            raise APIError(
                504, f"the engine did not answer within timeout_s={timeout_s:g}",
                type="server_error", code="timeout",
            ) from None  # fmt: skip
        except ValueError as e:
            raise bad_request(str(e)) from None

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        req = parse(UpdateWeightsFromDiskRequest, await request.body())
        aborted = 0
        if req.abort_all_requests:
            aborted = (await call(engine.pause("abort", req.timeout_s), req.timeout_s))["num_aborted"]  # fmt: skip
        try:
            result = await call(
                engine.call_core(
                    "update_weights_from_disk", req.timeout_s, model_path=req.model_path,
                    weight_version=req.weight_version, flush_cache=req.flush_cache,
                    recompute_kv=req.recompute_kv,
                ),
                req.timeout_s,
            )  # fmt: skip
        finally:
            if req.abort_all_requests:
                await engine.resume(req.timeout_s)
        return json_response({
            "success": True, "message": f"weights updated from {req.model_path}",
            "num_paused_requests": 0, "num_aborted_requests": aborted, **result,
        })  # fmt: skip

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        req = parse(InitWeightsUpdateGroupRequest, await request.body())
        where = req.model_dump(exclude={"timeout_s"})
        # the core gives up on the rendezvous at timeout_s; this waits a little longer for it
        result = await call(
            engine.call_core("init_weights_update_group", req.timeout_s + 10, **where,
                             timeout_s=req.timeout_s),
            req.timeout_s,
        )  # fmt: skip
        return json_response({"success": True, "message": "joined the group", **result})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        req = parse(UpdateWeightsFromDistributedRequest, await request.body())
        args = req.model_dump(exclude={"timeout_s"})
        result = await call(
            engine.call_core("update_weights_from_distributed", req.timeout_s, **args),
            req.timeout_s,
        )
        return json_response({"success": True, "message": "weights updated", **result})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        req = parse(_Call, await _body(request))
        await call(engine.call_core("destroy_weights_update_group", req.timeout_s), req.timeout_s)
        return json_response({"success": True})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        req = parse(PauseGenerationRequest, await _body(request))
        mode, recompute = _SGLANG_MODES[req.mode]
        result = await call(engine.pause(mode, req.timeout_s, recompute), req.timeout_s)
        return json_response({"success": True, "mode": req.mode, **result})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        req = parse(_Call, await _body(request))
        await call(engine.resume(req.timeout_s), req.timeout_s)
        return json_response({"success": True})

    @app.post("/pause")  # vLLM's: the mode in the query
    async def pause(request: Request, mode: str = "abort") -> Response:
        req = parse(_Call, await _body(request))
        if mode not in ("abort", "wait", "keep"):
            raise bad_request(f"mode: {mode!r} is not one of abort, wait, keep", "mode")
        result = await call(engine.pause(mode, req.timeout_s), req.timeout_s)
        return json_response({"success": True, "mode": mode, **result})

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        req = parse(_Call, await _body(request))
        await call(engine.resume(req.timeout_s), req.timeout_s)
        return json_response({"success": True})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return json_response({"is_paused": engine.paused is not None, "mode": engine.paused})

    async def reset(request: Request) -> Response:
        req = parse(_Call, await _body(request))
        try:
            result = await engine.call_core("reset_prefix_cache", req.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(504, "the engine did not answer in time", "server_error") from None
        except ValueError as e:  # requests hold KV: the cache cannot be emptied now
            raise APIError(409, str(e), code="requests_running") from None
        return json_response({"success": True, **result})

    app.post("/reset_prefix_cache")(reset)
    app.post("/flush_cache")(reset)

    async def sleep(request: Request, level: int) -> Response:
        req = parse(_Call, await _body(request))
        try:
            result = await call(engine.sleep(level, req.timeout_s), req.timeout_s)
        except APIError as e:
            if "in flight" in e.message:  # not now: a 409, as a reset that cannot happen
                raise APIError(409, e.message, code="requests_running") from None
            raise
        return json_response({"success": True, **result})

    @app.post("/sleep")
    async def sleep_level(request: Request, level: int = 1) -> Response:
        return await sleep(request, level)

    @app.post("/release_memory_occupation")  # SGLang's: weights and KV, vLLM's level 2
    async def release_memory_occupation(request: Request) -> Response:
        return await sleep(request, 2)

    async def wake_up(request: Request) -> Response:
        req = parse(_Call, await _body(request))
        result = await call(engine.wake_up(req.timeout_s), req.timeout_s)
        return json_response({"success": True, **result})

    app.post("/wake_up")(wake_up)
    app.post("/resume_memory_occupation")(wake_up)

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": bool(engine.sleeping), "level": engine.sleeping})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return json_response({"weight_version": engine.weight_version})


async def _body(request: Request) -> bytes:
    """The body, where an empty one means no arguments (a bare POST)."""
    body = await request.body()
    return body if body.strip() else b"{}"

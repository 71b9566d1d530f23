"""EngineCore: the step loop. Token ids in, token ids out; no text, no HTTP, no torch.

    plan     = scheduler.schedule()
    result   = runner.execute(plan)
    finished = scheduler.update(plan, result.sampled)

It is assembled, never self-building: `EngineCore(scheduler, runner, clock)`. The composition
roots (offline `LLM` and the engine-core process, through engine/builder.py; the simulator)
build the parts. The real runner loads a model, a simulated one returns the cost model's step
time; the loop cannot tell them apart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable

from tandem.core.request import Request, RequestStatus
from tandem.core.runner import RankFailed, Runner, RunnerOutput
from tandem.core.scheduler import Scheduler, SchedulerOutput
from tandem.engine.heap import resident_bytes
from tandem.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats

log = logging.getLogger("tandem")


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        clock: Callable[[], float],
        eos_token_ids: tuple[int, ...] = (),
        cpu_clock: Callable[[], float] | None = None,
        kv_tiers=None,
        kv_events=None,
    ) -> None:
        self.scheduler, self.runner, self.clock = scheduler, runner, clock
        # where the KV manager's events go, once a step (engine/kv_event_publisher.py)
        self.kv_events = kv_events
        # KV tiers (kv_transfer/offload.py; the scheduler asks them what it can load): the
        # loop starts the loads it plans, imports what arrives, and stores what it computes.
        self.kv_tiers = kv_tiers
        self.eos_token_ids = eos_token_ids  # the model's, given to every request's params
        # The last step scheduled and preempted nothing: only a new message (an add, an
        # abort, KV arriving) can change that, so a loop around the core may block.
        self.stalled = False
        self.last_step_timings: dict[str, float] = {}  # seconds per phase, on `clock`
        self.step_seconds, self.predicted_step_seconds = 0.0, None
        # cumulative: steps that ran the model, their wall-clock and this process's CPU time
        # (a host sharing its cores with a front end: wall minus CPU is time others took)
        self.num_steps, self.execute_seconds, self.execute_cpu_seconds = 0, 0.0, 0.0
        # the process's CPU clock, for execute_cpu_seconds: a real engine's (build_engine);
        # none in the simulator, whose steps take no CPU worth counting (and it costs a call)
        self.cpu_clock = cpu_clock
        self.lora_ids: set[int] = set()  # adapters the runner holds
        # Structured output: a request with a grammar waits here, outside the scheduler,
        # until a worker thread has compiled it (request, compile future, deadline).
        self.grammars = getattr(runner, "grammars", None)  # a GrammarCompiler, or None
        self.compiling: dict[str, tuple[Request, object, float]] = {}
        # TANDEM_STEP_LOG=<path>: every model step appended as a JSON line, [*StepShape fields,
        # start on `clock`, seconds]: how a server's steps ran under load, against a cost
        # model's prediction, and the gaps between them (benchmarks/sim_validation.py)
        path = os.environ.get("TANDEM_STEP_LOG")
        self.step_log = open(path, "a", buffering=1) if path else None
        # RL (update_weights, pause): the weights' version, and whether steps are held
        self.weight_version = "default"
        self.paused = False
        self.sleeping = 0  # the sleep level (0: awake)
        self.rss_at_start = 0  # resident bytes before the model loaded (its process sets it)
        # a level-2 sleeper's new runner (engine/builder.py; None: cannot wake from level 2)
        self.rebuild_runner: Callable | None = None

    # ---- requests ----------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if req.lora_id and req.lora_id not in self.lora_ids:
            raise ValueError(f"lora: adapter {req.lora_id} is not loaded")
        request = self._request(req)
        so = request.sampling_params.structured_outputs
        if so is not None:
            if self.grammars is None:
                raise ValueError(f"{so.source}: this engine has no structured output")
            future = self.grammars.submit(so)  # ValueError: a keyword the backend would drop
            if not future.done():
                deadline = self.clock() + self.grammars.timeout
                self.compiling[request.request_id] = (request, future, deadline)
                return
            request.grammar = future.result()  # one that failed before fails at once
        self.scheduler.add_request(request)
        self.stalled = False

    def admit_compiled(self) -> list[tuple[str, str]]:
        """Hand the requests whose grammars have compiled to the scheduler; -> (request id,
        why) for those whose compile failed or ran past its deadline."""
        from tandem.structured.compiler import timeout_message

        refused, now = [], self.clock()
        for rid, (request, future, deadline) in list(self.compiling.items()):
            if future.done():
                del self.compiling[rid]
                error = future.exception()
                if error is None:
                    request.grammar = future.result()
                    self.scheduler.add_request(request)
                    self.stalled = False
                else:
                    refused.append((rid, str(error)))
            elif not self.grammars.prepared():  # the vocabulary's time is not the compile's
                self.compiling[rid] = (request, future, now + self.grammars.timeout)
            elif now > deadline:
                del self.compiling[rid]
                so = request.sampling_params.structured_outputs
                refused.append((rid, timeout_message(so, self.grammars.timeout)))
        return refused

    def _request(self, req: EngineCoreRequest) -> Request:
        params = req.sampling_params
        params.eos_token_ids = self.eos_token_ids
        if req.kv_transfer is not None:
            params.max_tokens = 1  # the prompt and its first token; the decode side does the rest
        slo = req.slo.with_targets(params.ttft_ms, params.tpot_ms, req.priority)
        request = Request(
            req.request_id, req.prompt_token_ids, params, req.arrival_time, req.priority, slo
        )
        request.kv_transfer = req.kv_transfer
        request.lora_id = req.lora_id
        request.cache_salt = req.cache_salt
        request.session_id, request.session_ttl = req.session_id, req.session_ttl
        return request

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.compiling.pop(rid, None)
        # (a stop string ends a turn this way too: its KV is as good as a finished one's)
        self._pin_sessions(
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        )
        self.stalled = False

    # ---- agent sessions: a turn's prefix pinned until the next ---------------------------
    def _pin_sessions(self, finished: list[Request]) -> None:
        """Pin the prefix of each finished turn of a session until its TTL from now (its
        blocks are still cached: nothing allocates between the turn's end and this)."""
        now = self.clock()
        for req in finished:
            if req.session_id is not None and req.status != RequestStatus.FINISHED_ERROR:
                self.scheduler.kv.pin_prefix(req.session_id, req, now + req.session_ttl)

    def close_session(self, session_id: str) -> int:
        """Unpin a session's prefix (its blocks stay cached, evictable); -> blocks unpinned."""
        return self.scheduler.kv.unpin(session_id)

    def expire_sessions(self) -> list[str]:
        """Unpin the sessions whose TTL ran out; -> their ids."""
        return self.scheduler.kv.expire_pins(self.clock())

    def check_alive(self) -> None:
        """Raise RankFailed where the runner's model is split and a rank has died."""
        check = getattr(self.runner, "check_alive", None)
        if check is not None:
            check()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.paused or self.sleeping:  # (keep: running requests hold their KV till resume)
            self.stalled = True
            return []
        t0 = self.clock()
        self.scheduler.kv.expire_pins(t0)  # (the idle loop expires them too)
        if self.kv_tiers is not None:
            self._finish_kv_loads()
        plan = self.scheduler.schedule()
        if plan.kv_loads:
            self.kv_tiers.start(plan.kv_loads)
        loading = bool(self.scheduler.loading)  # a load that ends changes what can run
        self.stalled = plan.is_empty and not plan.preempted_ids and not plan.shed and not loading
        if plan.is_empty and not plan.finished_ids and not plan.shed:
            if loading:
                self.kv_tiers.wait(0.005)  # the loads' thread works; the loop does not spin
            return []
        cost = self.scheduler.cost_model
        self.predicted_step_seconds = cost.predict(plan.shape) if cost else None
        t1, cpu = self.clock(), self.cpu_clock() if self.cpu_clock else 0.0
        try:
            result = self.runner.execute(plan)  # an empty plan still releases finished state
            errors = dict(result.errors)
        except RankFailed:  # a split model's rank is gone: no step can run again
            raise
        except Exception:
            log.exception("a step of %d requests failed; retrying each alone", len(plan.scheduled))
            result, errors = self._execute_one_by_one(plan)
        if plan.kv_stores and not errors:  # (a failed row's KV may be half written)
            self._store_kv(plan.kv_stores)
        t2 = self.clock()
        self.step_seconds = t2 - t1
        if plan.scheduled:
            self.num_steps += 1
            self.execute_seconds += t2 - t1
            if self.cpu_clock:
                self.execute_cpu_seconds += self.cpu_clock() - cpu
            if self.step_log is not None:
                shape = dataclasses.astuple(plan.shape)
                self.step_log.write(json.dumps([*shape, round(t1, 6), round(t2 - t1, 6)]) + "\n")
        self.scheduler.observe_step(plan, t2 - t1)
        outputs = [_shed_output(r) for r in plan.shed] + self._fail(errors)
        before = [s.request.num_tokens for s in plan.scheduled]
        self._pin_sessions(self.scheduler.update(plan, result.sampled, result.drafts))
        for s, num_before in zip(plan.scheduled, before):
            req = s.request
            new = req.all_token_ids[num_before:]  # a stop may have cut drafts
            if not new or req.request_id in errors:
                continue
            logprobs = result.logprobs.get(req.request_id)
            outputs.append(self._output(req, new, logprobs[: len(new)] if logprobs else None))
        self._publish_kv_events()
        self.last_step_timings = {
            "schedule": t1 - t0,
            **(result.timings or {"execute": t2 - t1}),  # the runner's phases, if it has them
            "update": self.clock() - t2,
        }
        return outputs

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            batch = self.scheduler.kv.events.take()
            if batch is not None:
                self.kv_events.publish(batch)

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs) -> EngineCoreOutput:
        first = req.num_output_tokens == len(tokens)
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
            first_scheduled_time=req.first_scheduled_time if first else None,
        )

    def _execute_one_by_one(self, plan: SchedulerOutput) -> tuple[RunnerOutput, dict[str, str]]:
        """After a failed step, run its requests one at a time, so the one that breaks the
        runner (a bug its input exposes) fails alone and the rest go on. Rewriting a slot's
        KV writes the same values, so computing a chunk again is harmless."""
        merged, errors = RunnerOutput(), {}
        finished_ids = plan.finished_ids
        for s in plan.scheduled:
            alone = SchedulerOutput(scheduled=[s], finished_ids=finished_ids)
            finished_ids = []
            try:
                result = self.runner.execute(alone)
            except RankFailed:
                raise
            except Exception as e:
                log.exception("request %s failed in the runner", s.request.request_id)
                errors[s.request.request_id] = f"{type(e).__name__}: {e}"
                continue
            merged.sampled.update(result.sampled)
            merged.logprobs.update(result.logprobs)
            merged.drafts.update(result.drafts)
            errors.update(result.errors)
        return merged, errors

    def _fail(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish the requests the runner failed on; their outputs say why."""
        if not errors:  # the usual step
            return []
        failed = self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        return [
            EngineCoreOutput(
                r.request_id, [], finish_reason=r.finish_reason, error=errors[r.request_id]
            )
            for r in failed
        ]

    # ---- KV tiers -----------------------------------------------------------------------
    def _finish_kv_loads(self) -> None:
        """Import the loads that ended; their requests run on from what arrived."""
        for load, payloads in self.kv_tiers.finished():
            if load.request_id not in self.scheduler.loading:
                continue  # aborted while it loaded
            self.scheduler.finish_load(load.request_id, self._import_load(load, payloads))
            self.stalled = False

    def _import_load(self, load, payloads: list) -> int:
        """Write a load's arrived blocks into the request's own; -> the tokens written."""
        if not payloads:
            return 0
        try:
            self.runner.import_blocks(load.block_ids[: len(payloads)], payloads)
        except Exception:
            log.exception("request %s: importing its KV failed", load.request_id)
            return 0
        return len(payloads) * self.scheduler.kv.block_size

    def _store_kv(self, stores: list[tuple[int, bytes]]) -> None:
        try:
            payloads = self.runner.export_blocks([b for b, _ in stores])
        except Exception:
            log.exception("copying %d blocks for the KV tiers failed", len(stores))
            return
        self.kv_tiers.store([(h, p) for (_, h), p in zip(stores, payloads)])

    # ---- KV from or for another instance (prefill/decode disaggregation) ---------------
    def reserve(self, req: EngineCoreRequest) -> int | None:
        """Admit a request whose prompt KV another instance sends: how many prompt tokens
        are held here already (send the rest), or None when there is no room."""
        request = self._request(req)
        so = request.sampling_params.structured_outputs
        if so is not None and self.grammars is not None:
            self.grammars.submit(so)  # compiled by the time its KV lands (matchers wait on it)
        num_cached = self.scheduler.reserve(request)
        if num_cached is not None:  # one that found no room changed nothing
            self.stalled = False
            if self.kv_tiers is not None:
                num_cached += self._load_reserved(request, num_cached)
        return num_cached

    def _load_reserved(self, request: Request, num_cached: int) -> int:
        """Load what the KV tiers hold of a reserved prompt past its radix match, before the
        reservation is answered (the sender then sends only the rest): the tokens loaded.
        It blocks the loop for the load (at most the load timeout)."""
        n = self.scheduler.num_loadable(request, num_cached)
        if not n:
            return 0
        load = self.scheduler.kv_load(request, num_cached, n)
        loaded = self._import_load(load, self.kv_tiers.load_now(load))
        request.num_computed_tokens += loaded  # the KV the sender sends starts after it
        request.num_cached_tokens += loaded
        return loaded

    def receive_kv(self, request_id: str, start: int, kv) -> None:
        """KV of the reserved request's positions from `start` (the runner's format)."""
        req = self.scheduler.reserved[request_id]
        self.runner.import_kv(req.block_ids, start, kv)

    def receive_layer(self, request_id: str, layer: int, start: int, k, v, scales=None) -> None:
        """One layer's K and V ([tokens, kv_heads, head_dim]; 8-bit ones with their scales
        [2, tokens, kv_heads]) of positions from `start`."""
        req = self.scheduler.reserved[request_id]
        self.runner.import_layer(req.block_ids, layer, start, k, v, scales)

    def commit(self, request_id: str, first_token: int, logprobs=None) -> list[EngineCoreOutput]:
        """All of the prompt's KV is here: decode on from the token the sender sampled."""
        req = self.scheduler.commit(request_id, first_token)
        self.stalled = False
        return [self._output(req, [first_token], None if logprobs is None else [logprobs])]

    def fail_reserved(self, request_id: str, why: str) -> list[EngineCoreOutput]:
        """Give up a reservation whose KV will not come (or came wrong): its blocks go back
        and its output says why."""
        self.stalled = False
        return self._fail({request_id: why})

    def release(self, request_id: str) -> None:
        self.scheduler.release(request_id)
        self.stalled = False

    def export_kv(self, request_id: str, start: int, end: int):
        """KV of a running request's positions [start, end), for another instance."""
        req = self.scheduler.requests[request_id]
        return self.runner.export_kv(req.block_ids, start, end)

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_evicted_blocks=kv.num_evicted,
            spec_decode=self.scheduler.spec_stats.copy(),
            step_seconds=self.step_seconds,
            predicted_step_seconds=self.predicted_step_seconds,
            num_steps=self.num_steps,
            execute_seconds=self.execute_seconds,
            execute_cpu_seconds=self.execute_cpu_seconds,
            expert_tokens=self.expert_load(),
            num_pinned_blocks=kv.pins.num_blocks if kv.pins else 0,
            max_pinned_blocks=kv.pins.max_blocks if kv.pins else 0,
            **(self._tier_stats() if self.kv_tiers is not None else {}),
        )

    def expert_load(self) -> list[int]:
        """Tokens routed to each expert so far (a mixture of experts; else empty)."""
        load = getattr(self.runner, "expert_load", None)
        return load() if load is not None else []

    def _tier_stats(self) -> dict:
        tiers = self.kv_tiers
        seconds, tiers.load_seconds = tiers.load_seconds, []
        loads = dataclasses.replace(tiers.stats)
        return {"kv_tiers": tiers.tier_stats(), "kv_tier_loads": loads, "kv_load_seconds": seconds}

    # ---- LoRA adapters ------------------------------------------------------------------
    def read_lora(self, path: str):
        """An adapter's files, read and checked by the runner; touches no engine state, so
        the engine-core process calls it off the step loop."""
        return self.runner.read_lora(path)

    def add_lora(self, lora_id: int, weights) -> None:
        """Register an adapter `read_lora` returned, under its id."""
        self.runner.add_lora(lora_id, weights)
        self.lora_ids.add(lora_id)
        for hasher in self._hashers():  # its KV named by its weights, for tiers and events
            hasher.add_adapter(lora_id, weights.digest())

    def remove_lora(self, lora_id: int) -> None:
        users = sum(r.lora_id == lora_id for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"lora: adapter {lora_id} is in use by {users} request(s)")
        self.runner.remove_lora(lora_id)
        self.lora_ids.discard(lora_id)
        for hasher in self._hashers():
            hasher.remove_adapter(lora_id)
        self.scheduler.kv.purge_lora(lora_id)  # its KV goes with it: the id may be reused

    def _hashers(self) -> set:
        """The block hashers naming KV here: the tiers' and the events' (often one)."""
        kv = self.scheduler.kv
        return {h for h in (kv.hasher, kv.events.hasher if kv.events else None) if h is not None}

    # ---- RL: weights from a trainer, pause and resume, cache resets ---------------------
    def update_weights(
        self,
        tensors: dict,
        weight_version: str | None = None,
        flush_cache: bool = True,
        recompute_kv: bool = False,
    ) -> int:
        """New weights, between two steps: checkpoint-named float tensors, all checked before
        any is written (a ValueError naming the tensor leaves the old weights). Requests
        admitted from now on never match KV of older weights; running ones keep theirs
        (off-policy), or with `recompute_kv` compute it anew. flush_cache: free the older
        weights' cached blocks now rather than as they are evicted. -> tensors written."""
        count = self.runner.update_weights(tensors)
        self._new_weights(weight_version or self.weight_version)
        if recompute_kv:
            self.scheduler.preempt_running()
        if flush_cache:
            self.scheduler.kv.reset_prefix_cache()
        self.stalled = False
        return count

    def _new_weights(self, version: str) -> None:
        """The model's weights changed: a new epoch, so no KV of the old ones matches (in the
        radix tree, and in the tiers and KV events, whose block names carry the version)."""
        self.weight_version = version
        epoch = self.scheduler.kv.new_weight_epoch()
        for hasher in self._hashers():
            hasher.set_weights(epoch, version)

    def pause(self, mode: str) -> list[EngineCoreOutput]:
        """Hold generation: "keep" holds the running requests with their KV until resume;
        "abort" ends every request now (finish_reason "abort", their tokens so far already
        sent). -> the aborted requests' last outputs. (vLLM's "wait", letting them finish, is
        the front end's: it holds new requests and waits for the rest.)"""
        if mode not in ("keep", "abort"):
            raise ValueError(f"mode: {mode!r} is not one of keep, abort")
        outputs = []
        if mode == "abort":
            ids = [*self.scheduler.requests, *self.compiling]
            for rid in self.compiling:
                outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
            self.compiling.clear()
            finished = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            outputs += [EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in finished]
            self._pin_sessions(finished)
        self.paused = True
        return outputs

    def resume(self) -> None:
        self.paused, self.stalled = False, False

    def sleep(self, level: int) -> dict:
        """Free memory while a trainer runs: level 1 gives the KV pool's pages back, level 2
        drops the model too (wake_up loads it again, at the checkpoint's weights). Refused
        while requests are in flight. -> the resident memory before and after (measured:
        the call returns once it is released)."""
        if level not in (1, 2):
            raise ValueError(f"level: {level!r} must be 1 or 2")
        if level == 2 and self.rebuild_runner is None:
            raise ValueError("level: 2 needs a runner that can be built again; use level 1")
        if self.has_unfinished():
            raise ValueError(
                "sleep: requests are in flight; pause generation (mode abort or wait) first"
            )
        before = resident_bytes()
        self.reset_prefix_cache()
        self.runner.sleep(max(level, self.sleeping))
        self.sleeping = max(level, self.sleeping)
        after = resident_bytes()
        return {"level": self.sleeping, "rss_before": before, "rss_after": after,
                "freed_bytes": before - after, "rss_at_start": self.rss_at_start}  # fmt: skip

    def wake_up(self) -> dict:
        """Back from sleep; from level 2 with the checkpoint's weights (version "default",
        and no KV of the weights before matches). -> the resident memory after."""
        if self.sleeping == 2:
            self.runner = self.rebuild_runner(self.runner)
            self._new_weights("default")
        self.sleeping, self.stalled = 0, False
        return {"rss_after": resident_bytes(), "weight_version": self.weight_version}

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (and pin): -> how many were freed. A ValueError while a
        request holds blocks: its KV cannot go, so the cache could not be emptied."""
        busy = self.scheduler.num_seated
        if busy:
            raise ValueError(
                f"reset_prefix_cache: {busy} request(s) hold KV blocks; pause generation "
                "(mode abort) or let them finish first"
            )
        kv = self.scheduler.kv
        kv.expire_pins(float("inf"))
        return kv.reset_prefix_cache()


def _shed_output(req: Request) -> EngineCoreOutput:
    slo = req.slo
    why = f"TTFT target of {slo.ttft_ms:g} ms" if slo.ttft_ms is not None else "SLO"
    return EngineCoreOutput(
        req.request_id,
        [],
        finish_reason=req.finish_reason,
        error=f"shed: it could no longer meet its {why} (class {slo.name!r})",
    )

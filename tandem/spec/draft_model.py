"""Draft-model proposer: a smaller checkpoint with the same tokenizer guesses k tokens
greedily, on its own KV pool (the same block allocator, its own blocks), in this process.

For each request the draft keeps a shadow `Request` (its tokens, its blocks, how many of its
positions hold KV). Each step it catches up on what the target produced (one multi-token row:
the whole prompt the first time, then the accepted tokens), samples the first guess, then runs
k - 1 single-token steps for the rest. After the target's verdict, the draft's KV of rejected
guesses is simply no longer counted: the shadow's computed length falls back to the tokens
the target kept, and its extra blocks go back to the draft's pool.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import ScheduledRequest, SchedulerOutput
from tandem.spec.proposer import Backoff, ProposeRow

log = logging.getLogger("tandem")
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftModelProposer:
    def __init__(self, runner, kv: KVCacheManager, num_speculative_tokens: int) -> None:
        self.runner, self.kv, self.k = runner, kv, num_speculative_tokens
        self._shadows: dict[str, Request] = {}
        self._num_real: dict[str, int] = {}  # a shadow's leading tokens that are not guesses
        self._backoff: dict[str, Backoff] = {}

    def propose(self, rows: list[ProposeRow]) -> dict[str, list[int]]:
        drafting: list[tuple[Request, int]] = []  # (shadow, tokens to draft)
        for row in rows:
            rid = row.request.request_id
            backoff = self._backoff.setdefault(rid, Backoff(self.k))
            backoff.observe(row.num_drafted, row.num_accepted)
            shadow = self._sync(rid, row.request.all_token_ids + row.new_token_ids)
            k = backoff.allowed()
            if not k:
                continue
            # room for the catch-up and k - 1 guesses' KV; short of blocks, this request
            # gives its own back (it catches up again later) and guesses nothing this step
            if self.kv.allocate_slots(
                shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1
            ):
                drafting.append((shadow, k))
            else:
                self.kv.free(shadow)
                shadow.num_computed_tokens = 0
        guesses: dict[str, list[int]] = {s.request_id: [] for s, _ in drafting}
        for i in range(max((k for _, k in drafting), default=0)):
            plan = SchedulerOutput(
                scheduled=[
                    ScheduledRequest.of(
                        s, s.num_computed_tokens, s.num_tokens - s.num_computed_tokens
                    )
                    for s, k in drafting
                    if k > i
                ]
            )
            out = self.runner.execute(plan)
            for s in plan.scheduled:
                token = out.sampled[s.request.request_id][0]
                s.request.num_computed_tokens = s.start + s.num_new_tokens
                s.request.append_token(token)
                guesses[s.request.request_id].append(token)
        return {rid: g for rid, g in guesses.items() if g}

    def _sync(self, rid: str, tokens: list[int]) -> Request:
        """The request's shadow, holding `tokens`; its KV counts only up to the first
        position where its old tokens (the guesses included) differ from them."""
        shadow, real = self._shadows.get(rid), self._num_real.get(rid, 0)
        self._num_real[rid] = len(tokens)
        if shadow is None:
            shadow = self._shadows[rid] = Request(rid, tokens, GREEDY)
            return shadow
        old, valid = shadow.all_token_ids, shadow.num_computed_tokens
        check = range(min(real, valid), min(valid, len(tokens)))  # only guesses can differ
        same = next((i for i in check if old[i] != tokens[i]), check.stop)
        shadow.all_token_ids = list(tokens)
        shadow.num_computed_tokens = min(valid, same, len(tokens) - 1)
        self.kv.trim(shadow, shadow.num_computed_tokens)
        return shadow

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            shadow = self._shadows.pop(rid, None)
            if shadow is not None:
                self.kv.free(shadow)
            self._backoff.pop(rid, None)
            self._num_real.pop(rid, None)
        if request_ids:
            self.runner.execute(SchedulerOutput(finished_ids=list(request_ids)))

    def check_invariants(self) -> None:
        self.kv.check_invariants(list(self._shadows.values()))


def build_draft_proposer(spec, config, loaded) -> DraftModelProposer:
    """Load the draft checkpoint as a second runner beside the target (`loaded`): same
    device, dtype and block size, its own pool of KV blocks."""
    from tandem.runner.builder import build_model_runner

    blocks = spec.num_draft_kv_blocks or loaded.num_blocks - 1
    draft_config = replace(
        config,
        model=spec.model,
        speculative_config=None,
        num_kv_blocks=blocks,
        max_model_len=loaded.max_model_len,
    )
    try:
        draft = build_model_runner(draft_config)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model: cannot load {spec.model!r}: {e}") from e
    if draft.model_config.vocab_size != loaded.model_config.vocab_size:
        raise ValueError(
            f"speculative_config.model: its vocabulary ({draft.model_config.vocab_size} tokens) "
            f"differs from the target's ({loaded.model_config.vocab_size}); a draft model must "
            f"share the target's tokenizer"
        )
    log.info("draft model %s loaded, %d KV blocks of its own", spec.model, blocks)
    kv = KVCacheManager(draft.num_blocks, config.block_size, enable_prefix_caching=False)
    return DraftModelProposer(draft.runner, kv, spec.num_speculative_tokens)

"""GrammarMasks: the runner's part of structured output.

One matcher per request with a grammar, made when it is first sampled (replaying the
tokens it already has: a request whose first token came from a prefill instance, or one
that was preempted, resumes in step). Each step the batch's bitmask is filled on a worker
thread while the forward pass runs, applied to the logits before sampling, and the sampled
tokens are accepted after it.

With speculative decoding a request has a row per draft: row j is masked as the grammar
stands after drafts[:j], so each draft is checked against the grammar as well as against
the model. The matcher walks the drafts to fill those rows and rolls them back; the tokens
kept are accepted afterwards. A draft the grammar refuses cannot equal the masked token
sampled in its row, so the rows after it are discarded whatever they hold.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger("tandem")


class GrammarMasks:
    def __init__(self, compiler, vocab_size: int) -> None:
        from tandem.model import kernels

        self.compiler, self.vocab_size = compiler, vocab_size
        # one pass per row in C++ (kernels/token_bitmask.cpp); xgrammar's torch ops else
        self._kernel = kernels.token_bitmask()
        self.matchers: dict[str, object] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)

    def start(self, rows) -> Future | None:
        """Begin filling the step's bitmask (rows: the runner's sample rows, each one logits
        row per draft plus one); None when no row has a grammar."""
        plan, offset = [], 0
        for s in rows:
            if s.request.sampling_params.structured_outputs is not None:
                plan.append((offset, s.request, list(s.draft_token_ids)))
            offset += len(s.draft_token_ids) + 1
        if not plan:
            return None
        for _, request, _ in plan:
            if request.request_id not in self.matchers:
                self.matchers[request.request_id] = self._new_matcher(request)
        return self.pool.submit(self._fill, plan, offset)

    def _new_matcher(self, request):
        compiled = request.grammar  # set at admission; a reserved request (PD) compiles now
        if compiled is None:
            compiled = self.compiler.submit(request.sampling_params.structured_outputs).result()
        matcher = compiled.backend.matcher(compiled.grammar)
        for token in request.all_token_ids[request.num_prompt_tokens :]:
            matcher.accept(token)
        return matcher

    def _fill(self, plan, num_rows: int) -> tuple[torch.Tensor, list[int]]:
        # xgrammar is imported by now: the request's grammar was compiled before admission
        from xgrammar import allocate_token_bitmask

        bitmask = allocate_token_bitmask(num_rows, self.vocab_size)
        indices = []
        for row, request, drafts in plan:
            m = self.matchers[request.request_id]
            if m.terminated:  # the grammar is complete (llguidance says so before EOS)
                if not request.sampling_params.ignore_eos:
                    self._only_stops(bitmask, row, request.sampling_params)
                    indices.append(row)
                continue
            m.fill(bitmask, row)
            indices.append(row)
            walked = 0
            for j, draft in enumerate(drafts):
                if m.terminated or not m.accept(draft):
                    for k in range(j + 1, len(drafts) + 1):  # discarded rows: any valid mask
                        bitmask[row + k] = bitmask[row + j]
                        indices.append(row + k)
                    break
                walked += 1
                m.fill(bitmask, row + j + 1)
                indices.append(row + j + 1)
            m.rollback(walked)
        return bitmask, indices

    def _only_stops(self, bitmask: torch.Tensor, row: int, params) -> None:
        bitmask[row] = 0
        for t in (*params.eos_token_ids, *params.stop_token_ids):
            if t < self.vocab_size:
                bitmask[row, t // 32] |= _bit(t % 32)

    def apply(self, logits: torch.Tensor, pending: Future | None) -> None:
        """Mask the logits in place: a token the grammar forbids gets -inf."""
        if pending is None:
            return
        bitmask, indices = pending.result()
        if not indices:
            return
        if self._kernel is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            self._kernel(logits, bitmask, torch.tensor(indices, dtype=torch.long))
        else:
            from xgrammar import apply_token_bitmask_inplace

            apply_token_bitmask_inplace(logits, bitmask, indices=indices)

    def accept(self, sampled: dict[str, list[int]]) -> None:
        for rid, tokens in sampled.items():
            m = self.matchers.get(rid)
            if m is None:
                continue
            for token in tokens:
                if m.terminated:
                    break
                if not m.accept(token):
                    log.warning("request %s: token %d is outside its grammar", rid, token)
                    break


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j

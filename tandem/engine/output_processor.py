"""Turn the core's token ids into RequestOutputs: detokenize, apply stop strings, collect
logprobs, and gather the n parallel samples of one request under their parent."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import DEFAULT_CLASS, SLOClass
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.messages import EngineCoreOutput, EngineCoreRequest
from tandem.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


@dataclass
class _Sequence:
    """One of a request's n samples."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    s.index,
                    s.text,
                    list(s.token_ids),
                    s.cumulative_logprob,
                    s.logprobs,
                    s.finish_reason,
                    s.stop_reason,
                )
                for s in self.seqs
            ],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Sequence]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        slo: SLOClass = DEFAULT_CLASS,
        lora_id: int = 0,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a request; return the core requests for its n samples."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs, core_requests = [], []
        for i in range(params.n):
            child = params.child(i)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, child.skip_special_tokens
            )
            seq = _Sequence(
                i,
                child,
                detok,
                logprobs=[] if child.logprobs is not None else None,
                cumulative_logprob=0.0 if child.logprobs is not None else None,
            )
            seqs.append(seq)
            cid = child_request_id(request_id, i, params.n)
            core_requests.append(
                EngineCoreRequest(
                    cid,
                    prompt_token_ids,
                    child,
                    arrival_time,
                    priority,
                    slo,
                    lora_id=lora_id,
                    cache_salt=cache_salt,
                )  # fmt: skip
            )
        parent = _Parent(request_id, prompt, prompt_token_ids, seqs, RequestMetrics(arrival_time))
        self._parents[request_id] = parent
        for seq, creq in zip(seqs, core_requests):
            self._children[creq.request_id] = (parent, seq)
        return core_requests

    def parent_id(self, child_id: str) -> str | None:
        entry = self._children.get(child_id)
        return entry[0].request_id if entry else None

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [child_request_id(request_id, s.index, len(parent.seqs)) for s in parent.seqs]

    def abort(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for s in parent.seqs:
                self._children.pop(child_request_id(request_id, s.index, len(parent.seqs)), None)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests' outputs and the child ids that stopped on a stop
        string (the core must be told to finish them)."""
        now = time.monotonic()
        updated: dict[str, _Parent] = {}
        stopped: list[str] = []
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            parent, seq = entry
            if seq.finish_reason is not None:
                continue
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
                parent.metrics.first_scheduled_time = out.first_scheduled_time
                parent.num_cached_tokens = out.num_cached_tokens
            parent.metrics.last_token_time = now
            for i, token in enumerate(out.new_token_ids):
                self._append(seq, token, out.logprobs[i] if out.logprobs else None)
                if seq.finish_reason is not None:
                    break  # a stop string: the tokens after it are not output
            if seq.finish_reason is not None:  # a stop string ended it here
                if out.finish_reason is None:
                    stopped.append(out.request_id)  # the core still runs it: stop it there
            elif out.finish_reason is not None:  # the core ended it
                self._add_text(seq, seq.detok.flush())  # held-back text may hold a stop string
                if seq.finish_reason is None:
                    seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            if seq.finish_reason is not None:
                del self._children[out.request_id]
            updated[parent.request_id] = parent
        results = []
        for parent in updated.values():
            if parent.finished:
                parent.metrics.finished_time = now
                del self._parents[parent.request_id]
            results.append(parent.output())
        return results, stopped

    def _append(self, seq: _Sequence, token: int, logprobs) -> None:
        seq.token_ids.append(token)
        if logprobs is not None and seq.logprobs is not None:
            ids, lps, rank = logprobs
            entry = {ids[0]: Logprob(lps[0], rank, self._token_text(ids[0]))}
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                entry.setdefault(tid, Logprob(lp, r, self._token_text(tid)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += lps[0]
        self._add_text(seq, seq.detok.push(token))

    def _add_text(self, seq: _Sequence, delta: str) -> None:
        if not delta:
            return
        before = len(seq.text)
        seq.text += delta
        self._check_stop_strings(seq, before)

    def _check_stop_strings(self, seq: _Sequence, before: int) -> None:
        for stop in seq.params.stop:
            # Only a match ending in the new text is new.
            idx = seq.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                seq.text = seq.text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

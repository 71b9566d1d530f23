"""Score a text through the paged KV cache: each token's logprob given the ones before it.

The tokens go through the runner's own step path in chunks, as chunked prefill (or, with
chunks of one, the decode path) computes them: each chunk writes its KV into the cache in
the cache's format and attends the earlier chunks' KV read back from it. So the perplexity
of a quantized KV cache (`--kv-cache-dtype int8|fp8`) is measured on the very numbers a
served request would read. Used by `benchmarks/kv_perplexity.py` and its tests.
"""

from __future__ import annotations

import math

import torch

from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import ScheduledRequest
from tandem.model.attention import forward_context
from tandem.runner.input_batch import prepare_inputs


def token_logprobs(core, tokens: list[int], chunk: int = 256) -> list[float]:
    """logprob of tokens[i + 1] after tokens[: i + 1], for every i, in `chunk`-token steps.
    `core` is an idle EngineCore: its KV manager lends the blocks and gets them back."""
    out: list[float] = []
    for targets, logprobs in chunk_distributions(core, tokens, chunk):
        out += logprobs.gather(1, targets[:, None])[:, 0].tolist()
    return out


@torch.inference_mode()
def chunk_distributions(core, tokens: list[int], chunk: int = 256):
    """For each `chunk`-token step over `tokens`: (the next tokens [n], the model's log
    distribution over the vocabulary after each, float32 [n, vocab]), as token_logprobs
    reads them; benchmarks compare two paths' distributions with it (KL divergence)."""
    if len(tokens) < 2:
        raise ValueError(f"tokens: need at least 2 to score, got {len(tokens)}")
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    runner, kv = core.runner, core.scheduler.kv
    request = Request("score", list(tokens), SamplingParams(max_tokens=1))
    if not kv.allocate_slots(request, len(tokens), publish=False):
        raise ValueError(f"tokens: {len(tokens)} tokens do not fit the KV cache")
    try:
        for start in range(0, len(tokens) - 1, chunk):
            n = min(chunk, len(tokens) - 1 - start)
            inputs = prepare_inputs(
                [ScheduledRequest(request, start, n, False)], runner.block_size, runner.device,
                runner.one_query_rows,
            )  # fmt: skip
            with forward_context(inputs.attn):
                hidden = runner.model(inputs.input_ids, inputs.positions)  # [n, hidden]
                logits = runner.model.compute_logits(hidden).float()
            targets = torch.tensor(tokens[start + 1 : start + n + 1], device=logits.device)
            yield targets, torch.log_softmax(logits, dim=-1)
    finally:
        kv.free(request, keep_cached=False)


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))

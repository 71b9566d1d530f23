"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tandem.core.sampling_params import SamplingParams
from tandem.engine.builder import build_engine
from tandem.engine.config import EngineConfig
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.outputs import RequestOutput
from tandem.engine.tokenizer import apply_chat_template, load_tokenizer
from tandem.lora.request import LoRARequest

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine, loaded = build_engine(self.config)
        self.model_path, self.model_config = loaded.model_path, loaded.model_config
        self._max_model_len = loaded.max_model_len
        self.quantization = loaded.weights  # what the weights are, as /v1/models says
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.model_path)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks of a split model (tensor or pipeline parallel); an LLM over a
        whole model holds nothing that needs it. Also `with LLM(...) as llm:`."""
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """priority: one per prompt, lower is more urgent (with scheduling_policy="priority"
        or "slo"), as vLLM's. lora_request: the adapter for every prompt, or one per prompt
        (None: the base model); loaded on first use (enable_lora=True)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        loras = self._lora_ids(lora_request, len(prompts))
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
        tokenized = [self._tokenize(p) for p in prompts]
        for ids, p in zip(tokenized, params):  # check everything before adding anything
            self._check_fits(ids, p)
        return self._run(list(zip(prompts, tokenized, params, priority, loras)), use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(
                self.tokenizer, conv, add_generation_prompt, **(chat_template_kwargs or {})
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- internals -----------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        vocab = self.model_config.vocab_size
        if not prompt or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(
                f"prompt: token ids must be a non-empty list of integers in [0, {vocab})"
            )
        return list(prompt)

    def _lora_ids(self, lora_request, n: int) -> list[int]:
        """Each prompt's adapter id, loading adapters not seen before."""
        if lora_request is None:
            return [0] * n
        loras = [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != n:
            raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
        for lora in loras:
            if lora is None or lora.lora_int_id in self.engine.lora_ids:
                continue
            if not self.config.enable_lora:
                raise ValueError("lora_request: LoRA is not enabled (LLM(..., enable_lora=True))")
            self.engine.add_lora(lora.lora_int_id, self.engine.read_lora(lora.lora_path))
        return [lora.lora_int_id if lora else 0 for lora in loras]

    def remove_lora(self, lora_int_id: int) -> None:
        self.engine.remove_lora(lora_int_id)

    # ---- RL: new weights between generate calls ------------------------------------------
    def update_weights(
        self, weights=None, *, model_path: str | None = None, weight_version: str | None = None
    ) -> int:
        """Write new weights: `weights` (name, tensor) pairs or a dict in the checkpoint's
        names (a trainer's `model.named_parameters()`), or an HF folder's (`model_path`).
        A ValueError names a tensor that does not fit; the old weights then stay, all of
        them. -> how many tensors were written."""
        if (weights is None) == (model_path is None):
            raise ValueError("update_weights: give weights or model_path, one of them")
        runner = self.engine.runner
        tensors = runner.read_weights(model_path) if model_path else dict(weights)
        return self.engine.update_weights(tensors, weight_version)

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def sleep(self, level: int = 1) -> dict:
        """Free memory between generate calls (an RL trainer's turn): level 1 the KV pool,
        level 2 the model too; -> the resident bytes before and after."""
        return self.engine.sleep(level)

    def wake_up(self) -> None:
        """Back from sleep; after level 2 the model is the checkpoint's again."""
        self.engine.wake_up()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; -> True (nothing runs between generate calls)."""
        self.engine.reset_prefix_cache()
        return True

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        params.check_for_model(self.model_config.vocab_size, self.config.max_logprobs)
        self.engine.scheduler.check_request(len(ids), params.max_tokens)
        if params.structured_outputs is not None:  # compiled now: a bad grammar fails here
            self.engine.grammars.compile(params.structured_outputs)

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        order = []
        for prompt, ids, params, priority, lora_id in items:
            rid = str(next(self._ids))
            order.append(rid)
            text = prompt if isinstance(prompt, str) else None
            for creq in self.processor.add_request(
                rid, text, ids, params, self.engine.clock(), priority, lora_id=lora_id
            ):
                self.engine.add_request(creq)
        bar = _progress(len(items), use_tqdm)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            outputs, stopped = self.processor.process(self.engine.step())
            if stopped:
                self.engine.abort_requests(stopped)  # the frontend already recorded "stop"
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(self._throughput(bar, results), refresh=False)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]

    @staticmethod
    def _throughput(bar, results) -> str:
        elapsed = bar.format_dict.get("elapsed") or 1e-9
        toks = sum(len(o.token_ids) for r in results.values() for o in r.outputs)
        return f"output {toks / elapsed:.1f} tok/s"


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts: must not be empty")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise ValueError(
                f"prompts: each prompt must be a string or a list of token ids, got {type(p).__name__}"
            )
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return params

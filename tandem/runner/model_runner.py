"""ModelRunner: owns the KV tensors, runs the model on a plan and samples. It never decides
what runs; it computes exactly the plan it is given."""

from __future__ import annotations

import math
import mmap
import time
from dataclasses import dataclass

import torch

from tandem.core.model_config import ModelConfig
from tandem.core.runner import RunnerOutput
from tandem.core.scheduler import SchedulerOutput
from tandem.lora.layers import lora_context
from tandem.model import kernels
from tandem.model.attention import (
    amx_sdpa,
    attention_fn,
    causal_sdpa,
    forward_context,
    sdpa_attention,
)
from tandem.model.decode_stack import build_decode_stack
from tandem.model.kv_quant import storage_dtype
from tandem.model.layers import use_fused_kernels
from tandem.model.packed_linear import pack_linears, packing_available
from tandem.runner.input_batch import prepare_inputs
from tandem.runner.kv_transfer import (
    block_layout,
    export_blocks,
    export_kv,
    export_layer,
    import_blocks,
    import_kv,
    import_layer,
)
from tandem.runner.sampler import Sampler
from tandem.spec.proposer import ProposeRow


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take no memory until written, on the CPU: an anonymous mapping is fresh
    zero pages the OS maps in only when first touched, while torch.zeros writes every byte.
    So resident memory grows with the KV actually used, not with the pool's size (the default
    2 GiB pool was most of an idle server's footprint).

    Not numpy's zeros: it madvises large blocks for huge pages, and where the kernel defrags
    on such faults (THP `defrag=madvise`, a common default) a step's first write to a new 2 MB
    region stalled in memory compaction: prefill steps 2-3x slower at random (a 237-token
    prefill 408-427 ms against 184 ms without)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


@dataclass
class PreparedWeights:
    """New weights checked and in the model's forms, ready to be written (the writes)."""

    writes: list
    count: int  # the tensors they came from
    model: object = None  # the model they were made for


def release_pages(pool: torch.Tensor) -> None:
    """Hand a zeroed_pool's pages back to the OS (madvise DONTNEED): resident memory drops
    now, and the pool reads as zeros again, page by page as it is next written (what a
    fresh pool is). Elsewhere (CUDA) the pool is zeroed instead."""
    if pool.device.type != "cpu":
        pool.zero_()
        return
    import ctypes

    madv_dontneed = 4
    nbytes = pool.numel() * pool.element_size()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(pool.data_ptr(), nbytes, madv_dontneed) != 0:
        pool.zero_()  # not a mapping of its own (it must be page-aligned): write zeros


class ModelRunner:
    def __init__(
        self,
        model,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype,
        device,
        seed: int,
        kv_cache_dtype: str = "auto",
        batch_invariant: bool = False,
    ) -> None:
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, device
        self.dtype = dtype
        if packing_available(dtype, device):
            pack_linears(model)
        # Norms, RoPE, SiLU and the KV write as one C++ call each (kernels/fused.cpp): most
        # of a small step's ops are these (None where the kernels cannot be built).
        cpu_float = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        fused = kernels.fused() if cpu_float else None
        if fused is not None:
            use_fused_kernels(model, fused)
        # [layers, 2, blocks, block_size, kv_heads, head_dim]; zeroed so unwritten slots are
        # finite (they are masked, but NaN * 0 is still NaN).
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = zeroed_pool(shape, storage_dtype(kv_cache_dtype, dtype), device)
        # an 8-bit cache's scales: [layers, 2, blocks, block_size, kv_heads] float32
        self.kv_scales = (
            None if kv_cache_dtype == "auto" else zeroed_pool(shape[:-1], torch.float32, device)
        )
        attend = attention_fn(dtype, device, fused)
        # On the CPU, decodes skip the KV gather: a C++ kernel reads the paged cache in place
        # (built on first use, ~40 s once; None where it cannot be built), an 8-bit cache too.
        decode_kernel = (
            kernels.paged_decode_attention()
            if device.type == "cpu" and cfg.head_dim % kernels.vec_lanes() == 0
            else None
        )
        # Chunks too, in bf16 on CPUs with AVX512-BF16 (an 8-bit cache too): each query
        # computes only the keys it sees (the torch path computes every pair and masks half
        # away); None elsewhere.
        prefill_kernel = (
            kernels.prefill_attention()
            if device.type == "cpu" and dtype == torch.bfloat16
            and cfg.head_dim % 16 == 0 and cfg.head_dim <= 128
            else None
        )  # fmt: skip
        if prefill_kernel is not None and kv_cache_dtype == "auto" and amx_sdpa():
            attend, prefill_kernel = sdpa_attention, None
        # every chunk's attention reads the cache in place, one after cached context as cheaply
        # as a fresh one (the default step budget follows: engine/config.py)
        self.chunks_in_place = prefill_kernel is not None
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            attn.prefill_kernel = prefill_kernel
            if self.kv_scales is not None:
                attn.k_scale, attn.v_scale = self.kv_scales[i, 0], self.kv_scales[i, 1]
            attn.layer_index = i
            attn.attend, attn.decode_kernel = attend, decode_kernel
            # chunks with no cached context skip the gather and the mask's masked-away half
            # where SDPA runs them (an 8-bit cache: read back as the other chunks are)
            # (not batch-invariant: a lone token at position 0 then reads the cache as others)
            if (attend is sdpa_attention and prefill_kernel is None and self.kv_scales is None
                    and not batch_invariant):  # fmt: skip
                attn.fresh_attend = causal_sdpa
        # Batch-invariant (engine/config.py): every token a row of its own for attention, so
        # each query is computed by the decode kernel over its own keys, in one order, whether
        # it comes in a prompt's chunk, a decode, a draft's verification or beside other rows
        # (the chunk kernels' sums and roundings run otherwise); the projections are made
        # row-invariant before this (quantize.use_rows_invariant).
        self.one_query_rows = batch_invariant
        if batch_invariant and decode_kernel is None:
            raise ValueError(
                "batch_invariant: needs the C++ decode attention kernel (the CPU, a head_dim "
                f"that is a multiple of {kernels.vec_lanes()})"
            )
        # Decode-only steps of int4 models run their layers in one C++ call (None: no fit).
        model.model.decode_stack = build_decode_stack(model, fused)
        self.sampler = Sampler(seed, device)
        # Told each layer's index once its K/V for the step is written (a prefill instance
        # streams layers to the decode side with it); None: nobody listens.
        self.on_layer_written = None
        # Guesses the tokens after each row's new ones (speculative decoding); None: no guesses.
        self.proposer = None
        self.lora = None  # a LoRAManager when LoRA is enabled (enable_lora)
        # Structured output: the grammar compiler the engine admits requests through, and
        # the per-request matchers that mask the logits (enable_structured_outputs).
        self.grammars = None
        self.masks = None
        # Where the model is split over ranks (tandem/distributed): the driver that sends each
        # step's ledger to the other ranks and runs this rank's stage; None: the model is whole.
        self.distributed = None
        # RL weight updates (model/weight_update.py), set by the builder where they can run;
        # else why not
        self.weights = None
        self.weights_refusal = "this model was not loaded from a checkpoint folder"
        self.lora_state = None  # LoRA's slots and adapters, kept over a level-2 sleep

    def map_kv_pool(self) -> None:
        """Write zeros over the KV pool (and an 8-bit cache's scales) before anything is cached
        in it, so every page is mapped. The CPU pool pages in as it is first written, and a
        step on fresh blocks meets a page fault per 4 KiB: the first pass of `tandem profile`
        over a fresh default pool ran steps up to 10x their time (a 12-row decode 407 ms
        against 42). A server that has cycled through its pool runs on mapped pages; the
        profile times those."""
        for pool in (self.kv_cache, self.kv_scales):
            if pool is not None:
                pool.zero_()

    def expert_load(self) -> list[int]:
        """Tokens routed to each expert so far, summed over the MoE layers (this rank
        routes every token: the router is whole on each); empty for a dense model."""
        blocks = self.model.moe_blocks() if self.model is not None else []  # (asleep: none)
        return sum(b.routed for b in blocks).tolist() if blocks else []

    def check_alive(self) -> None:
        """Raise RankFailed where a rank of a split model has died (idle servers ask)."""
        if self.distributed is not None:
            self.distributed.check_idle()

    def close(self) -> None:
        """Stop the other ranks of a split model; nothing to do for a whole one."""
        if self.distributed is not None:
            self.distributed.close()
            self.distributed = None

    # ---- sleep (RL: free memory while the trainer runs) ---------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: give the KV pool's pages back (its contents are dropped: the engine
        holds no request and has emptied its cache). Level 2: also drop the model; the
        engine then builds a new runner to wake up (engine/builder.py: rebuild_runner)."""
        for pool in (self.kv_cache, self.kv_scales):
            if pool is not None:
                release_pages(pool)
        if level == 2:
            from tandem.engine.heap import collect_all
            from tandem.model.quantize import _return_freed_memory

            if self.lora is not None:  # what a rebuilt runner loads again
                self.lora_state = (self.lora.max_loras, self.lora.max_rank, dict(self.lora.adapters))  # fmt: skip
            self.model = self.kv_cache = self.kv_scales = self.lora = self.weights = None
            self.weights_refusal = "the engine is asleep (level 2): wake it up first"
            collect_all()
            _return_freed_memory()

    def enable_structured_outputs(self, compiler) -> None:
        from tandem.structured.masks import GrammarMasks

        self.grammars = compiler
        self.masks = GrammarMasks(compiler, self.cfg.vocab_size)

    # ---- LoRA adapters ---------------------------------------------------------------
    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        from tandem.lora.manager import LoRAManager

        dtype = self.kv_cache.dtype
        self.lora = LoRAManager(self.model, self.cfg, max_loras, max_rank, dtype, self.device)
        if self.one_query_rows:
            if self.lora.kernel is None:
                raise ValueError("batch_invariant with LoRA: needs the C++ LoRA kernel (CPU)")
            self.lora.per_token = True
        self.model.model.decode_stack = None  # each token's LoRA update runs in the layers

    def read_lora(self, path: str):
        """Read and check an adapter's files; safe to call off the step loop."""
        if self.lora is None:
            raise ValueError("lora: LoRA is not enabled (enable_lora)")
        return self.lora.read(path)

    def add_lora(self, lora_id: int, weights) -> None:
        self.lora.add(lora_id, weights)

    def remove_lora(self, lora_id: int) -> None:
        self.lora.remove(lora_id)

    # ---- new weights from a trainer (RL), in place between two steps -------------------------
    def weight_updater(self):
        """The model's model.weight_update.WeightUpdater; a ValueError where there is none."""
        if self.weights is None:
            raise ValueError(f"weight updates: {self.weights_refusal}")
        return self.weights

    def read_weights(self, model_path: str) -> dict[str, torch.Tensor]:
        """An HF checkpoint folder's tensors, checked against this model (off the step
        loop: it only reads); a ValueError names what does not fit."""
        from pathlib import Path

        from tandem.model.weight_update import read_checkpoint

        updater = self.weight_updater()
        if not Path(model_path).is_dir():
            raise ValueError(f"model_path: {model_path!r} is not a checkpoint folder")
        tensors = dict(read_checkpoint(Path(model_path)))
        for name, t in tensors.items():
            updater.check(name, t.shape, t.dtype)
        return tensors

    def prepare_weights(self, tensors: dict[str, torch.Tensor]) -> PreparedWeights:
        """Check checkpoint-named float tensors and compute what they make of the model's
        layers (quantized again, repacked), writing nothing: safe off the step loop."""
        return PreparedWeights(self.weight_updater().prepare(tensors), len(tensors), self.model)

    def weight_preparation(self):
        """A model.weight_update.Preparation: prepare_weights a tensor at a time, as a
        trainer's broadcast brings them (prepared() makes PreparedWeights of it)."""
        from tandem.model.weight_update import Preparation

        return Preparation(self.weight_updater())

    @staticmethod
    def prepared(preparation) -> PreparedWeights:
        return PreparedWeights(preparation.finish(), preparation.count, preparation.updater.model)

    def update_weights(self, tensors: dict[str, torch.Tensor] | PreparedWeights) -> int:
        """Write new weights (tensors, or what prepare_weights made of them) between two
        steps; -> how many tensors. The KV already computed stays: the engine keys new KV by
        weight epoch."""
        if not isinstance(tensors, PreparedWeights):
            tensors = self.prepare_weights(tensors)
        if self.weights is None:  # fell asleep since it was prepared
            raise ValueError(f"weight updates: {self.weights_refusal}")
        if tensors.model is not self.model:
            raise ValueError("weight updates: the model was loaded again since; push again")
        for write in tensors.writes:
            write()
        return tensors.count

    # ---- KV of a token range, layout-neutral (prefill/decode disaggregation) ---------------
    def export_kv(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """[layers, 2, tokens, kv_heads, head_dim] of positions [start, end), on the CPU, in
        the model's dtype (an 8-bit cache's dequantized). A split model's: all its ranks'."""
        if self.distributed is not None:
            return self.distributed.export_kv(block_ids, start, end)
        return export_kv(self.kv_cache, self.kv_scales, block_ids, start, end, self.dtype)

    def import_kv(self, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
        """Write KV from another instance (any block size, any float dtype) from `start`."""
        if self.distributed is not None:
            return self.distributed.import_kv(block_ids, start, kv)
        import_kv(self.kv_cache, self.kv_scales, block_ids, start, kv)

    def export_layer(self, block_ids: list[int], layer: int, start: int, end: int):
        """(K, V, scales) of one layer, K and V [tokens, kv_heads, head_dim] as the cache
        stores them, on the CPU; an 8-bit cache's scales [2, tokens, kv_heads], else None."""
        if self.distributed is not None:
            return self.distributed.export_layer(block_ids, layer, start, end)
        return export_layer(self.kv_cache, self.kv_scales, block_ids, layer, start, end)

    def import_layer(self, block_ids: list[int], layer: int, start: int, k, v, scales=None):
        if self.distributed is not None:
            return self.distributed.import_layer(block_ids, layer, start, k, v, scales)
        import_layer(self.kv_cache, self.kv_scales, block_ids, layer, start, k, v, scales)

    # ---- whole blocks as stored, for the KV tiers -------------------------------------
    @property
    def kv_layout(self) -> str:
        layout = block_layout(self.kv_cache, self.kv_scales)
        return layout if self.distributed is None else self.distributed.kv_layout(layout)

    def export_blocks(self, block_ids: list[int]) -> list[memoryview]:
        if self.distributed is not None:
            return self.distributed.export_blocks(block_ids)
        return export_blocks(self.kv_cache, self.kv_scales, block_ids)

    def import_blocks(self, block_ids: list[int], payloads) -> None:
        if self.distributed is not None:
            return self.distributed.import_blocks(block_ids, payloads)
        import_blocks(self.kv_cache, self.kv_scales, block_ids, payloads)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        self.sampler.forget(plan.finished_ids)
        if self.proposer is not None:
            self.proposer.forget(plan.finished_ids)
        if self.masks is not None:
            self.masks.forget(plan.finished_ids)
        if plan.is_empty:
            return RunnerOutput()
        if self.distributed is not None:
            self.distributed.send_step(plan, self.block_size)
        inputs = prepare_inputs(plan.scheduled, self.block_size, self.device, self.one_query_rows)
        inputs.attn.on_layer_written = self.on_layer_written
        # the grammar masks fill on a worker thread while the forward pass runs
        masks = self.masks.start(inputs.sample_rows) if self.masks is not None else None
        t1 = time.perf_counter()
        lora = self.lora.context(inputs.token_lora_ids) if self.lora else None
        with forward_context(inputs.attn), lora_context(lora):
            if self.distributed is not None:
                logits = self.distributed.forward(self.model, inputs)  # [S, vocab]
            else:
                hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
                logits = self.model.compute_logits(hidden[inputs.sample_index])  # [S, vocab]
        t2 = time.perf_counter()
        timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": 0.0}
        if not inputs.sample_rows:
            return RunnerOutput(timings=timings)
        if masks is not None:
            self.masks.apply(logits, masks)
        sampled, logprobs = self._sample(logits, inputs.sample_rows)
        if masks is not None:
            self.masks.accept(sampled)
        timings["sample"] = time.perf_counter() - t2
        drafts = {}
        if self.proposer is not None:
            drafts = self.proposer.propose(
                [
                    ProposeRow(s.request, sampled[s.request.request_id], len(s.draft_token_ids))
                    for s in inputs.sample_rows
                ]
            )
            timings["propose"] = time.perf_counter() - t2 - timings["sample"]
        return RunnerOutput(sampled=sampled, logprobs=logprobs, timings=timings, drafts=drafts)

    def _sample(self, logits: torch.Tensor, rows) -> tuple[dict, dict]:
        """Sample every position of `rows` (logits: one per position), and keep for each row
        its tokens up to and including the first that differs from its draft there."""
        ids, params, histories, prompts = [], [], [], []
        for s in rows:
            r, drafts = s.request, s.draft_token_ids
            for j in range(len(drafts) + 1):
                ids.append(r.request_id)
                params.append(r.sampling_params)
                histories.append(r.all_token_ids + list(drafts[:j]) if j else r.all_token_ids)
                prompts.append(r.num_prompt_tokens)
        result = self.sampler.sample(logits, ids, params, histories, prompts)
        sampled, logprobs, i = {}, {}, 0
        for s in rows:
            rid, drafts = s.request.request_id, s.draft_token_ids
            targets = result.token_ids[i : i + len(drafts) + 1]
            n = num_agreeing(targets, drafts) + 1
            sampled[rid] = targets[:n]
            if drafts:
                self.sampler.keep(rid, n)
            if result.logprobs[i] is not None:
                logprobs[rid] = result.logprobs[i : i + n]
            i += len(drafts) + 1
        return sampled, logprobs


def num_agreeing(targets: list[int], drafts) -> int:
    """How many drafts, from the first, equal the token sampled at their position. Sampling
    each position as plain decoding does and keeping this prefix yields exactly the tokens of
    plain decoding. For a proposer that names one token (a point mass, as n-gram lookup and
    greedy drafting do) this is the rejection rule of Leviathan et al.: the draft is accepted
    with probability p(draft), and a rejected one is replaced by a sample of p without it."""
    n = 0
    while n < len(drafts) and targets[n] == drafts[n]:
        n += 1
    return n

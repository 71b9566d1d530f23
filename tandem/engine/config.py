"""EngineConfig: what a user sets, with each default and its help written once. The engine
flags of `tandem serve` and `tandem generate` are generated from these fields.

Derived values (dtype, device, max_model_len, number of KV blocks) are resolved when the
engine is built and passed to components, never written back here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from tandem.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
# GiB for the KV cache when no flag sets it: vLLM's VLLM_CPU_KVCACHE_SPACE, under our name.
KV_CACHE_SPACE_ENV = "TANDEM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_GIB = 2.0
# vLLM's switch for batch-invariant output, honoured as --batch-invariant
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel takes
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # stored as tandem/model/kv_quant.py says
ROLES = ("both", "prefill", "decode")
# Tokens a step computes when --max-num-batched-tokens is not given: vLLM's server default,
# except where every prefill chunk's attention reads the paged cache in place (the C++ kernel,
# on CPUs with AVX512-BF16 in bf16: without AMX, or with an 8-bit KV cache), so a chunk after
# cached context costs what a fresh one does. There smaller chunks let a wave of new prompts start sooner at no cost in
# throughput: served random 256/128 at c=16 on an AVX-512 EPYC, mean TTFT 992 vs 1,965 ms and
# 301 vs 287 output tok/s, ShareGPT 436 vs 680 ms and 332 vs 311, a lone 2,000-token prompt
# level (1.67-1.85 vs 1.65-1.78 s). Elsewhere a continued chunk gathers its keys and computes
# the masked pairs too (a lone 2,000-token prompt 634-724 vs 479-528 ms at 1,024 on an AMX Xeon).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
IN_PLACE_CHUNKS_MAX_NUM_BATCHED_TOKENS = 512


def _flag(default, help: str, **argparse_kwargs):
    """A field that is also a command-line flag (--name-with-dashes)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True)
class EngineConfig:
    # The model is a positional argument of each sub-command, not a generated flag.
    model: str | None = field(default=None, metadata={"cli": False})
    tokenizer: str | None = _flag(None, "tokenizer folder (default: the model's own)", type=str)
    dtype: str = _flag(
        "auto",
        "weights and KV dtype; auto: bfloat16 on GPUs and CPUs with native bf16, else float32 "
        "(half = float16, float = float32)",
        choices=(*DTYPES, *DTYPE_ALIASES),
    )
    quantization: str | None = _flag(
        None,
        "weights: gguf (a GGUF model's own Q4_0/Q4_1/Q8_0 blocks; a GGUF's default), int8 (per "
        "channel) or int4 (group-wise), quantized at load from an HF checkpoint, or none (float "
        "weights; an HF checkpoint's default). On the CPU only",
        type=str,
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = _flag(
        32, f"int4: input columns per scale and zero, one of {INT4_GROUP_SIZES}"
    )
    activation_quantization: str = _flag(
        "auto",
        "int8: int4 projections' steps of 9-512 rows (prefill chunks, many running requests) "
        "quantize their input rows to int8, a scale per 32 columns, as llama.cpp multiplies "
        "GGUF's 4-bit blocks: about 1.2-1.4x faster matmuls, lossy (real text's perplexity "
        "within 0.2%% of the float path, mean KL divergence under 0.004). CPUs with AVX512-BF16 "
        "and AVX512-VNNI, without AMX. auto: int8 where it runs (int4 weights on such a CPU), "
        "else none; none: bf16 activations, the float path's numbers",
        choices=ACTIVATION_QUANTIZATIONS,
    )
    batch_invariant: bool = _flag(
        False,
        "a request's tokens and logprobs never depend on the other requests in its steps or on "
        "where its prompt is cut into chunks: every token's row is computed by the same kernels "
        f"in the same order whatever the batch (also on with ${BATCH_INVARIANT_ENV}=1, vLLM's "
        "variable). Costs throughput and prefill time (docs/batch-invariance.md)",
    )
    bf16_weight_copy: bool = _flag(
        False,
        "quantized weights: also hold them in bf16, prepacked for oneDNN, for steps past 10 rows "
        "(prefill, many running requests), which then run at bf16 speed instead of "
        "dequantizing each step; 2 more bytes a weight. CPUs with native bf16 only",
    )
    kv_cache_dtype: str = _flag(
        "auto",
        "KV cache storage: auto (the model's dtype), int8 or fp8 (= fp8_e4m3), each token's K "
        "and V per KV head with its own float32 scale: about 3.8x the tokens of a float32 cache "
        "in the same memory, 1.9x bf16's",
        choices=KV_CACHE_DTYPES,
    )
    device: str = _flag("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    seed: int = _flag(0, "seed for sampling without a per-request seed")
    block_size: int = _flag(16, "tokens per KV cache block")
    kv_cache_memory: float | None = _flag(
        None,
        f"GiB for the KV cache pool (default: ${KV_CACHE_SPACE_ENV} if set; on CUDA, "
        f"--gpu-memory-utilization; else {DEFAULT_KV_CACHE_GIB})",
        type=float,
    )
    kv_cache_memory_bytes: int | None = _flag(
        None, "bytes for the KV cache pool, overriding --kv-cache-memory (as vLLM's)", type=int
    )
    gpu_memory_utilization: float = _flag(
        0.9,
        "on CUDA, the share of GPU memory the engine may use (weights, activations and the KV "
        "pool sized from what is left, as vLLM); ignored on the CPU",
    )
    enable_prefix_caching: bool = _flag(True, "reuse the KV of shared prompt prefixes")
    radix_eviction_policy: str = _flag(
        "lru",
        "which cached blocks go first when the pool is short: lru (least recently read) or "
        "priority (those only less urgent requests used, then least recently read; SGLang's "
        "flag)",
        choices=["lru", "priority"],
    )
    kv_events_config: str | None = _flag(
        None,
        "publish KV cache events for external routers, vLLM's JSON and wire format: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}\'',
        type=str,
    )
    max_pinned_fraction: float = _flag(
        0.5,
        "the share of the KV pool agent sessions may pin between their turns (the rest always "
        "serves ordinary traffic); opening a session past it is a 429",
    )
    max_num_seqs: int = _flag(256, "most sequences in one running batch")
    max_num_batched_tokens: int | None = _flag(
        None,
        f"most tokens computed in one step (default: {IN_PLACE_CHUNKS_MAX_NUM_BATCHED_TOKENS} "
        "where prefill attention reads the paged KV cache in place for every chunk: bf16 on CPUs "
        "with AVX512-BF16, without AMX or with an 8-bit KV cache; else "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS})",
        type=int,
    )
    max_model_len: int | None = _flag(
        None, "longest prompt + output (default: the model's limit)", type=int
    )
    num_kv_blocks: int | None = _flag(
        None, "usable KV blocks, overriding --kv-cache-memory (tests, simulations)", type=int
    )
    max_logprobs: int = _flag(20, "most logprobs a request may ask for per token")
    scheduling_policy: str = _flag(
        "fcfs",
        "fcfs: first come, first served; priority: strict priority (lower first), preempting "
        "lower classes; slo: SLO-aware batching driven by the cost model",
        choices=SCHEDULING_POLICIES,
    )
    cost_model: str | None = _flag(
        None,
        "a step-latency cost model from `tandem profile` (default: fitted online from the "
        "steps the engine times)",
        type=str,
    )
    role: str = _flag(
        "both",
        "both: prefill and decode here; prefill: also compute prompts whose KV a decode "
        "instance asks for and send it there; decode: also take requests whose prompt KV a "
        "prefill instance sends (prefill/decode disaggregation, through `tandem proxy`)",
        choices=ROLES,
    )
    enable_role_switching: bool = _flag(
        False,
        "prefill or decode role: set up both ends of the KV link, so `POST /role` (an admin "
        "endpoint this opens to API keys) switches the instance to the other role without a "
        "restart, its prefix cache kept (`tandem router --pd-ratio auto` does)",
    )
    kv_host: str = _flag(
        "127.0.0.1",
        "decode role (or one that may switch to it): the address to receive KV on, as "
        "prefill instances reach it",
    )
    kv_port: int = _flag(
        0,
        "decode role (or one that may switch to it): the TCP port to receive KV on (0: any free port)",
    )
    kv_transfer_timeout: float = _flag(
        60.0,
        "decode role: seconds a reservation waits for its KV before it is given up (the "
        "request fails and its blocks go back)",
    )
    kv_secret_key: str | None = _flag(
        None,
        "an authenticated KV link (CurveZMQ): this instance's secret key file from `tandem keys "
        "generate` (default: the link is open to whoever reaches it)",
        type=str,
    )
    kv_peer_keys: str | None = _flag(
        None,
        "with --kv-secret-key: decode role, a folder of the public keys of the prefill "
        "instances it takes KV from; prefill role, the decode instances' public key file",
        type=str,
    )
    kv_offloading_size: float = _flag(
        0.0,
        "GiB of host memory for a KV tier behind the prefix cache: the KV of every computed "
        "block is kept there too, and a prompt whose prefix left the pool loads it back "
        "instead of computing it (vLLM's flag; 0: off)",
    )
    kv_disk_dir: str | None = _flag(
        None,
        "a directory for a local-disk KV tier, which outlives the server: a restart finds the "
        "prefixes its predecessor computed (default: off)",
        type=str,
    )
    kv_disk_size: float = _flag(10.0, "GiB the disk tier may hold (least recently used dropped)")
    kv_remote_url: str | None = _flag(
        None,
        "redis://HOST:PORT[/DB]: a KV tier in Redis, which instances pointed at the same server "
        "share: one reuses the prefixes another computed (default: off)",
        type=str,
    )
    kv_offload_min_tokens: int = _flag(
        256,
        "KV tiers: a prefix found in a tier is loaded only if it is at least this many tokens "
        "(a shorter one is computed: cheaper than a lookup and a load)",
    )
    kv_offload_load_timeout: float = _flag(
        2.0,
        "KV tiers: seconds a load may take; a later one is given up and its tokens computed",
    )
    speculative_config: SpeculativeConfig | None = _flag(
        None,
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": '
        '4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4} (default: off)',
        type=str,
    )
    enable_lora: bool = _flag(False, "serve LoRA adapters (PEFT format) beside the base model")
    max_loras: int = _flag(1, "with --enable-lora: most adapters in one step (adapter slots)")
    max_lora_rank: int = _flag(16, "with --enable-lora: the largest adapter rank accepted")
    structured_outputs_backend: str = _flag(
        "auto",
        "the grammar library behind response_format, structured_outputs and tools: xgrammar, "
        "guidance (llguidance), or auto: xgrammar, and llguidance for a JSON schema with a "
        "keyword xgrammar does not enforce",
        choices=("auto", "xgrammar", "guidance"),
        aliases=("--structured-outputs-config.backend",),
    )
    structured_outputs_compile_timeout: float = _flag(
        5.0,
        "seconds a request's grammar may take to compile (on a worker thread, never holding up "
        "other requests); past them the request fails with a 400",
    )
    kernel_build_timeout: float = _flag(
        300.0,
        "seconds a start may spend building the C++ CPU kernels, all together, or waiting for "
        "another process that builds them (it says so every few seconds); past them the "
        "kernels not built run on the torch path and the start goes on",
    )
    tensor_parallel_size: int = _flag(
        1,
        "ranks each layer is split over (Megatron: heads and MLP columns), each its own "
        "process with its share of the weights and KV; on torch.distributed (gloo)",
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = _flag(
        1, "stages the layers are split into, each on its own ranks", aliases=("-pp",)
    )
    enable_expert_parallel: bool = _flag(
        False,
        "a mixture of experts' experts spread whole over the tensor-parallel ranks (each "
        "expert on one rank; tokens sent to their experts and back by all-to-all) instead of "
        "each expert split over them",
    )
    expert_placement_strategy: str = _flag(
        "linear",
        "which rank holds which expert under --enable-expert-parallel: linear (rank r the "
        "r-th contiguous range) or round_robin (expert e on rank e mod ranks)",
        choices=("linear", "round_robin"),
    )
    distributed_executor_backend: str = _flag(
        "mp",
        "how ranks past the first start: mp (processes on this node; with --nnodes, a "
        "`--headless` server on each other node) or ray (actors on the Ray cluster this "
        "process joins, placed one rank a CPU bundle)",
        choices=("mp", "ray"),
    )
    nnodes: int = _flag(1, "nodes the ranks run on (mp backend); ranks split evenly")
    node_rank: int = _flag(0, "this node's index, 0 to nnodes - 1 (0 runs the server)")
    master_addr: str = _flag(
        "127.0.0.1", "address of node 0, where the ranks meet (torch.distributed's store)"
    )
    master_port: int = _flag(
        0, "port of that store (0: a free one on one node; with --nnodes, 29500)"
    )
    headless: bool = _flag(
        False, "run this node's ranks only, for the server on node 0 (with --node-rank >= 1)"
    )
    cpu_threads_bind: str = _flag(
        "auto",
        "CPUs of each of this node's ranks, as VLLM_CPU_OMP_THREADS_BIND: auto (each NUMA "
        "node's CPUs to an equal share of the ranks, split evenly), none, or a list per rank "
        "such as 0-3|4-7",
    )
    distributed_timeout: float = _flag(
        30.0,
        "seconds a collective (all-reduce, gather, a stage's activations) may wait for a rank; "
        "past them the server fails its requests and exits",
    )
    distributed_start_timeout: float = _flag(
        120.0, "seconds a start waits for every rank to join, and then to load its weights"
    )
    trust_remote_code: bool = _flag(
        False,
        "accepted for vLLM's scripts; no remote code is ever run (architectures are built in)",
    )
    enforce_eager: bool = _flag(
        False, "accepted for vLLM's scripts; tandem always runs eagerly (no graph capture)"
    )

    def _check_choice(self, name: str, choices: tuple) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        self._check_choice("dtype", DTYPES)
        if self.quantization is not None:
            self._check_choice("quantization", QUANTIZATIONS)
        self._check_choice("quantization_group_size", INT4_GROUP_SIZES)
        self._check_choice("activation_quantization", ACTIVATION_QUANTIZATIONS)
        self._check_choice("kv_cache_dtype", KV_CACHE_DTYPES)
        self._check_choice("structured_outputs_backend", ("auto", "xgrammar", "guidance"))
        self._check_choice("radix_eviction_policy", ("lru", "priority"))
        if self.kv_events_config is not None:
            from tandem.engine.kv_event_publisher import KVEventsConfig

            events = KVEventsConfig.parse(self.kv_events_config)  # a ValueError naming the field
            if events is not None and not self.enable_prefix_caching:
                raise ValueError("kv_events_config: events come from the prefix cache; enable it")
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(
                "structured_outputs_compile_timeout must be > 0 (seconds), got "
                f"{self.structured_outputs_compile_timeout!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not (isinstance(self.block_size, int) and 1 <= self.block_size <= 1024):
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 (GiB), got {self.kv_cache_memory!r}")
        if self.kv_cache_memory_bytes is not None and not self.kv_cache_memory_bytes >= 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes!r}"
            )
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        self._check_choice("scheduling_policy", SCHEDULING_POLICIES)
        self._check_choice("role", ROLES)
        if bool(self.kv_secret_key) != bool(self.kv_peer_keys):
            raise ValueError("kv_secret_key: give --kv-secret-key and --kv-peer-keys together")
        if self.enable_role_switching and self.role == "both":
            raise ValueError("enable_role_switching: needs --role prefill or --role decode")
        if self.enable_role_switching and self.kv_secret_key:
            # a prefill end trusts one decode key, a decode end a folder of prefill keys
            raise ValueError(
                "enable_role_switching: not with --kv-secret-key (an authenticated link's "
                "keys are per role); switch roles on a private network, or keep roles fixed"
            )
        if not (isinstance(self.kv_port, int) and 0 <= self.kv_port <= 65535):
            raise ValueError(f"kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        if not self.kernel_build_timeout > 0:
            raise ValueError(
                f"kernel_build_timeout must be > 0 (seconds), got {self.kernel_build_timeout!r}"
            )
        if not self.kv_transfer_timeout > 0:
            raise ValueError(
                f"kv_transfer_timeout must be > 0 (seconds), got {self.kv_transfer_timeout!r}"
            )
        self._check_kv_tiers()
        self._check_parallel()
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.max_logprobs, int) and self.max_logprobs >= 0):
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name == "max_num_batched_tokens" and value is None:
                continue
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_kv_blocks is not None and not (
            isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1
        ):
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and not (
            isinstance(self.max_model_len, int) and self.max_model_len >= 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")

    @property
    def kv_tiers_on(self) -> bool:
        return bool(self.kv_offloading_size or self.kv_disk_dir or self.kv_remote_url)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self._check_choice("distributed_executor_backend", ("mp", "ray"))
        self._check_choice("expert_placement_strategy", ("linear", "round_robin"))
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "enable_expert_parallel: experts spread over the tensor-parallel ranks; "
                "set tensor_parallel_size >= 2"
            )
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise ValueError(f"node_rank must be in [0, nnodes - 1 = {self.nnodes - 1}], got {self.node_rank!r}")  # fmt: skip
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes: {self.world_size} ranks (tensor x pipeline parallel size) do not split evenly over {self.nnodes} nodes")  # fmt: skip
        if self.headless and self.node_rank == 0:
            raise ValueError("headless: node 0 runs the server; --headless is for --node-rank >= 1")  # fmt: skip
        if not (isinstance(self.master_port, int) and 0 <= self.master_port <= 65535):
            raise ValueError(f"master_port must be an integer in [0, 65535], got {self.master_port!r}")  # fmt: skip
        for name in ("distributed_timeout", "distributed_start_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (seconds), got {getattr(self, name)!r}")
        if self.world_size == 1:
            return
        spec = self.speculative_config
        unsupported = {
            "enable_lora": (self.enable_lora, "adapters are not split over ranks"),
            "speculative_config": (spec is not None and spec.method == "draft_model",
                                   "the draft model is not split over ranks (ngram is)"),
            "device": (self.device.startswith("cuda"), "ranks run on the CPU (gloo)"),
        }  # fmt: skip
        for name, (on, why) in unsupported.items():
            if on:
                raise ValueError(
                    f"{name}: not supported with tensor or pipeline parallelism yet ({why}); "
                    "run it with tensor_parallel_size and pipeline_parallel_size 1"
                )

    def _check_kv_tiers(self) -> None:
        for name in ("kv_offloading_size", "kv_disk_size"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{name} must be >= 0 (GiB), got {value!r}")
        if self.kv_disk_dir is not None and not self.kv_disk_size > 0:
            raise ValueError(f"kv_disk_size must be > 0 (GiB) with --kv-disk-dir, got {self.kv_disk_size!r}")  # fmt: skip
        url = self.kv_remote_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote_url must be redis://HOST:PORT[/DB], got {url!r}")
        if not (isinstance(self.kv_offload_min_tokens, int) and self.kv_offload_min_tokens >= 0):
            raise ValueError(f"kv_offload_min_tokens must be an integer >= 0, got {self.kv_offload_min_tokens!r}")  # fmt: skip
        if not self.kv_offload_load_timeout > 0:
            raise ValueError(f"kv_offload_load_timeout must be > 0 (seconds), got {self.kv_offload_load_timeout!r}")  # fmt: skip
        if self.kv_tiers_on and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size: KV tiers sit behind the prefix cache; "
                             "they need --enable-prefix-caching")  # fmt: skip


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named as vLLM's, with its default in the help."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        meta = dict(f.metadata)
        if not meta.pop("cli", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = (flag, *meta.pop("aliases", ()))  # vLLM's other spellings
        help_text = meta.pop("help")
        if "(default" not in help_text:
            help_text += f" (default: {f.default})"
        if isinstance(f.default, bool):
            group.add_argument(
                *flags, dest=f.name, default=f.default,
                action=argparse.BooleanOptionalAction, help=help_text,
            )  # fmt: skip
        else:
            meta.setdefault("type", type(f.default))
            group.add_argument(*flags, dest=f.name, default=f.default, help=help_text, **meta)


def engine_config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    names = [f.name for f in fields(EngineConfig) if f.metadata.get("cli", True)]
    return EngineConfig(model=model, **{name: getattr(args, name) for name in names})


def step_token_budget(config: EngineConfig, chunks_in_place: bool) -> int:
    """max_num_batched_tokens as set, else its default for how this runner attends prefill
    chunks (chunks_in_place: every chunk reads the paged cache in place)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if chunks_in_place:
        return IN_PLACE_CHUNKS_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS


def kv_cache_setting(config: EngineConfig) -> tuple[int | None, str]:
    """(bytes for the KV pool, which setting says so); None bytes: size it from
    --gpu-memory-utilization (CUDA only, once the model is loaded)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory * 2**30), "--kv-cache-memory"
    env = os.environ.get(KV_CACHE_SPACE_ENV)
    if env:
        try:
            gib = float(env)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(f"{KV_CACHE_SPACE_ENV} must be a number of GiB > 0, got {env!r}")
        return int(gib * 2**30), f"${KV_CACHE_SPACE_ENV}"
    return None, "default"


def resolve_batch_invariant(config: EngineConfig) -> bool:
    """--batch-invariant, or vLLM's VLLM_BATCH_INVARIANT=1 in the environment."""
    env = os.environ.get(BATCH_INVARIANT_ENV, "0").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be 0 or 1, got {env!r}")
    on = config.batch_invariant or env == "1"
    if on and config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ValueError(
            "batch_invariant: a model split over ranks (tensor or pipeline parallel) sums its "
            "shards' products in another order; run it whole"
        )
    return on

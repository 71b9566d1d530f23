"""Shared fixtures: tiny seeded checkpoints built with transformers, saved as safetensors.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a fixed text, and
the models are random but seeded, with a wide init so greedy choices are not near-ties.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks. "
    "Continuous batching lets requests join and leave every step. Prefix caching reuses the KV of "
    "shared prompts. Héllo wörld, naïve café, 東京 and 🙂 emoji test the byte-level decoder. "
) * 20
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCH_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama3": dict(  # llama3 rope scaling, tied embeddings, head_dim != hidden / heads
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        sliding_window=None,
    ),
}

# Mixtures of experts, tiny, from transformers' own config classes: 8 experts, 2 per token.
_MOE_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)
MOE_CONFIGS = {
    "mixtral": dict(
        _MOE_BASE, architectures=["MixtralForCausalLM"], model_type="mixtral",
        num_local_experts=8, intermediate_size=32, sliding_window=None,
    ),
    "qwen2_moe": dict(  # a shared expert; layer 1 dense; top-k weights not renormalized
        _MOE_BASE, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
        num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False, use_sliding_window=False,
    ),
    "qwen3_moe": dict(  # q/k norms per head; head_dim != hidden / heads
        _MOE_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        num_experts=8, moe_intermediate_size=32, intermediate_size=96, head_dim=32,
        norm_topk_prob=True, use_sliding_window=False,
    ),
    "olmoe": dict(  # q/k norms over the whole projection
        _MOE_BASE, architectures=["OlmoeForCausalLM"], model_type="olmoe",
        num_experts=8, intermediate_size=32, norm_topk_prob=False,
    ),
    "granitemoe": dict(  # Granite's scalings; experts stored stacked in the checkpoint
        _MOE_BASE, architectures=["GraniteMoeForCausalLM"], model_type="granitemoe",
        num_local_experts=8, intermediate_size=32, embedding_multiplier=6.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
    ),
}  # fmt: skip


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_checkpoint(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """overrides: config.json fields in place of ARCH_CONFIGS[arch]'s."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    configs = {**ARCH_CONFIGS, **MOE_CONFIGS}
    cfg_dict = dict(
        configs[arch],
        **overrides,
        vocab_size=len(tok),
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.15,
    )
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == configs[arch]["architectures"]
    return folder


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_checkpoint(root / arch, arch) for arch in MOE_CONFIGS}


@pytest.fixture(scope="session")
def llama_path(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    """HF transformers models on the same weights, the reference for every parity test."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str, path: Path | None = None):
        if arch not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                str(path or checkpoints[arch]), dtype=torch.float32
            ).eval()
            model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos
            cache[arch] = model
        return cache[arch]

    return get


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """HF generate(), greedy, never stopping early; returns (token ids, chosen logprobs)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            generation_config=gen,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)
    ]
    return tokens, logprobs


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """GGUF conversions made by tests go to a private cache, unless one is set explicitly."""
    if "TANDEM_CACHE_DIR" not in os.environ:
        os.environ["TANDEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("tandem-cache"))
    yield


def pytest_report_header(config):
    """Which CPU instruction-set levels this machine runs and which one the run is at (the
    kernel paths a test can take follow from it; tests/model/test_cpu_isa.py runs the rest)."""
    from tandem import cpu_isa

    try:
        level = cpu_isa.selected()
    except ValueError as e:
        level = f"invalid ({e})"
    return f"cpu isa: this CPU runs {', '.join(cpu_isa.cpu_levels())}; this run: {level}"


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (tests/redis_server.py), killed after."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.kill()

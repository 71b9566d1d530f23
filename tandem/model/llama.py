"""The Llama family (Llama 2/3, Mistral, Qwen2) and its mixtures of experts (Mixtral,
Qwen2/3-MoE, OLMoE, Granite-MoE): one decoder, differing only in config (q/k norms, Granite's
scalings, an MoE block in place of the MLP: model/moe.py).

Parameter names follow the HF checkpoints, except that q/k/v and gate/up projections are
fused into one matmul each (a module's `shard_sizes` say where each shard goes) and each MoE
layer's experts are stacked into two tensors (moe.py); loader.py maps the names.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.model_config import ModelConfig
from tandem.model.attention import PagedAttention
from tandem.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rope
from tandem.model.moe import SparseMoE


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if cfg.attention_multiplier is not None:
            self.attn.scale = cfg.attention_multiplier
        self.shard_sizes = {"qkv_proj": [self.q_size, self.kv_size, self.kv_size]}
        # q and k normalized before RoPE: per head (Qwen3) or over the whole projection (OLMoE)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm is not None:
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if full else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if full else cfg.head_dim, cfg.rms_norm_eps)
        self.fused = None  # RoPE in place (kernels/fused.cpp), where the runner binds it
        # Sums o_proj's partial outputs over the tensor-parallel ranks, where the model is
        # split (tandem/distributed/sharding.py); None: the model is whole.
        self.reduce = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            qk = self._norm_qk(qk)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, rope, self.fused)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        out = self.o_proj(self.attn(q, k, v))
        return out if self.reduce is None else self.reduce(out)

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        if self.q_norm.weight.shape[0] == self.q_size:  # over the whole projection
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        else:
            d = self.head_dim
            q, k = self.q_norm(q.reshape(-1, d)), self.k_norm(k.reshape(-1, d))
        return torch.cat([q.view(qk.shape[0], -1), k.view(qk.shape[0], -1)], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()
        self.reduce = None  # as LlamaAttention's, for down_proj
        self.shard_sizes = {"gate_up_proj": [cfg.intermediate_size] * 2}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, SiluAndMul()) if cfg.is_moe_layer(index) else LlamaMLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to the residual stream (None
        before the first layer, where x is the embedding); each norm adds its input to the
        stream first, so the skip connection and the norm are one pass (vLLM's form)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        # a weight given: no random init, whose normal_ on the meta device imports torch._dynamo
        # (~2 s of every start)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite's
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The layers of a decode-only step in one C++ call (model/decode_stack.py), where the
        # runner builds one.
        self.decode_stack = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary.rows(positions)
        if self.decode_stack is not None and (out := self.decode_stack(x, rope)) is not None:
            return out
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint shard name -> (fused parameter name, shard index); the sizes of the shards:
    # the fused parameter's module's `shard_sizes`
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [N, vocab]
        scaling = self.config.logits_scaling  # Granite's
        return logits if scaling == 1.0 else logits / scaling

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def plain_layers(self) -> bool:
        """Llama's layers as they are (no experts, q/k norms or scalings): what the C++
        decode stack (decode_stack.py) computes."""
        cfg = self.config
        return (cfg.moe, cfg.qk_norm, cfg.attention_multiplier) == (None, None, None) and (
            cfg.embedding_multiplier,
            cfg.residual_multiplier,
            cfg.logits_scaling,
        ) == (1.0, 1.0, 1.0)

    def moe_blocks(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

"""LoRAManager: the adapters a runner knows (in host memory) and the `max_loras` slots the
model computes with. A step's adapters are put in slots before it runs: a free slot, else
the least recently used one no request of this step needs (its adapter stays in host memory
and comes back when asked for). The scheduler keeps a step within max_loras adapters."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from tandem.core.model_config import ModelConfig
from tandem.lora.adapter import AdapterWeights, load_adapter, shard_shapes
from tandem.lora.layers import LoRAContext, LoRALinear
from tandem.model import kernels

# A slot with more tokens than this in a step (a prefill chunk) is computed on its own;
# the rest share two batched matmuls, padded to the busiest of them.
GROUP_MIN_TOKENS = 8


class LoRAManager:
    def __init__(self, model, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, device):
        self.cfg, self.max_loras, self.max_rank, self.device = cfg, max_loras, max_rank, device
        self.modules: dict[tuple[int, str], LoRALinear] = {}
        shapes = shard_shapes(cfg)
        cpu = torch.device(device).type == "cpu"
        self.kernel = kernels.lora_bgmv() if cpu else None
        lora_dtype = torch.float32 if cpu and self.kernel is None else dtype  # see layers.py
        for i, layer in enumerate(model.model.layers):
            # an MoE layer's experts are not adapted (adapter.py refuses weights for them)
            mlp = [] if cfg.is_moe_layer(i) else [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]  # fmt: skip
            for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), *mlp):  # fmt: skip
                outs = [out for _, out in shapes[name]]
                base = getattr(parent, name)
                wrapped = LoRALinear(
                    base, outs, max_loras, max_rank, lora_dtype, device, self.kernel
                )
                setattr(parent, name, wrapped)
                self.modules[(i, name)] = wrapped
        self.adapters: dict[int, AdapterWeights] = {}
        # batch-invariant: every adapted token through the kernel, as it goes when few do
        # (the grouped matmuls sum otherwise); set by the runner
        self.per_token = False
        # adapter id -> slot, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()

    # ---- the adapters known -------------------------------------------------------
    def read(self, path: str | Path) -> AdapterWeights:
        """Read and check an adapter's files (no state changes: safe off the step loop)."""
        return load_adapter(path, self.cfg, self.max_rank)

    def add(self, lora_id: int, weights: AdapterWeights) -> None:
        self.remove(lora_id)
        self.adapters[lora_id] = weights

    def remove(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self._load(slot, None)

    # ---- a step ----------------------------------------------------------------------
    def context(self, token_lora_ids: np.ndarray | None) -> LoRAContext | None:
        """The step's LoRA layout for tokens of these adapter ids (0: the base model)."""
        if token_lora_ids is None:
            return None
        ids = [int(i) for i in np.unique(token_lora_ids) if i != 0]
        if not ids:
            return None
        self._activate(ids)
        padded, groups = [], []
        num_tokens = len(token_lora_ids)
        for lid in ids:
            idx = np.flatnonzero(token_lora_ids == lid)
            slot = self.slot_of[lid]
            if self.per_token and self.kernel is not None:  # each token alike, however many
                padded.append((slot, idx))
            elif len(idx) == num_tokens:  # the whole step runs this adapter
                groups.append((slot, None))
            elif len(idx) > GROUP_MIN_TOKENS:
                groups.append((slot, self._tensor(idx)))
            else:
                padded.append((slot, idx))
        if not padded:
            return LoRAContext(None, None, None, None, None, groups)
        if self.kernel is not None:
            token_slots = np.full(num_tokens, -1, dtype=np.int64)
            for slot, idx in padded:
                token_slots[idx] = slot
            return LoRAContext(None, None, None, None, None, groups, self._tensor(token_slots))
        # All slots in order when most are used (no copy of their weights), else the used.
        slots = (
            list(range(self.max_loras))
            if 2 * len(padded) >= self.max_loras
            else sorted(s for s, _ in padded)
        )
        row = {s: r for r, s in enumerate(slots)}
        m = max(len(idx) for _, idx in padded)
        index = np.full((len(slots), m), -1, dtype=np.int64)
        for slot, idx in padded:
            index[row[slot], : len(idx)] = idx
        flat = index.reshape(-1)
        valid = flat >= 0
        tokens = flat[valid]
        pad_index = self._tensor(np.where(index >= 0, index, 0))
        pad_valid = None if valid.all() else self._tensor(valid)
        pad_slots = self._tensor(np.array(slots)) if len(slots) < self.max_loras else None
        # every token of the step is in the layout (once): gather instead of scatter
        inverse = self._tensor(np.argsort(tokens)) if len(tokens) == num_tokens else None
        return LoRAContext(pad_slots, pad_index, pad_valid, self._tensor(tokens), inverse, groups)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _activate(self, ids: list[int]) -> None:
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step uses {len(ids)} adapters; max_loras is {self.max_loras}")
        for lid in ids:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            if lid not in self.adapters:
                raise RuntimeError(f"adapter {lid} is not loaded")
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter this step does not need
                victim = next(v for v in self.slot_of if v not in ids)
                slot = self.slot_of.pop(victim)
            self._load(slot, self.adapters[lid])
            self.slot_of[lid] = slot

    def _load(self, slot: int, weights: AdapterWeights | None) -> None:
        for (layer, name), module in self.modules.items():
            for shard in range(len(module.shard_outs)):
                pair = weights.pairs.get((layer, name, shard)) if weights else None
                a, b = pair if pair else (None, None)
                module.set_slot(slot, shard, a, b)

    def check_invariants(self) -> None:
        assert len(self.slot_of) <= self.max_loras
        assert set(self.slot_of) <= set(self.adapters), "a slot holds an unloaded adapter"
        assert len(set(self.slot_of.values())) == len(self.slot_of), "a slot holds two adapters"

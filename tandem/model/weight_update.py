"""New weights into a loaded model, in place, between two steps: what an RL trainer pushes
to its rollout engine (the checkpoint's tensor names, HF's, in float).

A tensor lands where loading put its checkpoint twin (loader._target_of: q/k/v into qkv_proj,
gate/up into gate_up_proj). A plain parameter takes it as it is. A layer whose weight the
runner transformed at load is rebuilt from its current weight with the new rows written over:
a prepacked oneDNN weight (packed_linear.py) is reordered again, a quantized one quantized
again into the same blocks and shapes (int4 groups of its group size: GGUF's Q4_0, Q4_1 and
Q4_K and HF int4; 8 bits a group: Q8_0 and the int8 head; 5 bits: the Q5 types; int8 per
channel), so the C++ decode stack, a tied embedding and every pointer into them see the new
values. Loading checkpoint B and updating a model of A with B's tensors give the same
weights (the same quantizer on the same float values in the model's dtype).

Every tensor is checked (name, shape, a floating dtype) and every new form computed before
any is written (prepare, which the engine runs off its step loop); commit then only copies
and assigns, between two steps. A bad update is a ValueError naming the tensor, and the old
weights stay.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from tandem.model.loader import _target_of
from tandem.model.moe import moe_param_name
from tandem.model.packed_linear import PackedLinear
from tandem.model.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    _one_byte,
    int4_term,
    quantize_int4,
    quantize_int8,
    quantize_int8_groups,
    torch_packed,
)


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF folder's safetensors and its shape, from the files' headers."""
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__" and not name.endswith("rotary_emb.inv_freq"):
                shapes[name] = tuple(meta["shape"])
    return shapes


def read_checkpoint(folder: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """An HF folder's tensors, one at a time (a new checkpoint to update from)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path: {str(folder)!r} holds no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    yield name, f.get_tensor(name)


class WeightUpdater:
    """model: a loaded (and maybe quantized and packed) LlamaForCausalLM; shapes: its
    checkpoint's tensors (checkpoint_shapes of the folder it was loaded from)."""

    def __init__(self, model, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        self.model, self.shapes, self.dtype = model, dict(shapes), dtype
        self.tied = model.config.tie_word_embeddings
        if self.tied and "lm_head.weight" not in self.shapes:  # a trainer's state_dict has it
            self.shapes["lm_head.weight"] = self.shapes["model.embed_tokens.weight"]

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raise a ValueError naming the tensor if it cannot go into this model."""
        expected = self.shapes.get(name)
        if expected is None:
            raise ValueError(f"{name}: no such tensor in this model's checkpoint")
        if tuple(shape) != expected:
            raise ValueError(f"{name}: shape {tuple(shape)}, the model's is {expected}")
        if not dtype.is_floating_point:
            raise ValueError(f"{name}: dtype {dtype} is not a floating-point type")

    def prepare(self, tensors: dict[str, torch.Tensor]) -> list[Callable[[], None]]:
        """Check every tensor and compute each transformed layer's new form (quantizing,
        repacking), writing nothing the steps read: safe off the step loop. -> the writes
        that install them (commit), each a copy or an assignment."""
        for name, t in tensors.items():
            self.check(name, t.shape, t.dtype)
        preparation = Preparation(self)
        for name, t in tensors.items():
            preparation.add(name, t)
        return preparation.finish()

    def apply(self, tensors: dict[str, torch.Tensor]) -> int:
        """prepare, then commit; -> how many tensors were written."""
        commit(self.prepare(tensors))
        return len(tensors)

    def owner(self, path: str) -> nn.Module:
        """The module holding the weight loading put at `path`."""
        module = self.model.get_submodule(path)
        if isinstance(module, QuantizedEmbedding):  # a quantized embedding is a head's rows
            module = module.source
        return getattr(module, "base", module)  # under a LoRA wrapper, the base layer


# One thread quantizes every push, for the life of the process (not a thread, and a pool
# of OpenMP threads under it, started per push).
_WORKER = ThreadPoolExecutor(1, thread_name_prefix="weights")


class Preparation:
    """prepare, a tensor at a time as they arrive (a trainer's broadcast): a transformed
    layer whose rows have all come is quantized or repacked on a worker thread while the
    next tensors arrive; finish() waits for them and returns the writes, in arrival order."""

    def __init__(self, updater: WeightUpdater) -> None:
        self.updater = updater
        self.writes: list[Future | Callable[[], None]] = []
        self.staged: dict[str, list[tuple[object, torch.Tensor]]] = {}  # layers awaiting rows
        self.count = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        u = self.updater
        u.check(name, t.shape, t.dtype)
        self.count += 1
        if u.tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"  # one matrix; the last one given wins
        target, _, index = _target_of(u.model, moe_param_name(name))
        path, _, leaf = target.rpartition(".")
        module = u.owner(path)
        value = t.detach().to(u.dtype)
        if leaf == "weight" and isinstance(module, (PackedLinear, QuantizedLinear)):
            self._stage(path, module, index, value)
            return
        self.writes.append(functools.partial(_write, getattr(module, leaf).data, index, value))
        tied_head = u.tied and target == "model.embed_tokens.weight"
        if tied_head and isinstance(u.model.lm_head, PackedLinear):  # a packed copy of it
            self._stage("lm_head", u.model.lm_head, None, value)

    def _stage(self, path: str, module, index, value: torch.Tensor) -> None:
        rows = self.staged.setdefault(path, [])
        rows.append((index, value))
        covered = sum(module.out_features if i is None else i.stop - i.start for i, _ in rows)
        if covered >= module.out_features:  # all of it new: nothing of the old to read back
            del self.staged[path]
            self.writes.append(_WORKER.submit(self._rebuilt, module, rows, whole=True))

    def _rebuilt(self, module, rows, whole: bool) -> Callable[[], None]:
        shape = (module.out_features, module.in_features)
        weight = torch.empty(shape, dtype=self.updater.dtype) if whole else current_weight(module, self.updater.dtype)  # fmt: skip
        for index, value in rows:
            _write(weight, index, value)
        return rebuilt(module, weight)

    def finish(self) -> list[Callable[[], None]]:
        """The writes, once every layer's new form is computed (a layer only partly
        pushed: its other rows read back from the model)."""
        for path, rows in self.staged.items():
            self.writes.append(
                self.worker.submit(self._rebuilt, self.updater.owner(path), rows, False)
            )
        self.staged = {}
        try:
            return [w.result() if isinstance(w, Future) else w for w in self.writes]
        finally:
            self.close()

    def close(self) -> None:
        """Drop what has not run yet (a push that failed on the way)."""
        for w in self.writes:
            if isinstance(w, Future):
                w.cancel()


def _write(dest: torch.Tensor, index, value: torch.Tensor) -> None:
    (dest if index is None else dest[index]).copy_(value)


def current_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A transformed layer's weight [out, in] in `dtype`: a quantized one dequantized, a
    prepacked one multiplied by the identity (exact: one product a sum, the rest zeros)."""
    if isinstance(module, QuantizedLinear):
        return module.dequantize().to(dtype)
    eye = torch.eye(module.in_features, dtype=dtype)
    out = torch.ops.mkldnn._linear_pointwise(eye, module.packed, None, "none", [], "")
    return out.t().contiguous()


def commit(writes: list[Callable[[], None]]) -> None:
    """Install what prepare computed (between two steps: the steps read these tensors)."""
    for write in writes:
        write()


def rebuilt(module: nn.Module, weight: torch.Tensor) -> Callable[[], None]:
    """`weight` in a transformed layer's form, computed now; -> the write that installs
    it in place (the same tensors, so every pointer into them sees the new values)."""
    if isinstance(module, PackedLinear):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return functools.partial(setattr, module, "packed", packed)
    if isinstance(module, Int8Linear):
        q, scale = quantize_int8(weight)
        pairs = [(module.q, q), (module.scale, scale.to(module.scale.dtype))]
        return functools.partial(_copy_all, pairs)
    if isinstance(module, Int4Linear):
        if module.on_cuda:
            raise ValueError("weight updates of int4 weights on CUDA are not supported")
        pairs = _int4_terms(module, weight)

        def install() -> None:
            _copy_all(pairs)
            if module.dense_copy is not None:
                module.keep_dense_copy()

        return install
    raise ValueError(f"weight updates: cannot rebuild a {type(module).__name__}")


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dest, src in pairs:
        dest.copy_(src)


def _int4_terms(module: Int4Linear, weight: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The terms of `weight` in the module's form: (its tensor, the new bytes) pairs."""
    group, k = module.terms[0].group, module.in_features
    if len(module.terms) == 1:
        parts = [quantize_int4(weight, group)]
    elif _one_byte(module.terms):
        parts = quantize_int8_groups(weight, group)
    else:
        parts = quantize_int5(weight, group)
    pairs = []
    for i, (term, part) in enumerate(zip(module.terms, parts, strict=True)):
        new = int4_term(*part)
        pairs += [(term.packed, new.packed), (term.scales_zeros, new.scales_zeros)]
        if module.mm_packed and module.mm_packed[i] is not term.packed:
            pairs.append((module.mm_packed[i], torch_packed(new, k)))
    return pairs


def quantize_int5(w: torch.Tensor, group: int) -> list[tuple[torch.Tensor, ...]]:
    """Asymmetric min/max quantization to 5 bits per group (GGUF's Q5_1 math) as two int4
    terms, q = 16 hi + lo: (hi + 8, 16 s, 0) and (lo, s, 8 s + min), gguf_quant's form."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 31).clamp_min(1e-8)
    q = ((g - lo[..., None]) / s[..., None]).round().clamp(0, 31).reshape(n, k).to(torch.uint8)
    return [((q >> 4) + 8, 16 * s, torch.zeros_like(s)), (q & 15, s, 8 * s + lo)]

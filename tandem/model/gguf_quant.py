"""A GGUF's quantized tensors as int4 terms (quant.py), without requantizing them.

GGML blocks hold 32 weights of one row: Q4_0 is an f16 scale d and 16 bytes of nibbles (w =
d * (q - 8)), Q4_1 adds an f16 minimum m (w = d * q + m), Q8_0 is d and 32 signed bytes (w = d
* q). Nibble j of a block is byte j's low half for j < 16, byte j - 16's high half after.
Other types (K-quants, F16, ...) return None: their layers keep the float weights the
converted HF folder already holds.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.model.gguf import unpermute
from tandem.model.quant import int8_group_terms

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # the types read here
# (q, scale, zero) per term: q [N, K] in [0, 16), scale and zero [N, K / 32]
Terms = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def tensor_terms(tensor, permute_heads: int | None = None) -> Terms | None:
    """The int4 terms of a GGUF tensor (a gguf.ReaderTensor), rows in HF order (llama.cpp's
    interleaved rotary rows of q and k undone with `permute_heads`), or None for a type
    without them."""
    kind = tensor.tensor_type.name
    if kind not in BLOCK_BYTES:
        return None
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF shapes are [in, out]
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // BLOCK, BLOCK_BYTES[kind])
    d = _f16(raw[..., 0:2])
    if kind == "Q8_0":
        q8 = torch.from_numpy(raw[..., 2:].view(np.int8).reshape(rows, cols).copy())
        terms = int8_group_terms(q8, torch.from_numpy(d))
    else:
        qs = raw[..., 4:] if kind == "Q4_1" else raw[..., 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, G, 32]
        zero = _f16(raw[..., 2:4]) + 8 * d if kind == "Q4_1" else np.zeros_like(d)
        terms = [(q, d, zero)]
    out = []
    for q, scale, zero in terms:
        q, scale, zero = (torch.as_tensor(np.ascontiguousarray(a)) for a in (q, scale, zero))
        q = q.reshape(rows, cols).to(torch.uint8)
        if permute_heads:
            q, scale, zero = (unpermute(t, permute_heads) for t in (q, scale, zero))
        out.append((q, scale, zero))
    return out


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 holding little-endian float16s -> [...] float32."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)

"""A GGUF's quantized tensors as int4 terms (quant.py), without requantizing them.

GGML blocks hold 32 weights of one row: Q4_0 is an f16 scale d and 16 bytes of nibbles (w =
d * (q - 8)), Q4_1 adds an f16 minimum m (w = d * q + m), Q8_0 is d and 32 signed bytes (w = d
* q). Nibble j of a block is byte j's low half for j < 16, byte j - 16's high half after.
Q5_0 and Q5_1 add a fifth bit per weight (bit j of a 32-bit word; w = d * (q - 16), d * q + m).
The K-quants group 8 sub-blocks of 32 into a super-block of 256 with f16 d and dmin and 6-bit
scales and minimums per sub-block (w = d * sc * q - dmin * m): Q4_K (nibbles: sub-blocks 2c and
2c + 1 are the low and high halves of the same 32 bytes) and Q5_K (plus bit 2c or 2c + 1 of a
byte per weight). Each sub-block is an int4 group of 32: w = s * q + c is the term (q, s,
8s + c); a 5-bit q = 16 hi + lo is two, (hi + 8, 16s, 0) + (lo, s, 8s + c), as Q8_0's 8 bits
are. Other types (Q6_K's groups of 16, Q2_K/Q3_K, the IQ types, F16, ...) return None: their
layers keep the float weights the converted HF folder already holds.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.model.gguf import unpermute
from tandem.model.quant import int8_group_terms

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176}  # fmt: skip
WEIGHTS_PER_BLOCK = {"Q4_K": 256, "Q5_K": 256}  # the rest: BLOCK
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
    per = WEIGHTS_PER_BLOCK.get(kind, BLOCK)
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // per, BLOCK_BYTES[kind])
    out = []
    for q, scale, zero in _DECODE[kind](raw):  # q [N, blocks, ..., 32]; scale, zero [N, groups]
        q, scale, zero = (torch.as_tensor(np.ascontiguousarray(a)) for a in (q, scale, zero))
        q = q.reshape(rows, cols).to(torch.uint8)
        scale, zero = scale.reshape(rows, cols // BLOCK), zero.reshape(rows, cols // BLOCK)
        if permute_heads:
            q, scale, zero = (unpermute(t, permute_heads) for t in (q, scale, zero))
        out.append((q, scale, zero))
    return out


def _q4_0(raw):
    d = _f16(raw[..., 0:2])
    return [(_nibbles(raw[..., 2:]), d, np.zeros_like(d))]


def _q4_1(raw):
    d = _f16(raw[..., 0:2])
    return [(_nibbles(raw[..., 4:]), d, _f16(raw[..., 2:4]) + 8 * d)]


def _q8_0(raw):
    rows, blocks = raw.shape[:2]
    q8 = torch.from_numpy(raw[..., 2:].view(np.int8).reshape(rows, blocks * BLOCK).copy())
    return int8_group_terms(q8, torch.from_numpy(_f16(raw[..., 0:2])))


def _q5_0(raw):
    d = _f16(raw[..., 0:2])
    return _five_bits(_high_bits(raw[..., 2:6]), _nibbles(raw[..., 6:]), d, -16 * d)


def _q5_1(raw):
    d = _f16(raw[..., 0:2])
    return _five_bits(_high_bits(raw[..., 4:8]), _nibbles(raw[..., 8:]), d, _f16(raw[..., 2:4]))


def _q4_k(raw):
    scale, offset = _k_scales(raw)
    qs = raw[..., 16:144].reshape(*raw.shape[:2], 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*raw.shape[:2], 8, 32)
    return [(q, scale, 8 * scale + offset)]


def _q5_k(raw):
    scale, offset = _k_scales(raw)
    qh = raw[..., 16:48][..., None, :]  # [N, blocks, 1, 32]: bit i for sub-block i
    hi = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, blocks, 8, 32]
    qs = raw[..., 48:176].reshape(*raw.shape[:2], 4, 1, 32)
    lo = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*raw.shape[:2], 8, 32)
    return _five_bits(hi, lo, scale, offset)


def _k_scales(raw):
    """A K-quant super-block's per-sub-block scale d * sc and offset -dmin * m, [N, blocks,
    8] float32, from its f16 d, dmin and twelve bytes of 6-bit sc and m (llama.cpp's
    get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in the
    nibbles of bytes 8-11, their top two bits in the top of bytes 0-3 and 4-7)."""
    d, dmin, b = _f16(raw[..., 0:2]), _f16(raw[..., 2:4]), raw[..., 4:16]
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * m.astype(np.float32))


def _nibbles(qs):
    """[..., 16] bytes -> [..., 32] nibbles: the low halves, then the high halves."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh):
    """[..., 4] bytes, a little-endian 32-bit word -> [..., 32]: bit j for weight j."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _five_bits(hi, lo, scale, offset):
    """Terms of w = scale * (16 hi + lo) + offset, hi in {0, 1}, lo in [0, 16)."""
    return [(hi + 8, 16 * scale, np.zeros_like(scale)), (lo, scale, 8 * scale + offset)]


_DECODE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k}  # fmt: skip


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 holding little-endian float16s -> [...] float32."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)

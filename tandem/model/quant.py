"""Weight-only quantized linear layers: a step reads 4 or 8 bits a weight instead of 16 or 32.

- int4, group-wise: w = (q - 8) * scale + zero over each `group` input columns, q in [0, 16),
  stored in torch's AVX-512 CPU layout (pack_cpu_q), whatever the CPU. GGUF's Q4_0 and Q4_1
  blocks are exactly this (Q4_1: w = d*q + m = d*(q - 8) + (m + 8d)), and Q8_0 (w = d*q, q a
  signed byte) is two such terms, q = 16*hi + lo: (hi + 8, scale 16d, zero 0) + (lo, scale d,
  zero 8d); so a GGUF's weights are repacked, never requantized (see gguf_quant.py).
- int8, per output row: w = q * scale (`_weight_int8pack_mm`), quantized at load.
- On CUDA (CudaInt4Linear), the same int4 terms repacked for torch's CUDA kernel
  (`_weight_int4pack_mm`, tinygemm), which takes the same scales and zeros, for few rows,
  and dequantized to bf16 by torch ops for many; int8 is always dequantized there (torch's
  CUDA int8 kernel is slower than that at every size). The C++ dense paths are the CPU's.

Which path runs depends on the rows in the step. torch's kernels dequantize per input row:
at one row they are about 5x faster than a bf16 matmul on this project's whole weights (which
stream from memory), level at 16 rows, 2x slower at 64. Past KERNEL_MAX_ROWS rows the
weight is instead dequantized to bf16 a cache-sized slice at a time (C++,
kernels/dequant.cpp) and each slice multiplied while it is still in cache
(benchmarks/quant_linear.py measures both). Where the CPU has AMX or AVX512-BF16, an int4
weight's dense steps are one C++ call instead (int4_gemm: each 64-row block dequantized into
AMX's operand order and multiplied in place; with AMX by tile instructions 32 columns at a
time up to 16 rows, by oneDNN's brgemm past them, 2-3.8x faster than the slices there, used
from 3 rows to about 240; without, by vdpbf16ps with 6 rows' sums in registers, from 1 row
to 512, up to 8 rows straight from the packed bytes): the layer's `gemm` path, its rows in
GEMM_KERNEL_MAX_ROWS and GEMM_MAX_ROWS. The
kernels take bfloat16 activations (float32 ones take a scalar path 20-60x slower), so a
float32 model's activations are rounded to bf16 around each quantized matmul.
"""

from __future__ import annotations

import functools
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tandem.model import kernels
from tandem.model.packed_linear import PackedLinear

INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 CPU kernel takes
# A dequantized slice, sized to stay in this CPU's L3 while its matmul reads it, and to hold a
# layer's largest projection (gate_up, 3.5 MB) whole: one matmul instead of two (the model's
# projections at 2,048 rows 161 vs 177 ms with 2 MB slices, 48 vs 54 at 256; an AMX Xeon)
SLICE_BYTES = 4 << 20
# oneDNN builds a kernel per matmul shape (on an AMX Xeon ~1 ms a shape, 10-40 ms a prompt of
# a length not seen before): dense rows are padded to a multiple of this, so a server meets
# at most max_num_batched_tokens / DENSE_ROW_BUCKET row counts a weight.
DENSE_ROW_BUCKET = 16


@dataclass(frozen=True)
class Int4Term:
    packed: torch.Tensor  # uint8 [rows, K / 2], rows padded to 64 (pack_cpu_q's layout)
    scales_zeros: torch.Tensor  # bfloat16 [K / group, rows, 2]
    group: int
    # CUDA (cuda_term): the integers two a byte, [rows, K / 2], even column high, which the
    # dense path dequantizes (tinygemm's layout is opaque); None on the CPU
    plain: torch.Tensor | None = None


def int4_term(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Term:
    """q: [N, K] integers in [0, 16); scale, zero: [N, K / group]."""
    n, k = q.shape
    group = k // scale.shape[1]
    pad = -n % 64  # the layout packs blocks of 64 rows; padded rows are zero and never read
    q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q.to(torch.int32), scale, zero))
    sz = torch.stack([scale.float(), zero.float()], -1).transpose(0, 1)
    return Int4Term(pack_cpu_q(q), sz.to(torch.bfloat16).contiguous(), group)


def pack_cpu_q(q: torch.Tensor) -> torch.Tensor:
    """q [rows (a multiple of 64), K] in [0, 16) -> the CPU layout, uint8 [rows, K / 2]: each
    block of 64 rows is K x 32 bytes, row j of the block in the low nibbles and row 32 + j in
    the high ones. It is what `_convert_weight_to_int4pack_for_cpu` makes where torch runs
    AVX-512 kernels; elsewhere torch packs otherwise (32-row blocks on AVX2, adjacent row
    pairs without vectors), so tandem packs it itself and every CPU reads the same bytes."""
    rows, k = q.shape
    blocks = q.to(torch.uint8).view(rows // 64, 2, 32, k)  # [block, half, j, K]
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [block, 32, K]
    return packed.transpose(1, 2).contiguous().view(rows, k // 2)


@functools.cache
def torch_reads_cpu_layout() -> bool:
    """Whether torch's CPU int4 matmul (`_weight_int4pack_mm_for_cpu`) reads pack_cpu_q's
    layout here (its AVX-512 kernels); elsewhere a layer keeps a copy in torch's own."""
    q = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0))
    ours = pack_cpu_q(q)
    return torch.equal(ours, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))


def torch_packed(term: Int4Term, k: int) -> torch.Tensor:
    """`term`'s weights in the layout torch's CPU int4 matmul reads here."""
    if torch_reads_cpu_layout():
        return term.packed
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_cpu_q(term.packed, k).int(), 1)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric min/max quantization of w [N, K] per group: -> (q, scale, zero)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scale, lo + 8 * scale


def int8_group_terms(q: torch.Tensor, d: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Signed 8-bit weights with a scale per group (w = d * q, as GGUF's Q8_0) as two int4
    terms, q = 16 * hi + lo: (hi + 8, scale 16d, zero 0) and (lo, scale d, zero 8d).
    q: [N, K] integers in [-128, 128); d: [N, K / group]."""
    q = q.to(torch.int16)
    hi, lo = (q >> 4) + 8, q & 15
    return [(hi, 16 * d, torch.zeros_like(d)), (lo, d, 8 * d)]


def quantize_int8_groups(w: torch.Tensor, group: int) -> list[tuple[torch.Tensor, ...]]:
    """Symmetric absmax quantization of w [N, K] to 8 bits per group: -> int4 terms."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    d = (g.abs().amax(-1) / 127).clamp_min(1e-8)
    q = (g / d[..., None]).round().clamp(-127, 127).reshape(n, k)
    return int8_group_terms(q, d)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of w [N, K] per row: -> (q int8, scale)."""
    scale = (w.float().abs().amax(-1) / 127).clamp_min(1e-8)
    q = (w.float() / scale[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


class QuantizedLinear(nn.Module, ABC):
    """y = x W^T + b with W quantized; the subclasses say how W is stored."""

    KERNEL_MAX_ROWS = 32  # measured crossover of torch's kernels and dequantize + bf16 matmul
    # ... and of torch's kernels and a bf16 copy prepacked at load (keep_dense_copy): 9.6 vs
    # 12.0 ms a step at 8 rows, 16.9 vs 13.0 at 12 (`python benchmarks/quant_linear.py`)
    COPY_KERNEL_MAX_ROWS = 10
    # ... and of torch's kernels and int4_gemm, by its path here (Int4Linear.gemm, dequant.cpp):
    # "amx", up to 16 rows its tile path: 5.9 vs 8.4 ms a step at 1 row, 6.9 vs 8.3 at 2, 7.8 vs
    # 8.5 at 3, 9.2 vs 8.3 at 4, 28.9 vs 8.3 at 16 (an AMX Xeon, `benchmarks/quant_linear.py`;
    # on the default model's own weights 3 rows measured the other way, 7.4 vs 6.4); "dot"
    # (vdpbf16ps, no AMX) from 1 row, its up to 8 rows straight from the packed bytes
    # (dequant.cpp's gemv_terms): 3.9 vs 4.9 ms at 1 row, 4.9 vs 7.8 at 4, 5.6 vs 13.9 at 5
    # (torch's kernel passes 4 rows at a time), 9.0 vs 14.5 at 8, 15.8 vs 26.9 at 16 (an
    # AVX-512 EPYC)
    GEMM_KERNEL_MAX_ROWS = {"amx": 2, "dot": 0}
    # Rows torch's CPU weight-only kernels compute per pass over the weights (BLOCK_M of aten's
    # int4 and int8 kernels): each pass dequantizes every weight again, so 5 rows cost about
    # as much as 8 (one 1536x576 Q4_1 projection: 26 us at 4 rows, 49 at 5).
    CPU_ROW_TILE = 4
    # On CUDA: whether a step past CUDA_KERNEL_MAX_ROWS rows dequantizes W to bf16 for one
    # matmul (the subclasses that run there can; they set where, as measured there)
    CUDA_DENSE = False
    CUDA_KERNEL_MAX_ROWS = 0
    fmt: str  # e.g. "int4 (group 32)", "Q4_1", for logs and /v1/models
    padded_rows: int  # output rows as stored (int4 packs blocks of 64)

    def __init__(
        self, in_features: int, out_features: int, bias: torch.Tensor | None, on_cuda=False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.on_cuda = on_cuda
        # else torch's kernels for every size
        self.can_dense = self.CUDA_DENSE if self.on_cuda else kernels.dequant() is not None
        self.dense_copy: PackedLinear | None = None  # keep_dense_copy's bf16 weight
        self.gemm = ""  # int4_gemm's path for the dense steps (Int4Linear): "amx", "dot" or none
        # int4_gemm's steps with x's rows quantized to int8 (use_int8_activations)
        self.int8_activations = False
        # one kernel and one order of sums for a row whatever the step's other rows
        # (use_rows_invariant): a request's tokens never depend on its neighbours
        self.rows_invariant = False
        self.invariant_gemm = False  # ... through int4_gemm's invariant path (Int4Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The usual call (2-D bf16 activations, no bias) skips the reshapes and casts: at one
        # running request a step is ~120 of these calls, and each Python-level op counts.
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        xb = rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16)
        if rows.shape[0] <= self.kernel_max_rows or not self.can_dense:
            y = self.kernel(xb)
            if self.padded_rows != self.out_features:
                y = y[:, : self.out_features]
        else:
            y = self.dense(xb)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    @property
    def kernel_max_rows(self) -> int:
        """Rows up to which this layer runs torch's kernel (then dequantize + dense)."""
        if self.rows_invariant:  # int4_gemm's invariant path for every row, else torch's kernel
            return 0 if self.invariant_gemm else sys.maxsize
        if self.dense_copy is not None:
            return self.COPY_KERNEL_MAX_ROWS
        if self.on_cuda:
            return self.CUDA_KERNEL_MAX_ROWS
        return self.GEMM_KERNEL_MAX_ROWS.get(self.gemm, self.KERNEL_MAX_ROWS)

    def use_rows_invariant(self) -> None:
        """Compute every step's rows by one kernel whose sums for a row run in one order, so a
        row's output never depends on how many rows share its step: int4_gemm's few-row path
        at any row count where it is built (AVX512-BF16), or int8 activations' (a row's own
        quantization and integer sums); elsewhere torch's weight-only kernel, which computes
        each row alike, for every row count (a prefill then pays its per-row dequantization)."""
        self.rows_invariant = True
        self.invariant_gemm = self._invariant_gemm()

    def _invariant_gemm(self) -> bool:
        return False

    def keep_dense_copy(self) -> None:
        """Hold W in bf16 too, prepacked for oneDNN once: a step past kernel_max_rows then
        multiplies it directly instead of dequantizing it slice by slice (2 more bytes a
        weight; the same bf16 numbers the slices hold)."""
        self.dense_copy = PackedLinear.of_weight(self.dequantize().to(torch.bfloat16))
        self.can_dense = True
        self.fmt += " + bf16 copy"

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through bf16 matmuls, its rows padded to a multiple of DENSE_ROW_BUCKET
        (on CUDA: one matmul, W dequantized whole)."""
        if self.on_cuda:
            return x @ self.dequant_t(0, self.out_features)
        m = x.shape[0]
        pad = -m % DENSE_ROW_BUCKET
        if not pad:
            return self._dense(x)
        return self._dense(F.pad(x, (0, 0, 0, pad)))[:m]

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through bf16 matmuls, W dequantized one slice of rows at a time."""
        if self.dense_copy is not None:
            return self.dense_copy(x)
        n, k = self.out_features, self.in_features
        step = max(64, SLICE_BYTES // (2 * k) // 64 * 64)
        if step >= n:
            return x @ self.dequant_t(0, self.padded_rows)[:, :n]
        out = x.new_empty(x.shape[0], n)
        for n0 in range(0, n, step):
            n1 = min(n0 + step, self.padded_rows)
            cols = min(n1, n) - n0
            # into out's columns directly: an assignment copies the product (2,048 rows of the
            # default model's gate_up: 1.9 vs 1.45 ms a slice)
            torch.mm(x, self.dequant_t(n0, n1)[:, :cols], out=out[:, n0 : n0 + cols])
        return out

    @abstractmethod
    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through torch's weight-only kernel, [rows, padded_rows]."""

    @abstractmethod
    def dequant_t(self, n0: int, n1: int) -> torch.Tensor:
        """W[n0:n1]^T as bf16 [K, n1 - n0], in a scratch buffer valid until the next call."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]: the reference these layers are tested against."""

    @abstractmethod
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] as float32 [len(ids), K]: an embedding lookup on the same storage."""

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


class Int4Linear(QuantizedLinear):
    # Two terms (GGUF's Q8_0, the 8-bit head of HF int4/int8) are two kernel calls, each
    # dequantizing per row, so dense wins much sooner: on the default model's Q8_0 head
    # (49152 x 576) the kernel is 3.2x faster at 1 row and 1.3x at 8, dense 1.1x faster at 12,
    # 1.2x at 16 and 2x at 32 (`python benchmarks/quant_linear.py --head`).
    TWO_TERM_KERNEL_MAX_ROWS = 10
    # With int4_gemm the head's dense path wins sooner: on AMX from 2 rows, 2.02 vs 1.69 ms at 2
    # rows, 1.53 vs 1.62 at 1 (an AMX Xeon, `python benchmarks/quant_linear.py --head`); on the
    # dot path from 1 row (gemv_terms up to 2 rows): 0.72 vs 1.69 ms at 1, 0.87 vs 2.03 at 2,
    # 2.38 vs 2.42 at 3 (the EPYC)
    # (int8 activations run on the dot path only, so from 1 row too: up to 8 rows, 2 for the
    # head, int4_gemm takes gemv_terms with bf16 activations, faster than int8's at these rows,
    # the head 0.72 vs 0.99 ms at 1 row, the projections 3.9 vs 6.2; past them int8's: the head
    # 2.26 vs 11.03 at 16 rows, the EPYC, `python benchmarks/quant_linear.py --head`)
    GEMM_TWO_TERM_KERNEL_MAX_ROWS = {"amx": 1, "dot": 0}
    # Rows up to which int4_gemm runs the dense steps, by path. AMX's brgemm calls run at about
    # a third of its matmul rate, so past ~250 rows the slices' one oneDNN matmul each wins back
    # its reorders: the model's projections 50.8 vs 63.1 ms at 192 rows, 62.9 vs 60.5 at 256,
    # 442 vs 227 at 2048 (an AMX Xeon). Without AMX oneDNN's bf16 matmul is bound by the same
    # vdpbf16ps as int4_gemm's dot path, and level with it past ~1,000 rows: prefill steps of
    # the default model 188 vs 225-232 ms at 256 tokens, 340-363 vs 402-406 at 512, 628-697 vs
    # 628-633 at 1,024, 1,368-1,392 vs 1,355-1,363 at 2,048 (the EPYC, offline, alternating)
    GEMM_MAX_ROWS = {"amx": 240, "dot": 512}

    def __init__(self, in_features, out_features, terms: list[Int4Term], fmt: str, bias=None):
        super().__init__(in_features, out_features, bias, terms[0].packed.is_cuda)
        self.terms, self.fmt = terms, fmt
        self.padded_rows = terms[0].scales_zeros.shape[1]
        # the packed bytes torch's int4 matmul reads: the terms' own, but below AVX-512 a copy
        self.mm_packed = [torch_packed(t, in_features) for t in terms] if not self.on_cuda else []
        # Where the CPU has AMX or AVX512-BF16, dense steps of up to GEMM_MAX_ROWS rows
        # dequantize and multiply a block at a time in one C++ call (dequant.cpp's int4_gemm).
        if self.can_dense and not self.on_cuda and torch_reads_cpu_layout():
            self.gemm = kernels.dequant().gemm_path()  # (whose CPUs run torch at AVX-512)

    @property
    def kernel_max_rows(self) -> int:
        if len(self.terms) == 1 or self.rows_invariant:
            return super().kernel_max_rows
        two_term = self.GEMM_TWO_TERM_KERNEL_MAX_ROWS.get(self.gemm, self.TWO_TERM_KERNEL_MAX_ROWS)
        return min(super().kernel_max_rows, two_term)

    @property
    def gemm_max_rows(self) -> int:
        """Rows up to which the dense steps go through int4_gemm (0: never)."""
        if self.invariant_gemm:
            return sys.maxsize
        return self.GEMM_MAX_ROWS[self.gemm] if self.gemm and self.dense_copy is None else 0

    def _invariant_gemm(self) -> bool:
        return (
            bool(self.gemm) and self.dense_copy is None and kernels.dequant().rows_invariant_here()
        )

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.gemm_max_rows:
            return super().dense(x)
        out = x.new_empty(x.shape[0], self.out_features)
        packed, scales_zeros = [t.packed for t in self.terms], [t.scales_zeros for t in self.terms]
        group = self.terms[0].group
        kernels.dequant().int4_gemm(
            out, x, packed, scales_zeros, group, self.int8_activations, self.invariant_gemm
        )
        return out

    def use_int8_activations(self) -> bool:
        """Have int4_gemm's steps quantize x's rows to int8, 32 columns a scale, as llama.cpp
        multiplies GGUF's blocks (about twice the multiplies an instruction of bf16's); ->
        whether this layer can: on int4_gemm's dot path, where the CPU has AVX512-VNNI, one
        term, or two that make one byte (16 q_hi + q_lo: the high term's scales 16 times the
        low one's, as GGUF's Q8_0 and Q5 types and the HF head's 8 bits are). Lossy: the
        other steps (up to gemv_rows, int4_gemm's few-row path; past gemm_max_rows) keep bf16
        activations."""
        ok = (
            (len(self.terms) == 1 or _one_byte(self.terms))
            and self.gemm == "dot"
            and self.dense_copy is None
            and self.terms[0].group % 32 == 0
            and kernels.dequant().int8_activations_here()
        )
        self.int8_activations = ok
        return ok

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        terms = zip(self.terms, self.mm_packed)
        (first, packed), *rest = terms
        y = mm(x, packed, first.group, first.scales_zeros)
        for t, p in rest:  # GGUF's Q8_0: a second term
            y.add_(mm(x, p, t.group, t.scales_zeros))
        return y

    def dequant_t(self, n0: int, n1: int) -> torch.Tensor:
        k, size = self.in_features, self.in_features * (n1 - n0)
        out = _scratch(size)[:size].view(k, n1 - n0)
        packed, scales_zeros = [t.packed for t in self.terms], [t.scales_zeros for t in self.terms]
        kernels.dequant().dequant_int4_t(out, packed, scales_zeros, self.terms[0].group, n0, n1)
        return out

    def dequantize(self) -> torch.Tensor:
        all_rows = torch.arange(self.out_features)
        return self.rows(all_rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        out = None
        for t in self.terms:
            byte = t.packed.view(-1, k, 32)[ids // 64, :, ids % 32]  # [len(ids), K]
            q = torch.where((ids % 64 >= 32)[:, None], byte >> 4, byte & 15).float()
            scale, zero = (t.scales_zeros[:, ids, i].float().t() for i in (0, 1))
            w = (q - 8) * scale.repeat_interleave(t.group, 1) + zero.repeat_interleave(t.group, 1)
            out = w if out is None else out + w
        return out


def _one_byte(terms: list[Int4Term]) -> bool:
    """Whether two int4 terms are one 8-bit weight, 16 q_hi + q_lo (int8_group_terms')."""
    if len(terms) != 2:
        return False
    hi, lo = (t.scales_zeros[..., 0].float() for t in terms)
    return torch.equal(hi, 16 * lo)


class CudaInt4Linear(Int4Linear):
    """Int4Linear on a CUDA device: the terms in tinygemm's layout for its kernel (few rows:
    it reads 4 bits a weight) and, two a byte, for dequantizing to bf16 for one matmul
    (many rows: tinygemm is 27x slower than bf16 at 2,048 rows on an H200). One byte a
    weight in all, half of bf16."""

    CUDA_DENSE = True
    # tinygemm against dequantize + matmul (torch ops) over Llama-3.2-1B's projections on an
    # H200: 0.67 vs 13.1 ms at 1 row (bf16 0.93), 4.8 vs 13.2 at 64, 9.2 vs 13.2 at 128, 18.0
    # vs 13.4 at 256, 139 vs 17.9 at 2,048 (`python benchmarks/cuda_throughput.py --layers`)
    CUDA_KERNEL_MAX_ROWS = 128

    @property
    def kernel_max_rows(self) -> int:
        return self.CUDA_KERNEL_MAX_ROWS

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm
        first, *rest = self.terms
        y = mm(x, first.packed, first.group, first.scales_zeros)
        for t in rest:
            y.add_(mm(x, t.packed, t.group, t.scales_zeros))
        return y

    def weights(self, rows) -> torch.Tensor:
        """W[rows] in bf16 (rows: a slice or ids): (q - 8) * scale + zero, term by term."""
        out = None
        for t in self.terms:
            pairs = t.plain[rows]
            n, k, g = pairs.shape[0], self.in_features, t.group
            q = torch.stack([pairs >> 4, pairs & 15], -1).view(n, k // g, g).to(torch.bfloat16)
            scale, zero = (t.scales_zeros[:, rows, i].t()[..., None] for i in (0, 1))
            w = ((q - 8) * scale + zero).view(n, k)
            out = w if out is None else out + w
        return out

    def dequant_t(self, n0: int, n1: int) -> torch.Tensor:
        return self.weights(slice(n0, n1)).t()

    def dequantize(self) -> torch.Tensor:
        return self.weights(slice(0, self.out_features)).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights(ids.to(self.terms[0].plain.device)).float()


def unpack_cpu_q(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The integers [rows, K] behind torch's CPU int4 layout (as Int4Linear.rows reads it):
    each block of 64 rows is K x 32 bytes, row j of the block in the low nibbles and row
    32 + j in the high ones."""
    byte = packed.view(-1, k, 32)
    q = torch.stack([byte & 15, byte >> 4], 1)  # [blocks, 2, K, 32]
    return q.transpose(2, 3).reshape(-1, k)


def cuda_term(term: Int4Term, k: int, device: torch.device) -> Int4Term:
    """A CPU-layout term repacked for torch's CUDA int4 kernel, on `device`: two integers a
    byte along K (even column high), then `_convert_weight_to_int4pack`'s tiling, which needs
    K a multiple of 16 x its inner k-tiles (2, 4 or 8)."""
    tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
    if tiles is None:
        raise ValueError(f"CUDA's int4 kernel needs input features a multiple of 32, got {k}")
    q = unpack_cpu_q(term.packed, k).to(device)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return Int4Term(packed, term.scales_zeros.to(device), term.group, pairs)


def int4_linear(in_features, out_features, terms, fmt, bias, device) -> Int4Linear:
    """An int4 layer of CPU-layout terms, for `device`: repacked for CUDA's kernel there."""
    if device.type == "cpu":
        return Int4Linear(in_features, out_features, terms, fmt, bias)
    if device.type != "cuda":
        raise ValueError(f"int4 weights run on the CPU or CUDA, not {device.type}")
    terms = [cuda_term(t, in_features, device) for t in terms]
    bias = None if bias is None else bias.to(device)
    return CudaInt4Linear(in_features, out_features, terms, fmt, bias)


class Int8Linear(QuantizedLinear):
    # On CUDA always dequantize + matmul: torch's CUDA int8 kernel took 10 ms for Llama-3.2-1B's
    # projections at 1 row where that takes 6 (bf16: 0.9-1.6), and 38 vs 6 at 16, 4316 vs 10 at
    # 2,048 (an H200, `python benchmarks/cuda_throughput.py --layers`): int8 there saves
    # memory, not time.
    CUDA_DENSE = True
    CUDA_KERNEL_MAX_ROWS = 0

    def __init__(self, in_features, out_features, q: torch.Tensor, scale: torch.Tensor, bias=None):
        super().__init__(in_features, out_features, bias, q.is_cuda)
        self.q, self.scale = q.contiguous(), scale.to(torch.bfloat16).contiguous()
        self.fmt, self.padded_rows = "int8 (per channel)", out_features

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def dequant_t(self, n0: int, n1: int) -> torch.Tensor:
        if self.on_cuda:
            return (self.q[n0:n1].to(torch.bfloat16) * self.scale[n0:n1, None]).t()
        k, size = self.in_features, self.in_features * (n1 - n0)
        out = _scratch(size)
        kernels.dequant().dequant_int8(out, self.q[n0:n1], self.scale[n0:n1])
        return out[:size].view(n1 - n0, k).t()

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids].float()[:, None]


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up in a quantized (output head's) weight."""

    def __init__(self, source: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.source, self.dtype = source, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids).to(self.dtype)


_scratch_buffer = torch.empty(0, dtype=torch.bfloat16)


def _scratch(size: int) -> torch.Tensor:
    """One reused bf16 buffer, grown to the largest slice asked for: layers run one after
    another, and each slice is consumed by its matmul before the next is written."""
    global _scratch_buffer
    if _scratch_buffer.numel() < size:
        _scratch_buffer = torch.empty(size, dtype=torch.bfloat16)
    return _scratch_buffer

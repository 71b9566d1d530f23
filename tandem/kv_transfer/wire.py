"""The KV wire format: one message per layer of a request's token range, as ZeroMQ frames
[header, K bytes, V bytes]. The header (msgspec) names the request, the layer, the token
range, the dtype and the shape; the tensors travel as raw bytes, never pickled, and are
read back without a copy (torch.frombuffer over the received frame).

An 8-bit cache's KV travels as it is stored (int8 or e4m3, a byte a value) with a fourth
frame, its float32 scales [2, tokens, kv_heads] (K's, then V's): a quarter of float32's bytes
plus 4 per token and KV head, and the receiver copies the bytes without rounding them again.

After its layers, a request's transfer ends with a one-frame message: the first token the
sender sampled from the prompt (and its logprobs, when asked for)."""

from __future__ import annotations

import warnings

import msgspec
import torch

from tandem.model.kv_quant import EIGHT_BIT

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,  # an 8-bit cache's, with scales
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class LayerHeader(msgspec.Struct, array_like=True):
    request_id: str
    layer: int
    num_layers: int
    start: int  # first token position of the range
    end: int
    dtype: str
    shape: tuple[int, int, int]  # [tokens, kv_heads, head_dim] of K (and of V)
    scaled: bool = False  # 8-bit: a fourth frame holds the scales [2, tokens, kv_heads]


class TransferDone(msgspec.Struct, array_like=True):
    request_id: str
    first_token: int
    logprobs: tuple[list[int], list[float], int] | None = None  # as core.runner.TokenLogprobs


_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(LayerHeader).decode
_decode_done = msgspec.msgpack.Decoder(TransferDone).decode


def encode_done(done: TransferDone) -> list:
    return [_encode(done)]


def decode_done(frames) -> TransferDone:
    return _decode_done(bytes(frames[0]))


def encode_layer(
    request_id: str, layer: int, num_layers: int, start: int, k: torch.Tensor, v: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> list:  # fmt: skip
    """Frames for one layer: k and v are [tokens, kv_heads, head_dim] on the CPU; 8-bit ones
    come with their scales [2, tokens, kv_heads] float32."""
    k, v = k.contiguous(), v.contiguous()
    if (k.dtype in EIGHT_BIT) != (scales is not None):
        raise ValueError(f"kv: {k.dtype} K and V travel {'with' if scales is None else 'without'} scales")  # fmt: skip
    header = LayerHeader(
        request_id, layer, num_layers, start, start + k.shape[0], _NAMES[k.dtype], tuple(k.shape),
        scales is not None,
    )  # fmt: skip
    frames = [_encode(header), _raw(k), _raw(v)]
    if scales is not None:
        frames.append(_raw(scales.to(torch.float32).contiguous()))
    return frames


def decode_layer(frames) -> tuple[LayerHeader, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(header, K, V, scales or None), the tensors views of the frames."""
    header = _decode_header(bytes(frames[0]))
    _check(header)
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise ValueError(f"kv: unknown dtype {header.dtype!r}")
    if (dtype in EIGHT_BIT) != header.scaled or len(frames) != 3 + header.scaled:
        raise ValueError(f"kv: {len(frames)} frames of {header.dtype} (scaled: {header.scaled})")
    k, v = (_tensor(f, dtype, header.shape) for f in frames[1:3])
    scales = None
    if header.scaled:
        scales = _tensor(frames[3], torch.float32, (2, *header.shape[:2]))
    return header, k, v, scales


def _check(h: LayerHeader) -> None:
    """Numbers a sender controls, bounded before any tensor is made from them."""
    if min(h.shape) < 0 or not 0 <= h.layer < h.num_layers or h.start < 0:
        raise ValueError(f"kv: layer {h.layer} of {h.num_layers}, start {h.start}, shape {h.shape}")
    if h.end != h.start + h.shape[0]:
        raise ValueError(f"kv: positions [{h.start}, {h.end}) for {h.shape[0]} tokens")


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _tensor(frame, dtype: torch.dtype, shape) -> torch.Tensor:
    buf = memoryview(frame)
    expected = dtype.itemsize
    for n in shape:
        expected *= n
    if buf.nbytes != expected:
        raise ValueError(f"kv: a frame of {buf.nbytes} bytes for shape {shape} of {dtype}")
    if not expected:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a received frame is read-only; the tensor only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)

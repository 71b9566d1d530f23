"""The KV wire format: one message per layer of a request's token range, as ZeroMQ frames
[header, K bytes, V bytes]. The header (msgspec) names the request, the layer, the token
range, the dtype and the shape; the tensors travel as raw bytes, never pickled, and are
read back without a copy (torch.frombuffer over the received frame).

After its layers, a request's transfer ends with a one-frame message: the first token the
sender sampled from the prompt (and its logprobs, when asked for)."""

from __future__ import annotations

import warnings

import msgspec
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


class LayerHeader(msgspec.Struct, array_like=True):
    request_id: str
    layer: int
    num_layers: int
    start: int  # first token position of the range
    end: int
    dtype: str
    shape: tuple[int, int, int]  # [tokens, kv_heads, head_dim] of K (and of V)


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
    request_id: str, layer: int, num_layers: int, start: int, k: torch.Tensor, v: torch.Tensor
) -> list:
    """Frames for one layer: k and v are [tokens, kv_heads, head_dim] on the CPU."""
    k, v = k.contiguous(), v.contiguous()
    header = LayerHeader(
        request_id, layer, num_layers, start, start + k.shape[0], _NAMES[k.dtype], tuple(k.shape)
    )
    return [_encode(header), _raw(k), _raw(v)]


def decode_layer(frames) -> tuple[LayerHeader, torch.Tensor, torch.Tensor]:
    header = _decode_header(bytes(frames[0]))
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise ValueError(f"kv: unknown dtype {header.dtype!r}")
    k, v = (_tensor(f, dtype, header.shape) for f in frames[1:3])
    return header, k, v


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

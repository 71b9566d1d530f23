"""A GGUF with K-quant blocks runs end to end, as a Q4_K_M file mixes them: the default model
rewritten with its down projections (the only tensors whose rows are whole 256-weight
super-blocks: 1,536 columns) as Q4_K in layers 0-9, Q5_K in 10-19 and Q6_K in 20-29, every
other tensor as shipped. Q4_K and Q5_K layers run on int4 terms, Q6_K layers on the float
path, and greedy output equals the dequantized float model's.

gguf-py reads K-quants but cannot write them, so `quantize_k` below does (llama.cpp's block
layouts; a simple min/max fit, not its search for the best scales): its blocks are checked
against gguf-py's own dequantization first."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import LLM, SamplingParams
from tandem.core.model_config import default_model_path
from tandem.model.quant import Int4Linear

pytestmark = pytest.mark.slow  # GGUF K-quant checkpoints built and run

QK = 256  # weights a super-block


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as float16 bytes [..., 2], and the float32 value they hold."""
    h = x.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _scales_12(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] packed in 12 bytes, as gguf's Q4_K.get_scale_min
    unpacks them."""
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return np.concatenate([d, m, md], axis=1).astype(np.uint8)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks of x [n, 256]."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, minus = (hi - lo) / top, -lo  # x ~ scale * q - minus
    d_bytes, d = _f16(scale.max(-1) / 63)
    m_bytes, dmin = _f16(minus.max(-1) / 63)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(minus / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    s, m = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.round((sub + m[..., None]) / np.where(s == 0, 1, s)[..., None]), 0, top)
    q = q.astype(np.uint8)  # [n, 8, 32]
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2g, 2g+1: nibbles
    parts = [d_bytes, m_bytes, _scales_12(sc, mn)]
    if bits == 5:  # byte i's bit j: the fifth bit of sub-block j's weight i
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8))
    return np.concatenate([p.reshape(len(x), -1) for p in (*parts, qs)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of x [n, 256]: 16 sub-blocks of 16 with int8 scales, q in [-32, 31]."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    s = d[:, None] * sc
    q = np.clip(np.round(sub / np.where(s == 0, 1, s)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # weight 128a + 32r + c: [a, r, c]
    low, high = q & 0xF, q >> 4
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)  # rows r, r + 2: nibbles
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d_bytes.reshape(-1, 2)], 1)


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) as `kind` blocks, bytes [rows, ...]."""
    blocks = w.reshape(-1, QK).astype(np.float32)
    raw = {"Q4_K": lambda b: _q45_k(b, 4), "Q5_K": lambda b: _q45_k(b, 5), "Q6_K": _q6_k}[kind]
    return raw(blocks).reshape(w.shape[0], -1)


@pytest.mark.parametrize("kind,bits", [("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6)])
def test_the_k_quantizer_writes_blocks_gguf_reads_back_as_its_weights(kind, bits):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = dequantize(quantize_k(w, kind), GGMLQuantizationType[kind])
    err = np.abs(back - w).max()
    assert err <= 2 * 0.05 * 8 / (2**bits - 1)  # a step of its grid over ~8 sigma, at most
    assert np.abs(back - w).mean() < err / 2  # and mostly well inside it


LAYER_KINDS = ["Q4_K"] * 10 + ["Q5_K"] * 10 + ["Q6_K"] * 10


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """The default model with its down projections re-encoded as LAYER_KINDS."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(default_model_path())
    path = tmp_path_factory.mktemp("kquants") / "SmolLM2-135M-Instruct.Q4_K_mix.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if t.name.endswith("ffn_down.weight"):
            layer = int(t.name.split(".")[1])
            kind = gguf.GGMLQuantizationType[LAYER_KINDS[layer]]
            data = quantize_k(dequantize(t.data, t.tensor_type), LAYER_KINDS[layer])
        tensors.append((t.name, data, kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return path


def test_a_gguf_of_mixed_k_quants_runs_on_its_blocks_and_follows_the_float_path(k_quant_gguf):
    """With bf16 activations (`--activation-quantization none`: int8 ones, the default where
    they run, are held to the float path by perplexity and KL divergence instead)."""
    messages = [{"role": "user", "content": "What is the capital of France? Tell me about it."}]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for method in ("gguf", "none"):
        llm = LLM(str(k_quant_gguf), dtype="float32", quantization=method, kv_cache_memory=0.05,
                  max_model_len=512, activation_quantization="none")  # fmt: skip
        outs[method] = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
        if method == "gguf":
            layers = llm.engine.runner.model.model.layers
            for i, kind in enumerate(LAYER_KINDS):
                down = layers[i].mlp.down_proj
                if kind == "Q6_K":  # groups of 16: no int4 terms, the float path
                    assert not isinstance(down, Int4Linear)
                else:
                    assert isinstance(down, Int4Linear) and down.fmt == kind
                assert layers[i].mlp.gate_up_proj.fmt == "Q4_1"  # as shipped
        del llm
    assert outs["gguf"] == outs["none"]
    assert len(set(outs["gguf"])) > 8  # a reply, not one token repeated

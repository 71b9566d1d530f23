"""C++ CPU kernels, built on first use; `paged_decode_attention()` is None where they can't
be (not x86, no compiler, build failure, or TANDEM_NO_CPP_KERNELS=1), and callers fall back
to the torch path."""

from tandem.model.kernels.build import (
    configure,
    dequant,
    fused,
    lora_bgmv,
    paged_decode_attention,
    prebuild,
    prefill_attention,
    token_bitmask,
    vec_lanes,
)

__all__ = [
    "configure",
    "dequant",
    "fused",
    "lora_bgmv",
    "paged_decode_attention",
    "prebuild",
    "prefill_attention",
    "token_bitmask",
    "vec_lanes",
]

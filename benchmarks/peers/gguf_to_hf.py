"""Dequantize a GGUF into an HF folder with transformers, for peers that cannot load GGUF.

    python gguf_to_hf.py MODEL.gguf OUT_DIR

transformers reads the GGUF (needs `gguf` and `accelerate`); the weights are saved as
float32 safetensors without the tied `lm_head.weight` and without the GGUF quantization
config, next to the tokenizer (with its chat template). Written to a temporary folder
and renamed, so an interrupted run leaves nothing half made.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # unset when loaded from a GGUF
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(sys.argv[2])

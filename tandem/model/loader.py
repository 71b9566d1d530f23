"""Find a checkpoint, read its config and build the model with its weights.

A model is an HF folder (config.json, *.safetensors, tokenizer files) or a GGUF file, which
is converted to such a folder once (see gguf.py). With no path, the bundled default model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.core.model_config import ModelConfig, default_model_path
from tandem.model.llama import LlamaForCausalLM


def resolve_model(model: str | Path | None) -> Path:
    """The HF-format folder holding the model."""
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ValueError(f"model: path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from tandem.model.gguf import gguf_as_hf_folder

        return gguf_as_hf_folder(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return resolve_model(ggufs[0])
        if not (path / "config.json").exists():
            raise ValueError(f"model: folder {str(path)!r} has no config.json")
        if not list(path.glob("*.safetensors")):
            raise ValueError(f"model: folder {str(path)!r} has no *.safetensors weights")
        return path
    raise ValueError(f"model: {str(path)!r} is neither an HF checkpoint folder nor a .gguf file")


def gguf_file(model: str | Path | None) -> Path | None:
    """The GGUF file a model is (or a folder holds alone), or None for an HF checkpoint."""
    path = Path(model) if model is not None else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def load_model(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    shard=None,
):
    """shard: a distributed.sharding.RankShard, for one rank's part of the model (cfg is
    then that part's config); None: the whole model."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, dtype, max_positions)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if hasattr(module, "init_tables"):
            module.init_tables()
    load_weights(model, folder, shard)
    return model.eval()


def load_weights(model: LlamaForCausalLM, folder: Path, shard=None) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    # (parameter, shard index or None): a fused parameter is whole once each shard is loaded
    fused_names = {fused for fused, _ in model.stacked_params.values()}
    missing = set()
    for pname in params:
        fused = pname.split(".")[-2]
        shards = len(model.shard_sizes(fused)) if fused in fused_names else 0
        missing.update([(pname, i) for i in range(shards)] or [(pname, None)])
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for source in f.keys():
                name = source if shard is None else shard.local_name(source)
                if (
                    name is None
                    or name.endswith("rotary_emb.inv_freq")
                    or (name == "lm_head.weight" and name not in params)
                ):
                    continue
                target, index, rows = _target_of(model, name)
                if target not in params:
                    raise ValueError(
                        f"model: checkpoint tensor {name!r} has no place in {type(model).__name__}"
                    )
                param = params[target].data
                dest = param if rows is None else param[rows]
                tensor = f.get_tensor(source)
                if shard is not None:
                    tensor = shard(source, tensor)
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"model: {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                missing.discard((target, index))
    if missing:
        names = sorted({p if s is None else f"{p}[shard {s}]" for p, s in missing})
        raise ValueError(f"model: checkpoint is missing weights {names[:5]}")


def _target_of(model: LlamaForCausalLM, name: str) -> tuple[str, int | None, slice | None]:
    """Map a checkpoint tensor to (parameter name, shard index, row slice of the parameter)."""
    for shard, (fused, index) in model.stacked_params.items():
        if f".{shard}." in name:
            sizes = model.shard_sizes(fused)
            start = sum(sizes[:index])
            return name.replace(shard, fused), index, slice(start, start + sizes[index])
    return name, None, None

"""Find a checkpoint, read its config and build the model with its weights.

A model is an HF folder (config.json, *.safetensors, tokenizer files) or a GGUF file, which
is converted to such a folder once (see gguf.py). With no path, the bundled default model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.core.model_config import ModelConfig, default_model_path
from tandem.model.llama import LlamaForCausalLM
from tandem.model.moe import EXPERT_TENSOR, moe_param_name


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
    # (parameter, shard key or None): a fused parameter is whole once each shard is loaded
    missing = set()
    for pname, param in params.items():
        missing.update((pname, key) for key in _shard_keys(model, pname, param))
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
                target, key, index = _target_of(model, moe_param_name(name))
                if target not in params:
                    raise ValueError(
                        f"model: checkpoint tensor {name!r} has no place in {type(model).__name__}"
                    )
                param = params[target].data
                dest = param if index is None else param[index]
                tensor = f.get_tensor(source)
                if shard is not None:
                    tensor = shard(source, tensor)
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"model: {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                if key == "all":  # a checkpoint's own stacked experts (Granite)
                    missing -= {(target, k) for k in _shard_keys(model, target, param)}
                missing.discard((target, key))
    if missing:
        names = sorted({p if s is None else f"{p}[shard {s}]" for p, s in missing})
        raise ValueError(f"model: checkpoint is missing weights {names[:5]}")


def _shard_keys(model, pname: str, param) -> list:
    """The pieces a parameter is loaded in: [None] for a whole one."""
    owner, _, leaf = pname.rpartition(".")
    module_name, _, fused = owner.rpartition(".")
    if leaf in ("w13", "w2"):  # stacked experts: per expert, gate and up apart
        halves = (0, 1) if leaf == "w13" else (None,)
        return [(e, h) for e in range(param.shape[0]) for h in halves]
    sizes = getattr(model.get_submodule(module_name), "shard_sizes", {}) if module_name else {}
    return list(range(len(sizes[fused]))) if fused in sizes else [None]


def _target_of(model: LlamaForCausalLM, name: str):
    """Map a checkpoint tensor (its MoE names made ours) to (parameter name, shard key,
    index of the parameter it fills or None for all of it)."""
    expert = EXPERT_TENSOR.search(name)
    if expert is not None:
        e, part = int(expert.group(1)), expert.group(2)
        target = name[: expert.start()] + (".w2" if part in ("w2", "down_proj") else ".w13")
        if part in ("w2", "down_proj"):
            return target, (e, None), e
        half = int(part in ("w3", "up_proj"))
        rows = model.get_submodule(target.rpartition(".")[0]).moe.intermediate_size
        return target, (e, half), (e, slice(half * rows, (half + 1) * rows))
    if name.endswith((".mlp.w13", ".mlp.w2")):
        return name, "all", None
    for part, (fused, index) in model.stacked_params.items():
        if f".{part}." in name:
            target = name.replace(part, fused)
            sizes = model.get_submodule(target.rsplit(".", 2)[0]).shard_sizes[fused]
            start = sum(sizes[:index])
            return target, index, slice(start, start + sizes[index])
    return name, None, None

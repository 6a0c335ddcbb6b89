"""Load weights into a Transformer: Hugging Face checkpoint directories (safetensors) and GGUF files."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig, SpdConfigError
from .model import Transformer


class CheckpointError(SpdConfigError):
    """A checkpoint file that is missing, truncated or corrupt."""


def _hf_to_ours(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers' parameter names to ours, fusing q/k/v and gate/up."""
    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}; is it a complete {cfg.model_type} checkpoint?")
        return sd[name]

    out: dict[str, torch.Tensor] = {
        "embed.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd.get("lm_head.weight", out["embed.weight"])
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")])
        if cfg.attention_bias:
            out[f"layers.{i}.attn.wqkv.bias"] = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
        out[f"layers.{i}.attn.wo.weight"] = take(a + "o_proj.weight")
        if cfg.qk_norm:
            out[f"layers.{i}.attn.q_norm.weight"] = take(a + "q_norm.weight")
            out[f"layers.{i}.attn.k_norm.weight"] = take(a + "k_norm.weight")
        out[f"layers.{i}.mlp.w_gate_up.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[f"layers.{i}.mlp.w_down.weight"] = take(p + "mlp.down_proj.weight")
        out[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return out


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-save the checkpoint") from e
        files = [path / n for n in names]
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}; save the model with save_pretrained(safe_serialization=True)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"shard {f.name} named in the index is missing from {path}")
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own SafetensorError for truncation / bad headers
            raise CheckpointError(
                f"cannot read {f} ({type(e).__name__}: {e}); the file is truncated or corrupt, copy it again") from e
    return sd


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    sd = read_safetensors_dir(path)
    return build_model(cfg, _hf_to_ours(cfg, sd), dtype, device)


def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match the {cfg.model_type} layout: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.to(dtype)
    model.eval().requires_grad_(False)
    return model

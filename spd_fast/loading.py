"""Load weights into a Transformer: Hugging Face checkpoint directories (safetensors) and GGUF files."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .config import ModelConfig, SpdConfigError
from .model import Transformer


class CheckpointError(SpdConfigError):
    """A checkpoint file that is missing, truncated or corrupt."""


def _hf_to_ours(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers' parameter names to ours, fusing q/k/v and gate/up. A tensor the mapping does not
    use (a bias or layer this runtime does not implement) is an error, not silently dropped."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}; is it a complete {cfg.model_type} checkpoint?")
        used.add(name)
        return sd[name]

    def cat(*names: str) -> torch.Tensor:  # q/k/v or gate/up, fused along the output rows
        parts = [take(n) for n in names]
        try:
            return torch.cat(parts)
        except RuntimeError:
            raise CheckpointError(f"tensors {', '.join(names)} cannot be fused: their shapes "
                                  f"{', '.join(str(list(t.shape)) for t in parts)} disagree; the checkpoint is "
                                  f"damaged or not a standard {cfg.model_type} one") from None

    out: dict[str, torch.Tensor] = {
        "embed.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if cfg.tie_word_embeddings and "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"],
                                                                               out["embed.weight"]):
        # transformers then keeps the stored output layer untied; tying it here would change every logit
        raise CheckpointError("checkpoint has an lm_head.weight that differs from model.embed_tokens.weight while "
                              "its config.json says tie_word_embeddings is true; set tie_word_embeddings to false "
                              "if the stored output layer is the model's, else drop lm_head.weight from the file")
    if not cfg.tie_word_embeddings:  # an untied output layer is a tensor of its own: its absence is not a tie
        if "lm_head.weight" not in sd:
            raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' while its config.json says "
                                  "tie_word_embeddings is false (the default); set it to true if the model's output "
                                  "layer is its embedding, else copy the complete checkpoint")
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.attn.wqkv.weight"] = cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        if cfg.attention_bias:
            out[f"layers.{i}.attn.wqkv.bias"] = cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        out[f"layers.{i}.attn.wo.weight"] = take(a + "o_proj.weight")
        if cfg.qk_norm:
            out[f"layers.{i}.attn.q_norm.weight"] = take(a + "q_norm.weight")
            out[f"layers.{i}.attn.k_norm.weight"] = take(a + "k_norm.weight")
        out[f"layers.{i}.mlp.w_gate_up.weight"] = cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        out[f"layers.{i}.mlp.w_down.weight"] = take(p + "mlp.down_proj.weight")
        out[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    # lm_head.weight: read above when untied, a copy of the embedding when tied; rotary inv_freq: recomputed
    extra = sorted(k for k in sd if k not in used and k != "lm_head.weight" and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} tensors the {cfg.model_type} layout of spd_fast does not "
                              f"use, e.g. {extra[:4]}: the model has biases or layers this runtime does not implement, "
                              f"so its output would be wrong; use a standard {cfg.model_type} checkpoint")
    return out


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            if not isinstance(wmap, dict) or not all(isinstance(n, str) and n for n in wmap.values()):
                raise ValueError("weight_map must map tensor names to shard file names")
            names = sorted(set(wmap.values()))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}); re-save the "
                                  f"checkpoint") from None
        files = [path / n for n in names]
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}; save the model with save_pretrained(safe_serialization=True)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            where = "named in the index " if index.is_file() else ""
            raise CheckpointError(f"shard {f.name} {where}is missing from {path} (or is not a file); copy the "
                                  f"checkpoint again")
        try:
            part = load_file(str(f))
        except Exception as e:  # safetensors raises its own SafetensorError for truncation / bad headers
            raise CheckpointError(
                f"cannot read {f} ({type(e).__name__}: {e}); the file is truncated or corrupt, copy it again") from e
        if dup := next((k for k in part if k in sd), None):  # e.g. a stray copy beside the checkpoint
            first = next(g.name for g in files if g != f and dup in _safetensors_keys(g))
            raise CheckpointError(f"tensor {dup!r} is in both {first} and {f.name} in {path}; remove the file that "
                                  f"does not belong to the checkpoint (or add its model.safetensors.index.json)")
        sd.update(part)
    return sd


def _safetensors_keys(f: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(f), "pt") as fh:
        return set(fh.keys())


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    sd = read_safetensors_dir(path)
    return build_model(cfg, _hf_to_ours(cfg, sd), dtype, device)


def fingerprint_tensors(embed: torch.Tensor, norm: torch.Tensor, last_w_down: torch.Tensor,
                        first_wqkv: torch.Tensor) -> str:
    """A cheap identity of a model's weights: hash of a few strided slices of the embedding, the final norm,
    the last layer's MLP down projection and the first layer's fused QKV, rounded to bf16 so that the same
    checkpoint stored in fp32 or bf16 gives the same value. An fp16 copy does not (fp32 -> fp16 -> bf16 rounds about
    6 % of the values otherwise), nor does a quantised one: the mismatch error says so. Draft heads record it (`base_fingerprint`);
    `build_model` keeps the value of the tensors it was given as `source_fingerprint`, before its cast."""
    h = hashlib.sha256()
    for t in (embed, norm, last_w_down, first_wqkv):
        flat = t.detach().reshape(-1)
        h.update(flat[:: max(1, flat.numel() // 4096)].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device) -> Transformer:
    # the identity of the weights as stored, before the cast: an fp16 load is the same model for a draft head
    fingerprint = fingerprint_tensors(sd["embed.weight"], sd["norm.weight"],
                                      sd[f"layers.{cfg.num_layers - 1}.mlp.w_down.weight"],
                                      sd["layers.0.attn.wqkv.weight"]) if "embed.weight" in sd else None
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(
            {k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=False)
    except RuntimeError as e:  # a tensor of another shape than the config gives it
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise CheckpointError(f"the config does not match the weights ({first}); use the checkpoint's own "
                              f"config.json") from None
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match the {cfg.model_type} layout: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.to(dtype)
    model.eval().requires_grad_(False)
    model.source_fingerprint = fingerprint
    return model

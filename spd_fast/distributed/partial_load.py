"""Load one pipeline stage straight from a safetensors checkpoint: only the tensors a rank needs.

A rank builds the full `Transformer` on the meta device (no memory) and assigns real tensors only to
its own layers, plus the embedding (first stage, and the draft head's LM-head rows), the final norm
and LM head (last stage, and the draft head on rank 0). Unowned layers stay on meta, so a rank
holds neither the weights nor the KV caches of other stages. Running the same `Transformer` code
(`run_layers`, `logits`) as the single-process engine keeps every op and shape identical.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch

from ..config import ModelConfig
from ..loading import CheckpointError
from ..model import Transformer, rope_tables
from ..runtime import weights_fingerprint


class CheckpointReader:
    """Tensors of a safetensors checkpoint directory (one file or sharded), read one by one by HF name."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("its weight_map is not an object of tensor name -> file name")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}); re-save "
                                      f"the checkpoint") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f.name for f in self.path.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}; save the model with "
                                  "save_pretrained(safe_serialization=True)")
        self._handles = {}
        for name in files:
            f = self.path / name
            if not f.is_file():
                raise CheckpointError(f"shard {name} named in the index is missing from {self.path}")
            try:
                self._handles[name] = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise CheckpointError(f"cannot read {f} ({type(e).__name__}: {e}); the file is truncated or "
                                      "corrupt, copy it again") from e
        if not weight_map:
            weight_map = {k: name for name, h in self._handles.items() for k in h.keys()}
        self._where = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its shape (read from the headers only): for layout checks."""
        return {k: torch.empty(self._handles[f].get_slice(k).get_shape(), device="meta")
                for k, f in self._where.items()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r}; is it complete?")
        return self._handles[self._where[name]].get_tensor(name)

    def first_row(self, name: str) -> torch.Tensor:
        """The first row (or element) only: a cheap probe for comparing checkpoints across ranks."""
        if name not in self._where:
            raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r}; is it complete?")
        return self._handles[self._where[name]].get_slice(name)[0:1]


def _layer_tensors(cfg: ModelConfig, rd: CheckpointReader, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer i in our fused layout (the same mapping as loading._hf_to_ours, one layer at a time)."""
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    yield f"layers.{i}.attn.wqkv.weight", torch.cat([rd.get(a + f"{x}_proj.weight") for x in "qkv"])
    if cfg.attention_bias:
        yield f"layers.{i}.attn.wqkv.bias", torch.cat([rd.get(a + f"{x}_proj.bias") for x in "qkv"])
    yield f"layers.{i}.attn.wo.weight", rd.get(a + "o_proj.weight")
    if cfg.qk_norm:
        yield f"layers.{i}.attn.q_norm.weight", rd.get(a + "q_norm.weight")
        yield f"layers.{i}.attn.k_norm.weight", rd.get(a + "k_norm.weight")
    yield f"layers.{i}.mlp.w_gate_up.weight", torch.cat([rd.get(p + "mlp.gate_proj.weight"),
                                                         rd.get(p + "mlp.up_proj.weight")])
    yield f"layers.{i}.mlp.w_down.weight", rd.get(p + "mlp.down_proj.weight")
    yield f"layers.{i}.attn_norm.weight", rd.get(p + "input_layernorm.weight")
    yield f"layers.{i}.mlp_norm.weight", rd.get(p + "post_attention_layernorm.weight")


def _check_layout(cfg: ModelConfig, rd: CheckpointReader, model: Transformer) -> None:
    """The single-process loader's checks (loading._hf_to_ours: every tensor present, none unused, an untied
    output layer stored, a tied one not stored differently; and every shape the config's), made on the whole
    checkpoint's names and shapes, so each rank refuses what `load` refuses, not only for its own layers."""
    from ..loading import _hf_to_ours

    meta = rd.meta()
    if cfg.tie_word_embeddings and "lm_head.weight" in meta:  # the one check that compares values
        for k in ("lm_head.weight", "model.embed_tokens.weight"):
            meta[k] = rd.get(k)
    mapped = _hf_to_ours(cfg, meta)
    want = model.state_dict()
    for k, v in mapped.items():
        if k in want and tuple(want[k].shape) != tuple(v.shape):
            raise CheckpointError(f"the config does not match the weights (size mismatch for {k}: the checkpoint "
                                  f"has {tuple(v.shape)}, the config gives {tuple(want[k].shape)}); use the "
                                  f"checkpoint's own config.json")


def _lm_head(cfg: ModelConfig, rd: CheckpointReader) -> torch.Tensor:
    if cfg.tie_word_embeddings or "lm_head.weight" not in rd:
        return rd.get("model.embed_tokens.weight")
    return rd.get("lm_head.weight")


def load_stage(path: str | Path, cfg: ModelConfig, layers: range, *, embedding: bool, head: bool,
               dtype: torch.dtype, device: torch.device, max_len: int) -> Transformer:
    """A Transformer whose layers in `layers` (plus embedding / final norm + LM head when asked) hold
    real weights and static KV caches of max_len + 1 slots; every other parameter stays on meta."""
    rd = CheckpointReader(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    _check_layout(cfg, rd, model)
    sd: dict[str, torch.Tensor] = {}
    for i in layers:
        sd.update(_layer_tensors(cfg, rd, i))
    if embedding:
        sd["embed.weight"] = rd.get("model.embed_tokens.weight")
    if head:
        sd["norm.weight"] = rd.get("model.norm.weight")
        if not (cfg.tie_word_embeddings and embedding):
            sd["lm_head.weight"] = _lm_head(cfg, rd)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    # assign=True swaps the meta parameters for these tensors; the others stay meta (no memory)
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_word_embeddings and embedding and head:
        model.lm_head.weight = model.embed.weight
    model.eval().requires_grad_(False)
    for i in layers:  # the same cache layout as Transformer.setup_caches, own layers only
        shape = (1, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
        model.layers[i].attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        model.layers[i].attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    model.max_len = max_len
    cos, sin = rope_tables(cfg, max_len + 1)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    from ..packed import enable_fused_ops, maybe_attach

    maybe_attach(model, Path(path))  # same decode kernels as a single-process model: same numerics
    enable_fused_ops(model)
    return model


def full_weights_fingerprint(path: str | Path, cfg: ModelConfig) -> str:
    """runtime.weights_fingerprint of the whole checkpoint, reading only the four tensors it hashes
    (so a draft head trained on the single-process model matches here too)."""
    rd = CheckpointReader(path)
    last, first = dict(_layer_tensors(cfg, rd, cfg.num_layers - 1)), dict(_layer_tensors(cfg, rd, 0))
    w = lambda t: SimpleNamespace(weight=t)  # noqa: E731  (as stored, like runtime.load_target: any dtype matches)
    # weights_fingerprint reads .embed, .norm, .layers[-1].mlp.w_down and .layers[0].attn.wqkv
    # one layer object serves as both layers[0] (its wqkv) and layers[-1] (its w_down)
    ends = SimpleNamespace(attn=SimpleNamespace(wqkv=w(first["layers.0.attn.wqkv.weight"])),
                           mlp=SimpleNamespace(w_down=w(last[f"layers.{cfg.num_layers - 1}.mlp.w_down.weight"])))
    fake = SimpleNamespace(embed=w(rd.get("model.embed_tokens.weight")), norm=w(rd.get("model.norm.weight")),
                           layers=[ends])
    return weights_fingerprint(fake)  # type: ignore[arg-type]


def checkpoint_probe(path: str | Path, cfg: ModelConfig) -> str:
    """A cheap identity every rank computes the same way from its own copy of the checkpoint: the
    config plus the first row of a few tensors spread over the model. Ranks compare it at startup."""
    rd = CheckpointReader(path)
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    L = cfg.num_layers
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
             f"model.layers.{L // 2}.mlp.up_proj.weight", f"model.layers.{L - 1}.mlp.down_proj.weight"]
    for name in names:
        h.update(rd.first_row(name).float().numpy().tobytes())
    return h.hexdigest()[:16]

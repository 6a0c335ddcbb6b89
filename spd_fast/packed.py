"""GGUF-packed decode weights: the linear layers of a GGUF model keep their quantised blocks.

A batch-1 decode step streams every weight once, so its cost is the bytes it reads. For a GGUF
model we keep, next to the fp32 copy used for prefill and training, the file's own Q4_1 / Q8_0
blocks (repacked for aligned loads), and the decode rows (M <= 16) go through the C++ ops of
spd_fast/csrc/gguf_linear.cpp, which dequantise in registers with the GGUF formula. Every weight is the
same fp32 number as in the dequantised copy; the sums run in a fixed order that does not depend
on M, so SPD stage steps (1..n rows) and the AR baseline (1 row) stay bit-identical.

The same module also switches on two fused C++ decode ops (RMSNorm, few-query attention):
`enable_fused_ops`, off with SPD_FAST_FUSED=0.

Packed weights are off with SPD_FAST_PACKED=0, for non-fp32 or non-CPU models, for checkpoints that are not GGUF,
and when the C++ ops cannot be built (one warning, then the fp32 path). A CPU model loaded in bf16 or fp16 from a
file that has such blocks warns that fp32 would decode faster (`maybe_attach`).

The draft head decodes the same way (`pack_draft`): its LM head takes the target's packed rows
of the draft vocabulary (the same numbers as its fp32 copy), its tower and aggregation weights
are quantised to Q8_0 at load (a draft-only approximation: verification still uses the exact
target, so the output does not change). Without it the fp32 PDM reads about 4.5x the bytes
of a Q4_1 target stage per cycle and cannot hide inside one. SPD_FAST_PACKED_DRAFT=0 keeps it fp32.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_loader import _open, _unpermute

_KINDS = {"Q4_1": 20, "Q8_0": 34}  # bytes per 32-weight block


def _switch(name: str) -> bool:
    """An on-by-default environment switch: 0 / false / no turn it off."""
    return os.environ.get(name, "1") not in ("0", "false", "no")


def enabled() -> bool:
    return _switch("SPD_FAST_PACKED")


def draft_enabled() -> bool:
    return enabled() and _switch("SPD_FAST_PACKED_DRAFT")


def _blocks(t) -> tuple[str, np.ndarray]:
    kind = t.tensor_type.name
    N, K = int(t.shape[1]), int(t.shape[0])
    return kind, np.asarray(t.data, dtype=np.uint8).reshape(N, K // 32, _KINDS[kind])


def _repack(kind: str, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    N, NB, _ = blocks.shape
    d = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(N, NB).astype(np.float32))
    if kind == "Q4_1":
        m = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(N, NB).astype(np.float32))
        qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:20]).reshape(N, NB * 16))
        return {"kind": "q4_1", "qs": qs, "d": d, "m": m}
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:34]).view(np.int8).reshape(N, NB * 32))
    return {"kind": "q8_0", "qs": qs, "d": d}


def read_packed(gguf_path: str | Path, cfg: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Our module name -> repacked blocks, for every linear layer stored as Q4_1 or Q8_0 (fused
    layers only when all their parts are)."""
    reader = _open(Path(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, dict[str, torch.Tensor]] = {}

    def fuse(names: list[str], perms: list[int | None]) -> dict[str, torch.Tensor] | None:
        parts = []
        for nm, heads in zip(names, perms):
            t = by_name.get(nm)
            if t is None or t.tensor_type.name not in _KINDS:
                return None
            kind, b = _blocks(t)
            if heads is not None:
                b = _unpermute(b, heads)
            parts.append((kind, b))
        if len({k for k, _ in parts}) != 1:
            return None
        return _repack(parts[0][0], np.concatenate([b for _, b in parts], axis=0))

    llama = cfg["model_type"] == "llama"
    for i in range(cfg["num_hidden_layers"]):
        p = f"blk.{i}."
        qkv = fuse([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                   [cfg["num_attention_heads"] if llama else None, cfg["num_key_value_heads"] if llama else None, None])
        for name, packed in ((f"layers.{i}.attn.wqkv", qkv),
                             (f"layers.{i}.attn.wo", fuse([p + "attn_output.weight"], [None])),
                             (f"layers.{i}.mlp.w_gate_up", fuse([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None])),
                             (f"layers.{i}.mlp.w_down", fuse([p + "ffn_down.weight"], [None]))):
            if packed is not None:
                out[name] = packed
    head = "token_embd.weight" if cfg.get("tie_word_embeddings") and "output.weight" not in by_name else "output.weight"
    packed = fuse([head], [None])
    if packed is not None:
        out["lm_head"] = packed
    return out


def packed_linear(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """x [..., K] fp32 with at most model.PACKED_MAX_ROWS rows -> [..., N] through the C++ op."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if p["kind"] == "q4_1":
        y = torch.ops.spd_fast.q4_1_linear(x2, p["qs"], p["d"], p["m"])
    else:
        y = torch.ops.spd_fast.q8_0_linear(x2, p["qs"], p["d"])
    return y.reshape(*shape[:-1], y.shape[-1])


def reference_linear(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """PyTorch twin: dequantise with the GGUF formula, then F.linear (the test oracle)."""
    N = p["d"].shape[0]
    if p["kind"] == "q4_1":
        qs = p["qs"].reshape(N, -1, 16)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()                    # [N, NB, 32]
        w = p["d"][..., None] * q + p["m"][..., None]
    else:
        w = p["d"][..., None] * p["qs"].reshape(N, -1, 32).float()
    return F.linear(x, w.reshape(N, -1))


def quantize_q8_0(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] float weight (K a multiple of 32) -> Q8_0 blocks in our repacked layout: per block of
    32 weights a scale d = max|w| / 127 (fp32) and int8 q = round(w / d), so |w - d q| <= d / 2."""
    N, K = w.shape
    if K % 32:
        raise ValueError(f"Q8_0 needs an input width divisible by 32, got a [{N}, {K}] weight")
    b = w.detach().float().cpu().reshape(N, K // 32, 32)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
    qs = torch.round(b * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return {"kind": "q8_0", "qs": qs.reshape(N, K).contiguous(), "d": d.contiguous()}


def take_rows(p: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The packed blocks of output rows `rows` (e.g. the LM-head rows of a draft vocabulary)."""
    return {k: (v if k == "kind" else v.index_select(0, rows.cpu()).contiguous()) for k, v in p.items()}


def aggregate_packed(anchor_rows: torch.Tensor, types: torch.Tensor, blocks: list[dict[str, torch.Tensor]]
                     ) -> torch.Tensor:
    """ops.aggregate for CPU decode rows with packed per-type projections: the rows of each type t
    go through W_t alone (reading (t+1)·H² weights, not the zero-padded m·H x m·H block)."""
    R, _, H = anchor_rows.shape
    out = anchor_rows.new_empty(R, H)
    tl = types.tolist()
    for t in sorted(set(tl)):
        idx = torch.tensor([r for r, x in enumerate(tl) if x == t])
        x = anchor_rows.index_select(0, idx)[:, : t + 1].reshape(len(idx), (t + 1) * H)
        out.index_copy_(0, idx, packed_linear(x, blocks[t]))
    return out


def pack_draft(head: torch.nn.Module, target: torch.nn.Module) -> bool:
    """Decode a CPU fp32 draft head from packed weights (see the module docstring). Only when the
    target itself is packed (a GGUF model), so both sides of a cycle use the same kind of kernels.
    Returns whether the head was packed."""
    lm = getattr(target, "lm_head", None)
    if (not draft_enabled() or not _cpu_fp32(head) or lm is None or getattr(lm, "packed", None) is None):
        return False
    linears = [m for layer in head.layers for m in (layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up,
                                                    layer.mlp.w_down)] + list(head.proj) + [head.lm_head]
    if any(m.weight.shape[1] % 32 for m in linears):  # Q8_0 blocks hold 32 inputs: such a head decodes in fp32
        return False
    for layer in head.layers:
        for mod in (layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down):
            mod.packed = quantize_q8_0(mod.weight)
    if head.dcfg.frozen_lm_head:
        head.lm_head.packed = take_rows(lm.packed, head.draft_vocab)  # lossless: the target's own blocks
    else:
        head.lm_head.packed = quantize_q8_0(head.lm_head.weight)
    head.__dict__["_packed_proj"] = [quantize_q8_0(p.weight) for p in head.proj]
    enable_fused_ops(head)
    return True


def attach(model: torch.nn.Module, packed: dict[str, dict[str, torch.Tensor]]) -> int:
    """Give each named linear its packed blocks (model.py's linears use them for <= model.PACKED_MAX_ROWS rows).
    Returns the number of layers attached."""
    mods = dict(model.named_modules())
    count = 0
    for name, p in packed.items():
        mod = mods.get(name)
        if mod is None or not hasattr(mod, "packed") or mod.weight.is_meta:
            continue  # not a packable linear, or a layer this process does not hold (distributed stages)
        N, K = p["d"].shape[0], p["d"].shape[1] * 32
        if tuple(mod.weight.shape) != (N, K):
            raise ValueError(f"packed weights for {name} have shape {(N, K)}, the model's {tuple(mod.weight.shape)}")
        mod.packed = p
        count += 1
    return count


def _cpu_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's (real, non-meta) weights when they are on the CPU, else None."""
    p0 = next((p for p in model.parameters() if not p.is_meta), None)
    return p0.dtype if p0 is not None and p0.device.type == "cpu" else None


def _has_packable(gguf_path: Path) -> bool:
    """Whether the GGUF file stores any tensor in a kind the packed path reads (Q4_1 / Q8_0)."""
    return any(t.tensor_type.name in _KINDS for t in _open(gguf_path).tensors)


def _cpu_fp32(model: torch.nn.Module) -> bool:
    """The model's (real, non-meta) weights are fp32 on the CPU: what the C++ decode ops serve."""
    return _cpu_dtype(model) == torch.float32


def fused_enabled() -> bool:
    return _switch("SPD_FAST_FUSED")


def enable_fused_ops(model: torch.nn.Module) -> bool:
    """Route a CPU fp32 model's decode-row RMSNorms and few-query attention through single C++ ops
    (spd_fast/csrc/gguf_linear.cpp) instead of a dozen small ATen ops each. Off with SPD_FAST_FUSED=0."""
    from .model import Attention, RMSNorm

    on = fused_enabled() and _cpu_fp32(model)
    if on:
        from . import cpp_ops

        on = cpp_ops.available()
    for mod in model.modules():
        if isinstance(mod, (Attention, RMSNorm)):
            mod.fused = on
    return on


def maybe_attach(model: torch.nn.Module, model_dir: Path, warn_dtype: bool = True) -> int:
    """Attach the GGUF blocks of a converted GGUF directory, when everything allows it; else 0. A CPU model
    loaded in another dtype than fp32 gets none, and with `warn_dtype` a warning says so when the file has blocks
    to pack: its decode would be several times faster in fp32 (training, which does not decode, passes False)."""
    from .store import read_marker

    meta = read_marker(Path(model_dir)) if enabled() else None
    if meta is None:  # not a conversion, or its marker is damaged: the fp32 weights alone
        return 0
    source = Path(meta["source"])
    if not source.is_file():
        return 0
    if not _cpu_fp32(model):
        if warn_dtype and (dtype := _cpu_dtype(model)) is not None and _has_packable(source):
            name = str(dtype).removeprefix("torch.")
            warnings.warn(f"dtype='{name}' on CPU turns off the packed GGUF decode path (the file's Q4_1/Q8_0 blocks "
                          f"read by C++ ops, fp32 only), which decodes faster on CPU (about 2.4x bfloat16's speed on "
                          f"the default model); use dtype='float32' (the default)", stacklevel=2)
        return 0
    from . import cpp_ops

    if not cpp_ops.available():
        return 0
    from .store import gguf_hash

    if meta.get("source_hash") != gguf_hash(source):  # the blocks must be those the fp32 weights came from
        warnings.warn(f"{source} is not the file {model_dir} was converted from (it changed since, or the marker "
                      f"predates the check): its packed blocks are not used, so decode runs on the fp32 weights, "
                      f"more slowly; load the .gguf file itself to convert it again", stacklevel=2)
        return 0
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return attach(model, read_packed(source, cfg))

"""Read a GGUF file (llama.cpp's format) into a Hugging Face-style config dict and state dict.

Quantised tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantised with the `gguf` package at load.
llama.cpp's converter permutes the rows of the Q and K projections of `llama` models for its
interleaved RoPE; we undo that so the weights use the half-split RoPE of HF checkpoints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import SUPPORTED_ARCHITECTURES, SpdConfigError
from .loading import CheckpointError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated files fail inside numpy memmap / struct parsing
        if "GGMLQuantizationType" in str(e):  # a tensor type newer than this gguf package
            from importlib.metadata import version

            raise CheckpointError(
                f"{path} uses a tensor type that the installed gguf package ({version('gguf')}) does not know "
                f"({e}); upgrade it (pip install -U gguf) or re-quantise the file to a common type (F16, Q8_0, "
                f"Q4_K)") from None
        raise CheckpointError(
            f"cannot read GGUF file {path} ({type(e).__name__}: {e}); it is truncated or corrupt, copy it again") from e


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def tokenizer_flags(path: Path) -> dict[str, bool]:
    """Whether the GGUF's tokenizer adds a BOS / an EOS token to an encoded text (`tokenizer.ggml.add_bos_token`,
    `add_eos_token`), as {"add_bos_token": ..., "add_eos_token": ...} for the keys the file holds. transformers 4.x
    rebuilds a GGUF tokenizer as a Llama one that adds BOS whatever the file says; the conversion applies these."""
    reader = _open(path)
    return {name: bool(v) for name in ("add_bos_token", "add_eos_token")
            if (v := _field(reader, f"tokenizer.ggml.{name}")) is not None}


def gguf_config(reader) -> dict[str, Any]:
    parts = _field(reader, "split.count")
    if isinstance(parts, int) and parts > 1:  # one file of a model split by llama.cpp's gguf-split
        raise SpdConfigError(f"this GGUF file is part {(_field(reader, 'split.no') or 0) + 1} of {parts} of a split "
                             f"model; merge the parts into one file first (llama-gguf-split --merge FIRST-PART OUT.gguf) "
                             f"and pass that")
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpdConfigError(
            f"unsupported GGUF architecture {arch!r}; spd_fast supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        v = g(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckpointError(f"this GGUF file lacks a valid {arch}.{key} (a positive integer; it holds {v!r}); "
                                  f"re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    kv = g("attention.head_count_kv", heads)
    if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or heads % kv:
        raise CheckpointError(f"this GGUF file's {arch}.attention.head_count_kv ({kv!r}) must be a positive integer "
                              f"that divides {arch}.attention.head_count ({heads}); re-convert the model with "
                              f"llama.cpp's convert_hf_to_gguf.py")
    if (g("expert_count") or 0) > 0:
        raise SpdConfigError(f"this GGUF file is a mixture-of-experts {arch} model ({g('expert_count')} experts), "
                             f"which spd_fast does not run; use a dense model")
    # as llama.cpp reads them: no type means linear, and the older rope.scale_linear key stands in for the factor
    scaling = g("rope.scaling.type", "linear")
    factor = g("rope.scaling.factor") or g("rope.scale_linear")
    if scaling != "none" and factor not in (None, 0, 0.0, 1, 1.0):
        raise SpdConfigError(f"this GGUF file asks for {scaling} RoPE scaling (factor {factor}), which spd_fast "
                             f"does not implement, so its logits would be wrong; use a checkpoint without RoPE "
                             f"scaling (Llama-3 scaling is supported from a Hugging Face checkpoint directory)")
    head_dim = g("attention.key_length", hidden // heads if hidden and heads else None)
    rot = g("rope.dimension_count")
    if rot is not None and head_dim is not None and rot != head_dim:
        raise SpdConfigError(f"this GGUF file rotates {rot} of each head's {head_dim} dimensions (partial RoPE), "
                             f"which spd_fast does not implement; its logits would be wrong")
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size") or (len(tokens.data) if tokens is not None else None)
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": g("context_length", 8192),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _stop_ids(reader),
        "torch_dtype": "float32",
    }
    return cfg


def _stop_ids(reader) -> int | list[int] | None:
    """The GGUF's end-of-sequence id, plus its end-of-turn and end-of-message ids where it names others (a
    Llama-3 instruct GGUF: <|eot_id|>, <|eom_id|>): generation stops at any of them, as in llama.cpp."""
    ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp's permute: rows grouped (head, pair, half) -> (head, half, pair).
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Returns (HF-style config dict, HF-named fp32 state dict)."""
    from gguf.quants import dequantize

    path = Path(path)
    reader = _open(path)
    cfg = gguf_config(reader)
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        elif t.name.startswith("blk."):
            parts = t.name.split(".", 2)
            idx, rest = (parts[1], parts[2]) if len(parts) == 3 and parts[1].isdigit() else ("", t.name)
            if rest not in _LAYER_NAMES or not idx:  # dropping it would run another model (e.g. MLP or output biases)
                raise CheckpointError(f"{path} holds tensor {t.name}, which a supported {cfg['model_type']} layer "
                                      f"does not have, so spd_fast would run the model without it and give wrong "
                                      f"logits; use a checkpoint of a supported architecture (docs: README, Usage)")
            name = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
        elif t.name == "rope_freqs.weight":  # llama.cpp's Llama-3.1+ RoPE scaling factors
            raise CheckpointError(f"{path} stores RoPE frequency factors (Llama-3.1-style RoPE scaling), which spd_fast "
                                  f"does not rebuild from a GGUF, so its logits would be wrong; load the model's "
                                  f"Hugging Face checkpoint directory instead (config.json keeps rope_scaling)")
        else:
            raise CheckpointError(f"{path} holds tensor {t.name}, which a supported {cfg['model_type']} model does "
                                  f"not have, so spd_fast would run the model without it and give wrong logits; use "
                                  f"a checkpoint of a supported architecture")
        try:
            arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise CheckpointError(f"cannot dequantise {t.name} ({t.tensor_type.name}) from {path}: {e}; re-save the "
                                  f"file with F32, F16 or a common quantisation (Q8_0, Q4_K)") from e
        arr = arr.reshape(tuple(int(x) for x in reversed(t.shape)))
        # llama.cpp permutes the rows of Q and K, their biases included (read right here, though loading then
        # refuses a llama model with attention biases: config.from_hf_dict)
        if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                           "k_proj.bias")):
            n = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = _unpermute(arr, n)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # an unquantised tensor is a read-only view of the memory-mapped file
            arr = arr.copy()
        sd[name] = torch.from_numpy(arr)
    return cfg, sd

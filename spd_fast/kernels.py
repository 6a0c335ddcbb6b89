"""One entry point per fused op of the decode cycle, with a backend switch.

backend="torch"  the pure-PyTorch twins (spd_fast.ops, spd_fast.ops_explicit): the oracle
backend="triton" spd_fast.triton_kernels (CUDA tensors; CPU tensors only under TRITON_INTERPRET=1)
backend="cpp"    the C++ CPU ops of spd_fast/csrc/ (built on first use; the twins, with one warning, if not)
backend="auto"   triton for CUDA tensors, cpp for CPU tensors when built, torch otherwise

The sampling ops take their random numbers explicitly (`u`, see spd_fast.ops_explicit.uniforms),
so every backend is deterministic given its inputs. `set_backend` also routes
spd_fast.ops.aggregate and spd_fast.ops.verify_greedy, i.e. what the engine calls, through here.
"""
from __future__ import annotations

import importlib
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch

from . import cpp_ops, ops, ops_explicit
from .config import SpdConfigError
from .sampling import SamplingParams

BACKENDS = ("auto", "torch", "triton", "cpp")
calls: Counter[str] = Counter()  # "op/backend" -> calls; how tests see which backend really ran


def _validate(backend: str) -> None:
    if backend not in BACKENDS:
        raise SpdConfigError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def set_backend(backend: str) -> None:
    """The backend of spd_fast.ops.aggregate / verify_greedy for the whole process (default "torch")."""
    _validate(backend)
    ops.BACKEND = backend


def get_backend() -> str:
    return ops.BACKEND


@contextmanager
def use_backend(backend: str) -> Iterator[None]:
    prev = ops.BACKEND
    set_backend(backend)
    try:
        yield
    finally:
        ops.BACKEND = prev


def _triton_usable() -> bool:
    try:
        importlib.import_module("triton")
        return True
    except ImportError:
        return False


def resolve(backend: str, device: torch.device, has_cpp: bool = True) -> str:
    """The backend that will run an op on `device` (has_cpp: the op has a C++ version)."""
    _validate(backend)
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _triton_usable() else "torch"
        return "cpp" if device.type == "cpu" and has_cpp and cpp_ops.available() else "torch"
    if backend == "cpp":
        if device.type != "cpu":
            raise SpdConfigError(f"the C++ ops run on CPU tensors only, got {device}; use backend='triton' or 'auto'")
        return "cpp" if has_cpp and cpp_ops.available() else "torch"
    if backend == "triton":
        from .triton_kernels._common import interpreting

        if device.type != "cuda" and not interpreting():
            raise SpdConfigError(f"the Triton kernels need CUDA tensors, got {device} (set TRITON_INTERPRET=1 "
                                 "before importing spd_fast to run them on CPU, slowly; or use backend='cpp')")
    return backend


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton and C++ ops take


def _choose(backend: str, t: torch.Tensor, has_cpp: bool = True, strict: bool = True) -> str:
    """strict=False: the caller routes the dtypes its fused op lacks itself (decode_attention)."""
    b = resolve(backend, t.device, has_cpp)
    if b != "torch" and t.dtype not in _FUSED_DTYPES:
        if backend == "auto" or not strict:
            return "torch"  # "auto" picks what runs: fp64 or integer inputs take the twin
        # the fused ops would compute in fp32 and could answer otherwise than the twin (a near tie in fp64)
        raise SpdConfigError(f"the {b} ops take float32, bfloat16 or float16 tensors, got {t.dtype}; cast the input, "
                             "or use backend='torch' (the exact twins) or 'auto'")
    return b


def _pick(op: str, backend: str, t: torch.Tensor, has_cpp: bool = True) -> str:
    b = _choose(backend, t, has_cpp)
    calls[f"{op}/{b}"] += 1
    return b


def _tk(module: str):
    return importlib.import_module(f"spd_fast.triton_kernels.{module}")


def aggregate(anchor_rows: torch.Tensor, types: torch.Tensor, w_padded: torch.Tensor,
              backend: str = "auto") -> torch.Tensor:
    """anchor_rows [R, m, H], types [R] int64, w_padded [m, H, m*H] -> g [R, H] (see ops.aggregate)."""
    b = _pick("aggregate", backend, anchor_rows)
    if b == "triton":
        return _tk("aggregate").aggregate(anchor_rows.contiguous(), types.contiguous(), w_padded.contiguous())
    if b == "cpp":
        return cpp_ops.op("aggregate_cpp")(anchor_rows, types, w_padded)
    return ops.aggregate_torch(anchor_rows, types, w_padded)


def verify_greedy(target_logits: torch.Tensor, draft_token: torch.Tensor,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V] / [B, V], draft token [] / [B] -> (accept, argmax)."""
    b = _pick("verify_greedy", backend, target_logits)
    if b == "triton":
        return _tk("verify").verify_greedy(target_logits.contiguous(), draft_token.long().contiguous())
    if b == "cpp":
        return cpp_ops.op("verify_greedy_cpp")(target_logits, draft_token)
    return ops.verify_greedy_torch(target_logits, draft_token)


def _top_k(params: SamplingParams, logits: torch.Tensor) -> int:
    """top_k as the fused ops take it: one at or past the vocabulary keeps every token, as 0 does (a top_k past
    2**63 - 1 would not fit their int64 argument)."""
    return params.top_k if params.top_k < logits.shape[-1] else 0


def verify_sampling(target_logits: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor, params: SamplingParams,
                    u: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling with explicit uniforms u [..., 2] (see ops_explicit.verify_sampling_explicit)."""
    if params.greedy:
        raise SpdConfigError("verify_sampling needs temperature > 0; greedy decoding uses verify_greedy")
    b = _pick("verify_sampling", backend, target_logits)
    args = (params.temperature, _top_k(params, target_logits), params.top_p)
    if b == "triton":
        return _tk("verify").verify_sampling(target_logits.contiguous(), draft_token.long().contiguous(),
                                             q.contiguous(), *args, u.contiguous())
    if b == "cpp":
        return cpp_ops.op("verify_sampling_cpp")(target_logits, draft_token, q, *args, u)
    return ops_explicit.verify_sampling_explicit(target_logits, draft_token, q, *args, u)


def draft_sample(logits_d: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, params: SamplingParams,
                 u: torch.Tensor | None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits [V_d] / [B, V_d] -> (token id in the full vocabulary, q [.., V] or None when greedy).
    u [] / [B]: one uniform per row (unused when greedy)."""
    if params.greedy:
        idx = verify_greedy(logits_d, torch.zeros(logits_d.shape[:-1], dtype=torch.long, device=logits_d.device),
                            backend)[1]
        return ops.take(draft_vocab, idx), None
    if u is None:
        raise SpdConfigError("sampled drafting needs its uniform random numbers u (see ops_explicit.uniforms)")
    b = _pick("draft_sample", backend, logits_d)
    args = (vocab_size, params.temperature, _top_k(params, logits_d), params.top_p)
    if b == "triton":
        return _tk("draft_sample").draft_sample(logits_d.contiguous(), draft_vocab.long().contiguous(), *args,
                                                u.contiguous())
    if b == "cpp":
        return cpp_ops.op("draft_sample_cpp")(logits_d, draft_vocab, *args, u)
    return ops_explicit.draft_sample_explicit(logits_d, draft_vocab, *args, u)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual -> (RMSNorm(h) * weight, h). No C++ version: on CPU the twin is as fast."""
    b = _pick("add_rmsnorm", backend, x, has_cpp=False)
    if b == "triton":
        return _tk("rmsnorm").add_rmsnorm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)
    return ops_explicit.add_rmsnorm(x, residual, weight, eps)


# ---- decode hot path -----------------------------------------------------------------------------
def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x [N, heads, D] (heads contiguous) rotated in place by cos/sin [N, D] fp32; returns x."""
    b = _pick("rope_inplace", backend, x, has_cpp=False)
    if b == "triton":
        _tk("decode").rope_inplace(x, cos.contiguous(), sin.contiguous())
        return x
    return ops_explicit.rope_inplace(x, cos, sin)


def swiglu(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I]."""
    b = _pick("swiglu", backend, gate_up, has_cpp=False)
    if b == "triton":
        return _tk("decode").swiglu(gate_up.contiguous())
    return ops_explicit.swiglu(gate_up)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_bound: int, backend: str = "auto") -> torch.Tensor:
    """Few-query attention over a static KV cache (split-K on the GPU, one C++ op on the CPU)."""
    b = _choose(backend, q, strict=False)
    if q.dim() == 4:  # positions broadcast over the batch ([1, T], as the model passes them) and any int dtype
        positions = positions.long().expand(q.shape[0], q.shape[1])
    if b == "cpp" and not q.dtype == k_cache.dtype == v_cache.dtype == torch.float32:
        b = "torch"  # the C++ op is fp32 only
    calls[f"decode_attention/{b}"] += 1  # the backend that really runs it
    if b == "triton":
        return _tk("decode").decode_attention(q, k_cache, v_cache, positions, kv_bound)
    if b == "cpp":
        return cpp_ops.op("decode_attention")(q, k_cache, v_cache, positions, kv_bound)
    return ops_explicit.decode_attention(q, k_cache, v_cache, positions, kv_bound)

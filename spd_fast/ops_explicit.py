"""PyTorch twins of the sampling kernels with explicit random inputs, plus the fused-norm twin.

The Triton and C++ sampling ops take their random numbers as a tensor `u` of uniforms in [0, 1)
drawn by the caller (`uniforms`), so they are deterministic given their inputs and can be compared
with these twins token for token. Sampling uses the inverse CDF (one uniform per draw) instead of
the exponential race of `spd_fast.sampling.sample_from` (one random number per vocabulary entry).
Shapes: one row [V] or a batch of rows [B, V]; u is [..., 2] for verification (acceptance, residual
draw) and [...] for drafting.

Logit processing is the engine's own (`spd_fast.sampling.processed_probs`, which `probs_from_logits` calls): a
run of logits tied at the top-p boundary (common with bf16 logits) is kept or dropped together.
"""
from __future__ import annotations

import torch

from .ops import take
from .sampling import processed_probs


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """float32 uniforms in [0, 1) on `device`, for the explicit-random sampling ops."""
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[..., V] non-negative weights, u [...] -> the first index whose running sum exceeds u * total.

    Zero-weight indices are never returned (rounding can push u * total past the last partial sum;
    then the last positive index is the answer). Close to the weights' law, not exact: the fp32 running sum and
    u's 2^-24 grid never draw a token lighter than about 2^-24 of the sum before it (docs/KERNELS.md); the
    engine samples with `sampling.sample_from` instead.
    """
    cum = torch.cumsum(weights, dim=-1)
    target = (u * cum[..., -1])[..., None]
    idx = (cum <= target).sum(-1)
    V = weights.shape[-1]
    last = torch.where(weights > 0, torch.arange(V, device=weights.device), 0).amax(-1)
    return torch.minimum(idx, last)


def draft_sample_explicit(logits_d: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, temperature: float,
                          top_k: int, top_p: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [..., V_d] -> (token id in the full vocabulary [...], q [..., V] fp32).

    q is the processed draft distribution scattered into the full vocabulary (zero elsewhere).
    """
    q_d = processed_probs(logits_d, temperature, top_k, top_p)
    j = sample_inverse_cdf(q_d, u)
    q = torch.zeros(*q_d.shape[:-1], vocab_size, dtype=q_d.dtype, device=q_d.device)
    q.scatter_(-1, draft_vocab.expand_as(q_d), q_d)
    return take(draft_vocab, j), q


def verify_sampling_explicit(target_logits: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor,
                             temperature: float, top_k: int, top_p: float,
                             u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (spd_fast.ops.verify_sampling) with u[..., 0] for the ratio
    test and u[..., 1] for the residual draw. -> (accept [...], token to commit [...])."""
    p = processed_probs(target_logits, temperature, top_k, top_p)
    x = draft_token[..., None]
    px, qx = p.gather(-1, x)[..., 0], q.gather(-1, x)[..., 0]
    accept = u[..., 0] * qx < px
    resid = (p - q).clamp_min(0)
    has_mass = resid.sum(-1, keepdim=True) > 0
    y = sample_inverse_cdf(torch.where(has_mass, resid, p), u[..., 1])
    return accept, torch.where(accept, draft_token, y)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; -> (RMSNorm(h) with spd_fast.model.RMSNorm's op order, h). Rows [N, H]."""
    h = x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(h.dtype), h


# ---- decode hot path (twins of triton_kernels/decode.py) -----------------------------------------
def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in place by model.apply_rope (half-split, fp32 math); cos/sin [N, D]."""
    from .model import apply_rope

    x.copy_(apply_rope(x[None], cos[None], sin[None])[0])
    return x


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate first) -> silu(gate) * up, as model.MLP computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_bound: int) -> torch.Tensor:
    """q [B, T, nh, D] over caches [Bc, nkv, S, D]: a query at position p reads slots <= min(p, kv_bound - 1).
    The model's own few-query path, computed in fp32 (GQA by grouping query heads)."""
    from .model import attention_mask, few_query_attention

    B = q.shape[0]
    keys, values = k_cache[:B, :, :kv_bound].float(), v_cache[:B, :, :kv_bound].float()
    return few_query_attention(q.float(), keys, values, attention_mask(positions, kv_bound)).to(q.dtype)

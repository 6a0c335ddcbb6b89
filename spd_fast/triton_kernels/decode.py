"""The decode hot path: RoPE in place, SwiGLU, and split-K few-query attention over the static cache.

All three work on the few rows of one decode step (one token per stage; up to n rows in SPD) and
keep spd_fast.model's numerics: fp32 math on loads, one rounding to the storage dtype at the end.
Twins (same signatures, the CPU path and the oracle): spd_fast.ops_explicit.{rope_inplace, swiglu,
decode_attention}.

Shapes
- rope_inplace: x [N, heads, D] (the q and k heads of a fused qkv row may be one view with row
  stride > heads*D), cos/sin [N, D] fp32 (rows of the model's tables at each row's position).
  Half-split rotation: out[:d] = x[:d]*cos[:d] - x[d:]*sin[:d], out[d:] = x[d:]*cos[d:] + x[:d]*sin[d:].
- swiglu: gate_up [N, 2I] (gate first, as model.MLP's fused w_gate_up) -> [N, I] = silu(gate) * up.
- decode_attention: q [B, T, nh, D], k/v cache [Bc, nkv, S, D] contiguous (slot == position),
  positions [B, T] int64, kv_bound <= S: a query at position p reads slots 0..min(p, kv_bound-1).
  Split-K ("flash-decoding"): grid (B*T*nh, splits); each program reduces a chunk of slots to a
  running max, normaliser and weighted V sum; a second kernel merges the chunks. GQA: query head
  h reads KV head h // (nh // nkv); K/V are never repeated.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_device, on_input_device


# ---- RoPE ------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(p_x, p_cos, p_sin, row_stride, HEADS, D_HALF, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    o = tl.arange(0, BLOCK_D)
    m = o < D_HALF
    base = p_x + row * row_stride + head * 2 * D_HALF
    x1 = tl.load(base + o, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + D_HALF + o, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(p_cos + row * 2 * D_HALF + o, mask=m, other=0.0)
    c2 = tl.load(p_cos + row * 2 * D_HALF + D_HALF + o, mask=m, other=0.0)
    s1 = tl.load(p_sin + row * 2 * D_HALF + o, mask=m, other=0.0)
    s2 = tl.load(p_sin + row * 2 * D_HALF + D_HALF + o, mask=m, other=0.0)
    tl.store(base + o, (x1 * c1 - x2 * s1).to(p_x.dtype.element_ty), mask=m)
    tl.store(base + D_HALF + o, (x2 * c2 + x1 * s2).to(p_x.dtype.element_ty), mask=m)


@on_input_device
def launch_rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    check(x.dim() == 3, f"x must be [N, heads, D], got shape {tuple(x.shape)}")
    N, heads, D = x.shape
    check(D % 2 == 0, f"head dim must be even, got {D}")
    check(x.dtype in FLOAT_DTYPES, f"x must be a float tensor, got {x.dtype}")
    check(x.stride(2) == 1 and x.stride(1) == D, "x must have contiguous heads (stride(1) == D, stride(2) == 1)")
    check(tuple(cos.shape) == (N, D) and tuple(sin.shape) == (N, D), f"cos/sin must be ({N}, {D}), got "
          f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    check(cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous(),
          "cos/sin must be contiguous fp32")
    check_device(x, cos, sin)
    _rope_kernel[(N, heads)](x, cos, sin, x.stride(0), heads, D // 2, BLOCK_D=triton.next_power_of_2(D // 2))
    return x


@torch.library.custom_op("spd_fast::rope_inplace_triton", mutates_args=("x",))
def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    launch_rope_inplace(x, cos, sin)


@rope_inplace.register_fake
def _(x, cos, sin):
    return None


# ---- SwiGLU ----------------------------------------------------------------------------------------
@triton.jit
def _swiglu_kernel(p_gu, p_out, INTER, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < INTER
    g = tl.load(p_gu + row * 2 * INTER + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(p_gu + row * 2 * INTER + INTER + o, mask=m, other=0.0).to(tl.float32)
    # silu rounded to the storage dtype first, as F.silu(gate) * up does in that dtype
    s = (g / (1.0 + tl.exp(-g))).to(p_out.dtype.element_ty).to(tl.float32)
    tl.store(p_out + row * INTER + o, (s * u).to(p_out.dtype.element_ty), mask=m)


@on_input_device
def launch_swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    check(gate_up.dtype in FLOAT_DTYPES and gate_up.is_contiguous(), "gate_up must be a contiguous float tensor")
    check_device(gate_up)
    N, I2 = gate_up.shape
    inter = I2 // 2
    if out is None:
        out = gate_up.new_empty(N, inter)
    check(tuple(out.shape) == (N, inter) and out.dtype == gate_up.dtype and out.is_contiguous(),
          f"out must be a contiguous ({N}, {inter}) tensor like gate_up")
    if out.numel() == 0:  # no row or no width: nothing to launch
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _swiglu_kernel[(N, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


@torch.library.custom_op("spd_fast::swiglu_triton", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return launch_swiglu(gate_up)


@swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


# ---- split-K few-query attention -------------------------------------------------------------------
@triton.jit
def _attn_split_kernel(p_q, p_k, p_v, p_pos, p_m, p_l, p_acc, T, NH, NKV, S, D, kv_bound, chunk, scale,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)          # (b, t, h) flattened
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    h = i % NH
    bt = i // NH
    b = bt // T
    kvh = h // (NH // NKV)
    last = tl.minimum(tl.load(p_pos + bt), kv_bound - 1)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    q = tl.load(p_q + i * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    kbase = p_k + (b * NKV + kvh) * S * D
    vbase = p_v + (b * NKV + kvh) * S * D
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = split * chunk
    for s0 in range(0, chunk, BLOCK_S):
        o_s = start + s0 + tl.arange(0, BLOCK_S)
        m_s = (o_s <= last) & (o_s < start + chunk)
        k = tl.load(kbase + o_s[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        sc = tl.where(m_s, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(sc, axis=0))
        # while no valid slot was seen m stays -inf: subtract 0 instead (no -inf - -inf = nan);
        # acc and l are still 0 then, so the alpha of that step does not matter
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_sub)
        pr = tl.exp(sc - m_sub)
        v = tl.load(vbase + o_s[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(pr[:, None] * v, axis=0)
        l_run = l_run * alpha + tl.sum(pr, axis=0)
        m_run = m_new
    out = i * n_split + split
    tl.store(p_m + out, m_run)
    tl.store(p_l + out, l_run)
    tl.store(p_acc + out * D + o_d, acc, mask=m_d)


@triton.jit
def _attn_merge_kernel(p_m, p_l, p_acc, p_o, D, N_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, N_SPLIT)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m = tl.load(p_m + i * N_SPLIT + o_s)
    l = tl.load(p_l + i * N_SPLIT + o_s)
    mx = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
    acc = tl.load(p_acc + (i * N_SPLIT + o_s)[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0.0)
    num = tl.sum(w[:, None] * acc, axis=0)
    den = tl.sum(w * l, axis=0)
    tl.store(p_o + i * D + o_d, (num / den).to(p_o.dtype.element_ty), mask=m_d)


@on_input_device
def launch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                            kv_bound: int, splits: int | None = None) -> torch.Tensor:
    check(q.dim() == 4, f"q must be [B, T, nh, D], got shape {tuple(q.shape)}")
    B, T, nh, D = q.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k/v caches must be [Bc, nkv, S, D], one shape")
    Bc, nkv, S, Dk = k_cache.shape
    check(Dk == D and Bc >= B and nh % nkv == 0, f"q {tuple(q.shape)} does not fit the caches {tuple(k_cache.shape)}")
    check(1 <= kv_bound <= S, f"kv_bound must be in 1..{S}, got {kv_bound}")
    check(tuple(positions.shape) == (B, T), f"positions must be [B, T] = [{B}, {T}], got {list(positions.shape)}")
    check(positions.dtype == torch.int64, f"positions must be int64, got {positions.dtype}")
    check(q.dtype in FLOAT_DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
          "q and the caches must share one float dtype")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "the caches must be contiguous")
    check_device(q, k_cache, v_cache, positions)
    q = q.contiguous()
    positions = positions.contiguous()
    if splits is None:  # enough programs to fill a GPU at batch 1, a chunk of >= 64 slots each
        splits = max(1, min(64, triton.cdiv(kv_bound, 64)))
    splits = triton.next_power_of_2(splits)
    chunk = triton.cdiv(kv_bound, splits)
    rows = B * T * nh
    m = q.new_empty(rows, splits, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = q.new_empty(rows, splits, D, dtype=torch.float32)
    block_d = triton.next_power_of_2(D)
    _attn_split_kernel[(rows, splits)](q, k_cache, v_cache, positions, m, l, acc, T, nh, nkv, S, D, kv_bound, chunk,
                                       D ** -0.5, BLOCK_S=min(64, triton.next_power_of_2(chunk)), BLOCK_D=block_d)
    o = torch.empty_like(q)
    _attn_merge_kernel[(rows,)](m, l, acc, o, D, N_SPLIT=splits, BLOCK_D=block_d)
    return o


@torch.library.custom_op("spd_fast::decode_attention_triton", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_bound: int) -> torch.Tensor:
    return launch_decode_attention(q, k_cache, v_cache, positions, kv_bound)


@decode_attention.register_fake
def _(q, k_cache, v_cache, positions, kv_bound):
    return torch.empty_like(q)

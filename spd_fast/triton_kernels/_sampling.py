"""Device functions shared by the sampling kernels: the logit processing of the twin
`spd_fast.ops_explicit.processed_probs` (temperature, top-k, top-p) expressed as thresholds.

A program owns BLOCK_B rows and walks the vocabulary in [BLOCK_B, BLOCK_V] tiles. Per-row state is a
[BLOCK_B, 1] column. A row's processed distribution is p_i = exp(x_i - mx) / z where
key(x_i) >= thr, else 0, with x = logits / temperature and key() an int32 ordered like the fp32
value. top-k and top-p become "keep every x at or above a threshold", found by a 16-ary search over
the int32 key space (8 passes over the row each): no sort, and p can be recomputed tile by tile.
Ties at the top-p boundary are kept or dropped together, as in the twin.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import interpreting


@triton.jit
def order_key(x):
    """fp32 -> int32 with the same order: negatives get their magnitude bits flipped. -0.0 is read as +0.0 first:
    the two compare equal in the twin, so a tie between them at a top-k / top-p cut must not be split."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def load_scaled(p_rows, o_v, V, temperature):
    # load, then fp32 right away (the interpreter's bf16 arithmetic is wrong); a rounded division
    # like the twin's `logits.float() / temperature`, not the GPU's approximate one
    b_x = tl.load(p_rows + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(b_x, temperature)


@triton.jit
def select_threshold(p_rows, V, temperature, mx, z, floor, target, WEIGHTED: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row, the largest key t with F(t) >= target, F(t) = sum of w_i over i with
    key_i >= max(t, floor); w_i = exp(x_i - mx) / z if WEIGHTED (top-p) else 1 (top-k). F falls as
    t grows, so each pass evaluates 16 candidates lo + j * step and keeps the last one that still
    reaches the target."""
    o_v = tl.arange(0, BLOCK_V)[None, :]
    o_c = tl.arange(0, 16)[None, None, :].to(tl.int64)
    lo = tl.full([BLOCK_B, 1], -0x7FFFFFFF, tl.int64) - 1
    for shift in tl.static_range(28, -1, -4):
        # int64 arithmetic (15 * 2^28 alone overflows int32), int32 values: the top candidate is < 2^31
        b_cand = (lo[:, :, None] + o_c * (1 << shift)).to(tl.int32)
        b_acc = tl.zeros([BLOCK_B, 16], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            b_x = load_scaled(p_rows, v0 + o_v, V, temperature)
            b_key = order_key(b_x)
            m_keep = (v0 + o_v < V) & (b_key >= floor)
            if WEIGHTED:
                b_w = tl.where(m_keep, tl.exp(b_x - mx) / z, 0.0)
            else:
                b_w = m_keep.to(tl.float32)
            b_acc += tl.sum(tl.where(b_key[:, :, None] >= b_cand, b_w[:, :, None], 0.0), axis=1)
        j = tl.maximum(tl.sum((b_acc >= target).to(tl.int32), axis=1, keep_dims=True) - 1, 0)
        lo = lo + j.to(tl.int64) * (1 << shift)
    return lo.to(tl.int32)  # a key of the row, so in int32 range


@triton.jit
def masked_sum_exp(p_rows, V, temperature, mx, thr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    o_v = tl.arange(0, BLOCK_V)[None, :]
    b_z = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        b_x = load_scaled(p_rows, v0 + o_v, V, temperature)
        b_z += tl.where((v0 + o_v < V) & (order_key(b_x) >= thr), tl.exp(b_x - mx), 0.0)
    return tl.sum(b_z, axis=1, keep_dims=True)


@triton.jit
def row_stats(p_rows, V, temperature, top_k, top_p, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
              BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """-> (mx, thr, z), each [BLOCK_B, 1]: see `probs_block`. top-k acts on the scaled logits, top-p
    on the softmax of the top-k survivors. top_k comes as an fp32 scalar (integer arguments equal to
    1 would be specialised into constants)."""
    o_v = tl.arange(0, BLOCK_V)[None, :]
    b_mx = tl.full([BLOCK_B, BLOCK_V], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        b_mx = tl.maximum(b_mx, load_scaled(p_rows, v0 + o_v, V, temperature))
    mx = tl.max(b_mx, axis=1, keep_dims=True)
    thr = tl.full([BLOCK_B, 1], -0x7FFFFFFF, tl.int32) - 1
    if TOP_K:
        thr = select_threshold(p_rows, V, temperature, mx, 1.0, thr, top_k, False, BLOCK_B, BLOCK_V)
    z = masked_sum_exp(p_rows, V, temperature, mx, thr, BLOCK_B, BLOCK_V)
    if TOP_P:
        thr = tl.maximum(thr, select_threshold(p_rows, V, temperature, mx, z, thr, top_p, True, BLOCK_B, BLOCK_V))
        z = masked_sum_exp(p_rows, V, temperature, mx, thr, BLOCK_B, BLOCK_V)
    return mx, thr, z


@triton.jit
def probs_block(p_rows, o_v, V, temperature, mx, thr, z):
    """Processed probabilities at column offsets o_v (0 outside the row and below the threshold)."""
    b_x = load_scaled(p_rows, o_v, V, temperature)
    return tl.where((o_v < V) & (order_key(b_x) >= thr), tl.exp(b_x - mx) / z, 0.0)


@triton.jit
def cdf_step(b_w, o_v, V, target, run, count, last):
    """One tile of an inverse-CDF draw per row over weights b_w at column offsets o_v. The drawn
    index is min(count, last) after the last tile: count = entries whose running sum is <= target,
    so a zero weight is never drawn, except when rounding pushes the target past the total (then
    `last`, the last positive index, is)."""
    b_c = run + tl.cumsum(b_w, axis=1)
    count += tl.sum(((b_c <= target) & (o_v < V)).to(tl.int32), axis=1, keep_dims=True)
    last = tl.maximum(last, tl.max(tl.where(b_w > 0, o_v, -1), axis=1, keep_dims=True))
    return run + tl.sum(b_w, axis=1, keep_dims=True), count, last


def launch_blocks(B: int, V: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_V): tiles of at most 1024 elements on a GPU (the top-k/top-p search holds a
    16x larger temporary in registers); 16384 when interpreted, where wide tiles mean fewer numpy
    calls. Small vocabularies pack several rows into one program."""
    tile = 16384 if interpreting() else 1024
    block_v = min(tile, triton.next_power_of_2(max(V, 16)))
    return min(triton.next_power_of_2(B), max(1, tile // block_v)), block_v

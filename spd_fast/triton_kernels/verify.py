"""Verification of one draft token per row, greedy and sampling (SPD_DESIGN.md section 4).

One program per row loops over the vocabulary in blocks, so any vocabulary size (Qwen's ~152-256k)
needs no second pass over partial results and the outputs can land straight in device state.
Shapes: target_logits [V] or [B, V] (fp32 / bf16 / fp16, contiguous); draft_token [] or [B] int64;
q like target_logits but fp32; u [2] or [B, 2] fp32 uniforms (ratio test, residual draw).
Outputs: accept (bool) and token (int64), shaped like draft_token.
Twins: spd_fast.ops.verify_greedy and spd_fast.ops_explicit.verify_sampling_explicit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_device, check_per_row, on_input_device, rows, vocab_warps
from ._sampling import cdf_step, launch_blocks, probs_block, row_stats


@triton.jit
def _verify_greedy_kernel(p_logits, p_draft, p_accept, p_token, V, s_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p_row = p_logits + row * s_row
    o_v = tl.arange(0, BLOCK_V)
    b_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    b_idx = o_v
    for v0 in range(0, V, BLOCK_V):
        b_x = tl.load(p_row + v0 + o_v, mask=v0 + o_v < V, other=float("-inf")).to(tl.float32)
        m_up = b_x > b_max  # strict: each lane keeps its first maximum
        b_max = tl.where(m_up, b_x, b_max)
        b_idx = tl.where(m_up, v0 + o_v, b_idx)
    mx = tl.max(b_max, axis=0)
    # the smallest index holding the maximum: torch.argmax's tie rule
    tok = tl.min(tl.where(b_max == mx, b_idx, V), axis=0).to(tl.int64)
    tl.store(p_token + row, tok)
    tl.store(p_accept + row, tok == tl.load(p_draft + row))


@triton.jit
def _verify_sampling_kernel(p_logits, p_q, p_draft, p_u, p_accept, p_token, B, V, s_row, s_q,
                            temperature, top_k, top_p, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                            BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    # rows past B redo row B-1 (no row masks in the helpers); only their stores are dropped
    o_r = tl.minimum(o_b, B - 1).to(tl.int64)[:, None]
    p_rows = p_logits + o_r * s_row
    p_qrows = p_q + o_r * s_q
    mx, thr, z = row_stats(p_rows, V, temperature, top_k, top_p, TOP_K, TOP_P, BLOCK_B, BLOCK_V)
    x_tok = tl.load(p_draft + o_r)
    # a draft id outside the vocabulary (the twin raises; a device check would sync) is rejected, never read at
    x_ok = (x_tok >= 0) & (x_tok < V)
    x_at = tl.where(x_ok, x_tok, 0)
    px = probs_block(p_rows, x_at, V, temperature, mx, thr, z)
    qx = tl.load(p_qrows + x_at)
    # u * q(x) < p(x)  <=>  u < p(x) / q(x), without dividing by a zero q(x)
    accept = x_ok & (tl.load(p_u + 2 * o_r) * qx < px)
    o_v = tl.arange(0, BLOCK_V)[None, :]
    b_mass = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
    b_tot = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
    b_nan = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        b_p = probs_block(p_rows, v0 + o_v, V, temperature, mx, thr, z)
        b_q = tl.load(p_qrows + v0 + o_v, mask=v0 + o_v < V, other=0.0)
        b_d = b_p - b_q
        b_mass += tl.maximum(b_d, 0.0)  # tl.maximum drops a NaN, so NaNs are counted apart
        b_nan += (b_d != b_d).to(tl.int32)
        b_tot += b_p
    mass = tl.sum(b_mass, axis=1, keep_dims=True)
    # the residual max(0, p - q) has no mass, or a NaN (a draft head's overflowed q) makes its sum NaN as in the
    # twin: draw from p itself
    use_p = (mass <= 0.0) | (tl.sum(b_nan, axis=1, keep_dims=True) > 0)
    target = tl.load(p_u + 2 * o_r + 1) * tl.where(use_p, tl.sum(b_tot, axis=1, keep_dims=True), mass)
    run = tl.zeros([BLOCK_B, 1], tl.float32)
    count = tl.zeros([BLOCK_B, 1], tl.int32)
    last = tl.full([BLOCK_B, 1], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        b_p = probs_block(p_rows, v0 + o_v, V, temperature, mx, thr, z)
        b_q = tl.load(p_qrows + v0 + o_v, mask=v0 + o_v < V, other=0.0)
        b_w = tl.where(use_p, b_p, tl.maximum(b_p - b_q, 0.0))
        run, count, last = cdf_step(b_w, v0 + o_v, V, target, run, count, last)
    y = tl.maximum(tl.minimum(count, last), 0).to(tl.int64)  # no positive weight (NaN logits): token 0, not -1
    m_b = o_b[:, None] < B
    tl.store(p_accept + o_r, accept, mask=m_b)
    tl.store(p_token + o_r, tl.where(accept, x_tok, y), mask=m_b)


def _outputs(batch_shape: torch.Size, device: torch.device,
             out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return (torch.empty(batch_shape, dtype=torch.bool, device=device),
                torch.empty(batch_shape, dtype=torch.long, device=device))
    check_per_row(out[0], batch_shape, torch.bool, "out[0] (accept)")
    check_per_row(out[1], batch_shape, torch.long, "out[1] (token)")
    return out


@on_input_device
def launch_verify_greedy(target_logits: torch.Tensor, draft_token: torch.Tensor,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accept = draft_token == argmax, token = argmax). NaN logits are ignored (torch.argmax
    would return a NaN's index)."""
    logits = rows(target_logits, "target_logits")
    batch = target_logits.shape[:-1]
    check_per_row(draft_token, batch, torch.long, "draft_token")
    check_device(target_logits, draft_token)
    accept, token = _outputs(batch, target_logits.device, out)
    B, V = logits.shape
    if B == 0:
        return accept, token
    block = min(4096, triton.next_power_of_2(max(V, 16)))
    _verify_greedy_kernel[(B,)](logits, draft_token, accept, token, V, logits.stride(0), BLOCK_V=block,
                                num_warps=vocab_warps(block))
    return accept, token


@on_input_device
def launch_verify_sampling(target_logits: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor,
                           temperature: float, top_k: int, top_p: float, u: torch.Tensor,
                           out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling: accept with probability min(1, p(x)/q(x)), else draw from
    normalize(max(0, p - q)), or from p when that residual is empty. p is the target's distribution
    after temperature / top-k / top-p (0 disables top-k, 1 disables top-p)."""
    logits = rows(target_logits, "target_logits")
    batch = target_logits.shape[:-1]
    check_per_row(draft_token, batch, torch.long, "draft_token")
    check_per_row(q, batch, torch.float32, "q", (target_logits.shape[-1],))
    check_per_row(u, batch, torch.float32, "u", (2,))
    check(temperature > 0, f"temperature must be > 0 for sampling verification, got {temperature}")
    check(top_k >= 0 and 0 < top_p <= 1, f"need top_k >= 0 and 0 < top_p <= 1, got {top_k}, {top_p}")
    check_device(target_logits, draft_token, q, u)
    accept, token = _outputs(batch, target_logits.device, out)
    B, V = logits.shape
    if B == 0:
        return accept, token
    block_b, block_v = launch_blocks(B, V)
    _verify_sampling_kernel[(triton.cdiv(B, block_b),)](
        logits, q, draft_token, u, accept, token, B, V, logits.stride(0), V, float(temperature), float(top_k),
        float(top_p), TOP_K=0 < top_k < V, TOP_P=top_p < 1.0, BLOCK_B=block_b, BLOCK_V=block_v, num_warps=8)
    return accept, token


@torch.library.custom_op("spd_fast::verify_greedy_triton", mutates_args=())
def verify_greedy(target_logits: torch.Tensor, draft_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_verify_greedy(target_logits, draft_token)


@torch.library.custom_op("spd_fast::verify_sampling_triton", mutates_args=())
def verify_sampling(target_logits: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor, temperature: float,
                    top_k: int, top_p: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_verify_sampling(target_logits, draft_token, q, temperature, top_k, top_p, u)


def _fake_outputs(target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = target_logits.shape[:-1]
    return target_logits.new_empty(shape, dtype=torch.bool), target_logits.new_empty(shape, dtype=torch.long)


@verify_greedy.register_fake
def _(target_logits, draft_token):
    return _fake_outputs(target_logits)


@verify_sampling.register_fake
def _(target_logits, draft_token, q, temperature, top_k, top_p, u):
    return _fake_outputs(target_logits)

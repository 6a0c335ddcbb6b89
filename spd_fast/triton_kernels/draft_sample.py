"""Draft sampling: PDM logits over the draft vocabulary -> q over the full vocabulary + a draft token.

One program per row: processes the draft logits exactly as the target's will be at verification
(temperature / top-k / top-p), writes q into a zeroed full-vocabulary row (the stored distribution
verification needs), and draws the draft by inverse CDF with the caller's uniform u.
Shapes: logits_d [V_d] or [B, V_d] (fp32 / bf16 / fp16, contiguous); draft_vocab [V_d] int64 (draft
index -> token id, distinct ids); u [] or [B] fp32. Outputs: token [] / [B] int64, q [V] / [B, V] fp32.
Twin: spd_fast.ops_explicit.draft_sample_explicit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_device, check_per_row, on_input_device, rows
from ._sampling import cdf_step, launch_blocks, probs_block, row_stats


@triton.jit
def _draft_sample_kernel(p_logits, p_vocab, p_u, p_q, p_token, B, Vd, V, s_row, s_q, temperature, top_k, top_p,
                         TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    # rows past B redo row B-1 (no row masks in the helpers); only their stores are dropped
    o_r = tl.minimum(o_b, B - 1).to(tl.int64)[:, None]
    m_b = o_b[:, None] < B
    p_rows = p_logits + o_r * s_row
    p_qrows = p_q + o_r * s_q
    o_v = tl.arange(0, BLOCK_V)[None, :]
    for v0 in range(0, V, BLOCK_V):
        tl.store(p_qrows + v0 + o_v, tl.zeros([BLOCK_B, BLOCK_V], tl.float32), mask=(v0 + o_v < V) & m_b)
    mx, thr, z = row_stats(p_rows, Vd, temperature, top_k, top_p, TOP_K, TOP_P, BLOCK_B, BLOCK_V)
    # the zeros above and the scatter below touch the same addresses from different threads
    tl.debug_barrier()
    b_tot = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
    for v0 in range(0, Vd, BLOCK_V):
        b_p = probs_block(p_rows, v0 + o_v, Vd, temperature, mx, thr, z)
        b_id = tl.load(p_vocab + v0 + o_v, mask=v0 + o_v < Vd, other=0)
        # ids outside the vocabulary (the twin raises; a device check would sync) are not written to
        tl.store(p_qrows + b_id, b_p, mask=(v0 + o_v < Vd) & m_b & (b_id >= 0) & (b_id < V))
        b_tot += b_p
    target = tl.load(p_u + o_r) * tl.sum(b_tot, axis=1, keep_dims=True)
    run = tl.zeros([BLOCK_B, 1], tl.float32)
    count = tl.zeros([BLOCK_B, 1], tl.int32)
    last = tl.full([BLOCK_B, 1], -1, tl.int32)
    for v0 in range(0, Vd, BLOCK_V):
        b_p = probs_block(p_rows, v0 + o_v, Vd, temperature, mx, thr, z)
        run, count, last = cdf_step(b_p, v0 + o_v, Vd, target, run, count, last)
    # a row with no positive probability (NaN logits) has last = -1: index 0, not the word before p_vocab
    tl.store(p_token + o_r, tl.load(p_vocab + tl.maximum(tl.minimum(count, last), 0)), mask=m_b)


@on_input_device
def launch_draft_sample(logits_d: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, temperature: float,
                        top_k: int, top_p: float, u: torch.Tensor,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (draft token id in the full vocabulary, q). Greedy drafting is an argmax: see
    spd_fast.kernels.draft_sample."""
    logits = rows(logits_d, "logits_d")
    batch = logits_d.shape[:-1]
    Vd = logits.shape[1]
    check_per_row(draft_vocab, torch.Size([]), torch.long, "draft_vocab", (Vd,))
    check_per_row(u, batch, torch.float32, "u")
    check(Vd <= vocab_size, f"the draft vocabulary ({Vd}) cannot be larger than the vocabulary ({vocab_size})")
    check(temperature > 0, f"temperature must be > 0 for sampled drafting, got {temperature}")
    check(top_k >= 0 and 0 < top_p <= 1, f"need top_k >= 0 and 0 < top_p <= 1, got {top_k}, {top_p}")
    check_device(logits_d, draft_vocab, u)
    if out is None:
        token = torch.empty(batch, dtype=torch.long, device=logits_d.device)
        q = torch.empty(*batch, vocab_size, dtype=torch.float32, device=logits_d.device)
    else:
        token, q = out
        check_per_row(token, batch, torch.long, "out[0] (token)")
        check_per_row(q, batch, torch.float32, "out[1] (q)", (vocab_size,))
    B = logits.shape[0]
    if B == 0:
        return token, q
    block_b, block_v = launch_blocks(B, Vd)
    _draft_sample_kernel[(triton.cdiv(B, block_b),)](
        logits, draft_vocab, u, q, token, B, Vd, vocab_size, logits.stride(0), vocab_size, float(temperature),
        float(top_k), float(top_p), TOP_K=0 < top_k < Vd, TOP_P=top_p < 1.0, BLOCK_B=block_b, BLOCK_V=block_v,
        num_warps=8)
    return token, q


@torch.library.custom_op("spd_fast::draft_sample_triton", mutates_args=())
def draft_sample(logits_d: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, temperature: float,
                 top_k: int, top_p: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_draft_sample(logits_d, draft_vocab, vocab_size, temperature, top_k, top_p, u)


@draft_sample.register_fake
def _(logits_d, draft_vocab, vocab_size, temperature, top_k, top_p, u):
    batch = logits_d.shape[:-1]
    return (logits_d.new_empty(batch, dtype=torch.long),
            logits_d.new_empty(*batch, vocab_size, dtype=torch.float32))

"""Multi-depth feature aggregation (SPD_DESIGN.md 5.1) as one grouped GEMM launch.

Row r of type t computes g_r = W_t · concat(h^{b_0}, ..., h^{b_t}) = w_padded[t, :, :(t+1)H] @ x_r[:(t+1)H].
A program owns BLOCK_R rows and BLOCK_N output features and walks the types present in its rows, so
rows sharing a type share each weight tile, only the (t+1)H real columns of W_t are read (never the
zero padding), and anchors above a row's type are never loaded (stale ones may hold anything).
Shapes: anchor_rows [R, m, H], types [R] int64 in [0, m), w_padded [m, H, m*H] (DraftHead.padded_proj),
all contiguous; fp32 / bf16 / fp16 with fp32 accumulation. Output [R, H] in the rows' dtype.
Twin: spd_fast.ops.aggregate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_device, interpreting, on_input_device


@triton.jit
def _aggregate_kernel(p_x, p_t, p_w, p_o, R, H, M, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    i_n, i_r = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_r, m_n = o_r < R, o_n < H
    b_t = tl.load(p_t + o_r, mask=m_r, other=-1)
    K = M * H  # row length of both the flattened anchors and the padded weight
    b_acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for t in range(0, M):
        m_rt = b_t == t
        if tl.sum(m_rt.to(tl.int32), axis=0) > 0:
            p_wt = p_w + (t * H).to(tl.int64) * K
            for k0 in range(0, (t + 1) * H, BLOCK_K):
                o_k = k0 + tl.arange(0, BLOCK_K)
                m_k = o_k < (t + 1) * H
                # rows of other types load zeros, so one dot serves the whole row block
                b_x = tl.load(p_x + o_r[:, None].to(tl.int64) * K + o_k[None, :],
                              mask=m_rt[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                b_w = tl.load(p_wt + o_n[None, :].to(tl.int64) * K + o_k[:, None],
                              mask=m_n[None, :] & m_k[:, None], other=0.0).to(tl.float32)
                # "ieee": fp32 operands must not be rounded to tf32 on tensor cores
                b_acc += tl.dot(b_x, b_w, input_precision="ieee")
    tl.store(p_o + o_r[:, None].to(tl.int64) * H + o_n[None, :], b_acc.to(p_o.dtype.element_ty),
             mask=m_r[:, None] & m_n[None, :])


@on_input_device
def launch_aggregate(anchor_rows: torch.Tensor, types: torch.Tensor, w_padded: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    check(anchor_rows.dim() == 3, f"anchor_rows must be [R, m, H], got shape {tuple(anchor_rows.shape)}")
    R, m, H = anchor_rows.shape
    check(tuple(types.shape) == (R,) and types.dtype in (torch.int64, torch.int32),
          f"types must be int64 or int32 of shape ({R},), got {types.dtype} {tuple(types.shape)}")
    check(tuple(w_padded.shape) == (m, H, m * H),
          f"w_padded must be [m, H, m*H] = {(m, H, m * H)}, got {tuple(w_padded.shape)}")
    check(anchor_rows.dtype in FLOAT_DTYPES and w_padded.dtype in FLOAT_DTYPES,
          f"anchor_rows and w_padded must be float32, bfloat16 or float16, got {anchor_rows.dtype}, {w_padded.dtype}")
    check(anchor_rows.is_contiguous() and types.is_contiguous() and w_padded.is_contiguous(),
          "anchor_rows, types and w_padded must be contiguous")
    check_device(anchor_rows, types, w_padded)
    if out is None:
        out = torch.empty(R, H, dtype=anchor_rows.dtype, device=anchor_rows.device)
    check(tuple(out.shape) == (R, H) and out.dtype == anchor_rows.dtype and out.is_contiguous(),
          f"out must be a contiguous {anchor_rows.dtype} tensor of shape {(R, H)}")
    if R == 0:
        return out
    # decode has R <= n + 1 rows: narrow feature tiles give the GPU enough programs to stream W;
    # the interpreter runs programs one by one, so it wants few, wide ones
    block_n, block_k = (128, 128) if interpreting() else (32, 64)
    grid = (triton.cdiv(H, block_n), triton.cdiv(R, 16))
    _aggregate_kernel[grid](anchor_rows, types, w_padded, out, R, H, m, BLOCK_R=16, BLOCK_N=block_n,
                            BLOCK_K=block_k, num_warps=4)
    return out


@torch.library.custom_op("spd_fast::aggregate_triton", mutates_args=())
def aggregate(anchor_rows: torch.Tensor, types: torch.Tensor, w_padded: torch.Tensor) -> torch.Tensor:
    return launch_aggregate(anchor_rows, types, w_padded)


@aggregate.register_fake
def _(anchor_rows, types, w_padded):
    return anchor_rows.new_empty(anchor_rows.shape[0], anchor_rows.shape[2])

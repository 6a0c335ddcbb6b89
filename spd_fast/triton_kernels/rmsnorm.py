"""Residual add fused with RMSNorm: h = x + residual, y = weight * RMSNorm(h), one read of each input.

One program per row (decode has one row per stage, H <= 8192 fits one block). The op order is
spd_fast.model.RMSNorm's: h rounded to the input dtype, normalised in fp32, cast back, then scaled.
Shapes: x, residual [N, H] or [H]; weight [H]; all one dtype, contiguous. Outputs (y, h) like x.
Twin: spd_fast.ops_explicit.add_rmsnorm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_device, on_input_device


@triton.jit
def _add_rmsnorm_kernel(p_x, p_res, p_w, p_y, p_h, H, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_x = tl.load(p_x + row * H + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_r = tl.load(p_res + row * H + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_h = (b_x + b_r).to(p_h.dtype.element_ty)
    tl.store(p_h + row * H + o_h, b_h, mask=m_h)
    b_hf = b_h.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(b_hf * b_hf, axis=0) / H + eps)
    b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_y = (b_hf * rstd).to(p_y.dtype.element_ty).to(tl.float32) * b_w
    tl.store(p_y + row * H + o_h, b_y.to(p_y.dtype.element_ty), mask=m_h)


@on_input_device
def launch_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check(x.dim() in (1, 2), f"x must be [H] or [N, H], got shape {tuple(x.shape)}")
    H = x.shape[-1]
    check(residual.shape == x.shape and tuple(weight.shape) == (H,),
          f"residual must match x {tuple(x.shape)} and weight be ({H},), got {tuple(residual.shape)}, {tuple(weight.shape)}")
    check(x.dtype in FLOAT_DTYPES and residual.dtype == x.dtype and weight.dtype == x.dtype,
          f"x, residual and weight must share one float dtype, got {x.dtype}, {residual.dtype}, {weight.dtype}")
    check(x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous(), "inputs must be contiguous")
    check(H <= 16384, f"hidden size {H} is above the one-block limit of 16384")
    check_device(x, residual, weight)
    if out is None:
        out = (torch.empty_like(x), torch.empty_like(x))
    check(all(o.shape == x.shape and o.dtype == x.dtype and o.is_contiguous() for o in out),
          "out must be two contiguous tensors like x")
    y, h = out
    if x.numel() == 0:  # no row or no width: nothing to launch
        return y, h
    N = x.numel() // H
    block = triton.next_power_of_2(H)
    _add_rmsnorm_kernel[(N,)](x, residual, weight, y, h, H, float(eps), BLOCK_H=block,
                              num_warps=8 if block >= 4096 else 4)
    return y, h


@torch.library.custom_op("spd_fast::add_rmsnorm_triton", mutates_args=())
def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_add_rmsnorm(x, residual, weight, eps)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)

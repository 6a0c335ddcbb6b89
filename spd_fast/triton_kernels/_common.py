"""Launcher helpers: argument checks with clear messages, and the interpreter switch."""
from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on CPU tensors, one program after the other (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    check(all(t.device == dev for t in tensors), f"all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    check(dev.type == "cuda" or interpreting(),
          f"Triton kernels need CUDA tensors (got {dev}); set TRITON_INTERPRET=1 before importing them to run on CPU")


def on_input_device(launch):
    """Launch with the first tensor argument's GPU current (positional or keyword): Triton launches on the current
    CUDA device, not on the tensors' own, so a kernel on a model loaded on cuda:1 would otherwise get cuda:1
    pointers on cuda:0."""
    @functools.wraps(launch)
    def wrapper(*args, **kwargs):
        t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if t is not None and t.device.type == "cuda":
            with torch.cuda.device(t.device):
                return launch(*args, **kwargs)
        return launch(*args, **kwargs)
    return wrapper


def rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[V] or [B, V] float, contiguous -> a [B, V] view."""
    check(t.dim() in (1, 2), f"{name} must be [V] or [B, V], got shape {tuple(t.shape)}")
    check(t.dtype in FLOAT_DTYPES, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    check(t.is_contiguous(), f"{name} must be contiguous")
    return t.view(1, -1) if t.dim() == 1 else t


def check_per_row(t: torch.Tensor, batch_shape: torch.Size, dtype: torch.dtype, name: str, extra: tuple[int, ...] = ()) -> None:
    want = tuple(batch_shape) + extra
    check(tuple(t.shape) == want, f"{name} must have shape {want}, got {tuple(t.shape)}")
    check(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    check(t.is_contiguous(), f"{name} must be contiguous")


def vocab_warps(block: int) -> int:
    return 8 if block >= 2048 else 4

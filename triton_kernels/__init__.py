"""Triton kernels (installed as spd_fast.triton_kernels)."""

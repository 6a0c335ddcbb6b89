"""Triton kernels (installed as spd_fast.triton_kernels), one op (decode: three) per module.

aggregate     multi-depth feature aggregation (grouped GEMM over rows of mixed types)
verify        greedy and sampling verification of one draft token per row
draft_sample  draft logits -> processed q over the full vocabulary + a sampled draft token
rmsnorm       residual add fused with RMSNorm
decode        the decode hot path: RoPE in place, SwiGLU, split-K few-query attention

Each module has a `launch_*` function (argument checks, optional `out` buffers) and a
torch.library custom op `spd_fast::<op>_triton` (opaque to torch.compile and CUDA graphs).
Use them through spd_fast.kernels, which picks a backend. Modules are imported lazily: on CPU they
need TRITON_INTERPRET=1 set before the first import.
"""

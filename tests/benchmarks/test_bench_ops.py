"""The cycle's fused ops on the default model's shapes (H=576, V=49152, n=3): the PyTorch twins
vs the C++ CPU ops and the Triton kernels (spd_fast.kernels, backend="torch" | "cpp" | "triton").
The twin is the baseline measured in the same session; other backends report their speedup.

One call = one cycle's op for one token, so calls/s is the op's tokens/s ceiling.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from bench_common import ROUNDS, SHORT, median_seconds, record

H, V, N = 576, 49152, 3
M, R, VD = N + 1, N + 1, 16384        # anchors (types), PDM rows per cycle, draft vocabulary size
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = ["aggregate", "draft_sample", "verify_greedy", "verify_sampling"]
_TWIN_SECONDS: dict[str, float] = {}


def _op(op: str, backend: str) -> Callable[..., Any]:
    """The op for a backend; skip when that backend cannot run here."""
    from spd_fast import kernels as k

    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("Triton kernels need a GPU (on CPU they only run in the interpreter, which says nothing "
                    "about speed)")
    if backend == "triton":
        from spd_fast.triton_kernels._common import interpreting

        if interpreting():  # TRITON_INTERPRET=1 in the environment: these rows would time numpy, not the kernels
            pytest.skip("TRITON_INTERPRET=1 is set, so the Triton kernels would run in the interpreter; run "
                        "`TRITON_INTERPRET=0 pytest --benchmark` on the GPU")
    if backend == "cpp":
        if DEVICE != "cpu":
            pytest.skip("the C++ ops are CPU ops")
        if not k.cpp_ops.available():  # builds once (untimed); False when there is no compiler
            pytest.skip("the C++ ops could not be built here")
    fn = getattr(k, op)
    return lambda *a, u=None: fn(*a, **({} if u is None else {"u": u}), backend=backend)


def _inputs(op: str) -> tuple[tuple, dict]:
    from spd_fast.sampling import SamplingParams

    torch.manual_seed(0)
    sampling = SamplingParams(temperature=1.0, seed=0)
    if op == "aggregate":
        rows = torch.randn(R, M, H, device=DEVICE)
        types = torch.tensor([N, 2, 1, 0][:R], device=DEVICE)
        w = torch.randn(M, H, M * H, device=DEVICE) / (M * H) ** 0.5
        return (rows, types, w), {}
    if op == "draft_sample":
        vocab = torch.randperm(V, device=DEVICE)[:VD]
        return (torch.randn(VD, device=DEVICE), vocab, V, sampling), {"u": torch.rand((), device=DEVICE)}
    logits = torch.randn(V, device=DEVICE)
    tok = torch.tensor(7, device=DEVICE)
    if op == "verify_greedy":
        return (logits, tok), {}
    q = torch.softmax(torch.randn(V, device=DEVICE), -1)
    return (logits, tok, q, sampling), {"u": torch.rand(2, device=DEVICE)}


def _assert_same(got: Any, want: Any, what: str) -> None:
    """Outputs of one op on two backends: floats to rounding, integers and flags exactly."""
    if isinstance(got, (tuple, list)):
        assert len(got) == len(want), what
        for g, w in zip(got, want):
            _assert_same(g, w, what)
    elif torch.is_tensor(got) and got.is_floating_point():
        torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4, msg=what)
    else:
        assert torch.equal(torch.as_tensor(got).cpu(), torch.as_tensor(want).cpu()), what


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])  # torch first: it is the baseline
@pytest.mark.parametrize("op", OPS)
def test_op(benchmark: Any, request: Any, op: str, backend: str) -> None:
    fn = _op(op, backend)
    args, kw = _inputs(op)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def call() -> None:
        fn(*args, **kw)
        sync()

    with torch.inference_mode():
        # also the warm-up (first-call allocations, kernel compilation): the backend must give the twin's answer (the
        # twin itself, the baseline row, is checked against fp64 references in tests/test_kernels.py)
        _assert_same(fn(*args, **kw), _op(op, "torch")(*args, **kw), f"{backend} {op}")
        if SHORT:
            benchmark.pedantic(call, rounds=ROUNDS + 2, iterations=5, warmup_rounds=1)
        else:
            benchmark(call)
    sec = median_seconds(benchmark)
    if backend == "torch":
        _TWIN_SECONDS[op] = sec
    twin = _TWIN_SECONDS.get(op)
    record(request, benchmark, op=op, backend=backend, device=DEVICE, us_per_call=1e6 * sec,
           tokens_per_s=1.0 / max(sec, 1e-12), speedup_vs_torch_twin=(twin / sec) if twin else None)

"""Fused ops: Triton kernels (interpreted on CPU) and C++ ops vs their PyTorch twins vs fp64 oracles,
sampling kernels by statistics, the backend switch, and the engine's greedy output on every backend."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from spd_fast import cpp_ops, kernels, ops, ops_explicit
from spd_fast.config import SpdConfigError
from spd_fast.ops_explicit import add_rmsnorm, draft_sample_explicit, processed_probs, verify_sampling_explicit
from spd_fast.sampling import SamplingParams, probs_from_logits
from spd_fast.triton_kernels._common import interpreting

P_MIN = 1e-3  # a correct sampler fails a chi-square test with probability ~0.1%
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
AGG_TOL = [pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"), pytest.param(torch.bfloat16, 3e-2, 3e-2, id="bf16")]
AGG_SHAPES = [pytest.param(1, 2, 65, id="R1-m2-H65"), pytest.param(3, 4, 65, id="R3-m4-H65"),
              pytest.param(7, 3, 577, id="R7-m3-H577"), pytest.param(37, 3, 65, id="prefill37")]
PARAMS = [pytest.param((1.0, 0, 1.0), id="t1"), pytest.param((0.7, 5, 1.0), id="t0.7-k5"),
          pytest.param((1.0, 0, 0.8), id="p0.8"), pytest.param((0.9, 50, 0.9), id="t0.9-k50-p0.9"),
          pytest.param((1.3, 1, 1.0), id="k1")]
LOGIT_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def triton_device(device: str) -> str:
    if device == "cpu" and not interpreting():
        pytest.skip("TRITON_INTERPRET=0: the Triton kernels are tested on the GPU")
    return device


def stat_device(backend: str) -> str:
    """The statistical tests run Triton on the GPU when there is one (compiled), else interpreted."""
    if backend != "triton":
        return "cpu"
    return "cuda" if torch.cuda.is_available() and not interpreting() else triton_device("cpu")


@pytest.fixture(scope="module")
def cpp():
    if torch.cuda.is_available() and not cpp_ops.available():  # a GPU machine without a C++ toolchain
        pytest.skip("the C++ ops do not build on this GPU machine; its run checks the Triton kernels")
    assert cpp_ops.available(), "the C++ ops must build on this machine (gcc is installed)"
    return lambda name: cpp_ops.op(name)


def assert_close_verbose(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """allclose that names the first mismatching indices (and fails on NaN anywhere)."""
    got, want = got.double().cpu(), want.double().cpu()
    bad = ~((got - want).abs() <= atol + rtol * want.abs())
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches, first at {idx}: got "
                             f"{[got[tuple(i)].item() for i in idx]} want {[want[tuple(i)].item() for i in idx]}")


def agg_inputs(R: int, m: int, H: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    types = torch.randint(0, m, (R,), generator=g)
    if R > 16:  # prefill-like: mostly depth-n rows
        types[: R - 3] = m - 1
    x = torch.randn(R, m, H, generator=g)
    for r in range(R):
        x[r, types[r] + 1:] = float("nan")  # anchors above a row's type are stale: must not leak
    w = torch.zeros(m, H, m * H)
    for i in range(m):
        w[i, :, : (i + 1) * H] = torch.randn(H, (i + 1) * H, generator=g) / ((i + 1) * H) ** 0.5
    return x.to(device, dtype), types.to(device), w.to(device, dtype)


def agg_fp64(x: torch.Tensor, types: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    R, m, H = x.shape
    return torch.stack([w[t, :, : (t + 1) * H].double() @ x[r, : t + 1].reshape(-1).double()
                        for r, t in enumerate(types.tolist())])


def probs_fp64(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The processing rule by its definition, in fp64: keep x_i iff x_i >= the k-th largest and the
    mass of the strictly larger logits is < p."""
    x = logits.double() / t
    if 0 < k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, k).values[..., -1:], float("-inf"))
    if p < 1:
        sp = torch.softmax(x, -1)
        for row, prow in zip(x.view(-1, x.shape[-1]), sp.view(-1, x.shape[-1])):
            vals, inv = torch.unique(row, return_inverse=True)  # ascending distinct logits
            mass = torch.zeros(len(vals), dtype=torch.float64).scatter_add_(0, inv, prow)
            mass_gt = mass.flip(0).cumsum(0).flip(0) - mass
            row.masked_fill_(mass_gt[inv] >= p, float("-inf"))
    return torch.softmax(x, -1)


# ---- aggregation --------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R,m,H", AGG_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", AGG_TOL)
def test_aggregate_triton_twin_oracle(device, R, m, H, dtype, atol, rtol):
    from spd_fast.triton_kernels.aggregate import launch_aggregate

    x, types, w = agg_inputs(R, m, H, dtype, triton_device(device))
    out = torch.full((R, H), float("nan"), dtype=dtype, device=device)
    got = launch_aggregate(x, types, w, out=out)
    twin, oracle = ops.aggregate_torch(x, types, w), agg_fp64(x.cpu(), types.cpu(), w.cpu())
    assert_close_verbose(twin, oracle, atol, rtol, "twin vs fp64")
    assert_close_verbose(got, oracle, atol, rtol, "triton vs fp64")
    assert_close_verbose(got, twin, 2 * atol, 2 * rtol, "triton vs twin")
    # attention-gym's rule: the kernel may not be much worse than eager at the same dtype
    assert (got.double().cpu() - oracle).abs().max() <= 3 * (twin.double().cpu() - oracle).abs().max() + atol / 4


@pytest.mark.parametrize("R,m,H", AGG_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", AGG_TOL)
def test_aggregate_cpp_twin_oracle(cpp, R, m, H, dtype, atol, rtol):
    x, types, w = agg_inputs(R, m, H, dtype, "cpu", seed=1)
    got = cpp("aggregate_cpp")(x, types, w)
    assert got.dtype == dtype and got.shape == (R, H)
    assert_close_verbose(got, agg_fp64(x, types, w), atol, rtol, "cpp vs fp64")
    assert_close_verbose(got, ops.aggregate_torch(x, types, w), 2 * atol, 2 * rtol, "cpp vs twin")


def test_aggregate_cpp_mixed_dtypes_and_errors(cpp):
    x, types, w = agg_inputs(5, 3, 65, torch.float32, "cpu")
    got = cpp("aggregate_cpp")(x.bfloat16(), types, w)
    assert_close_verbose(got, ops.aggregate_torch(x.bfloat16(), types, w), 3e-2, 3e-2, "bf16 rows, fp32 W")
    with pytest.raises(RuntimeError, match="outside"):
        cpp("aggregate_cpp")(x, torch.full_like(types, 3), w)
    with pytest.raises(RuntimeError, match="w_padded must be"):
        cpp("aggregate_cpp")(x, types, w[:, :, :-1])


# ---- greedy verification ------------------------------------------------------------------------
def greedy_inputs(B: int, V: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(V + B)
    logits = torch.randn(B, V, generator=g)
    logits[0, V // 3] = logits[0, V - 2] = 9.0  # a tie: the first index wins
    draft = torch.randint(0, V, (B,), generator=g)
    draft[0] = V // 3  # one accept, the other rows reject (almost surely)
    return logits.to(device, dtype), draft.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,V", [(1, 1000), (3, 3001)])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_verify_greedy_triton_and_cpp(device, B, V, dtype, cpp):
    from spd_fast.triton_kernels.verify import launch_verify_greedy

    logits, draft = greedy_inputs(B, V, dtype, triton_device(device))
    want_acc, want_tok = ops.verify_greedy_torch(logits, draft)
    assert torch.equal(want_tok.cpu(), logits.double().cpu().argmax(-1)) and bool(want_acc[0])
    out = (torch.zeros(B, dtype=torch.bool, device=device), torch.full((B,), -1, dtype=torch.long, device=device))
    acc, tok = launch_verify_greedy(logits, draft, out=out)
    assert torch.equal(tok, want_tok) and torch.equal(acc, want_acc)
    acc1, tok1 = launch_verify_greedy(logits[1 % B], draft[1 % B])  # one row, 0-d draft token
    assert tok1.shape == () and int(tok1) == int(want_tok[1 % B])
    c_acc, c_tok = cpp("verify_greedy_cpp")(logits.cpu(), draft.cpu())
    assert torch.equal(c_tok, want_tok.cpu()) and torch.equal(c_acc, want_acc.cpu())


# ---- sampling verification and draft sampling: token-exact vs the explicit twins ----------------
def sampling_inputs(B: int, V: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 2).to(dtype)
    q = torch.softmax(torch.randn(B, V, generator=g) * 2, -1)
    q[:, ::7] = 0  # a draft distribution with holes (draft vocabulary subset)
    q /= q.sum(-1, keepdim=True)
    x = torch.multinomial(q, 1, generator=g)[:, 0]
    u = torch.rand(B, 2, generator=g)
    return [t.to(device) for t in (logits, x, q, u)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1000, 3001])
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_verify_sampling_triton_and_cpp_match_twin(device, V, params, dtype, cpp):
    from spd_fast.triton_kernels.verify import launch_verify_sampling

    logits, x, q, u = sampling_inputs(3, V, dtype, triton_device(device), seed=V)
    want_acc, want_tok = verify_sampling_explicit(logits, x, q, *params, u)
    out = (torch.zeros(3, dtype=torch.bool, device=device), torch.full((3,), -1, dtype=torch.long, device=device))
    acc, tok = launch_verify_sampling(logits, x, q, *params, u, out=out)
    assert torch.equal(tok, want_tok) and torch.equal(acc, want_acc)
    c_acc, c_tok = cpp("verify_sampling_cpp")(logits.cpu(), x.cpu(), q.cpu(), *params, u.cpu())
    assert torch.equal(c_tok, want_tok.cpu()) and torch.equal(c_acc, want_acc.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Vd", [1000, 3001])
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_draft_sample_triton_and_cpp_match_twin_and_oracle(device, Vd, params, dtype, cpp):
    from spd_fast.triton_kernels.draft_sample import launch_draft_sample

    V = 3001
    g = torch.Generator().manual_seed(Vd)
    vocab = torch.randperm(V, generator=g)[:Vd].to(device)
    logits = (torch.randn(2, Vd, generator=g) * 2).to(device, dtype)
    u = torch.rand(2, generator=g).to(device)
    want_tok, want_q = draft_sample_explicit(logits, vocab, V, *params, u)
    if dtype == torch.float32:  # no ties: the explicit twin's processing is the engine's
        assert torch.equal(processed_probs(logits, *params), probs_from_logits(logits, SamplingParams(*params)))
    oracle = torch.zeros(2, V, dtype=torch.float64).scatter_(-1, vocab.cpu().expand(2, Vd), probs_fp64(logits.cpu(), *params))
    assert_close_verbose(want_q, oracle, 1e-7, 1e-5, "twin q vs fp64")
    out = (torch.full((2,), -1, dtype=torch.long, device=device),
           torch.full((2, V), float("nan"), device=device))  # q outside the draft vocabulary must be written too
    tok, q = launch_draft_sample(logits, vocab, V, *params, u, out=out)
    assert torch.equal(tok, want_tok)
    assert_close_verbose(q, oracle, 1e-7, 1e-5, "triton q vs fp64")
    c_tok, c_q = cpp("draft_sample_cpp")(logits.cpu(), vocab.cpu(), V, *params, u.cpu())
    assert torch.equal(c_tok, want_tok.cpu())
    assert_close_verbose(c_q, oracle, 1e-7, 1e-5, "cpp q vs fp64")


# ---- statistics: the sampled tokens have the promised distribution ------------------------------
STAT_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5])
STAT_Q = torch.tensor([0.05, 0.05, 0.4, 0.3, 0.05, 0.05, 0.05, 0.05])
STAT_PARAMS = [pytest.param(SamplingParams(temperature=1.0), id="t1"),
               pytest.param(SamplingParams(temperature=0.8, top_k=5, top_p=0.9), id="t0.8-k5-p0.9")]


def chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0, "a token outside the processed distribution was produced"
    keep = p > 0
    expected = p[keep].double() / p[keep].double().sum() * counts.sum()
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def stat_verify_tokens(backend: str, params: SamplingParams, N: int, q: torch.Tensor, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(STAT_Q, N, replacement=True, generator=g)  # drafts really drawn from STAT_Q
    u = torch.rand(N, 2, generator=g)
    dev = stat_device(backend)
    logits, q = STAT_LOGITS.expand(N, -1).contiguous(), q.expand(N, -1).contiguous()
    return kernels.verify_sampling(logits.to(dev), x.to(dev), q.to(dev), params, u.to(dev), backend=backend)[1]


@pytest.mark.parametrize("backend,N", [("triton", 6000), ("cpp", 20000), ("torch", 20000)])
@pytest.mark.parametrize("params", STAT_PARAMS)
def test_verify_sampling_reproduces_target_distribution(backend, N, params, cpp):
    p = probs_from_logits(STAT_LOGITS, params)
    assert chi2_pvalue(stat_verify_tokens(backend, params, N, STAT_Q), p) > P_MIN


def test_chi_square_detects_a_wrong_q():
    """The statistical test has power: verifying against a q the drafts were not drawn from biases y."""
    params = SamplingParams(temperature=1.0)
    wrong_q = torch.full((8,), 1 / 8)
    p = probs_from_logits(STAT_LOGITS, params)
    assert chi2_pvalue(stat_verify_tokens("torch", params, 20000, wrong_q), p) < P_MIN


@pytest.mark.parametrize("backend,N", [("triton", 6000), ("cpp", 20000), ("torch", 20000)])
@pytest.mark.parametrize("params", STAT_PARAMS)
def test_draft_sample_reproduces_q(backend, N, params, cpp):
    dev = stat_device(backend)
    vocab = torch.tensor([9, 2, 4, 0, 7, 5, 1, 3])  # draft index -> token id in a vocabulary of 10
    u = torch.rand(N, generator=torch.Generator().manual_seed(3))
    tok, q = kernels.draft_sample(STAT_LOGITS.expand(N, -1).contiguous().to(dev), vocab.to(dev), 10, params,
                                  u.to(dev), backend=backend)
    tok, q = tok.cpu(), q.cpu()
    q_d = probs_from_logits(STAT_LOGITS, params)
    assert_close_verbose(q[0][vocab], q_d, 1e-6, 1e-5, "q on the draft vocabulary")
    assert q[0].sum() == pytest.approx(1.0, abs=1e-5) and q[0, [6, 8]].abs().sum() == 0
    inverse = torch.full((10,), -1, dtype=torch.long).scatter_(0, vocab, torch.arange(8))
    assert chi2_pvalue(inverse[tok], q_d) > P_MIN


# ---- fused residual add + RMSNorm ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,H", [(1, 65), (3, 577)])
@pytest.mark.parametrize("dtype,atol,rtol", [pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
                                             pytest.param(torch.bfloat16, 6e-2, 2e-2, id="bf16")])
def test_add_rmsnorm_triton_twin_oracle(device, N, H, dtype, atol, rtol):
    from spd_fast.triton_kernels.rmsnorm import launch_add_rmsnorm

    g = torch.Generator().manual_seed(H)
    x, r = (torch.randn(N, H, generator=g).to(triton_device(device), dtype) for _ in range(2))
    w = torch.randn(H, generator=g).to(device, dtype)
    h64 = x.double() + r.double()
    oracle = w.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6)
    twin_y, twin_h = add_rmsnorm(x, r, w, 1e-6)
    out = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
    y, h = launch_add_rmsnorm(x, r, w, 1e-6, out=out)
    assert_close_verbose(twin_y, oracle, atol, rtol, "twin vs fp64")
    assert_close_verbose(y, oracle, atol, rtol, "triton vs fp64")
    assert_close_verbose(h, twin_h, atol, rtol, "triton h vs twin h")


# ---- custom ops, backend switch, errors ---------------------------------------------------------
def test_custom_ops_are_opaque_to_torch_compile(cpp):
    triton_device("cpu")
    import spd_fast.triton_kernels.aggregate  # noqa: F401  (registers the ops)
    import spd_fast.triton_kernels.verify as tv

    x, types, w = agg_inputs(2, 2, 17, torch.float32, "cpu")
    logits, draft = greedy_inputs(1, 50, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.spd_fast.aggregate_triton, (x, types, w), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.spd_fast.aggregate_cpp, (x, types, w), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.spd_fast.verify_greedy_cpp, (logits, draft), test_utils=("test_faketensor",))

    def step(lg: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        acc, tok = tv.verify_greedy(lg * 2.0, d)
        return torch.where(acc, tok, -tok)

    compiled = torch.compile(step, backend="eager", fullgraph=True)  # fullgraph: no graph break
    assert torch.equal(compiled(logits, draft), step(logits, draft))


def test_backend_switch_and_error_messages(monkeypatch):
    with pytest.raises(SpdConfigError, match="unknown kernel backend 'cuda'"):
        kernels.set_backend("cuda")
    with pytest.raises(SpdConfigError, match="CPU tensors only"):
        kernels.resolve("cpp", torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SpdConfigError, match="need CUDA tensors"):
        kernels.resolve("triton", torch.device("cpu"))
    assert kernels.resolve("triton", torch.device("cuda")) == "triton"
    assert kernels.resolve("auto", torch.device("cuda")) == "triton"
    with pytest.raises(SpdConfigError, match="greedy decoding uses verify_greedy"):
        kernels.verify_sampling(STAT_LOGITS, torch.tensor(0), STAT_Q, SamplingParams(), torch.rand(2), backend="torch")
    assert kernels.get_backend() == "torch"  # the default leaves the engine on the twins
    with kernels.use_backend("cpp"):
        assert ops.BACKEND == "cpp"
    assert ops.BACKEND == "torch"


def test_triton_launchers_check_their_arguments():
    triton_device("cpu")
    from spd_fast.triton_kernels.aggregate import launch_aggregate
    from spd_fast.triton_kernels.verify import launch_verify_greedy, launch_verify_sampling

    x, types, w = agg_inputs(3, 2, 17, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"w_padded must be \[m, H, m\*H\]"):
        launch_aggregate(x, types, w[:, :, :-1].contiguous())
    with pytest.raises(ValueError, match="must be contiguous"):
        launch_aggregate(x.transpose(0, 1).contiguous().transpose(0, 1), types, w)
    logits, draft = greedy_inputs(2, 100, torch.float32, "cpu")
    with pytest.raises(ValueError, match="draft_token must be torch.int64"):
        launch_verify_greedy(logits, draft.int())
    with pytest.raises(ValueError, match=r"u must have shape \(2, 2\)"):
        launch_verify_sampling(logits, draft, torch.softmax(logits, -1), 1.0, 0, 1.0, torch.rand(2))


def test_cpp_build_failure_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp_ops, "_state", {})
    monkeypatch.setattr(cpp_ops, "SOURCES", (tmp_path / "missing.cpp",))
    x, types, w = agg_inputs(3, 2, 17, torch.float32, "cpu")
    before = kernels.calls["aggregate/torch"]
    with pytest.warns(RuntimeWarning, match=r"C\+\+ CPU ops unavailable") as rec:
        got = kernels.aggregate(x, types, w, backend="cpp")
        kernels.aggregate(x, types, w, backend="auto")
    assert len(rec) == 1 and kernels.calls["aggregate/torch"] == before + 2
    assert torch.equal(got, ops.aggregate_torch(x, types, w))


def test_cpp_build_directory_follows_spd_fast_cache(monkeypatch, tmp_path):
    """The C++ build lives under $SPD_FAST_CACHE/cpp like the converted models; TORCH_EXTENSIONS_DIR, torch's own
    setting, still comes first; neither set: ~/.cache/spd_fast/cpp."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("SPD_FAST_CACHE", raising=False)
    assert cpp_ops.build_dir().parent == Path.home() / ".cache" / "spd_fast" / "cpp"
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    assert cpp_ops.build_dir().parent == tmp_path / "cache" / "cpp"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert cpp_ops.build_dir().parent == tmp_path / "ext" / "spd_fast"


def test_cpp_build_clears_a_stale_torch_lock(monkeypatch, tmp_path):
    """A builder killed inside torch's load() leaves d/lock behind, and every later load() would wait
    on it forever (this hung CI once). Under our flock that file is stale and goes."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    d = cpp_ops.build_dir()
    d.mkdir(parents=True)
    (d / "lock").touch()
    seen = []
    monkeypatch.setattr(ext, "load", lambda **kw: seen.append((kw["build_directory"], (d / "lock").exists())))
    monkeypatch.setattr(cpp_ops, "_register_fakes", lambda: None)
    cpp_ops._build()
    assert seen == [(str(d), False)]


def test_cpp_build_waits_for_a_live_builder_then_names_the_lock(monkeypatch, tmp_path):
    import fcntl

    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_ops, "BUILD_WAIT_S", 0.5)
    monkeypatch.setattr(cpp_ops, "_state", {})
    monkeypatch.setattr(ext, "load", lambda **kw: pytest.fail("built while another builder held the lock"))
    d = cpp_ops.build_dir()
    d.mkdir(parents=True)
    (d / "lock").touch()  # a live builder's torch lock must survive
    with open(d / ".spd_fast_build.lock", "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match=r"held the C\+\+ build lock in .* for over 0.5 s; .*delete that directory"):
            cpp_ops._build()
        assert (d / "lock").exists()
        with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU ops unavailable .*TimeoutError"):
            assert cpp_ops.available() is False


def test_cpp_build_waits_for_an_orphaned_builders_compilers(monkeypatch, tmp_path):
    """A builder killed alone (kill -9 of its pid, the OOM killer) leaves its ninja and compilers running in the build
    directory without our flock: the next process took the lock, deleted torch's lock file and ran a second ninja on
    the same objects. It now waits for them first, and says which processes when they do not end."""
    import subprocess
    import time

    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_ops, "_register_fakes", lambda: None)
    d = cpp_ops.build_dir()
    d.mkdir(parents=True)
    (d / "lock").touch()
    orphan = subprocess.Popen(["sleep", "1.5"], cwd=d)  # stands in for the orphaned ninja
    seen = []
    monkeypatch.setattr(ext, "load", lambda **kw: seen.append((orphan.poll() is not None, (d / "lock").exists())))
    t0 = time.monotonic()
    cpp_ops._build()
    assert seen == [(True, False)] and time.monotonic() - t0 >= 1.0  # built after the orphan ended
    orphan.wait()
    (d / "lock").touch()
    stuck = subprocess.Popen(["sleep", "30"], cwd=d)
    try:
        monkeypatch.setattr(cpp_ops, "BUILD_WAIT_S", 0.6)
        with pytest.raises(TimeoutError, match=rf"processes \[{stuck.pid}\] still work in the C\+\+ build directory"):
            cpp_ops._build()
        assert (d / "lock").exists() and len(seen) == 1
    finally:
        stuck.kill()
        stuck.wait()


def test_a_failed_cpp_build_names_its_cause():
    """The warning quoted ninja's "build stopped: subcommand failed", not the line that said why."""
    text = ("Error building extension 'spd_fast_cpp': [1/3] /nonexistent/c++ -MMD -c spd_ops.cpp -o spd_ops.o\n"
            "FAILED: spd_ops.o\n/nonexistent/c++ -MMD -c spd_ops.cpp -o spd_ops.o\n"
            "/bin/sh: 1: /nonexistent/c++: not found\nninja: build stopped: subcommand failed.")
    assert cpp_ops._first_cause(text) == "/bin/sh: 1: /nonexistent/c++: not found"
    text = ("Error building extension 'x': [1/2] c++ -c a.cpp\nFAILED: a.o\n"
            "a.cpp:3:10: fatal error: torch/extension.h: No such file or directory\ncompilation terminated.")
    assert cpp_ops._first_cause(text) == "a.cpp:3:10: fatal error: torch/extension.h: No such file or directory"
    assert cpp_ops._first_cause("something odd happened") == "something odd happened"


def test_a_named_fused_backend_refuses_fp64_instead_of_narrowing_it(cpp):
    """backend='cpp' computed fp64 logits in fp32: a near tie answered otherwise than the twin, silently."""
    logits = torch.tensor([[1.0, 1.0 + 1e-10, 0.5]], dtype=torch.float64)
    draft = torch.tensor([1])
    assert kernels.verify_greedy(logits, draft, backend="auto")[0].item() is True  # the twin, exact
    with pytest.raises(SpdConfigError, match=r"the cpp ops take float32, bfloat16 or float16 tensors, got "
                                             r"torch.float64; cast the input, or use backend='torch'"):
        kernels.verify_greedy(logits, draft, backend="cpp")


# ---- the engine: greedy output identical on every backend ---------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_engine_greedy_identical_across_backends(tiny_checkpoint, n, cpp):
    triton_device("cpu")
    from conftest import tiny_target
    from spd_fast.ar import decode_ar
    from spd_fast.config import uniform_boundaries
    from spd_fast.drafters import PdmDrafter
    from test_engine import random_head, spd

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, n)
    ids = [3, 14, 15, 92, 65]
    ref = decode_ar(m, ids, 10, SamplingParams(), []).token_ids
    outs = {}
    for backend in ("torch", "triton", "cpp"):
        before = kernels.calls.copy()
        with kernels.use_backend(backend):
            res = spd(m, ids, b, 10, drafter=PdmDrafter(random_head(m, b, layers=2, seed=n)))
        outs[backend] = res.token_ids
        if backend != "torch":  # the engine's ops really ran on that backend
            assert kernels.calls[f"aggregate/{backend}"] > before[f"aggregate/{backend}"]
            assert kernels.calls[f"verify_greedy/{backend}"] > before[f"verify_greedy/{backend}"]
    assert outs["torch"] == ref and outs["triton"] == ref and outs["cpp"] == ref


# ---- decode hot path: RoPE in place, SwiGLU, split-K attention ----------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,atol,rtol", [pytest.param(torch.float32, 1e-6, 1e-6, id="fp32"),
                                             pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16")])
def test_rope_inplace_triton_matches_the_model(device, dtype, atol, rtol):
    """On a fused-qkv row layout (q and k heads one strided view), as the model rotates them."""
    from spd_fast.model import apply_rope, rope_tables
    from spd_fast.triton_kernels.decode import launch_rope_inplace

    dev = triton_device(device)
    cfg = type("C", (), {"rope_theta": 10000.0, "head_dim": 16, "rope_scaling": None})()
    cos, sin = rope_tables(cfg, 50)
    pos = torch.tensor([3, 17, 49])
    qkv = torch.randn(3, (4 + 2 + 2) * 16, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    qk = qkv[:, : 6 * 16].view(3, 6, 16)
    want = apply_rope(qk.clone()[None], cos[pos][None].to(dev), sin[pos][None].to(dev))[0]
    untouched = qkv[:, 6 * 16:].clone()
    twin = qk.clone()
    launch_rope_inplace(qk, cos[pos].to(dev), sin[pos].to(dev))
    assert_close_verbose(qk, want, atol, rtol, "triton rope vs model.apply_rope")
    assert torch.equal(qkv[:, 6 * 16:], untouched)  # the v heads of the row stay as they were
    assert_close_verbose(kernels.rope_inplace(twin, cos[pos].to(dev), sin[pos].to(dev), backend="torch"), want,
                         atol, rtol, "twin vs model")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,atol,rtol", [pytest.param(torch.float32, 1e-6, 1e-5, id="fp32"),
                                             pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16")])
def test_swiglu_triton_matches_the_model_mlp(device, dtype, atol, rtol):
    from spd_fast.triton_kernels.decode import launch_swiglu

    dev = triton_device(device)
    gu = (torch.randn(2, 2 * 40, generator=torch.Generator().manual_seed(1)) * 4).to(dev, dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert_close_verbose(launch_swiglu(gu), want, atol, rtol, "triton swiglu")
    assert torch.equal(kernels.swiglu(gu, backend="torch"), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_split_k_matches_the_model(device, splits, cpp):
    """Split-K attention == the model's few-query path for GQA, per-row positions, kv_bound below
    a row's position (that row reads only the bound), and chunks with no valid slot."""
    from spd_fast.model import attention_mask, few_query_attention
    from spd_fast.triton_kernels.decode import launch_decode_attention

    dev = triton_device(device)
    g = torch.Generator().manual_seed(2)
    B, T, nh, nkv, D, S = 1, 3, 4, 2, 16, 40
    q = torch.randn(B, T, nh, D, generator=g)
    kc, vc = torch.randn(2, nkv, S, D, generator=g), torch.randn(2, nkv, S, D, generator=g)
    positions = torch.tensor([[2, 20, 39]])
    for bound in (32, S):
        want = few_query_attention(q, kc[:B, :, :bound], vc[:B, :, :bound], attention_mask(positions, bound))
        got = launch_decode_attention(q.to(dev), kc.to(dev), vc.to(dev), positions.to(dev), bound, splits=splits)
        assert_close_verbose(got, want, 1e-5, 1e-5, f"triton split-K, bound {bound}")
        twin = kernels.decode_attention(q, kc, vc, positions, bound, backend="torch")
        assert_close_verbose(twin, want, 1e-5, 1e-5, "twin")
        cpp_out = kernels.decode_attention(q, kc, vc, positions, bound, backend="cpp")
        assert_close_verbose(cpp_out, want, 1e-5, 1e-5, "C++")
        # a bf16 cache: the fp32-only C++ op hands over to the twin instead of raising
        bf = kernels.decode_attention(q, kc.bfloat16(), vc.bfloat16(), positions, bound, backend="cpp")
        assert torch.equal(bf, kernels.decode_attention(q, kc.bfloat16(), vc.bfloat16(), positions, bound,
                                                        backend="torch"))
    with pytest.raises(ValueError, match="kv_bound must be in 1..40"):
        launch_decode_attention(q.to(dev), kc.to(dev), vc.to(dev), positions.to(dev), 41)
    with pytest.raises(ValueError, match="positions must be int64"):
        launch_decode_attention(q.to(dev), kc.to(dev), vc.to(dev), positions.int().to(dev), 8)


def test_decode_hot_path_ops_are_opaque_custom_ops():
    triton_device("cpu")
    import spd_fast.triton_kernels.decode  # noqa: F401  (registers the ops)

    q, kc = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 16, 8)
    torch.library.opcheck(torch.ops.spd_fast.decode_attention_triton, (q, kc, kc.clone(), torch.tensor([[5]]), 16),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.spd_fast.swiglu_triton, (torch.randn(2, 16),), test_utils=("test_schema", "test_faketensor"))


def test_kernels_import_from_an_uninstalled_source_checkout():
    """The GPU machine runs the repository from PYTHONPATH without installing it; the kernels must import
    there too (they were once a top-level triton_kernels/ mapped in by pyproject's package-dir, which only
    an install sees). `-S` leaves out the site hooks, so the editable install's finder plays no part."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    site_dir = str(Path(torch.__file__).resolve().parent.parent)
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {site_dir!r}]; "
            "import spd_fast.triton_kernels._common as c; print(c.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd="/",
                       env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(root / "spd_fast" / "triton_kernels" / "_common.py")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_sampling_kernels_handle_empty_batches_and_rows_without_mass(device):
    """B = 0 launches nothing (a zero block size divided the grid), and a row whose processed probabilities are
    all zero or NaN (NaN logits) draws an index inside the vocabulary: the fallback index was -1, which read the
    word before the draft vocabulary and stored token -1."""
    from spd_fast.triton_kernels.draft_sample import launch_draft_sample
    from spd_fast.triton_kernels.verify import launch_verify_greedy, launch_verify_sampling

    dev = triton_device(device)
    V, Vd = 40, 16
    vocab = torch.arange(3, 3 + Vd, device=dev)
    empty = torch.zeros(0, V, device=dev)
    acc, tok = launch_verify_greedy(empty, torch.zeros(0, dtype=torch.long, device=dev))
    assert acc.shape == tok.shape == (0,)
    acc, tok = launch_verify_sampling(empty, torch.zeros(0, dtype=torch.long, device=dev), empty.clone(), 1.0, 0,
                                      1.0, torch.zeros(0, 2, device=dev))
    assert acc.shape == tok.shape == (0,)
    tok, q = launch_draft_sample(torch.zeros(0, Vd, device=dev), vocab, V, 1.0, 0, 1.0, torch.zeros(0, device=dev))
    assert tok.shape == (0,) and q.shape == (0, V)
    nan = torch.full((1, Vd), float("nan"), device=dev)
    tok, _ = launch_draft_sample(nan, vocab, V, 1.0, 0, 1.0, torch.full((1,), 0.5, device=dev))
    assert 3 <= int(tok) < 3 + Vd
    q = torch.zeros(1, V, device=dev)
    q[0, 5] = 1.0
    _, tok = launch_verify_sampling(torch.full((1, V), float("nan"), device=dev), torch.tensor([5], device=dev), q,
                                    1.0, 0, 1.0, torch.full((1, 2), 0.5, device=dev))
    assert 0 <= int(tok) < V


def test_gpu_kernel_paths_script_small_on_cpu():
    """bench/gpu_kernel_paths.py (the real-size Triton checks of the GPU lease) passes interpreted at small
    shapes, and a kernel that gives a wrong answer fails its own check without hiding the others."""
    import importlib.util

    triton_device("cpu")
    spec = importlib.util.spec_from_file_location("gpu_kernel_paths", "bench/gpu_kernel_paths.py")
    kp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kp)
    lines: list[str] = []
    rows = kp.run("cpu", small=True, log=lines.append)
    assert [r["check"] for r in rows] == [c[0] for c in kp.CHECKS] and all(r["ok"] for r in rows), rows
    assert len(lines) == len(rows) and lines[0].startswith("ok")
    orig = kp.Paths.__init__

    def broken_greedy(self, device, small):
        orig(self, device, small)
        self.k["greedy"] = lambda logits, d: (d == 0, torch.zeros_like(d))  # always token 0

    kp.Paths.__init__ = broken_greedy
    try:
        rows = kp.run("cpu", small=True, log=lines.append)
    finally:
        kp.Paths.__init__ = orig
    assert [r["ok"] for r in rows] == [False] + [True] * (len(rows) - 1)
    assert "AssertionError" in rows[0]["error"] and lines[-len(rows)].startswith("FAIL")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_sampling_kernels_never_touch_memory_at_ids_outside_the_vocabulary(device):
    """A draft id outside [0, V) (the twin raises; a device-side check would sync) was read at q[id] by verification,
    which then accepted token -1, and written at q[id] by draft sampling, past the row. Now it is rejected (the
    verified token is a real one) and never written."""
    from spd_fast.triton_kernels.draft_sample import launch_draft_sample
    from spd_fast.triton_kernels.verify import launch_verify_sampling

    dev = triton_device(device)
    V = 8
    logits = torch.linspace(-1.0, 1.0, V, device=dev)[None].repeat(2, 1)
    q = torch.full((2, V), 1.0 / V, device=dev)
    for bad in (-1, V, 10 * V):
        acc, tok = launch_verify_sampling(logits, torch.tensor([bad, 3], device=dev), q, 1.0, 0, 1.0,
                                          torch.tensor([[0.0, 0.5], [0.0, 0.5]], device=dev))
        assert not bool(acc[0]) and 0 <= int(tok[0]) < V and bool(acc[1]) and int(tok[1]) == 3, (bad, acc, tok)
    qbuf = torch.full((3, V + 4), -7.0, device=dev)  # row 1 of a wider buffer: its neighbours must stay untouched
    out_q = qbuf[1, :V]
    vocab = torch.tensor([0, 2, V + 1, 5], device=dev)
    tok, q1 = launch_draft_sample(torch.zeros(1, 4, device=dev), vocab, V, 1.0, 0, 1.0,
                                  torch.tensor([0.1], device=dev), out=(torch.empty(1, dtype=torch.long, device=dev),
                                                                        out_q[None]))
    assert torch.equal(qbuf[1, V:], torch.full((4,), -7.0, device=dev)) and torch.equal(qbuf[2], qbuf[0])
    assert set(torch.nonzero(out_q).flatten().tolist()) == {0, 2, 5}


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_signed_zero_tie_at_the_cut_is_kept_whole_on_every_backend(backend, cpp):
    """-0.0 and +0.0 compare equal in the twin; Triton's integer order key put -0.0 below +0.0, so a top-k / top-p
    cut between them kept one and dropped the other."""
    if backend == "triton":
        triton_device("cpu")
    vocab = torch.arange(4)
    u = torch.tensor([0.999])
    for x, k, p in [(torch.tensor([[2.0, 0.0, -0.0, -1.0]]), 2, 1.0),
                    (torch.tensor([[2.0, -0.0, 0.0, -1.0]]), 2, 1.0),
                    (torch.tensor([[3.0, 0.0, -0.0, -5.0]]), 0, 0.91)]:  # p(3.0) = 0.9094
        params = SamplingParams(temperature=1.0, top_k=k, top_p=p)
        want = ops_explicit.processed_probs(x, 1.0, k, p)
        assert int((want > 0).sum()) == 3  # the tie is kept whole
        tok, q = kernels.draft_sample(x, vocab, 4, params, u, backend=backend)
        assert torch.allclose(q, want, atol=1e-6, rtol=1e-6), (backend, x, q, want)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_nan_in_q_draws_the_correction_from_p_on_every_backend(backend, cpp):
    """A NaN in the draft's q (a head whose fp16 logits overflowed) makes the residual's sum NaN, so the twin
    draws the correction from p; Triton's tl.maximum dropped the NaN and drew from the rest of the residual."""
    if backend == "triton":
        triton_device("cpu")
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[-3.0, -2.0, 4.0, -1.0, 0.0, 1.2, -2.5, -4.0]])
    p = probs_from_logits(logits, params)
    q = p.clone()
    q[0, 5], q[0, 0] = 0.0, float("nan")
    q[0, 2] += p[0, 5]  # the residual without the NaN is all at token 5, p's 0.056
    for u1 in (0.05, 0.4, 0.8):
        u = torch.tensor([[0.5, u1]])
        want = verify_sampling_explicit(logits, torch.tensor([0]), q, 1.0, 0, 1.0, u)
        got = kernels.verify_sampling(logits, torch.tensor([0]), q, params, u, backend=backend)
        assert int(want[1]) == 2 and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (u1, got)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_top_k_past_int64_keeps_every_token_on_every_backend(backend, cpp):
    """SamplingParams takes any top_k >= 0 and one at or past the vocabulary is off; the fused ops' int64 argument
    refused top_k >= 2**63 with "Expected a value of type 'int' ... found type 'int'"."""
    if backend == "triton":
        triton_device("cpu")
    g = torch.Generator().manual_seed(3)
    logits, u = torch.randn(1, 10, generator=g), torch.rand(1, 2, generator=g)
    q = torch.softmax(torch.randn(1, 10, generator=g), -1)
    big, off = SamplingParams(temperature=1.0, top_k=2**63), SamplingParams(temperature=1.0)
    for fn, args in ((kernels.verify_sampling, (logits, torch.tensor([3]), q)),
                     (kernels.draft_sample, (logits, torch.arange(10), 10))):
        got, want = fn(*args, big, u if fn is kernels.verify_sampling else u[:, 0], backend=backend), \
            fn(*args, off, u if fn is kernels.verify_sampling else u[:, 0], backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_top_p_cut_at_a_real_vocabulary_size_is_the_exact_rule():
    """At V = 49,152 an fp32 softmax sums to about 1 + 4e-6: the twin's fp32 "mass before" moved the top-p cut and
    dropped a token of p = 3.8e-4 whose exact mass before is 0.9499983 < 0.95 (the fused ops kept it)."""
    V, T, p = 49152, 0.6, 0.95
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(V)) * 3
    sx = torch.sort(logits[0].double() / T, descending=True).values
    sp64 = torch.softmax(sx, -1)
    want = int((sp64.cumsum(0) - sp64 < p).sum())
    assert int((processed_probs(logits, T, 0, p) > 0).sum()) == want
    assert int((probs_from_logits(logits, SamplingParams(temperature=T, top_p=p)) > 0).sum()) == want


def test_a_top_p_under_fp32s_range_keeps_the_top_token_instead_of_nan():
    from spd_fast.sampling import MIN_TOP_P, probs_from_logits

    x = torch.tensor([2.0, 1.0, 0.5])
    params = SamplingParams(temperature=1.0, top_p=1e-46)
    assert params.top_p == MIN_TOP_P
    assert torch.equal(probs_from_logits(x, params), torch.tensor([1.0, 0.0, 0.0]))


def test_fused_backends_leave_training_gradients_to_the_twin(cpp):
    """With a process-wide fused backend (set_backend("cpp"), or "auto" on CPU), DraftHead.aggregate in training
    went through the C++ op, which has no backward: the gradients were silently lost."""
    x, types, w = agg_inputs(3, 2, 17, torch.float32, "cpu")
    grads = {}
    for backend in ("torch", "cpp"):
        wg = w.clone().requires_grad_(True)
        with kernels.use_backend(backend):
            ops.aggregate(x, types, wg).square().sum().backward()
        grads[backend] = wg.grad
    assert grads["cpp"] is not None and torch.allclose(grads["cpp"], grads["torch"])
    before = kernels.calls["aggregate/cpp"]
    with kernels.use_backend("cpp"), torch.no_grad():
        ops.aggregate(x, types, w.requires_grad_(True))  # inference still takes the fused op
    assert kernels.calls["aggregate/cpp"] == before + 1


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_decode_attention_takes_broadcast_and_int32_positions_on_every_backend(backend, cpp):
    if backend == "triton":
        triton_device("cpu")
    g = torch.Generator().manual_seed(3)
    B, T, nh, nkv, S, D = 2, 3, 4, 2, 16, 8
    q = torch.randn(B, T, nh, D, generator=g)
    kc, vc = torch.randn(B, nkv, S, D, generator=g), torch.randn(B, nkv, S, D, generator=g)
    full = torch.arange(5, 5 + T).expand(B, T)
    want = ops_explicit.decode_attention(q, kc, vc, full, 12)
    for pos in (torch.arange(5, 5 + T)[None], full.int()):
        before = kernels.calls[f"decode_attention/{backend}"]
        got = kernels.decode_attention(q, kc, vc, pos, 12, backend=backend)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert kernels.calls[f"decode_attention/{backend}"] == before + 1
    before = kernels.calls["decode_attention/torch"]
    kernels.decode_attention(q.double(), kc.double(), vc.double(), full, 12, backend="cpp" if backend == "cpp" else "torch")
    assert kernels.calls["decode_attention/torch"] == before + 1  # the fp32-only C++ op is not counted as run


def test_triton_decode_ops_take_empty_widths():
    triton_device("cpu")
    from spd_fast.triton_kernels.decode import launch_swiglu
    from spd_fast.triton_kernels.rmsnorm import launch_add_rmsnorm

    assert launch_swiglu(torch.zeros(3, 0)).shape == (3, 0)
    assert launch_swiglu(torch.zeros(0, 8)).shape == (0, 4)
    y, h = launch_add_rmsnorm(torch.zeros(0, 8), torch.zeros(0, 8), torch.ones(8), 1e-5)
    assert y.shape == h.shape == (0, 8)
    y, h = launch_add_rmsnorm(torch.zeros(2, 0), torch.zeros(2, 0), torch.ones(0), 1e-5)
    assert y.shape == h.shape == (2, 0)


def test_auto_leaves_dtypes_the_fused_ops_lack_to_the_twin(cpp):
    """backend="auto" chose the C++ op for integer logits (NotImplementedError) and Triton for fp64 on a GPU."""
    logits = torch.tensor([[1, 5, 3], [7, 2, 7]])
    before = kernels.calls["verify_greedy/torch"]
    acc, tok = kernels.verify_greedy(logits, torch.tensor([1, 0]), backend="auto")
    assert tok.tolist() == [1, 0] and acc.tolist() == [True, True]
    assert kernels.calls["verify_greedy/torch"] == before + 1
    x, types, w = agg_inputs(3, 2, 17, torch.float32, "cpu")
    got = kernels.aggregate(x.double(), types, w.double(), backend="auto")
    assert torch.allclose(got, ops.aggregate_torch(x.double(), types, w.double()))


def test_the_fused_decode_attention_takes_int32_positions_as_the_unfused_path_does(tiny_checkpoint, cpp):
    """Attention.forward passed int32 positions straight to the C++ decode_attention, which refused them ("int64
    positions [B, T] = [1, 3], got [1, 3]") where the unfused path took them."""
    from conftest import tiny_target
    from spd_fast.packed import enable_fused_ops

    m = tiny_target(tiny_checkpoint("llama"))
    m.setup_caches(1, 16)
    ids = torch.tensor([[5, 9, 2]])
    with torch.inference_mode():
        want = m(ids, torch.arange(3)[None])
    assert enable_fused_ops(m)
    with torch.inference_mode():
        for pos in (torch.arange(3)[None], torch.arange(3, dtype=torch.int32)[None]):
            torch.testing.assert_close(m(ids, pos), want, atol=1e-5, rtol=1e-5)


def test_a_row_without_mass_returns_an_index_inside_the_row():
    """A row without mass (every weight 0) gives an index inside the row, as the Triton and C++ ops do, not V."""
    from spd_fast.ops_explicit import sample_inverse_cdf

    assert int(sample_inverse_cdf(torch.zeros(3), torch.tensor(0.5))) == 0
    assert sample_inverse_cdf(torch.zeros(2, 5), torch.tensor([0.0, 0.9])).tolist() == [0, 0]

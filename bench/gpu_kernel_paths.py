"""Compiled Triton paths that tests/test_kernels.py's small shapes do not reach, checked against the PyTorch
twins at real sizes: a single row (B = 1, which Triton compiles as its own specialisation), vocabularies of
several tiles (Qwen's 152k), bf16 inputs, 8-warp RMSNorm, head dim 128 attention with the default split
count, and the greedy / sampling verification replayed from a CUDA graph with new inputs.

    python bench/gpu_kernel_paths.py                         # on a GPU (part of bench/gpu_check.py)
    TRITON_INTERPRET=1 python bench/gpu_kernel_paths.py --small   # the same logic on CPU, small shapes (tests)

One line per check; exit status 1 if any fails.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spd_fast import kernels, ops, ops_explicit as ox  # noqa: E402
from spd_fast.sampling import SamplingParams  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Paths:
    def __init__(self, device: str, small: bool):
        from spd_fast.triton_kernels import aggregate, decode, draft_sample, rmsnorm, verify

        self.k = dict(greedy=verify.launch_verify_greedy, sampling=verify.launch_verify_sampling,
                      draft=draft_sample.launch_draft_sample, rmsnorm=rmsnorm.launch_add_rmsnorm,
                      aggregate=aggregate.launch_aggregate, rope=decode.launch_rope_inplace,
                      attention=decode.launch_decode_attention)
        self.dev, self.small = device, small
        # vocabulary, draft vocabulary, hidden size, KV slots
        self.V, self.Vd, self.H, self.S = (5000, 1500, 96, 128) if small else (152064, 32768, 4096, 2048)

    def greedy(self) -> str:
        for dt in (torch.float32, torch.bfloat16):
            for B in (1, 3):
                x = (torch.randn(B, self.V, generator=_gen(B)) * 3).to(dt)
                x[:, -1] = x.float().max() + 1  # the maximum in the last tile
                x[0, 7] = x[0, -1]  # a tie: the lower index wins
                x = x.to(self.dev)
                logits = x[0] if B == 1 else x
                _, tok = self.k["greedy"](logits, torch.zeros(logits.shape[:-1], dtype=torch.long, device=self.dev))
                want = logits.float().argmax(-1)
                assert torch.equal(tok.cpu(), want.cpu()), f"{dt} B={B}: {tok.tolist()} != {want.tolist()}"
        return ""

    def sampling(self) -> str:
        bad = rows = 0
        for params in ((1.0, 0, 1.0), (0.7, 50, 0.9), (1.3, 1, 1.0), (0.8, 0, 0.95)):
            for seed in range(3 if self.small else 8):
                g = _gen(seed)
                for B in (1, 4):
                    logits = (torch.randn(B, self.V, generator=g) * 2).to(self.dev)
                    q = torch.softmax(torch.randn(B, self.V, generator=g) * 2, -1)
                    x = torch.multinomial(q, 1, generator=g)[:, 0].to(self.dev)
                    u = torch.rand(B, 2, generator=g).to(self.dev)
                    q = q.to(self.dev)
                    if B == 1:
                        logits, q, x, u = logits[0], q[0], x[0], u[0]
                    acc, tok = self.k["sampling"](logits, x, q, *params, u)
                    want_acc, want_tok = ox.verify_sampling_explicit(logits, x, q, *params, u)
                    rows += tok.numel()
                    bad += int((tok != want_tok).sum()) + int((acc != want_acc).sum())
        # summation order differs from the twin's: a uniform within rounding of a CDF step may land apart
        assert bad <= max(1, rows // 100), f"{bad} mismatches in {rows} rows"
        return f"{bad}/{rows} rows differ from the twin"

    def draft(self) -> str:
        bad = 0
        for params in ((0.7, 0, 1.0), (0.7, 50, 0.9)):
            for seed in range(3 if self.small else 6):
                g = _gen(seed)
                vocab = torch.randperm(self.V, generator=g)[: self.Vd].to(self.dev)
                logits = (torch.randn(self.Vd, generator=g) * 3).to(torch.bfloat16).to(self.dev)
                u = torch.rand((), generator=g).to(self.dev)
                tok, q = self.k["draft"](logits, vocab, self.V, *params, u)
                want_tok, want_q = ox.draft_sample_explicit(logits, vocab, self.V, *params, u)
                bad += int(tok != want_tok)
                err = float((q - want_q).abs().max())
                assert err < 1e-6, f"q differs from the twin's by {err}"
                outside = torch.ones(self.V, dtype=torch.bool, device=self.dev)
                outside[vocab] = False
                assert float(q[outside].abs().sum()) == 0.0, "q has mass outside the draft vocabulary"
        assert bad <= 1, f"{bad} draft tokens differ from the twin's"
        return f"{bad} tokens differ from the twin"

    def rmsnorm(self) -> str:
        for H in ((self.H, 4100) if self.small else (self.H, 2 * self.H)):
            for N in (1, 3):
                x, r = (torch.randn(N, H, generator=_gen(N + i)).to(torch.bfloat16).to(self.dev) for i in range(2))
                w = torch.rand(H, generator=_gen(9)).to(torch.bfloat16).to(self.dev)
                y, h = self.k["rmsnorm"](x, r, w, 1e-6)
                want_y, want_h = ox.add_rmsnorm(x, r, w, 1e-6)
                if self.small:  # the interpreter truncates fp32 -> bf16 (1 ulp); compiled code rounds like torch
                    assert float((h.float() - want_h.float()).abs().max()) <= 2 ** -7 * float(want_h.float().abs().max())
                else:
                    assert torch.equal(h, want_h), "the residual sum differs from torch's"
                err = float((y.float() - want_y.float()).abs().max())
                assert err <= 2e-2 * float(want_y.float().abs().max()), f"H={H} N={N}: normed rows off by {err}"
        return ""

    def rope(self) -> str:
        D, heads, N = 128, 40, 3
        base = torch.randn(N, heads * D + 8 * D, generator=_gen(3)).to(torch.bfloat16).to(self.dev)
        x = base[:, : heads * D].view(N, heads, D)  # rows strided as in a fused QKV projection
        cos, sin = torch.randn(N, D, generator=_gen(4)).to(self.dev), torch.randn(N, D, generator=_gen(5)).to(self.dev)
        want = ox.rope_inplace(x.clone(), cos, sin)
        self.k["rope"](x, cos, sin)
        err = float(((x.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)).max())
        assert err <= 1e-2, f"relative error {err}"
        return ""

    def attention(self) -> str:
        B, T, nh, nkv, D, S = 1, 3, 32, 8, 128, self.S
        q = torch.randn(B, T, nh, D, generator=_gen(6)).to(torch.bfloat16).to(self.dev)
        k = torch.randn(B, nkv, S, D, generator=_gen(7)).to(torch.bfloat16).to(self.dev)
        v = torch.randn(B, nkv, S, D, generator=_gen(8)).to(torch.bfloat16).to(self.dev)
        pos = torch.tensor([[5, S // 2, S - 1]], device=self.dev)
        for bound in (S, S // 2 + 3):
            got = self.k["attention"](q, k, v, pos, bound)
            want = ox.decode_attention(q.float(), k.float(), v.float(), pos, bound)
            err = float((got.float() - want).abs().max())
            assert err < 3e-2, f"kv_bound {bound}: off by {err}"
        return ""

    def aggregate(self) -> str:
        m, H = 4, self.H // 2
        g = _gen(11)
        types = torch.tensor([3, 2, 1, 0, 3])
        w = torch.zeros(m, H, m * H)
        for i in range(m):
            w[i, :, : (i + 1) * H] = torch.randn(H, (i + 1) * H, generator=g) / ((i + 1) * H) ** 0.5
        rows = torch.randn(len(types), m, H, generator=g)
        rows[1, 3] = float("nan")  # a stale anchor above the row's type must not leak into its output
        for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            a, t, wd = rows.to(self.dev, dt), types.to(self.dev), w.to(self.dev, dt)
            got = self.k["aggregate"](a, t, wd)
            want = ops.aggregate_torch(a.float(), t, wd.float())
            assert bool(torch.isfinite(got).all()), f"{dt}: a stale NaN anchor leaked"
            err = float((got.float() - want).abs().max())
            assert err < tol * (1 + float(want.abs().max())), f"{dt}: off by {err}"
        return ""

    def graph_replay(self) -> str:
        if self.dev != "cuda":
            return "skipped (needs CUDA)"
        sp = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
        V = self.V
        logits = torch.randn(V, device=self.dev)
        d = torch.zeros((), dtype=torch.long, device=self.dev)
        u = torch.rand(2, device=self.dev)
        q = torch.softmax(torch.randn(V, device=self.dev), -1)

        def step():
            return (kernels.verify_greedy(logits, d, backend="triton"),
                    kernels.verify_sampling(logits, d, q, sp, u, backend="triton"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for i in range(3):  # new inputs copied into the captured buffers, then replayed
            logits.copy_(torch.randn(V, device=self.dev))
            u.copy_(torch.rand(2, device=self.dev))
            graph.replay()
            torch.cuda.synchronize()
            ref = step()
            assert torch.equal(out[0][1], ref[0][1]) and torch.equal(out[1][1], ref[1][1]), f"replay {i} differs"
        return ""

    def timing(self) -> str:
        if self.dev != "cuda":
            return "skipped (needs CUDA)"
        from triton.testing import do_bench

        V = self.V
        logits = torch.randn(V, device=self.dev)
        d = torch.zeros((), dtype=torch.long, device=self.dev)
        q = torch.softmax(torch.randn(V, device=self.dev), -1)
        u = torch.rand(2, device=self.dev)
        us = {name: 1e3 * do_bench(fn, return_mode="median") for name, fn in (
            ("verify_greedy", lambda: self.k["greedy"](logits, d)),
            ("verify_sampling k50 p0.9", lambda: self.k["sampling"](logits, d, q, 0.7, 50, 0.9, u)),
            ("torch argmax", lambda: logits.argmax()))}
        return f"V={V}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items())


CHECKS = [("verify_greedy: several tiles, B=1, bf16, a tie", "greedy"),
          ("verify_sampling: B=1 and B=4, large V", "sampling"), ("draft_sample: B=1, bf16, large V", "draft"),
          ("add_rmsnorm: 8-warp H", "rmsnorm"), ("rope: D=128, bf16, strided rows", "rope"),
          ("decode_attention: bf16, default splits", "attention"),
          ("aggregate: fp32/bf16, stale NaN anchor", "aggregate"),
          ("CUDA graph replay of the verification kernels", "graph_replay"),
          ("timing (one program per row)", "timing")]


def run(device: str, small: bool, log: Callable[[str], None] = print) -> list[dict]:
    """Every check, each in its own try: one failure does not hide the others."""
    paths = Paths(device, small)
    rows = []
    for name, attr in CHECKS:
        t = time.perf_counter()
        try:
            note = getattr(paths, attr)()
            rows.append({"check": name, "ok": True, "note": note, "skipped": note.startswith("skipped")})
        except Exception as e:
            rows.append({"check": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-1500:]})
        r = rows[-1]
        log(f"{'ok  ' if r['ok'] else 'FAIL'} {name}: {r.get('note') or r.get('error', '')} "
            f"({time.perf_counter() - t:.1f} s)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU shapes, under TRITON_INTERPRET=1")
    a = p.parse_args(argv)
    if not a.small and not torch.cuda.is_available():
        print("gpu_kernel_paths: no CUDA device here; run it on a GPU, or use --small with TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    rows = run("cpu" if a.small else "cuda", a.small)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

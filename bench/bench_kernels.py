"""Fused ops of the decode cycle: fast backend vs PyTorch twin (vs torch.compile of the twin on a GPU).

GPU (CUDA + Triton): triton.testing.do_bench medians of kernel / twin / torch.compile(twin), the
bytes each op must move at least, and the bandwidth that implies next to a measured device copy.
CPU: the C++ ops (spd_fast/csrc/) vs the twins, median wall time and ratio. Shapes: the default model
(SmolLM2-135M, n=3), Llama-3-8B (128k vocab) and Qwen2-7B (152k vocab), one sequence.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_kernels.py --cpu    # -> bench/results/kernels_cpu.json
    .venv/bin/python bench/bench_kernels.py --gpu                      # -> bench/results/kernels_gpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from spd_fast import cpp_ops, kernels, ops, ops_explicit
from spd_fast.runtime import cpu_name
from spd_fast.sampling import SamplingParams

# H hidden, m anchor types (n + 1), V vocabulary, Vd draft vocabulary
SHAPES = {
    "smollm2-135m": dict(H=576, m=4, V=49152, Vd=49152),
    "llama3-8b": dict(H=4096, m=5, V=128256, Vd=32768),
    "qwen2-7b": dict(H=3584, m=5, V=152064, Vd=32768),
}
SAMPLING = {"t0.7": (0.7, 0, 1.0), "t0.7-k50-p0.9": (0.7, 50, 0.9)}


def make_inputs(shape: dict, dtype: torch.dtype, device: str, prefill: int = 0) -> dict:
    g = torch.Generator().manual_seed(0)
    H, m, V, Vd = shape["H"], shape["m"], shape["V"], shape["Vd"]
    # a full pipeline's rows: depths n-1 .. 0 plus the newly committed depth-n row; prefill: R rows of type m-1
    types = torch.full((prefill,), m - 1) if prefill else torch.arange(m - 1, -1, -1)
    w = torch.zeros(m, H, m * H, dtype=dtype)
    for i in range(m):
        w[i, :, : (i + 1) * H] = (torch.randn(H, (i + 1) * H, generator=g) / ((i + 1) * H) ** 0.5).to(dtype)
    q = torch.softmax(torch.randn(V, generator=g) * 3, -1)
    return {k: v.to(device) for k, v in dict(
        rows=torch.randn(len(types), m, H, generator=g).to(dtype), types=types, w=w,
        logits=torch.randn(V, generator=g) * 3, draft=torch.tensor(7), q=q, u2=torch.rand(2, generator=g),
        logits_d=torch.randn(Vd, generator=g) * 3, vocab=torch.randperm(V, generator=g)[:Vd], u1=torch.rand((), generator=g),
        x=torch.randn(1, H, generator=g).to(dtype), res=torch.randn(1, H, generator=g).to(dtype),
        norm_w=torch.rand(H, generator=g).to(dtype)).items()}


def min_bytes(op: str, a: dict, shape: dict) -> int:
    """What the op must read and write at least once."""
    e = a["rows"].element_size()
    H, V = shape["H"], shape["V"]
    if op.startswith("aggregate"):
        types = set(a["types"].tolist())
        return sum((t + 1) * H * H for t in types) * e + sum((t + 1) * H for t in a["types"].tolist()) * e + a["rows"].shape[0] * H * e
    if op == "verify_greedy":
        return V * a["logits"].element_size()
    if op.startswith("verify_sampling"):
        return V * (a["logits"].element_size() + 4)
    if op.startswith("draft_sample"):
        return shape["Vd"] * (a["logits_d"].element_size() + 8) + V * 4
    return 5 * H * e  # add_rmsnorm: x, residual, weight in; y, h out


def cases(a: dict, V: int) -> dict[str, tuple[Callable[[str], Callable], Callable]]:
    """op -> (backend -> a call of the op on that backend, a call of its twin)."""
    out: dict[str, tuple[Callable[[str], Callable], Callable]] = {
        "aggregate": (lambda b: lambda: kernels.aggregate(a["rows"], a["types"], a["w"], backend=b),
                      lambda: ops.aggregate_torch(a["rows"], a["types"], a["w"])),
        "verify_greedy": (lambda b: lambda: kernels.verify_greedy(a["logits"], a["draft"], backend=b),
                          lambda: ops.verify_greedy_torch(a["logits"], a["draft"])),
    }
    for name, (t, k, p) in SAMPLING.items():
        sp = SamplingParams(temperature=t, top_k=k, top_p=p)
        out[f"verify_sampling[{name}]"] = (
            lambda b, sp=sp: lambda: kernels.verify_sampling(a["logits"], a["draft"], a["q"], sp, a["u2"], backend=b),
            lambda t=t, k=k, p=p: ops_explicit.verify_sampling_explicit(a["logits"], a["draft"], a["q"], t, k, p, a["u2"]))
        out[f"draft_sample[{name}]"] = (
            lambda b, sp=sp: lambda: kernels.draft_sample(a["logits_d"], a["vocab"], V, sp, a["u1"], backend=b),
            lambda t=t, k=k, p=p: ops_explicit.draft_sample_explicit(a["logits_d"], a["vocab"], V, t, k, p, a["u1"]))
    return out


# decode hot path: heads, KV heads, head dim, MLP width of each shape (one token, cache of 2048, at 1024)
HOT = {"smollm2-135m": (9, 3, 64, 1536), "llama3-8b": (32, 8, 128, 14336), "qwen2-7b": (28, 4, 128, 18944)}


def hot_path_cases(name: str, dev: str, S: int = 2048, pos: int = 1024):
    """The decode hot-path kernels of one layer (bf16), with the bytes each must move."""
    nh, nkv, D, inter = HOT[name]
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    x = torch.randn(1, nh + nkv, D, generator=g).to(bf).to(dev)
    cos, sin = torch.randn(1, D, generator=g).to(dev), torch.randn(1, D, generator=g).to(dev)
    gu = torch.randn(1, 2 * inter, generator=g).to(bf).to(dev)
    q = torch.randn(1, 1, nh, D, generator=g).to(bf).to(dev)
    kc = torch.randn(1, nkv, S, D, generator=g).to(bf).to(dev)
    vc = torch.randn(1, nkv, S, D, generator=g).to(bf).to(dev)
    p = torch.tensor([[pos]], device=dev)
    cases = {
        "rope_inplace": (lambda b: lambda: kernels.rope_inplace(x, cos, sin, backend=b),
                         lambda: ops_explicit.rope_inplace(x, cos, sin)),
        "swiglu": (lambda b: lambda: kernels.swiglu(gu, backend=b), lambda: ops_explicit.swiglu(gu)),
        "decode_attention": (lambda b: lambda: kernels.decode_attention(q, kc, vc, p, S, backend=b),
                             lambda: ops_explicit.decode_attention(q, kc, vc, p, S)),
    }
    nbytes = {"rope_inplace": 2 * x.numel() * 2 + 2 * cos.numel() * 4, "swiglu": 3 * inter * 2,
              "decode_attention": 2 * nkv * (pos + 1) * D * 2 + 2 * nh * D * 2}
    return cases, nbytes


def cpu_median_us(fn: Callable, min_time: float = 0.3, min_reps: int = 5) -> float:
    fn()  # warm-up (and the C++ build on first use)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def run_cpu(out: Path) -> None:
    if not cpp_ops.available():
        raise SystemExit("the C++ ops did not build; nothing to compare")
    rows = []
    plan = [("smollm2-135m", torch.float32, 0), ("smollm2-135m", torch.bfloat16, 0), ("smollm2-135m", torch.float32, 16),
            ("qwen2-7b", torch.float32, 0)]
    for name, dtype, prefill in plan:
        shape = SHAPES[name]
        a = make_inputs(shape, dtype, "cpu", prefill)
        for op, (fast, twin) in cases(a, shape["V"]).items():
            if (prefill or dtype != torch.float32) and not op.startswith("aggregate"):
                continue  # the vocabulary ops read fp32 logits; prefill only changes aggregation
            if name == "qwen2-7b" and op == "aggregate":
                continue  # 5 x 3584 x 17920 weights: not a CPU workload
            label = f"{op}[prefill{prefill}]" if prefill else op
            t_twin, t_cpp = cpu_median_us(twin), cpu_median_us(fast("cpp"))
            row = dict(op=label, shape=name, dtype=str(dtype).removeprefix("torch."), twin_us=round(t_twin, 1),
                       cpp_us=round(t_cpp, 1), speedup=round(t_twin / t_cpp, 2))
            rows.append(row)
            print(f"| {label:32s} | {name:13s} | {row['dtype']:8s} | {t_twin:10.1f} | {t_cpp:10.1f} | {row['speedup']:6.2f}x |",
                  flush=True)
    meta = dict(device="cpu", threads=torch.get_num_threads(), torch=torch.__version__, machine=platform.machine(),
                processor=cpu_name(), note="median wall time per call, microseconds")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def run_gpu(out: Path, compile: bool = True) -> None:
    """`compile=False` skips torch.compile of the twins (tens of seconds each), for a short lease.
    The JSON is rewritten after every row, so a run cut short keeps what it measured."""
    import triton
    from triton.testing import do_bench

    dev = "cuda"
    big = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    copy_ms = do_bench(lambda: big.clone(), return_mode="median")
    copy_gbs = 2 * big.numel() / copy_ms / 1e6
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (triton {triton.__version__})")
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbs=copy_gbs, dtype="bfloat16 (logits fp32)", note="do_bench medians, microseconds",
                compiled=compile)
    for name, shape in SHAPES.items():
        a = make_inputs(shape, torch.bfloat16, dev)
        todo = cases(a, shape["V"])
        todo["add_rmsnorm"] = (lambda b: lambda: kernels.add_rmsnorm(a["x"], a["res"], a["norm_w"], 1e-6, backend=b),
                               lambda: ops_explicit.add_rmsnorm(a["x"], a["res"], a["norm_w"], 1e-6))
        hot, hot_bytes = hot_path_cases(name, dev)
        todo.update(hot)
        for op, (fast, twin) in todo.items():
            res = dict(op=op, shape=name, bytes=hot_bytes[op] if op in hot_bytes else min_bytes(op, a, shape))
            res["kernel_us"] = 1e3 * do_bench(fast("triton"), return_mode="median")
            res["twin_us"] = 1e3 * do_bench(twin, return_mode="median")
            res["compiled_us"] = None
            try:
                if compile:
                    res["compiled_us"] = 1e3 * do_bench(torch.compile(twin, dynamic=False), return_mode="median")
            except Exception as e:  # report, do not hide: some twins may not compile
                res["compiled_us"], res["compile_error"] = None, f"{type(e).__name__}: {e}"[:200]
            res["kernel_gbs"] = res["bytes"] / res["kernel_us"] / 1e3
            res["floor_us"] = res["bytes"] / copy_gbs / 1e3
            rows.append(res)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
            comp = f"{res['compiled_us']:9.1f}" if res["compiled_us"] else ("    error" if compile else "  skipped")
            print(f"| {op:28s} | {name:13s} | {res['kernel_us']:9.1f} | {res['twin_us']:9.1f} | {comp} | "
                  f"{res['kernel_gbs']:7.0f} GB/s | floor {res['floor_us']:6.1f} us |", flush=True)
        fused = sum(r["kernel_us"] for r in rows[-len(todo):] if r["op"] in
                    ("aggregate", "verify_greedy", "draft_sample[t0.7]"))
        print(f"  {name}: aggregate + verify_greedy + draft_sample[t0.7] = {fused:.1f} us per cycle")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="C++ ops vs twins (default when there is no GPU)")
    p.add_argument("--gpu", action="store_true", help="Triton kernels vs twins vs torch.compile")
    p.add_argument("--out-dir", default="bench/results")
    a = p.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.gpu or (not a.cpu and torch.cuda.is_available()):
        print("| op | shape | kernel us | twin us | compiled us | bandwidth | floor |")
        run_gpu(out / "kernels_gpu.json")
    if a.cpu or not torch.cuda.is_available():
        print(f"| op | shape | dtype | twin us | C++ us | speedup |  ({torch.get_num_threads()} thread(s))")
        run_cpu(out / "kernels_cpu.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

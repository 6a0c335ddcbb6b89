"""The GPU check: one command, one device lease (about 8 minutes on one H200).

    python bench/gpu_check.py --out "$OUT"          # on the GPU machine
    python bench/gpu_check.py --cpu-dry-run --out /tmp/x   # the same logic on CPU, tiny shapes (CI)

1. Exactness: greedy SPD == AR token for token with every placement this machine has (sequential,
   streams eager, streams + CUDA graph, devices when there are >= 2 GPUs), with a random PDM and
   with a drafter that is right half the time (so both accept and reject paths run).
2. Timings on random weights (the device machine reaches no hub, so real weights cannot come
   along) for (a) the default model's shape and (b) a Llama-3.2-1B shape, bf16:
   graphed AR vs its HBM roofline (bytes per token / measured copy bandwidth), and SPD on streams
   with CUDA graphs for n = 2, 3, 5. Acceptance is imposed by a drafter that is right with the
   probability the shipped head for that n measured on CPU (--acceptance sets one for all n); a PDM of the
   shipped heads' shape (their tower depth; at the default model's shape their anchors too) still runs every
   cycle, so its cost is in the timings. Per cycle: each phase captured as its own graph and
   replayed, overhead = whole cycle - the slower of the slowest stage and the PDM (which runs beside them).
3. The Triton kernels at real sizes and under CUDA-graph replay (bench/gpu_kernel_paths.py), the GPU
   kernel tests (tests/test_kernels.py compiled, not interpreted) and the kernel benchmark (--compile adds
   torch.compile of the twins, several minutes), last, so a lease cut short keeps 1 and 2.
Every check is caught on its own (one failure does not hide the others), sections that would start after
--deadline seconds are skipped, and the exit status is 1 on any failed check, inexact timing run, error or
skipped section.
Prints a short table last and writes everything to OUT/gpu_check.json (rewritten after every section).
"""
from __future__ import annotations

import time

T0 = time.perf_counter()  # --deadline counts from here, before the imports and CUDA's start-up

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spd_fast.ar import decode_ar  # noqa: E402
from spd_fast.config import ModelConfig, uniform_boundaries  # noqa: E402
from spd_fast.drafters import PdmDrafter, ReferenceDrafter  # noqa: E402
from spd_fast.engine import SPDEngine  # noqa: E402
from spd_fast.graphed_ar import GraphedAR  # noqa: E402
from spd_fast.model import Transformer  # noqa: E402
from spd_fast.pdm import DraftConfig, DraftHead, random_draft_head  # noqa: E402
from spd_fast.pipeline import PipelinedEngine  # noqa: E402
from spd_fast.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams()
SHAPES = {
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True),
    "llama-1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, rope_theta=500000.0,
                            tie_word_embeddings=True),
}
TINY = ModelConfig("llama", 512, 64, 128, 6, 4, 2, 16, tie_word_embeddings=True)


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, max_len: int, seed: int = 0) -> Transformer:
    # a generator of its own, and the modules built on the meta device (their own initialisers would draw from the
    # default generator): a capture that failed earlier can leave the default CUDA generator unusable, which would
    # fail every later section at its model's initialisation
    g = torch.Generator(device=device).manual_seed(seed)
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = Transformer(cfg)
    m = m.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each use of a shared parameter its own tensor
        m.lm_head.weight = m.embed.weight
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, 0.0, 0.05, generator=g)
            else:
                torch.nn.init.ones_(p)
    m = m.to(dtype).eval().requires_grad_(False)
    m.setup_caches(1, max_len)
    return m


SHIPPED = json.loads((ROOT / "spd_fast" / "heads" / "smollm2-135m-instruct-n3" / "draft_config.json").read_text())


def random_head(m: Transformer, n: int, layers: int = 2, vocab: int = 16384) -> DraftHead:
    dcfg = DraftConfig.make(m.cfg, uniform_boundaries(m.cfg.num_layers, n), None, layers, min(vocab, m.cfg.vocab_size))
    return random_draft_head(m, dcfg)  # the API's own random head (draft="random"), so its placement is checked


def timing_head(m: Transformer, n: int) -> DraftHead:
    """A random PDM of the shipped heads' shape, so a timing pays their drafting cost: their tower depth and
    draft vocabulary, and at the default model's layer count their anchors (every shipped n reads the same)."""
    anchors = SHIPPED["anchors"] if m.cfg.num_layers == SHIPPED["boundaries"][-1] else None
    dcfg = DraftConfig.make(m.cfg, uniform_boundaries(m.cfg.num_layers, n), anchors, SHIPPED["num_layers"],
                            min(SHIPPED["draft_vocab_size"], m.cfg.vocab_size))
    return random_draft_head(m, dcfg)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


class Clock:
    """CUDA-event (GPU) or perf_counter (CPU) timing of `reps` calls, in microseconds per call."""

    def __init__(self, dev: str):
        self.dev = dev

    def us(self, fn, reps: int) -> float:
        fn()
        sync(self.dev)
        if self.dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            return 1e3 * a.elapsed_time(b) / reps
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e6 * (time.perf_counter() - t) / reps


# ---- 1. kernels -----------------------------------------------------------------------------------
def kernel_tests(out: Path, timeout: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    t = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_kernels.py", "-k", "cuda or triton or reproduces"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        (out / "kernel_tests.log").write_text(r.stdout + r.stderr)
        last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
        return {"ok": r.returncode == 0, "summary": last, "seconds": round(time.perf_counter() - t, 1)}
    except subprocess.TimeoutExpired as e:  # keep what ran: which tests passed, and where it stood
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        (out / "kernel_tests.log").write_text(text(e.stdout) + text(e.stderr))
        return {"ok": False, "summary": f"timed out after {timeout} s (partial log: kernel_tests.log)",
                "seconds": timeout}


def kernel_paths(dry: bool) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_kernel_paths

    rows = gpu_kernel_paths.run("cpu" if dry else "cuda", small=dry, log=lambda line: print(line, flush=True))
    return {"ok": all(r["ok"] for r in rows), "checks": rows}


KERNEL_BENCH_S = 90.0  # about what kernel_bench takes on an H200 (three shapes, Triton compiles included)


def kernel_bench(out: Path, compile: bool = True) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_kernels

    t = time.perf_counter()
    bench_kernels.run_gpu(out / "kernels_gpu.json", compile=compile)
    rows = json.loads((out / "kernels_gpu.json").read_text())["rows"]
    within = [r for r in rows if r["kernel_us"] <= max(1.5 * r["floor_us"], 10.0)]
    wins = [r for r in rows if r["kernel_us"] < r["twin_us"] and (r.get("compiled_us") is None
                                                                    or r["kernel_us"] < r["compiled_us"])]
    return {"ops": len(rows), "within_goal": len(within), "beat_twin_and_compile": len(wins),
            "seconds": round(time.perf_counter() - t, 1)}


# ---- 2. exactness ---------------------------------------------------------------------------------
def gated(head):
    """A head whose lookup gate acts (a random head is never sure, so confidence 0 makes it): the
    gate's device-side ops run in every executor and CUDA graph below."""
    head.dcfg = dataclasses.replace(head.dcfg, lookup_gate_confidence=0.0, lookup_gate_ratio=0.5)
    return head


def boosted(head):
    """A gated head that also boosts copies when sampling (lookup_copy_boost): its device-side ops
    (slot lookup, scatter_add into the draft logits) run in the sampled checks below."""
    head.dcfg = dataclasses.replace(gated(head).dcfg, lookup_copy_boost=2.5)
    return head


def attempt(rows: list[dict], name: str, fn) -> None:
    """One check: fn() -> ok or (ok, extra fields); an exception fails this check alone."""
    try:
        res = fn()
        ok, extra = res if isinstance(res, tuple) else (res, {})
        rows.append({"check": name, "ok": bool(ok), **extra})
    except Exception as e:
        rows.append({"check": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-2000:]})
        print(f"  FAIL {name}: {type(e).__name__}: {e}", flush=True)


def _reference(dev: str, dtype: torch.dtype, cfg: ModelConfig, new: int) -> tuple:
    """(random model, prompt ids, greedy tokens of the static AR step run eagerly): the reference of the pipelined
    checks. Eager, so a failed capture of the graphed AR fails its own check instead of every check after it."""
    m = random_model(cfg, dev, dtype, max_len=256)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    return m, ids, GraphedAR(m, cuda_graphs=False).run(ids, new, GREEDY, []).token_ids


def exactness(dev: str, dtype: torch.dtype, cfg: ModelConfig, n: int, new: int, placements: list[str],
              rows: list[dict] | None = None) -> list[dict]:
    """Appends to `rows` as it goes, so a section that dies keeps the checks it finished."""
    rows = [] if rows is None else rows
    m, ids, static = _reference(dev, dtype, cfg, new)
    eager = decode_ar(m, ids, new, GREEDY, []).token_ids
    graphs = dev == "cuda"
    # graphed AR attends over the whole static cache, eager AR over a bound that grows: in bf16 a near-tie can
    # flip on that alone, so the graph itself is judged against the same static step run eagerly
    attempt(rows, "graphed AR == the same static step eager",
            lambda: GraphedAR(m, cuda_graphs=graphs).run(ids, new, GREEDY, []).token_ids == static)
    # information only (not in the exit status): see above
    attempt(rows, "graphed AR == eager AR (information: a bf16 near-tie may differ)",
            lambda: (static == eager, {"info": True}))
    b = uniform_boundaries(cfg.num_layers, n)
    full = [0] * len(ids) + static
    drafters = {"random PDM": lambda: PdmDrafter(random_head(m, n, layers=1, vocab=4096)),
                "random PDM + gated lookup 3": lambda: PdmDrafter(gated(random_head(m, n, layers=1, vocab=4096)), lookup=3),
                "right 50%": lambda: ReferenceDrafter(full, cfg.vocab_size, "bernoulli", p_right=0.5, seed=2)}

    def spd(runner, want):
        r = runner.run(ids, new, GREEDY, [])
        return r.token_ids == want, {"acceptance": round(r.metrics["acceptance_rate"], 3)}
    for dname, mk in drafters.items():
        attempt(rows, f"sequential SPD n={n} [{dname}] == eager AR", lambda mk=mk: spd(SPDEngine(m, mk(), b), eager))
        for pl in placements:
            if pl == "devices":
                continue
            for cg in ([False, True] if graphs else [False]):
                attempt(rows, f"{pl}{' + graph' if cg else ''} SPD n={n} [{dname}] == graphed AR",
                        lambda mk=mk, pl=pl, cg=cg: spd(PipelinedEngine(SPDEngine(m, mk(), b), pl, cuda_graphs=cg),
                                                        static))
    # sampled decoding with a boosted, gated lookup: every executor runs it, a seed reproduces it, another seed
    # gives another sample on the same engine (a graph that replayed frozen random numbers would not), and the
    # graph samples what the same cycle samples eagerly
    hot = SamplingParams(temperature=0.8)

    def sampled(pl: str, cg: bool, seeds: tuple[int, ...]) -> list[list[int]]:
        eng = SPDEngine(m, PdmDrafter(boosted(random_head(m, n, layers=1, vocab=4096)), lookup=3), b)
        runner = eng if pl == "sequential" else PipelinedEngine(eng, pl, cuda_graphs=cg)
        gen = torch.Generator(device=dev)
        return [runner.run(ids, new, hot, [], gen.manual_seed(s)).token_ids for s in seeds]
    for pl in ["sequential"] + [p for p in placements if p != "devices"]:
        for cg in ([False, True] if graphs and pl != "sequential" else [False]):
            name = f"{pl}{' + graph' if cg else ''} SPD n={n} [boosted lookup, T=0.8]"
            attempt(rows, f"{name} seeded twice gives the same tokens",
                    lambda pl=pl, cg=cg: (lambda o: o[0] == o[1] and len(o[0]) == new)(
                        [sampled(pl, cg, (7,))[0] for _ in range(2)]))
            attempt(rows, f"{name} seeds 7, 8, 7 on one engine: 7 repeats, 8 differs",
                    lambda pl=pl, cg=cg: (lambda o: o[0] == o[2] and o[0] != o[1])(sampled(pl, cg, (7, 8, 7))))
    if graphs:
        attempt(rows, f"streams + graph SPD n={n} [boosted lookup, T=0.8] == the same cycle eager, same seed",
                lambda: sampled("streams", True, (7,)) == sampled("streams", False, (7,)))

        def graphed_ar_sampled(cg: bool) -> list[int]:
            return GraphedAR(m, cuda_graphs=cg).run(ids, new, hot, [], torch.Generator(device=dev).manual_seed(7)).token_ids
        attempt(rows, "graphed AR T=0.8 == the same static step eager, same seed",
                lambda: graphed_ar_sampled(True) == graphed_ar_sampled(False))
    if "devices" in placements:
        k = min(torch.cuda.device_count(), n)

        def devices():
            md = random_model(cfg, dev, dtype, max_len=256)
            bd = uniform_boundaries(cfg.num_layers, k)
            drafter = ReferenceDrafter(full, cfg.vocab_size, "bernoulli", 0.5, 2)
            ok = PipelinedEngine(SPDEngine(md, drafter, bd), "devices").run(ids, new, GREEDY, []).token_ids == static
            ar_ok = decode_ar(md, ids, new, GREEDY, []).token_ids == eager  # norm + LM head after the last GPU
            return ok and ar_ok, {"ar_after_placing": ar_ok}
        attempt(rows, f"devices SPD n={k} ({k} GPUs) == graphed AR, and AR on the placed model", devices)
    return rows


def triton_cycle(dev: str, dtype: torch.dtype, cfg: ModelConfig, n: int, new: int,
                 rows: list[dict] | None = None) -> list[dict]:
    """The Triton verification and aggregation inside the captured cycle, on side streams: after the timings, since
    a compiled kernel that faults would poison the CUDA context for every later section."""
    from spd_fast import kernels

    rows = [] if rows is None else rows
    m, ids, static = _reference(dev, dtype, cfg, new)
    b = uniform_boundaries(cfg.num_layers, n)

    def run():
        with kernels.use_backend("triton"):
            eng = SPDEngine(m, PdmDrafter(gated(random_head(m, n, layers=1, vocab=4096)), lookup=3), b)
            r = PipelinedEngine(eng, "streams", cuda_graphs=True).run(ids, new, GREEDY, [])
        return r.token_ids == static, {"acceptance": round(r.metrics["acceptance_rate"], 3)}
    attempt(rows, f"streams + graph SPD n={n} [Triton kernels, gated lookup] == graphed AR", run)
    return rows


# ---- 3. timings -----------------------------------------------------------------------------------
def copy_bandwidth(dev: str, clock: Clock) -> float:
    x = torch.empty(1 << (30 if dev == "cuda" else 24), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    us = clock.us(lambda: y.copy_(x), 10 if dev == "cuda" else 3)
    return 2 * x.numel() / us / 1e3  # GB/s (read + write)


def timings(name: str, cfg: ModelConfig, dev: str, dtype: torch.dtype, ns: list[int], new: int,
            acceptance: dict[int, float],
            repeats: int, bw_gbs: float, clock: Clock, placement: str) -> dict:
    P = 32
    replays = 64
    m = random_model(cfg, dev, dtype, max_len=P + new + 3 * replays + 32)
    ids = torch.randint(0, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(3)).tolist()
    graphs = dev == "cuda"
    ar = GraphedAR(m, cuda_graphs=graphs)
    ar_ms = []
    for _ in range(repeats):
        r = ar.run(ids, new, GREEDY, [])
        ar_ms.append(1e3 * r.decode_seconds / (len(r.token_ids) - 1))
    ref = r.token_ids
    step_us = clock.us(ar._graph.replay, replays) if graphs else clock.us(lambda: ar.step(GREEDY, None), 4)
    # bytes one AR step must read: every weight once (tied embedding = the LM head) + K/V at ~P + new/2
    wbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    if not cfg.tie_word_embeddings:
        wbytes -= m.embed.weight.numel() * m.embed.weight.element_size()
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (P + new // 2) * m.dtype.itemsize
    roof_us = (wbytes + kv) / bw_gbs / 1e3
    out = {"shape": name, "params_M": round(wbytes / m.dtype.itemsize / 1e6, 1), "ar_ms_per_token": statistics.median(ar_ms),
           "ar_graph_step_us": step_us, "ar_roofline_us": roof_us, "ar_roofline_fraction": roof_us / step_us, "spd": []}
    for n in ns:
        try:  # one n failing keeps the others and the AR figures
            out["spd"].append(_spd_timing(m, cfg, n, ids, ref, new, acceptance[n], repeats, out["ar_ms_per_token"], dev,
                                          clock, placement, replays))
        except Exception as e:  # noqa: BLE001
            out.setdefault("errors", []).append({"n": n, "error": f"{type(e).__name__}: {e}",
                                                 "trace": traceback.format_exc()[-2000:]})
            print(f"  FAIL timing {name} n={n}: {type(e).__name__}: {e}", flush=True)
    return out


def _spd_timing(m, cfg: ModelConfig, n: int, ids: list[int], ref: list[int], new: int, acceptance: float,
                repeats: int, ar_ms_per_token: float, dev: str, clock: Clock, placement: str, replays: int) -> dict:
    """One n's SPD row of `timings`: tokens/s with an imposed acceptance, exactness against `ref`, phase times."""
    full = [0] * len(ids) + ref
    graphs = dev == "cuda"
    b = uniform_boundaries(cfg.num_layers, n)
    head = timing_head(m, n)
    drafter = ReferenceDrafter(full, cfg.vocab_size, "bernoulli", p_right=acceptance, seed=n, head=head)
    pe = PipelinedEngine(SPDEngine(m, drafter, b, head.dcfg.anchors), placement, cuda_graphs=graphs)
    tps, acc, exact = [], [], True
    for _ in range(repeats):
        r = pe.run(ids, new, GREEDY, [])
        tps.append(r.metrics["tokens_per_second"])
        acc.append(r.metrics["acceptance_rate"])
        exact &= r.token_ids == ref
    row = {"n": n, "tokens_per_s": statistics.median(tps), "acceptance": statistics.median(acc), "exact": exact,
           "acceptance_imposed": acceptance, "draft_layers": head.dcfg.num_layers, "anchors": list(head.dcfg.anchors),
           "equiv_accept_length": n * (len(r.token_ids) - 1) / r.metrics["cycles"]}
    row["speedup_vs_graphed_ar"] = row["tokens_per_s"] / (1e3 / ar_ms_per_token)
    row.update(phase_times(pe, ids, dev, clock, replays))
    return row


def phase_times(pe: PipelinedEngine, ids: list[int], dev: str, clock: Clock, reps: int) -> dict:
    """Each phase of one steady-state cycle timed alone (as its own graph on a GPU), and the whole cycle."""
    e = pe.engine
    st, _ = e.start(ids, GREEDY, None)
    cyc = pe._static(st, GREEDY, None)
    for _ in range(e.n + 1):  # fill the pipeline
        cyc.run(pe.rt)
    sync(dev)
    saved = {k: getattr(cyc.st, k).clone() for k in ("tokens", "p_new", "fill", "pdm_len", "cycles",
                                                     "verifications", "accepts")}

    def restore():
        for k, v in saved.items():
            getattr(cyc.st, k).copy_(v)

    def timed(fn) -> float:
        if dev != "cuda":
            return clock.us(fn, 3)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        us = clock.us(g.replay, reps)
        restore()
        return us

    res = {"pre_us": timed(cyc.pre), "draft_us": timed(cyc.draft)}
    stages = [timed(lambda s=s: cyc.stage(s)) for s in range(e.n)]
    res["stage_us"] = stages
    res["post_us"] = timed(cyc.post)
    restore()
    res["cycle_us"] = clock.us(pe._graph.replay, reps) if pe._graph is not None else clock.us(lambda: cyc.run(pe.rt), 3)
    restore()
    res["slowest_stage_us"] = max(stages)
    # the PDM runs beside the stages: the longer of the two branches is the cycle's work, the rest its overhead
    res["overhead_us"] = res["cycle_us"] - max(max(stages), res["draft_us"])
    return res


# ---- main -----------------------------------------------------------------------------------------
ACCEPTANCE_FILES = (ROOT / "bench" / "results" / "acceptance.json",  # the README's table: n = 2, 3
                    ROOT / "bench" / "results" / "n456" / "shipped_s33.json")  # the shipped n = 4, 5, 6 heads


def measured_acceptance(ns: list[int], paths: tuple[Path, ...] = ACCEPTANCE_FILES) -> dict[int, float]:
    """Each n's shipped head's overall acceptance at temperature 0, as `spd-fast eval` last recorded it (20 held-out
    prompts per category, 64 new tokens); an n no file holds gets the n=3 head's."""
    found: dict[int, float] = {}
    try:
        for path in paths:
            for r in json.loads(path.read_text())["rows"]:
                if r["temperature"] == 0 and r["category"] == "overall":
                    found.setdefault(r["n"], r["acceptance_rate"])
        missing = [n for n in ns if n not in found]
        if missing and 3 not in found:
            raise KeyError(f"no overall T=0 row for n={missing} nor n=3")
        return {n: found[n] if n in found else found[3] for n in ns}
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"gpu_check: cannot read the measured acceptance from {', '.join(map(str, paths))} "
                         f"({type(e).__name__}: {e}); pass --acceptance P") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--acceptance", type=float, default=None,
                   help="imposed acceptance rate for every n (default: each n's shipped head's at temperature 0, "
                        "read from bench/results/acceptance.json and bench/results/n456/shipped_s33.json)")
    p.add_argument("--num-stages", default="2,3,5")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel-test-timeout", type=int, default=240)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the kernel twins (several minutes of compiling)")
    p.add_argument("--no-compile", action="store_true", help="(the default; kept for older commands)")
    p.add_argument("--deadline", type=float, default=540.0,
                   help="seconds after which no new section starts, so the summary is printed within a "
                        "device call's limit (default 540)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the same logic on CPU with tiny shapes and simulated streams (no kernels, no graphs)")
    a = p.parse_args(argv)
    if a.acceptance is not None and not 0.0 <= a.acceptance <= 1.0:
        p.error(f"--acceptance must be a probability in [0, 1], got {a.acceptance}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dry = a.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on the GPU machine, or use --cpu-dry-run", file=sys.stderr)
        return 2
    dev = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    clock = Clock(dev)
    ns = [int(x) for x in a.num_stages.split(",")]
    accept = measured_acceptance(ns) if a.acceptance is None else {n: a.acceptance for n in ns}
    report: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                             "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(),
                             "gpus": 0 if dry else torch.cuda.device_count(), "host": platform.node(),
                             "acceptance_imposed": {str(n): accept[n] for n in ns}}, "errors": []}

    started = T0

    def section(name, fn, need: float = 0.0):
        """need: seconds the section takes at least; it is skipped when they would run past --deadline."""
        t = time.perf_counter()
        if t - started + need > a.deadline:
            report.setdefault("skipped", []).append(name)
            print(f"[{name}] skipped: it would end past --deadline {a.deadline:.0f} s", flush=True)
            return
        try:
            with torch.inference_mode():
                report[name] = fn()
        except Exception as e:  # keep going: one broken section must not hide the others
            report["errors"].append({"section": name, "error": f"{type(e).__name__}: {e}",
                                     "trace": traceback.format_exc()[-3000:]})
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"[{name}] {time.perf_counter() - t:.1f} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    placements = ["simulated"] if dry else ["streams"] + (["devices"] if torch.cuda.device_count() >= 2 else [])
    exact_cfg = TINY if dry else SHAPES["smollm2-135m"]
    report["exactness"] = []
    section("exactness", lambda: exactness(dev, dtype, exact_cfg, 3, 24 if dry else 64, placements,
                                           report["exactness"]))
    section("copy_bandwidth_gbs", lambda: copy_bandwidth(dev, clock))
    bw = report.get("copy_bandwidth_gbs") or 1.0
    shapes = {"tiny": TINY} if dry else SHAPES
    timing_rows = []
    for name, cfg in shapes.items():
        section(f"timing_{name}", lambda cfg=cfg, name=name: timings(
            name, cfg, dev, dtype, ns, 16 if dry else a.new_tokens, accept, 1 if dry else a.repeats, bw, clock,
            "simulated" if dry else "streams"))
        if f"timing_{name}" in report:
            timing_rows.append(report[f"timing_{name}"])
    # the kernels last: the engine's exactness and timings matter most when a lease is cut short
    if not dry and not a.skip_kernels:
        report["triton_cycle"] = []
        section("triton_cycle", lambda: triton_cycle(dev, dtype, exact_cfg, 3, 64, report["triton_cycle"]))
    if not a.skip_kernels and (not dry or os.environ.get("TRITON_INTERPRET") == "1"):
        section("kernel_paths", lambda: kernel_paths(dry))
    if not dry and not a.skip_kernels:
        left = a.deadline - (time.perf_counter() - started)
        # the benchmark after them needs about KERNEL_BENCH_S: the tests get what is left beyond that
        section("kernel_tests", lambda: kernel_tests(out, int(max(30, min(a.kernel_test_timeout,
                                                                           left - KERNEL_BENCH_S)))))
        section("kernel_bench", lambda: kernel_bench(out, compile=a.compile),
                need=KERNEL_BENCH_S * (4 if a.compile else 1))

    # ---- the short table, last ----
    print("\n== gpu_check summary ==")
    print(f"device: {report['meta']['device']} x{report['meta']['gpus']}  torch {torch.__version__}  "
          f"copy bandwidth {bw:.0f} GB/s  imposed acceptance {', '.join(f'n={n}: {accept[n]}' for n in ns)}")
    for k in ("kernel_tests", "kernel_bench"):
        if k in report:
            print(f"{k}: {report[k]}")
    if "kernel_paths" in report:
        kp = report["kernel_paths"]["checks"]
        ran = [r for r in kp if not r.get("skipped")]
        print(f"kernel paths: {sum(r['ok'] for r in ran)}/{len(ran)} pass, {len(kp) - len(ran)} skipped"
              + "".join(f"\n  FAIL {r['check']}: {r.get('error', '')}" for r in kp if not r["ok"]))
    ex = report.get("exactness", []) + report.get("triton_cycle", [])
    counted = [r for r in ex if not r.get("info")]
    print(f"exactness: {sum(r['ok'] for r in counted)}/{len(counted)} checks pass"
          + "".join(f"\n  {'differs' if r.get('info') else 'FAIL'} {r['check']}" for r in ex if not r["ok"]))
    print("| shape | AR ms/tok | AR step us | roofline | n | SPD tok/s | speedup | acc | exact | cycle us "
          "| slowest stage us | PDM us | overhead us |")
    for t in timing_rows:
        for r in t["spd"]:
            print(f"| {t['shape']} | {t['ar_ms_per_token']:.3f} | {t['ar_graph_step_us']:.1f} | "
                  f"{100 * t['ar_roofline_fraction']:.0f}% | {r['n']} | {r['tokens_per_s']:.0f} | "
                  f"{r['speedup_vs_graphed_ar']:.2f}x | {r['acceptance']:.2f} | {'yes' if r['exact'] else 'NO'} | "
                  f"{r['cycle_us']:.1f} | {r['slowest_stage_us']:.1f} | {r['draft_us']:.1f} | {r['overhead_us']:.1f} |")
    for t in timing_rows:
        for e in t.get("errors", []):
            print(f"  FAIL timing {t['shape']} n={e['n']}: {e['error']}")
    if report.get("skipped"):
        print(f"skipped (past --deadline): {', '.join(report['skipped'])}")
    if report["errors"]:
        print(f"errors in: {', '.join(e['section'] for e in report['errors'])} (see gpu_check.json)")
    ok = (not report["errors"] and not report.get("skipped") and all(r["ok"] for r in counted)
          and all(r["exact"] for t in timing_rows for r in t["spd"]) and not any(t.get("errors") for t in timing_rows)
          and all(report.get(k, {}).get("ok", True) for k in ("kernel_paths", "kernel_tests")))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

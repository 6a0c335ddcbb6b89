"""What does the glibc heap policy of CPU training cost? Runs the same short fine-tune of the shipped n=3 head
twice, each in a fresh process: "legacy" (every block above 64 KiB mmapped and unmapped on free, trim at
64 KiB: the policy before `spd_fast.train.heap`) and "tuned" (`heap.tune()` plus `heap.trim()` every
`heap.TRIM_EVERY` steps, the default). Each run builds its own teacher cache (a seeded subset of the GPU
self-distillation file) and then trains; the losses must match, since only the allocator differs.
Prints the teacher-cache seconds, the median training tokens/s, user/system CPU seconds and peak RSS of
each, and the tuned/legacy ratios.

    .venv/bin/python bench/bench_train_heap.py [--samples 150] [--steps 24] [--out bench/results/heap/heap.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data/self_distill/gpu_magpie_s41_s42_greedy_bf16_256.jsonl.gz"
HEAD = ROOT / "spd_fast/heads/smollm2-135m-instruct-n3"

CHILD = r"""
import json, resource, sys, time
from spd_fast.train import heap
import spd_fast.train.__main__ as m
if sys.argv[1] == "legacy":
    import ctypes, ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    heap.tune = lambda: bool(libc.mallopt(-3, 64 * 1024)) and bool(libc.mallopt(-1, 64 * 1024))
    heap.trim = lambda: False
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
rc = m.main(sys.argv[2:])
r = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({"rc": rc, "wall_s": time.perf_counter() - t0, "user_s": r.ru_utime - r0.ru_utime,
                              "sys_s": r.ru_stime - r0.ru_stime, "max_rss_mb": r.ru_maxrss / 1024}))
"""


def run(policy: str, data: Path, out: Path, a) -> dict:
    cmd = [sys.executable, "-c", CHILD, policy, "--out", str(out), "--init", str(HEAD), "--num-stages", "3",
           "--draft-layers", "3", "--draft-vocab", "16384", "--data", str(data), "--steps", str(a.steps),
           "--batch-tokens", str(a.batch_tokens), "--lr", "1e-5", "--warmup", "5", "--bf16", "--save-every", "100000",
           "--threads", str(a.threads)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_train_heap: the {policy} run failed:\n{p.stderr[-3000:]}")
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    res["cache_s"] = next(x["seconds"] for x in log if "feature_cache" in x)
    steps = [x for x in log if "tokens_per_s" in x]
    res["tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in steps[1:] or steps)  # not step 1 alone
    res["losses"] = [round(x["loss"], 6) for x in steps]
    return res


def main() -> None:
    from spd_fast.cli_common import positive_thread_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=150, help="answers drawn (seed 0) from the GPU data file")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    rows = [json.loads(x) for x in gzip.open(DATA, "rt")]
    random.Random(0).shuffle(rows)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "subset.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[: a.samples]))
        res = {pol: run(pol, data, Path(tmp) / pol, a) for pol in ("legacy", "tuned")}
    if res["legacy"]["losses"] != res["tuned"]["losses"]:
        sys.exit(f"bench_train_heap: the losses differ: {res['legacy']['losses']} vs {res['tuned']['losses']}")
    print(f"{'policy':8} {'cache s':>8} {'train tok/s':>12} {'user s':>7} {'sys s':>6} {'peak RSS MB':>12}")
    for pol, r in res.items():
        print(f"{pol:8} {r['cache_s']:8.1f} {r['tokens_per_s']:12.0f} {r['user_s']:7.0f} {r['sys_s']:6.0f} "
              f"{r['max_rss_mb']:12.0f}")
    L, T = res["legacy"], res["tuned"]
    print(f"tuned/legacy: teacher cache {L['cache_s'] / T['cache_s']:.2f}x faster, training "
          f"{T['tokens_per_s'] / L['tokens_per_s']:.2f}x faster, peak RSS {T['max_rss_mb'] / L['max_rss_mb']:.2f}x")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), **res}, indent=2))


if __name__ == "__main__":
    main()

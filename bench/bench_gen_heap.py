"""What does the glibc heap policy save in batched generation (self-distillation)? Decodes the same prompts
greedily under glibc's defaults and under `spd_fast.train.heap.tune()`, each run in a fresh process, the two
policies alternated --repeats times. The tokens must match, since only the allocator differs. Prints wall,
user and system CPU seconds and peak RSS of every run, and the median wall-time ratio.

    .venv/bin/python bench/bench_gen_heap.py [--prompts 64] [--max-new-tokens 48] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data/self_distill/val_long_s21_256.jsonl.gz"

CHILD = r"""
import gzip, hashlib, json, resource, sys, time
import torch
from spd_fast.batch_generate import generate_batch
from spd_fast.runtime import load_target
from spd_fast.sampling import SamplingParams
from spd_fast.train import heap
policy, path, B, N = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if policy == "tuned" and not heap.tune():
    sys.exit("heap.tune() was refused: not glibc?")
torch.set_num_threads(int(sys.argv[5]))
t = load_target(None, progress=False)
prompts = [json.loads(x)["prompt_ids"] for x in gzip.open(path, "rt")][:B]
t.model.setup_caches(len(prompts), 640)
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
out = generate_batch(t.model, prompts, N, SamplingParams(temperature=0.0), t.eos_ids, None)
r = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({"wall_s": time.perf_counter() - t0, "user_s": r.ru_utime - r0.ru_utime,
                              "sys_s": r.ru_stime - r0.ru_stime, "max_rss_mb": r.ru_maxrss / 1024,
                              "tokens": sum(map(len, out)), "digest": hashlib.sha256(str(out).encode()).hexdigest()}))
"""


def run(policy: str, a) -> dict:
    cmd = [sys.executable, "-c", CHILD, policy, str(PROMPTS), str(a.prompts), str(a.max_new_tokens), str(a.threads)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_gen_heap: the {policy} run failed:\n{p.stderr[-3000:]}")
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])


def main() -> None:
    from spd_fast.cli_common import positive_thread_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64, help="the first N prompts of the held-out val_long file")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="runs per policy, alternated")
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    if a.prompts < 1 or a.max_new_tokens < 1 or a.repeats < 1:
        p.error("--prompts, --max-new-tokens and --repeats must be >= 1")
    runs: dict[str, list[dict]] = {"default": [], "tuned": []}
    for _ in range(a.repeats):
        for pol in runs:
            runs[pol].append(run(pol, a))
    digests = {r["digest"] for rs in runs.values() for r in rs}
    if len(digests) != 1:
        sys.exit("bench_gen_heap: the policies decoded different tokens")
    print(f"{'policy':8} {'wall s':>7} {'user s':>7} {'sys s':>6} {'peak RSS MB':>12}")
    for pol, rs in runs.items():
        for r in rs:
            print(f"{pol:8} {r['wall_s']:7.1f} {r['user_s']:7.1f} {r['sys_s']:6.1f} {r['max_rss_mb']:12.0f}")
    med = {pol: statistics.median(r["wall_s"] for r in rs) for pol, rs in runs.items()}
    print(f"median wall: default {med['default']:.1f} s, tuned {med['tuned']:.1f} s, "
          f"speedup {med['default'] / med['tuned']:.2f}x ({runs['tuned'][0]['tokens']} tokens, identical)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs, "median_wall_s": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()

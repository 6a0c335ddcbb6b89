"""Per-cycle cost of the sequential SPD engine vs one AR step on the default model (CPU).

Splits each cycle into stages / PDM draft / verify (+ state update) / host overhead, and reports
tokens_per_cycle and equivalent_accept_length per n. Medians over all steady-state cycles.

    .venv/bin/python bench/bench_cycle.py --num-stages 2,3,5 --new-tokens 48
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

PROMPTS = ["Explain photosynthesis in simple terms.", "Write a Python function to check for primes.",
           "What is 23 + 19? Show your steps."]


def main(argv: list[str] | None = None) -> int:
    import spd_fast
    from spd_fast.ar import decode_ar
    from spd_fast.sampling import SamplingParams

    from spd_fast.cli_common import positive_thread_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-stages", default="2,3,5")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--draft", default=None, help="head dir; default: shipped head per n, else random")
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--out", default="bench/results/cycle.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from spd_fast.evaluate import provenance
    made_by = provenance()  # the code that runs, read before a commit landing mid-run could move HEAD
    rows = []
    for n in [int(x) for x in a.num_stages.split(",")]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = spd_fast.load(draft=a.draft, num_stages=n, progress=False)
        tg = eng.target
        ar_steps, prof, stats = [], [], {"dec": 0, "cyc": 0}
        for text in PROMPTS:
            ids = tg.encode([{"role": "user", "content": text}])
            r = decode_ar(tg.model, ids, a.new_tokens, SamplingParams(), [])
            ar_steps.append(r.decode_seconds / max(1, len(r.token_ids) - 1))
            eng.spd.profile, eng.spd.cycle_profile = True, []
            res = eng.spd.run(ids, a.new_tokens, SamplingParams(), [])
            if res.token_ids != r.token_ids:  # a time for wrong tokens is worthless, and a bug
                raise SystemExit(f"bench_cycle: greedy SPD at n={n} differs from AR on {text!r}; this is a bug")
            prof += [c for c in eng.spd.cycle_profile if c["fill"] == n]  # steady state (full pipeline)
            stats["dec"] += len(res.token_ids) - 1
            stats["cyc"] += res.metrics["cycles"]
            eng.spd.profile = False
        med = lambda k: 1e3 * statistics.median(c[k] for c in prof)  # noqa: E731
        ar_ms = 1e3 * statistics.median(ar_steps)
        tpc = stats["dec"] / stats["cyc"]
        row = {"n": n, "draft": eng.draft_source, "ar_step_ms": ar_ms, "cycle_ms": med("cycle"),
               "stages_ms": med("stages"), "slowest_stage_ms": med("slowest_stage"), "pdm_ms": med("draft"),
               "verify_ms": med("verify"), "overhead_ms": med("overhead"),
               "overhead_vs_ar_step": med("overhead") / ar_ms, "tokens_per_cycle": tpc,
               "equivalent_accept_length": n * tpc}
        rows.append(row)
        print(json.dumps(row), flush=True)
    from spd_fast.runtime import cpu_name
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_name(), "threads": a.threads,
            "new_tokens": a.new_tokens, "torch": torch.__version__, "prompts": len(PROMPTS), **made_by}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("| n | AR step ms | cycle ms | stages ms | slowest stage | PDM ms | verify ms | overhead ms | overhead/AR | tok/cycle | equiv. len |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['ar_step_ms']:.1f} | {r['cycle_ms']:.1f} | {r['stages_ms']:.1f} | {r['slowest_stage_ms']:.1f} | "
              f"{r['pdm_ms']:.2f} | {r['verify_ms']:.2f} | {r['overhead_ms']:.2f} | {100 * r['overhead_vs_ar_step']:.1f}% | "
              f"{r['tokens_per_cycle']:.3f} | {r['equivalent_accept_length']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

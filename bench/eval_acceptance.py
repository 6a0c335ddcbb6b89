"""Acceptance evaluation on the project's held-out prompt sets (chat / math / code).

For each n and temperature: acceptance_rate, tokens_per_cycle, equivalent_accept_length per
category and overall, and wall-clock SPD vs AR decode tokens/s measured in the same run.
Writes JSON and a markdown table.

    .venv/bin/python bench/eval_acceptance.py --num-stages 3 --temperatures 0 --limit 30
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

CATEGORIES = ("chat", "math", "code")


def main(argv: list[str] | None = None) -> int:
    import spd_fast
    from spd_fast.train.data import PROMPTS_DIR, read_jsonl

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=None, help="head directory (default: the shipped head for each n)")
    p.add_argument("--num-stages", default="3", help="comma-separated n values")
    p.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0,0.7,1.0")
    p.add_argument("--limit", type=int, default=40, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--no-ar", action="store_true", help="skip the AR wall-clock baseline")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/acceptance")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    prompts = {c: read_jsonl(PROMPTS_DIR / f"eval_{c}.jsonl")[: a.limit] for c in CATEGORIES}
    rows = []
    for n in [int(x) for x in a.num_stages.split(",")]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = spd_fast.load(draft=a.draft, num_stages=n, progress=False)
        for temp in [float(x) for x in a.temperatures.split(",")]:
            per_cat = {}
            for cat, ps in prompts.items():
                acc = {"ver": 0, "acc": 0, "cycles": 0, "decoded": 0, "spd_s": 0.0, "ar_s": 0.0, "ar_tok": 0}
                for i, rec in enumerate(ps):
                    msgs = [{"role": "user", "content": rec["prompt"]}]
                    o = eng.generate(msgs, a.max_new_tokens, temperature=temp, seed=i, method="spd")
                    m = o.metrics
                    acc["ver"] += m["verifications"]
                    acc["acc"] += m["accepted"]
                    acc["cycles"] += m["cycles"]
                    acc["decoded"] += m["new_tokens"] - 1
                    acc["spd_s"] += m["decode_seconds"]
                    if not a.no_ar and n == int(a.num_stages.split(",")[0]):
                        r = eng.generate(msgs, a.max_new_tokens, temperature=temp, seed=i, method="ar")
                        if temp == 0:
                            assert r.token_ids == o.token_ids, "greedy SPD differs from AR"
                        acc["ar_s"] += r.metrics["decode_seconds"]
                        acc["ar_tok"] += r.metrics["new_tokens"] - 1
                per_cat[cat] = acc
            tot = {k: sum(c[k] for c in per_cat.values()) for k in per_cat["chat"]}
            for cat, c in list(per_cat.items()) + [("overall", tot)]:
                tpc = c["decoded"] / max(1, c["cycles"])
                row = {"n": n, "temperature": temp, "category": cat, "prompts": len(prompts.get(cat, [])) or
                       sum(len(v) for v in prompts.values()),
                       "acceptance_rate": c["acc"] / max(1, c["ver"]), "tokens_per_cycle": tpc,
                       "equivalent_accept_length": n * tpc,
                       "spd_tokens_per_s": c["decoded"] / max(1e-9, c["spd_s"])}
                if c["ar_tok"]:
                    row["ar_tokens_per_s"] = c["ar_tok"] / max(1e-9, c["ar_s"])
                    row["speedup_vs_ar"] = row["spd_tokens_per_s"] / row["ar_tokens_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            src = eng.draft_source
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "threads": a.threads, "torch": torch.__version__, "draft": src, "max_new_tokens": a.max_new_tokens,
            "limit": a.limit}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| n | temp | category | acceptance | tokens/cycle | equiv. accept length | SPD tok/s | AR tok/s | SPD/AR |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['temperature']} | {r['category']} | {r['acceptance_rate']:.3f} | "
                     f"{r['tokens_per_cycle']:.3f} | {r['equivalent_accept_length']:.2f} | {r['spd_tokens_per_s']:.1f} | "
                     f"{r.get('ar_tokens_per_s', float('nan')):.1f} | {r.get('speedup_vs_ar', float('nan')):.2f} |")
    out.with_suffix(".md").write_text(f"draft: {src}; {meta}\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

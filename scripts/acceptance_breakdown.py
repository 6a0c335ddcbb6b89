"""Where greedy acceptance comes from: every draft of greedy SPD runs over the held-out prompts is
recorded, and the verified ones are counted by category, answer-position window, whether the output
token closes a 4-gram seen earlier in the answer (looping or copied text), and whether the context
lookup or the PDM made the draft, and the fill it was made at (tokens in flight: 1 right after a
reject, n in the steady state). The recorded totals are checked against the engine's own counts.

    .venv/bin/python scripts/acceptance_breakdown.py --limit 20 --max-new-tokens 512 \
        --out bench/results/acceptance_breakdown_512
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

WINDOWS = ("answer tokens 1-63", "answer tokens 64-127", "answer tokens 128-255", "answer tokens 256+")
ORDER = ("overall", "chat", "math", "code", *WINDOWS, "new 4-gram", "repeated 4-gram", "PDM draft", "lookup draft",
         *(f"{w} / {t}" for w in WINDOWS for t in ("new 4-gram", "repeated 4-gram")),
         *(f"{d} / {t}" for d in ("PDM draft", "lookup draft") for t in ("new 4-gram", "repeated 4-gram")))


def main(argv: list[str] | None = None) -> int:
    import spd_fast
    from spd_fast.cli_bench import decode_tokens
    from spd_fast.cli_common import check_output, cli_message, non_negative_int, positive_int, result_paths
    from spd_fast.config import DEFAULT_LOOKUP, SpdConfigError
    from spd_fast.evaluate import acceptance_breakdown, load_eval_prompts
    from spd_fast.runtime import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-stages", type=positive_int, default=3)
    ap.add_argument("--draft", default=None, help="head directory (default: the shipped head for this n)")
    ap.add_argument("--limit", type=positive_int, default=20, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=decode_tokens, default=512)
    ap.add_argument("--lookup", type=non_negative_int, default=DEFAULT_LOOKUP)
    ap.add_argument("--out", default="bench/results/acceptance_breakdown",
                    help="writes OUT.json and OUT.md (a .json/.md suffix is replaced; other dots stay in the name)")
    a = ap.parse_args(argv)
    try:  # everything checkable is checked before the model loads and the run (minutes) starts
        check_output(a.out, "--out", stem=True)
        prompts = load_eval_prompts(limit=a.limit)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = spd_fast.load(draft=a.draft, num_stages=a.num_stages, lookup=a.lookup, progress=False)
    except SpdConfigError as e:
        print(f"acceptance_breakdown.py: error: {cli_message(e, ap)}", file=sys.stderr)
        return 2
    t0 = time.time()
    res = acceptance_breakdown(eng, prompts, a.max_new_tokens, progress=True)
    c = res["counts"]
    overall = c.get("overall", {"verified": 0, "accepted": 0})  # absent when no draft was verified at all
    if (overall["verified"], overall["accepted"]) != (res["engine"]["verifications"], res["engine"]["accepted"]):
        print(f"recorded counts {overall} differ from the engine's {res['engine']}: a bug", file=sys.stderr)
        return 1
    res["meta"] = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_name(), "num_stages": a.num_stages,
                   "draft": eng.draft_source, "draft_digest": eng.draft_digest, "limit": a.limit,
                   "max_new_tokens": a.max_new_tokens, "lookup": a.lookup, "temperature": 0.0,
                   "seconds": round(time.time() - t0, 1)}
    lines = ["| drafts | verified | accepted | acceptance | share of verified |", "|---|---|---|---|---|"]
    total = overall["verified"]
    for k in (*ORDER, *(f"fill {f}" for f in range(1, a.num_stages + 1))):
        if k in c:
            v = c[k]
            lines.append(f"| {k} | {v['verified']} | {v['accepted']} | {v['acceptance_rate']:.3f} | "
                         f"{v['verified'] / max(1, total):.3f} |")
    if not total:
        lines.append("| (no draft was verified: every answer ended within its first token) | 0 | 0 | - | - |")
    table = "\n".join(lines)
    js, md = result_paths(a.out)
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(res, indent=2))
    md.write_text(f"{res['meta']}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

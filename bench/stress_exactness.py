"""Greedy SPD against greedy AR on unusual prompts and long answers, at every n asked for.

The eval prompts (`bench/eval_acceptance.py`) are ordinary requests of 64 tokens. This script feeds the
engine what they do not: one-letter and number-run prompts, a word repeated, bare code, mixed scripts and
emoji, a system message, a multi-turn chat, a request that repeats itself for hundreds of tokens, one that
ends after a few tokens, a long prompt, and answers of up to --max-new-tokens. Every pair must be
token-identical; the exit status is 1 if any differs (2 for a bad option or prompt, after the runs done so
far are reported), and the JSON lists each run.

    .venv/bin/python bench/stress_exactness.py --num-stages 2,3,4,5,6 --max-new-tokens 256 \
        --out bench/results/stress_exactness
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from spd_fast.config import DEFAULT_LOOKUP

PROMPTS: list = [
    "a",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "the " * 16,
    "def fibonacci(n):",
    "Écris un poème sur la mer. 日本語で答えてください。 🙂🙂",
    [{"role": "user", "content": "Repeat the word 'banana' 100 times."}],
    [{"role": "user", "content": "Count from 1 to 200, separated by commas."}],
    [{"role": "user", "content": "Write a long story about a dragon who learns to code in Rust."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Explain TCP handshakes."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Translate 'good morning' into five languages and explain each."}],
    [{"role": "user", "content": "A train leaves at 3pm at 60 mph, another at 4pm at 80 mph. When does the "
                                 "second catch up? Show the steps."}],
    [{"role": "user", "content": "x" * 3000}],
    [{"role": "user", "content": "Write a SQL query joining three tables, a Python function that runs it, "
                                 "and a bash script that calls the function."}],
]


def stress(engines, prompts: list, max_new_tokens: int, rows: list[dict] | None = None) -> list[dict]:
    """engines: (n, Engine) pairs. One row per (n, prompt): AR and SPD token ids compared, appended to `rows`
    (kept by the caller when a later prompt fails)."""
    rows = [] if rows is None else rows
    for n, eng in engines:
        for i, prompt in enumerate(prompts):
            t = time.perf_counter()
            ar = eng.generate(prompt, max_new_tokens, method="ar")
            spd = eng.generate(prompt, max_new_tokens, method="spd")
            first = next((k for k, (a, b) in enumerate(zip(ar.token_ids, spd.token_ids)) if a != b),
                         None if len(ar.token_ids) == len(spd.token_ids) else min(len(ar.token_ids),
                                                                                  len(spd.token_ids)))
            rows.append({"num_stages": n, "prompt": i, "identical": first is None, "first_difference": first,
                         "ar_tokens": len(ar.token_ids), "spd_tokens": len(spd.token_ids),
                         "finished_by_eos": ar.finished_by_eos,
                         "acceptance_rate": spd.metrics.get("acceptance_rate"),
                         "seconds": round(time.perf_counter() - t, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import spd_fast
    from spd_fast.cli_common import check_output, int_list, positive_int, positive_thread_count, write_output
    from spd_fast.config import SpdConfigError

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="head directory (default: the shipped head for each n)")
    p.add_argument("--num-stages", type=int_list, default=[2, 3, 4, 5, 6], help="comma-separated n values")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--prompts", default=None,
                   help="a JSON file with a list of prompts (strings or chat-message lists) instead of the built-in ones")
    p.add_argument("--lookup", type=int, default=DEFAULT_LOOKUP)
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--out", default=None, help="write OUT.json (OUT may end in .json)")
    a = p.parse_args(argv)
    prompts = PROMPTS
    if a.prompts:
        try:
            prompts = json.loads(Path(a.prompts).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--prompts {a.prompts}: {e}; pass a JSON file holding a list of prompts")
        if not isinstance(prompts, list) or not prompts:
            p.error(f"--prompts {a.prompts}: expected a non-empty JSON list of prompts")
    out = Path(a.out.removesuffix(".json") + ".json") if a.out is not None else None
    try:
        check_output(None if out is None else str(out), "--out")  # before the runs whose results it would hold
    except SpdConfigError as e:
        p.error(str(e))
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    rows: list[dict] = []
    error = None
    try:
        # every n is loaded (and so checked) before the first run: a bad n found after an hour's runs wasted them
        engines = [(n, spd_fast.load(a.model, a.draft, num_stages=n, progress=False, lookup=a.lookup))
                   for n in a.num_stages]
        for n, eng in engines:
            stress([(n, eng)], prompts, a.max_new_tokens, rows)
    except SpdConfigError as e:  # e.g. a prompt the engine refuses: the runs done so far are still reported
        error = str(e)
    bad = [r for r in rows if not r["identical"]]
    summary = {"runs": len(rows), "identical": len(rows) - len(bad), "tokens": sum(r["ar_tokens"] for r in rows),
               "seconds": round(time.perf_counter() - t0, 1)}
    if error is not None:
        summary["error"] = error
    if rows:
        print(f"{summary['identical']} of {summary['runs']} runs token-identical ({summary['tokens']} AR tokens, "
              f"{summary['seconds']} s)")
    for r in bad:
        print(f"MISMATCH: n={r['num_stages']} prompt {r['prompt']}: first difference at token "
              f"{r['first_difference']}", file=sys.stderr)
    if error is not None:
        print(f"stress_exactness.py: error: {error}", file=sys.stderr)
    if out is not None and rows:
        try:
            write_output(out, json.dumps({"summary": summary, "max_new_tokens": a.max_new_tokens, "prompts": prompts,
                                          "rows": rows}, indent=1, ensure_ascii=False))
        except SpdConfigError as e:
            print(f"stress_exactness.py: error: {e}", file=sys.stderr)
            error = error or str(e)
    return 1 if bad else 2 if error is not None else 0


if __name__ == "__main__":
    sys.exit(main())

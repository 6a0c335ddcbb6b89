"""`spd-fast bench` (AR vs SPD decode speed, several n, one run) and `spd-fast eval` (acceptance tables)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .cli_common import (DefaultsFormatter, _int_at_least, add_model_options, apply_runtime_options, check_output,
                         cli_warning, float_list, int_list, kv_length, load_engine, positive_int, seed_int,
                         write_output)
from .evaluate import CATEGORIES, add_spd_metrics, check_prompts_fit, dtype_name, kernel_backend, provenance

# the first token comes from the prefill: a speed or an acceptance needs at least one decoded after it
decode_tokens = _int_at_least(2, "an integer >= 2 (the first token comes from the prefill, the rest are decoded)")


def add_parsers(sub: Any) -> None:
    b = sub.add_parser("bench", help="AR vs SPD decode speed for several n, measured in the same run",
                       description="Decode a small prompt set with the AR baseline once and with SPD for each n; "
                       "report tokens/s, acceptance, tokens/cycle and the ratio to AR.",
                       formatter_class=DefaultsFormatter)
    b.add_argument("--num-stages", "-n", type=int_list, default=[2, 3], help="comma-separated n (default: 2,3)")
    b.add_argument("--prompts", type=positive_int, default=None,
                   help="held-out prompts per category (chat, math, code; default: 1); not with --prompt")
    b.add_argument("--prompt", action="append", default=[], help="use this user message instead (repeatable)")
    b.add_argument("--max-new-tokens", type=decode_tokens, default=32,
                   help="new tokens per answer (the first comes from the prefill)")
    b.add_argument("--max-len", type=kv_length, default=2048, help="KV cache length: prompt + new tokens + n + 1")
    b.add_argument("--repeats", type=positive_int, default=1, help="decode each prompt this many times")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy, where SPD is checked against AR")
    add_model_options(b)
    b.add_argument("--out", help="also write the JSON result here (e.g. bench/results/bench.json)")
    b.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    b.set_defaults(func=run_bench_cli)

    e = sub.add_parser("eval", help="acceptance tables on the held-out prompt sets (chat / math / code)",
                       description="Acceptance rate, tokens/cycle, equivalent accept length per category and "
                       "overall, and SPD vs AR tokens/s (AR measured for the first n). The README's acceptance table "
                       "used --limit 20 --max-new-tokens 64.", formatter_class=DefaultsFormatter)
    e.add_argument("--num-stages", "-n", type=int_list, default=[3], help="comma-separated n (default: 3)")
    e.add_argument("--temperatures", type=float_list, default=[0.0], help="comma-separated (default: 0)")
    e.add_argument("--limit", type=positive_int, default=40, help="prompts per category (default: 40)")
    e.add_argument("--max-new-tokens", type=decode_tokens, default=96,
                   help="new tokens per answer (the first comes from the prefill)")
    e.add_argument("--max-len", type=kv_length, default=2048, help="KV cache length: prompt + new tokens + n + 1")
    e.add_argument("--categories", type=str, default=",".join(CATEGORIES),
                   help=f"comma-separated subset of {','.join(CATEGORIES)}")
    e.add_argument("--no-ar", action="store_true", help="skip the AR wall-clock baseline")
    e.add_argument("--seed", type=seed_int, default=0,
                   help="prompt i samples with seed SEED+i (default: 0); compare heads at temperature > 0 over "
                        "a few seeds")
    add_model_options(e)
    e.add_argument("--out", help="write <out>.json and <out>.md (e.g. bench/results/acceptance)")
    e.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    e.set_defaults(func=run_eval_cli)


# ---- bench ---------------------------------------------------------------------------------------
def bench_prompts(per_category: int, custom: list[str]) -> list[Any]:
    if custom:
        return [[{"role": "user", "content": p}] for p in custom]
    from .evaluate import load_eval_prompts

    sets = load_eval_prompts(CATEGORIES, per_category)
    return [[{"role": "user", "content": r["prompt"]}] for c in CATEGORIES for r in sets[c]]


def run_bench(args: argparse.Namespace, quiet: bool) -> dict[str, Any]:
    """For every n, AR and SPD on each prompt back to back on the same engine (so both see the same machine
    state); each SPD row's `speedup_vs_ar` is the median over those pairs of the SPD/AR tokens/s ratio, and
    greedy SPD is checked against AR. The AR row pools every AR run."""
    import statistics

    from .progress import bar
    from .sampling import SamplingParams

    SamplingParams(args.temperature)  # fail before loading the model
    made_by = provenance()  # the code that runs, read before a commit landing mid-run could move HEAD
    if args.prompt and args.prompts is not None:
        from .config import SpdConfigError

        raise SpdConfigError("--prompts counts held-out prompts per category, which --prompt replaces; pass one of "
                             "them")
    prompts = bench_prompts(args.prompts or 1, args.prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    ar = {"decoded": 0.0, "seconds": 0.0}
    rows: list[dict[str, Any]] = []
    sources = []
    from .pdm import check_draft_stages

    def rate(m: dict[str, float]) -> float | None:  # one run's decode tokens/s (None: it decoded nothing)
        return (m["new_tokens"] - 1) / m["decode_seconds"] if m["new_tokens"] > 1 and m["decode_seconds"] > 0 else None

    check_draft_stages(args.draft, args.num_stages)  # a head for one n, asked for several: refused before any run
    for i, n in enumerate(args.num_stages):
        eng = load_engine(args, n, quiet)
        if i == 0:  # every n against the model, before the first one's run
            from .config import validate_num_stages

            for m in args.num_stages:
                validate_num_stages(eng.target.cfg.num_layers, m)
            check_prompts_fit(eng, [(f"{j}", p) if args.prompt else (f"{j} of the held-out set", p)
                                    for j, p in enumerate(prompts)],
                              args.max_new_tokens, max(args.num_stages), True, "bench")
        sources.append(eng.draft_source)
        fingerprint = eng.target.fingerprint
        warm = min(4, args.max_new_tokens)  # no more than the runs ask for: what fits them fits the warm-up
        for method in ("ar", "spd"):  # warm-up: first-call allocations, on both sides
            eng.generate(prompts[0], max_new_tokens=warm, method=method)
        s = dict.fromkeys(("ver", "acc", "cycles", "decoded", "seconds"), 0.0)
        identical, ratios = True, []
        for r in range(args.repeats):
            for j, p in enumerate(bar(prompts, f"bench AR + SPD n={n}", enabled=not quiet)):
                a = eng.generate(p, seed=j, method="ar", **kw)
                ar["decoded"] += a.metrics["new_tokens"] - 1
                ar["seconds"] += a.metrics["decode_seconds"]
                o = eng.generate(p, seed=j, method="spd", **kw)
                add_spd_metrics(s, o.metrics, "seconds")
                identical &= o.token_ids == a.token_ids
                ra, ro = rate(a.metrics), rate(o.metrics)
                if ra and ro:
                    ratios.append(ro / ra)
        tps = s["decoded"] / max(s["seconds"], 1e-9)
        tpc = s["decoded"] / max(s["cycles"], 1)
        row = {"method": "spd", "n": n, "draft": eng.draft_source, "tokens_per_s": tps,
               "ms_per_token": 1e3 / max(tps, 1e-9), "acceptance_rate": s["acc"] / max(s["ver"], 1),
               "tokens_per_cycle": tpc, "equivalent_accept_length": n * tpc,
               "ms_per_cycle": 1e3 * s["seconds"] / max(s["cycles"], 1),
               "speedup_vs_ar": statistics.median(ratios) if ratios else None, "pairs": len(ratios),
               "decoded_tokens": int(s["decoded"])}
        if args.temperature == 0:
            row["identical_to_ar"] = bool(identical)  # greedy SPD must equal greedy AR token for token
        rows.append(row)
        del eng
    ar_tps = ar["decoded"] / max(ar["seconds"], 1e-9)
    rows.insert(0, {"method": "ar", "n": 1, "tokens_per_s": ar_tps, "ms_per_token": 1e3 / max(ar_tps, 1e-9),
                    "decoded_tokens": int(ar["decoded"])})
    import torch

    from .runtime import cpu_name
    from .store import DEFAULT_MODEL_NAME
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_name(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "device": args.device,
            "dtype": dtype_name(args.dtype), "prompts": len(prompts), "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "draft": sources[0] if len(set(sources)) == 1 else sources, "kernels": kernel_backend(),
            "kernels_run": kernel_backend(args.device),
            "cuda_graphs": args.placement == "streams" and not getattr(args, "no_cuda_graphs", False),  # as run
            "model": args.model or DEFAULT_MODEL_NAME, "model_fingerprint": fingerprint, "placement": args.placement,
            "lookup": args.lookup, "max_len": args.max_len, **made_by}
    return {"meta": meta, "rows": rows}


def bench_table(rows: list[dict[str, Any]]) -> str:
    """The printed table; "identical to AR" is greedy SPD's token-for-token check (- when sampling: none)."""
    lines = ["| method | n | tok/s | ms/token | acceptance | tokens/cycle | equiv. accept length | ms/cycle | vs AR "
             "| identical to AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "ar":
            lines.append(f"| AR | - | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | - | - | - | - | 1.00x | - |")
        else:
            same = {True: "yes", False: "NO"}.get(r.get("identical_to_ar"), "-")
            lines.append(f"| SPD | {r['n']} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | "
                         f"{r['acceptance_rate']:.3f} | {r['tokens_per_cycle']:.3f} | "
                         f"{r['equivalent_accept_length']:.2f} | {r['ms_per_cycle']:.1f} | "
                         f"{'-' if r['speedup_vs_ar'] is None else format(r['speedup_vs_ar'], '.2f') + 'x'} | {same} |")
    return "\n".join(lines)


def run_bench_cli(args: argparse.Namespace) -> int:
    check_output(args.out, "--out")
    apply_runtime_options(args)
    res = run_bench(args, quiet=args.json)
    if args.json:
        print(json.dumps(res))
    else:
        m = res["meta"]
        print(f"{m['prompts']} prompts x {m['repeats']}, {m['max_new_tokens']} new tokens, T={m['temperature']}, "
              f"{m['threads']} threads, {m['dtype']} on {m['device']}, kernels {m['kernels']}, draft {m['draft']}\n")
        print(bench_table(res["rows"]))
    if args.out:  # after the results are shown: a file that cannot be written loses nothing
        write_output(Path(args.out), json.dumps(res, indent=2))
    if any(r.get("identical_to_ar") is False for r in res["rows"]):  # with --json too: scripts read the status
        print("spd-fast: warning: greedy SPD output differs from AR; this is a bug, please report it",
              file=sys.stderr)
        return 1
    return 0


# ---- eval ----------------------------------------------------------------------------------------
def run_eval_cli(args: argparse.Namespace) -> int:
    from .config import SpdConfigError
    from .evaluate import GreedyMismatch, evaluate_acceptance, markdown_table, write_results
    from .sampling import SamplingParams

    cats = list(dict.fromkeys(c.strip() for c in args.categories.split(",") if c.strip()))  # each category once
    bad = [c for c in cats if c not in CATEGORIES]
    if bad or not cats:
        raise SpdConfigError(f"--categories {args.categories!r}: choose a comma-separated subset of "
                             f"{','.join(CATEGORIES)}")
    for t in args.temperatures:
        SamplingParams(t)
    check_output(args.out, "--out", stem=True)
    apply_runtime_options(args)
    try:
        res = evaluate_acceptance(args.num_stages, args.temperatures, args.limit, args.max_new_tokens, args.draft,
                                  cats, with_ar=not args.no_ar, model=args.model, dtype=args.dtype,
                                  device=args.device, progress=not args.json, seed=args.seed, lookup=args.lookup,
                                  placement=args.placement, cuda_graphs=False if args.no_cuda_graphs else None,
                                  max_len=args.max_len,
                                  on_warning=lambda m: print(f"spd-fast: warning: {cli_warning(m)}", file=sys.stderr))
    except GreedyMismatch as e:  # as bench says it: one line, status 1
        print(f"spd-fast: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        print(f"draft {res['meta']['draft']}, {args.limit} prompts per category, {args.max_new_tokens} new tokens\n")
        print(markdown_table(res["rows"]))
    if args.out:  # after the results are shown: a file that cannot be written loses nothing
        js, md = write_results(res, args.out)
        if not args.json:
            print(f"wrote {js} and {md}", file=sys.stderr)
    return 0

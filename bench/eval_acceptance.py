"""Acceptance evaluation on the project's held-out prompt sets (chat / math / code).

For each n and temperature: acceptance_rate, tokens_per_cycle, equivalent_accept_length per
category and overall, and wall-clock SPD vs AR decode tokens/s measured in the same run.
Writes JSON and a markdown table. The logic lives in spd_fast/evaluate.py (also `spd-fast eval`).

    .venv/bin/python bench/eval_acceptance.py --num-stages 3 --temperatures 0 --limit 30
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from spd_fast.config import DEFAULT_LOOKUP


def main(argv: list[str] | None = None) -> int:
    from spd_fast.cli_bench import decode_tokens
    from spd_fast.cli_common import (check_output, cli_message, float_list, int_list, kv_length, non_negative_int,
                                     positive_int, positive_thread_count, seed_int)
    from spd_fast.config import SpdConfigError
    from spd_fast.evaluate import GreedyMismatch, evaluate_acceptance, markdown_table, write_results
    from spd_fast.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=None, help="head directory (default: the shipped head for each n)")
    p.add_argument("--num-stages", type=int_list, default=[3], help="comma-separated n values")
    p.add_argument("--temperatures", type=float_list, default=[0.0], help="comma-separated, e.g. 0,0.7,1.0")
    p.add_argument("--limit", type=positive_int, default=40, help="prompts per category")
    p.add_argument("--max-new-tokens", type=decode_tokens, default=96)
    p.add_argument("--no-ar", action="store_true", help="skip the AR wall-clock baseline")
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--max-len", type=kv_length, default=2048, help="KV cache length: prompt + new tokens + n + 1")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="prompt i samples with seed SEED+i (matters at temperature > 0)")
    p.add_argument("--lookup", type=non_negative_int, default=DEFAULT_LOOKUP,
                   help=f"context lookup beside the PDM (default {DEFAULT_LOOKUP}; 0: the PDM alone)")
    p.add_argument("--out", default="bench/results/acceptance")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        for t in a.temperatures:  # before the model loads
            SamplingParams(temperature=t)
        check_output(a.out, "--out", stem=True)
        res = evaluate_acceptance(a.num_stages, a.temperatures, a.limit, a.max_new_tokens, a.draft,
                                  with_ar=not a.no_ar, progress=False, max_len=a.max_len,
                                  on_row=lambda r: print(json.dumps(r), flush=True), seed=a.seed, lookup=a.lookup)
        print(markdown_table(res["rows"]))
        write_results(res, a.out)
    except SpdConfigError as e:
        msg = cli_message(e, p)
        if "model=<its model>" in msg:  # a head for another model: this script has no --model to load that one
            msg += ("\n(this script runs the default model only; evaluate a head for another model with "
                    "`spd-fast eval --model <its model> --draft HEAD`)")
        print(f"eval_acceptance.py: error: {msg}", file=sys.stderr)
        return 2
    except GreedyMismatch as e:
        print(f"eval_acceptance.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

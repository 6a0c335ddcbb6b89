"""Cut self-distilled answers to their first N tokens (and optionally keep every k-th sample).

The 64-token acceptance evaluation only sees the start of each answer, and a short answer costs a
fraction of a long one in the teacher cache and in training. The n=4 head (docs/TRAINING.md, "The n=4
head") trained on the committed answer files cut this way:

    python3 scripts/cut_answers.py data/self_distill/magpie_s9_greedy_256.jsonl.gz runs/trunc80/magpie_s9_greedy_256.jsonl
    python3 scripts/cut_answers.py data/self_distill/gpu_magpie_s41_s42_greedy_bf16_256.jsonl.gz \\
        runs/trunc80/gpu_first2500.jsonl --every 6 --limit 2500
    python3 scripts/cut_answers.py data/self_distill/gpu_magpie_s41_s42_greedy_bf16_256.jsonl.gz \\
        runs/trunc80/gpu_rest.jsonl --every 6 --complement      # the rows that cut left out (n=5 stage 3)

Each output line is the input sample with `response_ids` cut to `--max-response-tokens`; every other
field (prompt, prompt_ids, ...) is kept as it is. Standard library only.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path


def cut(lines, max_response_tokens: int, every: int = 1, limit: int = 0, complement: bool = False):
    """Yield the samples of `lines` (JSON strings): every `every`-th from the first (with `complement`,
    all the others instead), at most `limit` (0: all), each with response_ids cut to max_response_tokens."""
    kept = 0
    for i, line in enumerate(x for x in lines if x.strip()):
        if bool(i % every) != complement:
            continue
        if limit and kept >= limit:
            return
        s = json.loads(line)
        if "response_ids" not in s:
            raise ValueError(f"sample {i} has no response_ids; this script cuts self-distilled answer files "
                             "(scripts/self_distill_magpie.py output)")
        s["response_ids"] = s["response_ids"][:max_response_tokens]
        kept += 1
        yield s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help=".jsonl or .jsonl.gz answer file")
    ap.add_argument("out", help="output .jsonl")
    ap.add_argument("--max-response-tokens", type=int, default=80)
    ap.add_argument("--every", type=int, default=1, help="keep samples 0, k, 2k, ...")
    ap.add_argument("--limit", type=int, default=0, help="keep at most this many (0: all)")
    ap.add_argument("--complement", action="store_true",
                    help="keep the samples --every K drops (1, ..., K-1, K+1, ...): the rest of a file an earlier cut sampled")
    a = ap.parse_args(argv)
    if a.max_response_tokens < 1 or a.every < 1 or a.limit < 0:
        ap.error("--max-response-tokens and --every must be >= 1 and --limit >= 0")
    if a.complement and a.every == 1:
        ap.error("--complement with --every 1 keeps nothing: give --every K > 1")
    src = Path(a.src)
    if not src.is_file():
        ap.error(f"{src} does not exist")
    opener = gzip.open if src.suffix == ".gz" else open
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    try:
        with opener(src, "rt", encoding="utf-8") as f, out.open("w", encoding="utf-8") as w:
            for s in cut(f, a.max_response_tokens, a.every, a.limit, a.complement):
                w.write(json.dumps(s) + "\n")
                n += 1
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        out.unlink(missing_ok=True)
        ap.error(f"{src}: {e}")
    print(f"{n} samples -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

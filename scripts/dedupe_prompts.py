"""Merge self-distillation jsonl files, keeping the first row of every prompt not seen before.

Rows whose "prompt" appears in an --exclude file (earlier training data, validation data) are
dropped, and so are later repeats within the inputs. Used to add a new seed of
scripts/self_distill_magpie.py to the shipped head's data without training twice on one prompt:

    python3 scripts/dedupe_prompts.py runs/sd_magpie_s2.jsonl --exclude runs/sd_magpie.jsonl \
        --out runs/sd_magpie_s2_train.jsonl

Any file named *.gz (input, exclude or --out) is read or written gzip-compressed, like
data/self_distill/*.jsonl.gz.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys


def _open(path: str, mode: str = "r"):
    """Text-mode open; gzip for *.gz."""
    return gzip.open(path, mode + "t", encoding="utf-8") if path.endswith(".gz") else open(path, mode, encoding="utf-8")


def dedupe(inputs: list[str], exclude: list[str], out: str) -> tuple[int, int]:
    """Write the new rows of `inputs` to `out`; return (rows read, rows kept)."""
    seen = set()
    if any(os.path.exists(f) and os.path.exists(out) and os.path.samefile(f, out) for f in inputs):
        raise SystemExit(f"--out {out} is also an input: it would be emptied before it is read; write elsewhere")
    same = [f for f in exclude if os.path.exists(f) and os.path.exists(out) and os.path.samefile(f, out)]
    if same:  # a glob like data/*.jsonl.gz that also matches --out: its own rows would empty it
        print(f"dedupe_prompts: not excluding {same[0]}, the --out file itself", file=sys.stderr)
    for f in exclude:
        if f in same:
            continue
        with _open(f) as fh:
            seen.update(json.loads(line).get("prompt") for line in fh)
    read = kept = 0
    with _open(out, "w") as fh:
        for f in inputs:
            with _open(f) as src:
                for row, line in enumerate(src, 1):
                    read += 1
                    prompt = json.loads(line).get("prompt")
                    if prompt is None:
                        raise SystemExit(f"{f}: row {row} has no 'prompt' field; "
                                         "give the jsonl written by a self_distill script")
                    if prompt not in seen:
                        seen.add(prompt)
                        fh.write(line)
                        kept += 1
    return read, kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="jsonl files to merge, in order")
    p.add_argument("--exclude", nargs="*", action="extend", default=[],
                   help="jsonl files whose prompts are dropped; the flag may be repeated (all its files count)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    read, kept = dedupe(a.inputs, a.exclude, a.out)
    print(json.dumps({"read": read, "kept": kept, "dropped": read - kept, "out": a.out}))


if __name__ == "__main__":
    main()

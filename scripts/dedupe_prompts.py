"""Merge self-distillation jsonl files, keeping the first row of every prompt not seen before.

Rows whose "prompt" (or "prompt_ids") appears in an --exclude file (earlier training data, validation data,
prompt sets) are dropped, and so are later repeats within the inputs. A last line cut short by a killed
writer is dropped with a note. Used to add a new seed of
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


def _rows(path: str):
    """(row number, parsed row, its text) of a jsonl file; blank lines skipped; a last line cut short by a killed
    writer is dropped with a note (the round it belonged to is incomplete), any other bad line is an error."""
    try:
        with _open(path) as fh:
            lines = fh.read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise SystemExit(f"dedupe_prompts: cannot read {path} ({type(e).__name__}: {e}); a .gz name needs gzip "
                         "content") from None
    last = len(lines) - 1  # the text after the final newline: "" for a complete file
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield i + 1, json.loads(line), line
        except ValueError:
            if i == last:
                print(f"dedupe_prompts: {path}: dropped row {i + 1}, cut short (no newline at its end)",
                      file=sys.stderr)
                continue
            raise SystemExit(f"dedupe_prompts: {path}: row {i + 1} is not JSON; fix or remove it") from None


def dedupe(inputs: list[str], exclude: list[str], out: str) -> tuple[int, int]:
    """Write the new rows of `inputs` to `out`; return (rows read, rows kept). A row is old when its "prompt" text
    or its "prompt_ids" occurred before (in an exclude file or an earlier input row)."""
    seen: set = set()
    seen_ids: set = set()
    if any(os.path.exists(f) and os.path.exists(out) and os.path.samefile(f, out) for f in inputs):
        raise SystemExit(f"--out {out} is also an input: it would be emptied before it is read; write elsewhere")
    same = [f for f in exclude if os.path.exists(f) and os.path.exists(out) and os.path.samefile(f, out)]
    if same:  # a glob like data/*.jsonl.gz that also matches --out: its own rows would empty it
        print(f"dedupe_prompts: not excluding {same[0]}, the --out file itself", file=sys.stderr)
    for f in inputs + exclude:  # every file exists before anything is read or written
        if not os.path.isfile(f):
            raise SystemExit(f"dedupe_prompts: {f} does not exist; pass the jsonl files a self_distill script wrote")
    for f in exclude:
        if f in same:
            continue
        for row, r, _ in _rows(f):
            if "prompt" not in r and "prompt_ids" not in r:  # it would exclude nothing, silently
                raise SystemExit(f"dedupe_prompts: {f}: row {row} has neither 'prompt' nor 'prompt_ids'; exclude "
                                 "files must be self-distillation rows (or prompt sets with a 'prompt' field)")
            if "prompt" in r:
                seen.add(r["prompt"])
            if "prompt_ids" in r:
                seen_ids.add(tuple(r["prompt_ids"]))
    tmp = out + ".tmp" + (".gz" if out.endswith(".gz") else "")
    try:
        read, kept = _write_new(inputs, tmp, seen, seen_ids)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, out)  # whole or not at all: a stopped run leaves no partial --out behind
    return read, kept


def _write_new(inputs: list[str], tmp: str, seen: set, seen_ids: set) -> tuple[int, int]:
    read = kept = 0
    with _open(tmp, "w") as fh:
        for f in inputs:
            for row, r, line in _rows(f):
                read += 1
                prompt = r.get("prompt")
                if prompt is None:
                    raise SystemExit(f"{f}: row {row} has no 'prompt' field; "
                                     "give the jsonl written by a self_distill script")
                ids = tuple(r["prompt_ids"]) if "prompt_ids" in r else None
                if prompt not in seen and (ids is None or ids not in seen_ids):
                    seen.add(prompt)
                    if ids is not None:
                        seen_ids.add(ids)
                    fh.write(line + "\n")  # the row as written
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

"""Is head B's acceptance really different from head A's? A paired comparison of two evaluation runs.

Both JSON files come from bench/eval_acceptance.py (or `spd-fast eval`) on the same prompts (same
--limit, categories, --max-new-tokens and --seed). For every (n, temperature, category) row present
in both, it prints both acceptance rates (the heads and the --lookup may differ), the difference B - A and its paired bootstrap 95%
interval over prompts. Prompt i is the same prompt in both runs, so the prompt-to-prompt spread
both runs share cancels: the interval is much narrower than the two unpaired intervals together.

    .venv/bin/python bench/eval_acceptance.py --num-stages 3 --limit 20 --max-new-tokens 64 --no-ar --out /tmp/a
    .venv/bin/python bench/eval_acceptance.py --draft runs/new/head --num-stages 3 --limit 20 --max-new-tokens 64 \\
        --no-ar --out /tmp/b
    .venv/bin/python bench/compare_acceptance.py /tmp/a.json /tmp/b.json

--prompts 20:40 compares only prompts 20-39 of each category (both runs need --limit 40 or more), e.g. the
half of the eval prompts that no head was ever picked on: a head chosen because it scored best on prompts
0-19 looks better there than it is.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spd_fast.config import SpdConfigError

# the draft and the lookup may differ: that is what is compared (older results lack model_fingerprint: not checked)
_SAME = {"max_new_tokens": "--max-new-tokens", "limit": "--limit", "categories": "--categories", "seed": "--seed",
         "model_fingerprint": "--model", "dtype": "--dtype",  # bf16 logits change the target's own answers
         "device": "--device"}  # so do a GPU's kernels: prompt i would not be the same answer in both runs


def _load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise SpdConfigError(f"{path} {what}; pass the .json file that bench/eval_acceptance.py --out wrote")
    try:
        res = json.loads(p.read_text())
        rows = res["rows"]
        ok = isinstance(rows, list) and all(isinstance(r, dict) and {"n", "temperature", "category"} <= r.keys()
                                            for r in rows) and isinstance(res.get("meta", {}), dict)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise SpdConfigError(f"{path} is not an evaluation result (no list of 'rows' with n, temperature and "
                             "category); pass the .json file that bench/eval_acceptance.py --out wrote") from None
    if rows and not any("per_prompt" in r for r in rows):
        raise SpdConfigError(f"{path} has no per-prompt counts (it predates them); run the evaluation again "
                             "with this version of bench/eval_acceptance.py")
    for r in rows:  # [verified, accepted] per prompt, as evaluate writes them
        pp = r.get("per_prompt", [])
        if not isinstance(pp, list) or not all(isinstance(x, list) and len(x) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x) and x[1] <= x[0] for x in pp):
            raise SpdConfigError(f"{path}: the per_prompt counts of row ({r['n']}, {r['temperature']}, "
                                 f"{r['category']}) are not [verified, accepted] pairs of counts; the file is damaged "
                                 "or was edited: run the evaluation again")
    return res


def parse_slice(text: str) -> slice:
    """'20:40' -> slice(20, 40): the prompt indices (within each category) to compare."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpdConfigError(f"--prompts takes START:STOP, e.g. 20:40, got {text!r}") from None
    if not 0 <= a < b:
        raise SpdConfigError(f"--prompts {text}: need 0 <= START < STOP, e.g. 20:40")
    return slice(a, b)


def _sliced(rows: list[dict], sel: slice | None) -> list[dict]:
    """The rows with per_prompt cut to `sel` in every category; an 'overall' row is rebuilt as the
    concatenation of its (n, temperature)'s cut category rows, since its own list is all prompts of all
    categories one after the other."""
    if sel is None:
        return rows
    out, cats = [], {}
    for r in rows:
        if "per_prompt" not in r:
            continue
        if r["category"] != "overall":
            pp = r["per_prompt"]
            if len(pp) < sel.stop:
                raise SpdConfigError(f"--prompts {sel.start}:{sel.stop} needs {sel.stop} prompts per category, the "
                                     f"run has {len(pp)} for {r['category']}; evaluate with --limit {sel.stop} (there are 40 "
                                     f"prompts per category) or pick prompts below {len(pp)}")
            r = dict(r, per_prompt=pp[sel])
            cats.setdefault((r["n"], r["temperature"]), []).extend(r["per_prompt"])
        out.append(r)
    return [dict(r, per_prompt=cats.get((r["n"], r["temperature"]), [])) if r["category"] == "overall" else r
            for r in out]


def compare(base: dict, new: dict, prompts: slice | None = None) -> list[dict]:
    from spd_fast.evaluate import dtype_name, paired_difference

    mb, mn = dict(base.get("meta", {})), dict(new.get("meta", {}))
    for m in (mb, mn):  # results written before dtypes had one spelling ("fp32", "torch.float32")
        if "dtype" in m:
            m["dtype"] = dtype_name(m["dtype"])
        if isinstance(m.get("device"), str):  # "cuda" and "cuda:0" are the same kind of device
            m["device"] = m["device"].split(":")[0]
    for k, flag in _SAME.items():
        if k in mb and k in mn and mb[k] != mn[k]:
            raise SpdConfigError(f"the two runs differ in {k} ({mb[k]!r} vs {mn[k]!r}): a paired comparison needs "
                                 f"the same model, prompts and settings; run both with the same {flag}")
    key = lambda r: (r["n"], r["temperature"], r["category"])  # noqa: E731
    have = {key(r): r for r in _sliced(base["rows"], prompts) if "per_prompt" in r}
    out = []
    for r in _sliced(new["rows"], prompts):
        b = have.get(key(r))
        if b is None or "per_prompt" not in r:
            continue
        out.append(dict(zip(("n", "temperature", "category"), key(r)), prompts=len(r["per_prompt"]),
                        **paired_difference(b["per_prompt"], r["per_prompt"])))
    if not out:
        raise SpdConfigError("the two runs share no (n, temperature, category) row; evaluate both at the same "
                             "--num-stages and --temperatures")
    return out


def table(rows: list[dict]) -> str:
    lines = ["| n | temp | category | prompts | A | B | B - A | paired 95% CI |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['temperature']} | {r['category']} | {r['prompts']} | {r['base']:.3f} | "
                     f"{r['new']:.3f} | {r['difference']:+.3f} | {r['ci_low']:+.3f} to {r['ci_high']:+.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="evaluation JSON of head A (the baseline)")
    p.add_argument("new", help="evaluation JSON of head B, same prompts and settings")
    p.add_argument("--prompts", help="START:STOP, compare only these prompts of each category (e.g. 20:40)")
    a = p.parse_args(argv)
    try:
        rows = compare(_load(a.base), _load(a.new), parse_slice(a.prompts) if a.prompts else None)
    except SpdConfigError as e:
        print(f"compare_acceptance: error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Give a trained head with a frozen LM head a larger draft vocabulary, without training.

A head saved with `frozen_lm_head` stores only `draft_vocab` (draft index -> token id); its LM-head rows are
copied from the target at load. Appending token ids to that buffer therefore lets the tower's output score
tokens it was never trained on, through the target's own rows. The old ids keep their order and slots.

    .venv/bin/python scripts/extend_draft_vocab.py spd_fast/heads/smollm2-135m-instruct-n3 runs/vocab/n3_full
    .venv/bin/python scripts/extend_draft_vocab.py HEAD OUT --size 0 --data data/self_distill   # every token seen

`--size` 0 with `--data` adds every token id the answers and prompts of those .jsonl(.gz) files contain, most
frequent first; otherwise the vocabulary grows to `--size` ids (the base vocabulary size: all of them).
Session 34 measured the full vocabulary at n=3: docs/TRAINING.md, "A full draft vocabulary".
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def token_counts(paths: list[Path]) -> collections.Counter:
    cnt: collections.Counter = collections.Counter()
    files = [f for p in paths for f in (sorted(p.glob("*.jsonl*")) if p.is_dir() else [p])]
    for f in files:
        with (gzip.open(f, "rt") if f.suffix == ".gz" else open(f)) as fh:
            for line in fh:
                row = json.loads(line)
                cnt.update(row.get("prompt_ids", []))
                cnt.update(row.get("response_ids", []))
    return cnt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", type=int, default=-1, help="new vocabulary size (-1: the base vocabulary size)")
    ap.add_argument("--data", type=Path, action="append", default=[],
                    help="rank added ids by their frequency in these files or folders")
    args = ap.parse_args(argv)

    cfg = json.loads((args.head / "draft_config.json").read_text())
    if not cfg.get("frozen_lm_head"):
        raise SystemExit(f"{args.head}: its LM head was trained (frozen_lm_head false), so rows for new ids do not "
                         "exist; extend only heads with a frozen LM head")
    sd = load_file(str(args.head / cfg.get("weights", "draft.safetensors")))
    old = sd["draft_vocab"].long()
    have = set(old.tolist())
    base = int(cfg["base_vocab_size"])
    if args.data:
        ranked = [t for t, _ in token_counts(args.data).most_common() if t not in have and 0 <= t < base]
    else:
        ranked = []
    if args.size != 0:
        seen = have | set(ranked)
        ranked += [t for t in range(base) if t not in seen]
    size = base if args.size < 0 else (len(old) + len(ranked) if args.size == 0 else args.size)
    if not len(old) <= size <= base:
        raise SystemExit(f"--size {size} must lie between the head's {len(old)} and the base vocabulary's {base}")
    new = torch.cat([old, torch.tensor(ranked[: size - len(old)], dtype=torch.long)]).to(sd["draft_vocab"].dtype)
    sd["draft_vocab"] = new
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(args.out / "draft.safetensors"))
    cfg.update(draft_vocab_size=len(new), weights="draft.safetensors")
    (args.out / "draft_config.json").write_text(json.dumps(cfg, indent=2))
    print(f"{args.out}: draft vocabulary {len(old)} -> {len(new)} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Give a trained head with a frozen LM head a larger draft vocabulary, without training.

A head saved with `frozen_lm_head` stores only `draft_vocab` (draft index -> token id); its LM-head rows are
copied from the target at load. Adding token ids to that buffer therefore lets the tower's output score
tokens it was never trained on, through the target's own rows.

    .venv/bin/python scripts/extend_draft_vocab.py spd_fast/heads/smollm2-135m-instruct-n3 runs/vocab/n3_full
    .venv/bin/python scripts/extend_draft_vocab.py HEAD OUT --size 32768 --data data/self_distill/human_s45_greedy_80.jsonl.gz

The vocabulary grows to `--size` ids (default: all of the base vocabulary), chosen like a new head's
(`trainer.build_draft_vocab`, the old ids kept): most frequent answer tokens of `--data`, then prompt tokens,
then the lowest unused ids. The ids come back sorted; the order does not matter, since the frozen rows are
rebuilt from the buffer at load.
Session 34 measured the full vocabulary at n=3: docs/TRAINING.md, "A full draft vocabulary".
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file, save_file

from spd_fast.pdm import WEIGHTS_FILE, read_draft_config
from spd_fast.train.data import read_jsonl
from spd_fast.train.trainer import build_draft_vocab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", type=int, default=0, help="new vocabulary size (default: the base vocabulary size)")
    ap.add_argument("--data", action="append", default=[], help="a .jsonl(.gz) file whose token frequencies rank the added ids")
    args = ap.parse_args(argv)

    dcfg = read_draft_config(args.head)
    if not dcfg.frozen_lm_head:
        raise SystemExit(f"{args.head}: its LM head was trained (frozen_lm_head false), so rows for new ids do not "
                         "exist; extend only heads with a frozen LM head")
    sd = load_file(str(args.head / dcfg.weights))
    old = sd["draft_vocab"]
    size = args.size or dcfg.base_vocab_size
    if not old.numel() <= size <= dcfg.base_vocab_size:
        raise SystemExit(f"--size {size} must lie between the head's {old.numel()} and the base vocabulary's "
                         f"{dcfg.base_vocab_size}")
    samples = [row for f in args.data for row in read_jsonl(f)]
    sd["draft_vocab"] = build_draft_vocab(samples, size, dcfg.base_vocab_size, always=old.tolist()).to(old.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(args.out / WEIGHTS_FILE))
    (args.out / "draft_config.json").write_text(replace(dcfg, draft_vocab_size=size, weights=WEIGHTS_FILE).to_json())
    print(f"{args.out}: draft vocabulary {old.numel()} -> {size} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

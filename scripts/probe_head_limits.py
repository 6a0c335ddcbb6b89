"""Teacher-forced top-1 agreement of a draft head by fill and by data file: where its limit lies.

Two questions decide what a GPU lease should buy for a head that stopped improving:
  - does the pipeline's depth pattern cost much? At full fill the PDM sees the newest token at depth 0,
    the next ones at depths 1..n-1 and only older ones complete; at fill 1 every older token is complete
    (the information an EAGLE-style head has). If fill 1 scores little above full fill, the head's own
    modelling of the newest token is the limit, not the pipeline.
  - more data or more capacity? Agreement on answers the head trained on against held-out ones of the
    same kind: a large gap says data; a low figure on trained answers says capacity or steps.

    .venv/bin/python scripts/probe_head_limits.py spd_fast/heads/smollm2-135m-instruct-n3 \\
        --val data/self_distill/val_long_s21_256.jsonl.gz --fills full,1,2 --out runs/limits.json
    .venv/bin/python scripts/probe_head_limits.py spd_fast/heads/smollm2-135m-instruct-n3 \\
        --val data/self_distill/gpu_magpie_s41_s42_greedy_bf16_256.jsonl.gz --fills full

Prints one markdown row per (file, fill): top-1 over all answer tokens and over answer tokens 0-63 (the
window a 64-token evaluation reads). Session 36's figures: docs/TRAINING.md, "Where the n=3 head's limit lies".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _fills(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "full":
            out.append(None)
        elif part.isdigit():
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"expected 'full' or a fill count per comma-separated item, got {part!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    from spd_fast.config import SpdConfigError
    from spd_fast.train.calibrate import load_target_and_head
    from spd_fast.train.data import read_val_samples
    from spd_fast.train.trainer import PdmTrainer, TrainConfig

    from spd_fast.cli_common import thread_count

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", help="head directory (draft_config.json + draft.safetensors)")
    ap.add_argument("--val", action="append", required=True, help="answers to score (.jsonl/.jsonl.gz/...); repeatable")
    ap.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--limit", type=int, default=80, help="score the first LIMIT samples of each file (default 80)")
    ap.add_argument("--fills", type=_fills, default=[None], help="'full' and/or fill counts 1..n-1 (default full)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--after-miss", action="store_true",
                    help="score each fill f < n only on rows that follow a miss of the head f tokens back, as the "
                         "pipeline's refills after a reject do (full fill scores every row)")
    ap.add_argument("--threads", type=thread_count, default=0)
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args(argv)
    try:
        target, head = load_target_and_head(a.head, a.model, a.threads)
        head, n = head.float(), head.dcfg.num_stages
        bad = [f for f in a.fills if f is not None and not 1 <= f < n]
        if bad:
            raise SpdConfigError(f"--fills {bad[0]} is out of range for this n={n} head: use full or 1..{n - 1}")
        tr = PdmTrainer(target.model, head, TrainConfig(max_seq_len=a.max_seq_len, fill_after_miss=a.after_miss))
        rows = []
        print("| file | fill | top-1 | top-1, answer tokens 0-63 | rows |\n|---|---|---|---|---|")
        for f in a.val:
            samples = read_val_samples([f], target)[: a.limit]
            for fill in a.fills:
                v = tr.validate(samples, pos_edges=(64,), fill=fill)
                row = {"file": f, "fill": "full" if fill is None else fill, "samples": len(samples),
                       "after_miss": bool(a.after_miss and fill is not None),
                       "top1": v["val_top1"], "top1_0_63": v["val_top1_by_pos"].get("0-63"), "rows": v["val_tokens"]}
                rows.append(row)
                w = "-" if row["top1_0_63"] is None else f"{row['top1_0_63']:.4f}"
                label = f"{row['fill']}, after a miss" if row["after_miss"] else row["fill"]
                print(f"| {Path(f).name} | {label} | {row['top1']:.4f} | {w} | {int(row['rows'])} |", flush=True)
    except SpdConfigError as e:
        print(f"probe_head_limits: error: {e}", file=sys.stderr)
        return 2
    if a.out:
        Path(a.out).write_text(json.dumps({"head": a.head, "num_stages": n, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

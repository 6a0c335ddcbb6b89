"""Average the weights of two draft heads of the same shape (a two-model "soup"), without training.

    .venv/bin/python scripts/average_heads.py spd_fast/heads/smollm2-135m-instruct-n3 runs/head_n3_v13/best_head \\
        runs/soup50 --weight 0.5

OUT gets (1 - w) * A + w * B for every floating-point tensor and A's draft_config.json (its calibration
included; recalibrate with `python -m spd_fast.train.calibrate OUT --val ... --write` if wanted). The
heads must agree on everything but their weights: n, anchors, layers, draft vocabulary, base model.
Session 36 measured a 50/50 soup of the shipped n=3 head and its session-35 fine-tune: docs/TRAINING.md,
"Where the n=3 head's limit lies".
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spd_fast.pdm import WEIGHTS_FILE, read_draft_config

# what may differ between the two heads: their calibration and the weights' file name; every other
# draft_config.json field (n, anchors, layers, vocabulary size, base model, format) must match
_FREE_FIELDS = {"draft_temperature_scale", "lookup_gate_confidence", "lookup_gate_ratio", "lookup_copy_boost",
                "weights"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="first head directory (its draft_config.json is kept)")
    ap.add_argument("b", type=Path, help="second head directory")
    ap.add_argument("out", type=Path)
    ap.add_argument("--weight", type=float, default=0.5, help="share of B, in [0, 1] (default 0.5)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.weight <= 1.0:
        raise SystemExit(f"--weight {args.weight} must lie in [0, 1] (the share of the second head)")
    ca, cb = read_draft_config(args.a), read_draft_config(args.b)
    for f in (x.name for x in fields(ca) if x.name not in _FREE_FIELDS):
        if getattr(ca, f) != getattr(cb, f):
            raise SystemExit(f"the heads differ in {f} ({getattr(ca, f)} vs {getattr(cb, f)}); only heads of the "
                             "same shape and base model can be averaged")
    sa, sb = load_file(str(args.a / ca.weights)), load_file(str(args.b / cb.weights))
    if sa.keys() != sb.keys():
        raise SystemExit(f"the heads store different tensors ({sorted(sa.keys() ^ sb.keys())[:3]}...); "
                         "only heads of the same shape can be averaged")
    out = {}
    for k, ta in sa.items():
        tb = sb[k]
        if ta.is_floating_point():
            out[k] = torch.lerp(ta.float(), tb.float(), args.weight).to(ta.dtype)
        elif torch.equal(ta, tb):
            out[k] = ta
        else:
            raise SystemExit(f"tensor {k} (e.g. the draft vocabulary) differs between the heads; averaging needs "
                             "the same ids in both")
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out / WEIGHTS_FILE))
    (args.out / "draft_config.json").write_text(replace(ca, weights=WEIGHTS_FILE).to_json())
    print(f"{args.out}: {1 - args.weight:g} x {args.a} + {args.weight:g} x {args.b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

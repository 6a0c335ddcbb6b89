"""Calibrate a trained head's draft temperature for sampled decoding.

With one draft per position, a draft drawn from q is accepted with probability sum_x min(p(x), q(x)),
p the target's distribution at temperature T. A head trained with a KL loss is usually less sure
than the target (it sees less of the context), so its softmax at T is flatter than p and drafting
at a lower temperature T * s (s < 1) raises that overlap. Output stays exact for any s: verification
uses the q the draft was drawn from.

`calibrate()` estimates the expected acceptance teacher-forced on held-out samples at full fill
(the pipeline's steady state) for a grid of scales and temperatures; `python -m
spd_fast.train.calibrate HEAD --val FILE --write` stores the best common scale in the head's
draft_config.json (`draft_temperature_scale`), which PdmDrafter applies at every temperature > 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

DEFAULT_SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.15)
DEFAULT_TEMPERATURES = (0.7, 1.0)


@torch.no_grad()
def calibrate(target_obj, head, samples: Sequence[dict], temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
              scales: Sequence[float] = DEFAULT_SCALES, batch_size: int = 8, max_seq_len: int = 512) -> dict:
    """-> {"rows", "top1", "acceptance": {"T": {"s": expected acceptance}}, "mean": {"s": mean over T},
    "best_scale"}. Rows: the assistant positions of `samples`, each scored as the newest token."""
    from ..config import SpdConfigError
    from ..pdm import SCALE_RANGE, valid_scale
    from .trainer import PdmTrainer, TrainConfig, collate

    if not samples:
        raise SpdConfigError("calibration needs held-out samples; pass --val FILE (chat jsonl or text)")
    for x in temperatures:
        if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
            raise SpdConfigError(f"temperatures must be positive numbers, got {x!r}")
    for x in scales:
        if not valid_scale(x):
            raise SpdConfigError(f"scales must be numbers in [{SCALE_RANGE[0]}, {SCALE_RANGE[1]}], got {x!r}")
    head.eval()
    tr = PdmTrainer(target_obj.model, head, TrainConfig(max_seq_len=max_seq_len))
    dv = head.draft_vocab
    sums = {(t, s): 0.0 for t in temperatures for s in scales}
    rows = agree = 0.0
    try:
        for i in range(0, len(samples), batch_size):
            ids, lens, loss_mask = collate(list(samples[i:i + batch_size]), max_seq_len)
            anchors, logits = tr.teacher_forward(ids, lens)
            sel = loss_mask.reshape(-1).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            s_logits, _ = tr.student_logits(anchors, lens, None, sel)
            s_logits = s_logits.float()
            t_logits = logits.float().reshape(-1, logits.shape[-1])[sel]
            rows += sel.numel()
            agree += float((dv[s_logits.argmax(-1)] == t_logits.argmax(-1)).sum())
            for t in temperatures:
                p_dv = torch.softmax(t_logits / t, -1)[:, dv]  # the draft has no mass outside V_d
                for s in scales:
                    sums[(t, s)] += float(torch.minimum(p_dv, torch.softmax(s_logits / (t * s), -1)).sum())
    finally:
        target_obj.model.free_caches()
    rows_ = max(rows, 1.0)
    acc = {str(t): {str(s): sums[(t, s)] / rows_ for s in scales} for t in temperatures}
    mean = {str(s): sum(acc[str(t)][str(s)] for t in temperatures) / len(temperatures) for s in scales}
    best = max(scales, key=lambda s: mean[str(s)])
    return {"rows": int(rows), "top1": agree / rows_, "acceptance": acc, "mean": mean, "best_scale": best}


def write_scale(head_dir: str | Path, scale: float) -> None:
    """Set draft_temperature_scale in a head directory's draft_config.json."""
    from ..pdm import read_draft_config

    dcfg = dataclasses.replace(read_draft_config(head_dir), draft_temperature_scale=float(scale))
    (Path(head_dir) / "draft_config.json").write_text(dcfg.to_json())


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    from ..config import SpdConfigError

    p = argparse.ArgumentParser(prog="spd_fast.train.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", help="head directory (draft_config.json + draft.safetensors)")
    p.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--val", action="append", default=[], help="held-out data (.jsonl/.jsonl.gz/.txt/.parquet); repeatable")
    p.add_argument("--val-limit", type=int, default=140, help="use at most this many samples")
    p.add_argument("--temperatures", type=_floats, default=list(DEFAULT_TEMPERATURES))
    p.add_argument("--scales", type=_floats, default=list(DEFAULT_SCALES))
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--write", action="store_true", help="store the best scale in the head's draft_config.json")
    p.add_argument("--out", help="also write the result JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        from ..pdm import load_draft
        from ..runtime import load_target
        from .data import read_val_samples

        if not a.val:
            raise SpdConfigError("pass held-out data with --val FILE (not the head's training data)")
        target = load_target(a.model)
        head = load_draft(a.head, target.model, target.fingerprint)
        res = calibrate(target, head, read_val_samples(a.val, target)[: a.val_limit], a.temperatures, a.scales)
    except SpdConfigError as e:
        print(f"spd_fast.train.calibrate: error: {e}", file=sys.stderr)
        return 2
    res["head"], res["val"] = str(a.head), a.val
    res["previous_scale"] = head.dcfg.draft_temperature_scale
    print("| scale | " + " | ".join(f"T={t}" for t in a.temperatures) + " | mean |")
    print("|---|" + "---|" * (len(a.temperatures) + 1))
    for s in a.scales:
        cells = " | ".join(f"{res['acceptance'][str(t)][str(s)]:.4f}" for t in a.temperatures)
        print(f"| {s} | {cells} | {res['mean'][str(s)]:.4f} |")
    print(f"best scale {res['best_scale']} (rows {res['rows']}, greedy top-1 {res['top1']:.4f})")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    if a.write:
        write_scale(a.head, res["best_scale"])
        print(f"wrote draft_temperature_scale={res['best_scale']} to {Path(a.head) / 'draft_config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

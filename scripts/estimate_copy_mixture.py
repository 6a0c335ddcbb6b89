"""Estimate, teacher-forced, what a mixture draft for context copies would add at temperature T > 0.

Today a copy is drafted with a one-hot q. The alternative: draft the copy with probability lambda, else
the PDM's own sample, so q = lambda * one-hot + (1 - lambda) * q_PDM (still exact). On every held-out
answer row (full fill, like `spd_fast.train.calibrate`) this prints the expected acceptance
sum_x min(p_T(x), q(x)) for several lambda, with the head's lookup gate and draft temperature applied
(lambda 1 is today's drafter).

    .venv/bin/python scripts/estimate_copy_mixture.py [HEAD] [--val FILE] [--val-limit 80]
"""
from __future__ import annotations

import argparse
import warnings

import torch

LAMBDAS = (0.0, 0.25, 0.5, 0.75, 1.0)
TEMPERATURES = (0.7, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", nargs="?", default="spd_fast/heads/smollm2-135m-instruct-n3")
    p.add_argument("--val", default="data/self_distill/val_long_s21_256.jsonl.gz")
    p.add_argument("--val-limit", type=int, default=80)
    p.add_argument("--lookup", type=int, default=3)
    a = p.parse_args()
    warnings.simplefilter("ignore")
    from spd_fast.ops import lookup_next
    from spd_fast.pdm import load_draft
    from spd_fast.runtime import load_target
    from spd_fast.train.data import read_val_samples
    from spd_fast.train.trainer import PdmTrainer, TrainConfig, collate

    target = load_target(None)
    head = load_draft(a.head, target.model, target.fingerprint)
    dc = head.dcfg
    samples = read_val_samples([a.val], target)[: a.val_limit]
    tr = PdmTrainer(target.model, head, TrainConfig(max_seq_len=512))
    dv, V = head.draft_vocab, target.model.cfg.vocab_size
    slot = torch.full((V,), -1, dtype=torch.long).scatter_(0, dv.long(), torch.arange(dv.numel()))
    sums = {(t, lam): 0.0 for t in TEMPERATURES for lam in LAMBDAS}
    rows = copies = 0
    with torch.no_grad():
        for i in range(0, len(samples), 8):
            ids, lens, mask = collate(samples[i:i + 8], 512)
            anchors, logits = tr.teacher_forward(ids, lens)
            sel = mask.reshape(-1).nonzero().squeeze(1)
            s_logits, _ = tr.student_logits(anchors, lens, None, sel)
            s_logits, t_logits = s_logits.float(), logits.float().reshape(-1, V)[sel]
            q_raw = torch.softmax(s_logits, -1)  # what the gate reads
            for row, flat in enumerate(sel.tolist()):
                b, r = divmod(flat, ids.shape[1])
                rows += 1
                copy = None
                if r >= a.lookup:
                    found, c = lookup_next(ids[b, :r + 1], torch.tensor(r), a.lookup)
                    if bool(found):
                        c = int(c)
                        top = float(q_raw[row].max())
                        p_copy = float(q_raw[row, slot[c]]) if slot[c] >= 0 else 0.0
                        if not (top > dc.lookup_gate_confidence and p_copy < dc.lookup_gate_ratio * top):
                            copy = c
                copies += copy is not None
                for t in TEMPERATURES:
                    pt = torch.softmax(t_logits[row] / t, -1)
                    q = torch.zeros(V)
                    q[dv] = torch.softmax(s_logits[row] / (t * dc.draft_temperature_scale), -1)
                    base = float(torch.minimum(pt, q).sum())
                    for lam in LAMBDAS:
                        if copy is None:
                            sums[t, lam] += base
                        else:
                            qm = (1 - lam) * q
                            qm[copy] += lam
                            sums[t, lam] += float(torch.minimum(pt, qm).sum())
    print(f"{rows} rows, {copies} drafted as copies (gate {dc.lookup_gate_confidence}/{dc.lookup_gate_ratio})")
    print("| T | " + " | ".join(f"lambda {lam}" for lam in LAMBDAS) + " |")
    print("|---|" + "---|" * len(LAMBDAS))
    for t in TEMPERATURES:
        print(f"| {t} | " + " | ".join(f"{sums[t, lam] / rows:.4f}" for lam in LAMBDAS) + " |")


if __name__ == "__main__":
    main()

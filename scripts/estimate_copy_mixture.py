"""Estimate, teacher-forced, what a mixture draft for context copies would add at temperature T > 0.

A copy drafted one-hot (the default of a head without a copy boost) against a mixture: draft the copy
with probability lambda, else the PDM's own sample, so q = lambda * one-hot + (1 - lambda) * q_PDM
(still exact). On every held-out answer row (full fill, like `spd_fast.train.calibrate`) this prints the expected acceptance
sum_x min(p_T(x), q(x)) for several lambda, with the head's lookup gate and draft temperature applied
(lambda 1 is the one-hot drafter). Session 28 built a logit boost for copies instead, which scored
higher on the same rows; `python -m spd_fast.train.calibrate` fits it (`lookup_copy_boost`).

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
    from spd_fast.pdm import draft_vocab_slots, gate_keeps_pdm, load_draft
    from spd_fast.runtime import load_target
    from spd_fast.train.calibrate import lookup_matches, teacher_rows
    from spd_fast.train.data import read_val_samples

    target = load_target(None)
    head = load_draft(a.head, target.model, target.fingerprint)
    dc = head.dcfg
    samples = read_val_samples([a.val], target)[: a.val_limit]
    dv, V = head.draft_vocab, target.model.cfg.vocab_size
    slot = draft_vocab_slots(dv, V)
    sums = {(t, lam): 0.0 for t in TEMPERATURES for lam in LAMBDAS}
    rows = copies = 0
    for ids, sel, s_logits, t_logits in teacher_rows(target, head, samples):
        q_raw = torch.cat([torch.softmax(s_logits, -1), s_logits.new_zeros(len(s_logits), 1)], 1)  # what the gate reads
        copy_of = {row: c for row, c in lookup_matches(ids, sel, a.lookup)
                   if not gate_keeps_pdm(float(q_raw[row].max()), float(q_raw[row, slot[c]]), int(slot[c]) < len(dv),
                                         dc.lookup_gate_confidence, dc.lookup_gate_ratio)}
        rows += sel.numel()
        copies += len(copy_of)
        for t in TEMPERATURES:
            pt = torch.softmax(t_logits / t, -1)
            q = torch.zeros_like(pt)
            q[:, dv] = torch.softmax(s_logits / (t * dc.draft_temperature_scale), -1)
            base = torch.minimum(pt, q).sum(-1)
            for lam in LAMBDAS:
                total = float(base.sum())
                for row, c in copy_of.items():
                    qm = (1 - lam) * q[row]
                    qm[c] += lam
                    total += float(torch.minimum(pt[row], qm).sum()) - float(base[row])
                sums[t, lam] += total
    print(f"{rows} rows, {copies} drafted as copies (gate {dc.lookup_gate_confidence}/{dc.lookup_gate_ratio})")
    print("| T | " + " | ".join(f"lambda {lam}" for lam in LAMBDAS) + " |")
    print("|---|" + "---|" * len(LAMBDAS))
    for t in TEMPERATURES:
        print(f"| {t} | " + " | ".join(f"{sums[t, lam] / rows:.4f}" for lam in LAMBDAS) + " |")


if __name__ == "__main__":
    main()

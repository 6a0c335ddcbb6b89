"""Teacher-forced probe of two lookup variants that were measured and not built (session 28).

On the held-out long answers (full fill, as `spd_fast.train.calibrate`), with the head's own gate on
3-token matches, it counts what would change:
- a 2-token (or 1-token) match as a fallback where no 3-token match exists, behind its own gate
  (a grid of confidence / ratio): gain in rows the draft gets right;
- preferring a 4-token match where its copy differs from the 3-token match's: how often each is right.

    .venv/bin/python scripts/probe_lookup_fallback.py [HEAD] > bench/results/copy_boost/fallback_probe.txt
"""
from __future__ import annotations

import argparse
import warnings

import torch

warnings.simplefilter("ignore")


def main() -> None:
    from spd_fast.pdm import draft_vocab_slots, gate_keeps_pdm, load_draft
    from spd_fast.runtime import load_target
    from spd_fast.train.calibrate import lookup_matches, teacher_rows
    from spd_fast.train.data import read_val_samples

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", nargs="?", default="spd_fast/heads/smollm2-135m-instruct-n3", help="head directory")
    head_dir = p.parse_args().head
    torch.set_num_threads(1)
    target = load_target(None)
    head = load_draft(head_dir, target.model, target.fingerprint)
    dc = head.dcfg
    samples = read_val_samples(["data/self_distill/val_long_s21_256.jsonl.gz"], target)[:80]
    dv = head.draft_vocab
    slot = draft_vocab_slots(dv, target.model.cfg.vocab_size)
    rows = base_right = 0
    recs: dict[int, list] = {2: [], 1: [], 4: []}
    for ids, sel, s_logits, t_logits in teacher_rows(target, head, samples):
        rows += sel.numel()
        y = t_logits.argmax(-1)
        q = torch.softmax(s_logits, -1)
        own = dv[q.argmax(-1)]
        m = {k: dict(lookup_matches(ids, sel, k)) for k in (1, 2, 3, 4)}
        for r in range(sel.numel()):
            top = float(q[r].max())

            def feats(c: int) -> tuple:
                inside = int(slot[c]) < len(dv)
                return (top, float(q[r, slot[c]]) if inside else 0.0, inside, c == int(y[r]), int(own[r]) == int(y[r]))

            if r in m[3]:
                f = feats(m[3][r])
                use = not gate_keeps_pdm(f[0], f[1], f[2], dc.lookup_gate_confidence, dc.lookup_gate_ratio)
                base_right += f[3] if use else f[4]
                if r in m[4] and m[4][r] != m[3][r]:
                    recs[4].append((feats(m[4][r]), use, f[3], f[4]))
            else:
                base_right += int(own[r]) == int(y[r])
                if r in m[2]:
                    recs[2].append(feats(m[2][r]))
                elif r in m[1]:
                    recs[1].append(feats(m[1][r]))
    print("rows", rows, "base acc", base_right / rows, "fallback2 rows", len(recs[2]), "fallback1 rows", len(recs[1]),
          "4-differs", len(recs[4]))
    for k in (2, 1):
        R = recs[k]
        print(k, "copy right", sum(f[3] for f in R), "pdm right", sum(f[4] for f in R))
        for c in (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0):
            for ra in (0.025, 0.1, 0.5, 1.0, 2.0):
                gain = sum((f[3] - f[4]) for f in R if not gate_keeps_pdm(f[0], f[1], f[2], c, ra))
                print(f"  k={k} c={c} r={ra} gain {gain} -> {(base_right + gain) / rows:.4f}")
    R = recs[4]
    print("4-match differs from 3-match copy: 4 right", sum(f[0][3] for f in R), "3 right", sum(f[2] for f in R))


if __name__ == "__main__":
    main()

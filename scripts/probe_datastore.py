"""Probe a corpus lookup ("datastore" drafting, as in REST) offline, on greedy SPD cycles.

Record: run greedy SPD with the shipped head (its context lookup and gate on) over eval prompts and keep,
for every cycle whose context turned out right (the drafts verification counts), the shipped draft, the
PDM's top-32 tokens and probabilities, and the 8 newest context tokens.
Score: build an n-gram table (k = 1..6 tokens -> the most frequent next token and its counts) from the
self-distilled answers in data/self_distill (never the eval prompts), and count how many more drafts a
corpus copy would get right, behind a gate on the PDM's confidence and the table's own counts.

    .venv/bin/python scripts/probe_datastore.py record --start 0 --limit 20 --out runs/ds_0_19.pt
    .venv/bin/python scripts/probe_datastore.py score runs/ds_0_19.pt --test runs/ds_20_39.pt
"""
from __future__ import annotations

import argparse
import glob
import gzip
import itertools
import json
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))  # probe_lookup, beside this
KS = (1, 2, 3, 4, 5, 6)
TAIL = 8


def record(start: int, limit: int, n: int, max_new: int) -> list[dict]:
    import spd_fast
    from spd_fast.drafters import PdmDrafter

    class Rec(PdmDrafter):
        def prefill(self, engine, st):
            super().prefill(engine, st)
            self.prompt = st.tokens[:st.prompt_len].tolist()

        def draft(self, engine, st, params, generator):
            # capture the PDM's logits as PdmDrafter.draft computes them (an instance attribute shadows the method)
            seen = {}
            head_logits = self.head.draft_logits
            self.head.draft_logits = lambda h: seen.setdefault("logits", head_logits(h))
            try:
                tok, q = super().draft(engine, st, params, generator)
            finally:
                del self.head.draft_logits
            top = torch.softmax(seen["logits"].float(), -1).topk(32)
            self.rows.append({"p": int(st.p_new), "ctx": st.tokens[:int(st.p_new) + 1].clone(), "draft": int(tok),
                              "top_ids": self.head.draft_vocab[top.indices].tolist(), "top_p": top.values.tolist()})
            return tok, q

    warnings.simplefilter("ignore")
    eng = spd_fast.load(num_stages=n, progress=False)
    old = eng.spd.drafter
    rec = Rec(old.head, old.lookup)
    eng.spd.drafter = rec
    from probe_lookup import verified_rows

    def tail(row, full):
        row["tail"] = full[max(0, row["p"] + 1 - TAIL):row["p"] + 1]

    return verified_rows(eng, rec, start, limit, max_new, extra=tail)


class NgramTable:
    """k-gram -> (most frequent next token, its count, all counts), over a token corpus, with numpy."""

    def __init__(self, seqs: list[list[int]], k: int):
        self.k = k
        keys, nxt = [], []
        for s in seqs:
            a = np.asarray(s, dtype=np.int64)
            if len(a) <= k:
                continue
            w = np.lib.stride_tricks.sliding_window_view(a[:-1], k)
            keys.append(self.hash(w))
            nxt.append(a[k:])
        key, nx = np.concatenate(keys), np.concatenate(nxt)
        comb = np.unique(key * 65536 + nx, return_counts=True)
        ck, cn = comb[0] // 65536, comb[0] % 65536
        cnt = comb[1]
        # per key: total count, and the argmax next token
        uk, idx = np.unique(ck, return_index=True)
        tot = np.add.reduceat(cnt, idx)
        best = np.maximum.reduceat(cnt, idx)
        # the next token with the best count (first among ties)
        is_best = cnt == np.repeat(best, np.diff(np.append(idx, len(cnt))))
        pos = np.flatnonzero(is_best)
        grp = np.searchsorted(idx, pos, side="right") - 1
        firstpos = pos[np.unique(grp, return_index=True)[1]]
        self.keys, self.tot, self.best, self.tok = uk, tot, best, cn[firstpos]

    @staticmethod
    def hash(w: np.ndarray) -> np.ndarray:
        h = np.zeros(w.shape[0], dtype=np.uint64)
        for j in range(w.shape[1]):
            h = h * np.uint64(1000003) + w[:, j].astype(np.uint64) + np.uint64(1)
        return (h & np.uint64((1 << 46) - 1)).astype(np.int64)

    def query(self, tail: list[int]):
        if len(tail) < self.k:
            return None
        h = int(self.hash(np.asarray([tail[-self.k:]], dtype=np.int64))[0])
        i = np.searchsorted(self.keys, h)
        if i < len(self.keys) and self.keys[i] == h:
            return int(self.tok[i]), int(self.best[i]), int(self.tot[i])
        return None


def corpus(files: list[str]) -> list[list[int]]:
    seqs = []
    for f in files:
        op = gzip.open if f.endswith(".gz") else open
        with op(f, "rt") as fh:
            for line in fh:
                r = json.loads(line)
                seqs.append(r["response_ids"])
    return seqs


def score(train_rows: list[dict], test_rows: list[dict] | None, files: list[str]) -> None:
    seqs = corpus(files)
    print(f"corpus: {len(seqs)} answers, {sum(map(len, seqs))} tokens")
    tables = {k: NgramTable(seqs, k) for k in KS}
    for rows in (train_rows, test_rows):
        if rows is None:
            continue
        for r in rows:
            r["ds"] = {k: tables[k].query(r["tail"]) for k in KS}
            r["pconf"] = r["top_p"][0]

    def stats(rows):
        N = len(rows)
        base = sum(r["draft"] == r["truth"] for r in rows) / N
        print(f"{N} drafts with right context; shipped drafter {base:.4f}")
        for k in KS:
            hit = [r for r in rows if r["ds"][k] is not None]
            ok = sum(r["ds"][k][0] == r["truth"] for r in hit)
            union = sum((r["ds"][k] is not None and r["ds"][k][0] == r["truth"]) or r["draft"] == r["truth"] for r in rows)
            print(f"  k={k}: found {len(hit) / N:.3f}; right there {ok / max(1, len(hit)):.3f}; "
                  f"shipped right there {sum(r['draft'] == r['truth'] for r in hit) / max(1, len(hit)):.3f}; "
                  f"oracle union {union / N:.4f}")

    def policy(rows, kmin, conf, minc, frac):
        """longest match k >= kmin with count >= minc and best/total >= frac, used when the PDM's top
        probability is below conf and the drafter did not copy from the context (draft == PDM top)."""
        good = 0
        for r in rows:
            d = r["draft"]
            if r["pconf"] < conf and d == r["top_ids"][0]:
                for k in KS[::-1]:
                    if k < kmin:
                        break
                    q = r["ds"][k]
                    if q is not None and q[1] >= minc and q[1] / q[2] >= frac:
                        d = q[0]
                        break
            good += d == r["truth"]
        return good / len(rows)

    print("fit rows:")
    stats(train_rows)
    grid = []
    for kmin, conf, minc, frac in itertools.product((1, 2, 3, 4), (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.01),
                                                    (1, 2, 3, 5, 10), (0.3, 0.5, 0.7, 0.9)):
        grid.append((policy(train_rows, kmin, conf, minc, frac), (kmin, conf, minc, frac)))
    grid.sort(reverse=True)
    base = sum(r["draft"] == r["truth"] for r in train_rows) / len(train_rows)
    for v, g in grid[:10]:
        print(f"  {v:.4f} (+{v - base:.4f})  kmin {g[0]} conf< {g[1]} count>= {g[2]} frac>= {g[3]}")
    if test_rows:
        print("test rows:")
        stats(test_rows)
        tb = sum(r["draft"] == r["truth"] for r in test_rows) / len(test_rows)
        for v, g in grid[:5]:
            t = policy(test_rows, *g)
            print(f"  fit best {g}: test {t:.4f} (+{t - tb:.4f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--start", type=int, default=0)
    r.add_argument("--limit", type=int, default=20)
    r.add_argument("--num-stages", type=int, default=3)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--out", required=True)
    s = sub.add_parser("score")
    s.add_argument("rows")
    s.add_argument("--test")
    s.add_argument("--data", nargs="*", default=None)
    a = ap.parse_args()
    if a.cmd == "record":
        torch.set_num_threads(2)
        torch.save(record(a.start, a.limit, a.num_stages, a.max_new_tokens), a.out)
    else:
        files = a.data or sorted(f for f in glob.glob("data/self_distill/*.jsonl.gz") if "val_" not in f)
        score(torch.load(a.rows), torch.load(a.test) if a.test else None, files)


if __name__ == "__main__":
    main()

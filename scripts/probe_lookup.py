"""Probe draft policies offline: run greedy SPD with the shipped head on eval prompts, record at every
cycle the PDM's greedy draft and confidence and the context-lookup candidates for several match
lengths k, then score policies on the drafts whose context was right (the ones verification counts).

    .venv/bin/python scripts/probe_lookup.py --start 20 --limit 20 --out runs/probe_20_39.pt
    .venv/bin/python scripts/probe_lookup.py --load runs/probe_20_39.pt

The policy numbers approximate greedy acceptance (a draft is verified only when its context was right).
"""
from __future__ import annotations

import argparse
import itertools
import warnings

import torch

KS = (1, 2, 3, 4, 5, 6, 8)


def record(start: int, limit: int, n: int, max_new: int) -> list[dict]:
    import spd_fast
    from spd_fast.drafters import PdmDrafter
    from spd_fast.evaluate import load_eval_prompts
    from spd_fast.model import kv_bound_for
    from spd_fast.ops import lookup_next

    class Rec(PdmDrafter):
        def __init__(self, head):
            super().__init__(head, 0)
            self.rows: list[dict] = []
            self.prompt: list[int] = []

        def prefill(self, engine, st):
            super().prefill(engine, st)
            self.prompt = st.tokens[:st.prompt_len].tolist()

        def draft(self, engine, st, params, generator):
            head = self.head
            p_new, start_ = int(st.p_new), int(st.pdm_len)
            pos = torch.arange(start_, p_new + 1)
            depth = torch.where(pos < st.p_old, engine.n, st.p_new - pos)
            g = head.aggregate(st.anchors[start_:p_new + 1], engine.depth_type[depth])
            h = head.tower(g[None], pos[None], kv_bound_for(p_new, head.max_len))
            logits = head.draft_logits(h[0, -1]).float()
            pr = torch.softmax(logits, -1)
            top2 = pr.topk(2)
            tok = head.draft_vocab[top2.indices[0]]
            full_logits = engine.model.lm_head(head.norm(h[0, -1])).float()   # every target token, frozen rows
            tok_full = int(full_logits.argmax())
            ctx = st.tokens[:p_new + 1]
            cands = {}
            for k in KS:
                if p_new >= k:
                    f, c = lookup_next(ctx, st.p_new, k)
                    if bool(f):
                        cands[k] = int(c)
            # what fraction of copies' token is in the PDM's top list, and its PDM prob
            full = torch.zeros(engine.model.cfg.vocab_size)
            full[head.draft_vocab] = pr
            cprob = {k: float(full[c]) for k, c in cands.items()}
            self.rows.append({"p": p_new, "ctx": ctx.clone(), "pdm": int(tok), "pdm_full": tok_full, "conf": float(top2.values[0]),
                              "margin": float(top2.values[0] - top2.values[1]), "cands": cands, "cprob": cprob})
            return tok, None

    warnings.simplefilter("ignore")
    eng = spd_fast.load(num_stages=n, lookup=0, progress=False)
    rec = Rec(eng.spd.drafter.head)
    eng.spd.drafter = rec
    return verified_rows(eng, rec, start, limit, max_new)


def verified_rows(eng, rec, start: int, limit: int, max_new: int, extra=None) -> list[dict]:
    """Greedy SPD over eval prompts [start, start + limit) of each category with the recording drafter `rec`
    (rows with "p" and "ctx"); keep the rows whose context turned out right (the drafts verification counts),
    each with "truth" (the target's next token) and "cat"; extra(row, full tokens) may add fields first."""
    from spd_fast.evaluate import load_eval_prompts

    out = []
    for cat, ps in load_eval_prompts(limit=start + limit).items():
        for r in ps[start:start + limit]:
            rec.rows = []
            o = eng.generate([{"role": "user", "content": r["prompt"]}], max_new, temperature=0, method="spd")
            full = rec.prompt + o.token_ids
            for row in rec.rows:
                p = row["p"]
                if p + 1 >= len(full) or row["ctx"].tolist() != full[:p + 1]:
                    continue
                if extra is not None:
                    extra(row, full)
                del row["ctx"]
                row["truth"] = full[p + 1]
                row["cat"] = cat
                out.append(row)
            print(cat, r.get("id"), len(o.token_ids), o.metrics["accepted"] / max(1, o.metrics["verifications"]),
                  flush=True)
    return out


def score(rows: list[dict]) -> None:
    N = len(rows)
    base = sum(r["pdm"] == r["truth"] for r in rows) / N
    print(f"{N} drafts with right context; PDM alone {base:.4f}")
    if "pdm_full" in rows[0]:
        print(f"  PDM over the whole target vocabulary (frozen LM-head rows): "
              f"{sum(r['pdm_full'] == r['truth'] for r in rows) / N:.4f}")
    for k in KS:
        hit = [r for r in rows if k in r["cands"]]
        if hit:
            print(f"  k={k}: found {len(hit) / N:.3f}; copy right {sum(r['cands'][k] == r['truth'] for r in hit) / len(hit):.3f}"
                  f"  PDM right there {sum(r['pdm'] == r['truth'] for r in hit) / len(hit):.3f}")

    def policy(ks, gate=None):
        good = 0
        for r in rows:
            d = r["pdm"]
            for k in ks:
                if k in r["cands"]:
                    thr = (gate or {}).get(k)
                    if thr is None or r["conf"] < thr:
                        d = r["cands"][k]
                    break
            good += d == r["truth"]
        return good / N

    res = []
    for kmax, kmin in itertools.product((3, 4, 5, 6, 8), (1, 2, 3, 4)):
        if kmin > kmax:
            continue
        ks = [k for k in KS if kmin <= k <= kmax][::-1]
        res.append((policy(ks), f"longest {kmax}..{kmin}"))
        for t1, t2 in itertools.product((0.3, 0.5, 0.7, 0.9, 1.01), (0.3, 0.5, 0.7, 0.9, 1.01)):
            gate = {1: t1, 2: t2}
            res.append((policy(ks, gate), f"longest {kmax}..{kmin} gate k1<{t1} k2<{t2}"))
    for v, name in sorted(set(res), reverse=True)[:15]:
        print(f"  {v:.4f}  {name}")
    print(f"  {policy([3]):.4f}  k=3 only (current)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=20)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--load", nargs="*")
    a = ap.parse_args()
    if a.load:
        rows = [r for f in a.load for r in torch.load(f)]
    else:
        rows = record(a.start, a.limit, a.num_stages, a.max_new_tokens)
        if a.out:
            torch.save(rows, a.out)
    score(rows)


if __name__ == "__main__":
    main()

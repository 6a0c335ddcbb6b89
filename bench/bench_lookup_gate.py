"""Do the lookup gate and the copy boost cost wall clock? One engine, the shipped head, its calibrated gate
and copy boost ("gated") against neither (gate (1, 0), one-hot copies: "ungated"), interleaved prompt by
prompt (the order alternates) so both see the same machine; prints the median ms per cycle of each and the
median per-pair ratio (gated / ungated).

    .venv/bin/python bench/bench_lookup_gate.py [--num-stages 3] [--temperature 0.7] [--limit 4] [--reps 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--limit", type=int, default=4, help="eval prompts per category")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    warnings.simplefilter("ignore")
    import spd_fast
    from spd_fast.evaluate import load_eval_prompts

    eng = spd_fast.load(num_stages=a.num_stages, progress=False)
    head = eng.spd.drafter.head
    gated = head.dcfg
    plain = dataclasses.replace(gated, lookup_gate_confidence=1.0, lookup_gate_ratio=0.0, lookup_copy_boost=None)
    prompts = [r["prompt"] for v in load_eval_prompts(limit=a.limit).values() for r in v]
    ms = {"gated": [], "ungated": []}
    for rep in range(a.reps):
        for i, text in enumerate(prompts):
            order = [("gated", gated), ("ungated", plain)]
            for name, cfg in (order if (i + rep) % 2 == 0 else order[::-1]):
                head.dcfg = cfg
                m = eng.generate([{"role": "user", "content": text}], a.max_new_tokens, temperature=a.temperature,
                                 seed=i).metrics
                ms[name].append(m["decode_seconds"] / m["cycles"] * 1e3)
    head.dcfg = gated
    print(f"gate {gated.lookup_gate_confidence}/{gated.lookup_gate_ratio}, copy boost {gated.lookup_copy_boost}, "
          f"n={a.num_stages}, T={a.temperature}, {len(ms['gated'])} pairs")
    for k, v in ms.items():
        print(f"{k}: median {statistics.median(v):.2f} ms per cycle")
    ratio = statistics.median(g / u for g, u in zip(ms["gated"], ms["ungated"]))
    print(f"gated / ungated, median over pairs: {ratio:.3f}")


if __name__ == "__main__":
    main()

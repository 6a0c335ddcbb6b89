"""Peak and resident memory of PDM training steps on the CPU, step by step (docs/TRAINING.md, "Session 42").

The trainer runs on synthetic cached batches (random token ids and fp16 anchor states of the default model's
shape), warm-started from the shipped n=3 head grown to `--draft-layers`, with the heap policy of real runs
(`heap.tune()`, `malloc_trim` every TRIM_EVERY steps). Each step prints one JSON line: its seconds, the live
tensor count, VmRSS and the process's peak (ru_maxrss). `--fixed` holds every shape fixed (every row a loss
row, no fill augmentation), which tells shape-driven heap growth from a leak.

    .venv/bin/python bench/probe_train_memory.py --seq-len 256 --batch-tokens 4096 --steps 40
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fixed", action="store_true", help="the same shapes every step")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from spd_fast.api import shipped_head
    from spd_fast.config import uniform_boundaries
    from spd_fast.pdm import DraftConfig, DraftHead, init_from_target
    from spd_fast.runtime import load_target
    from spd_fast.train import heap
    from spd_fast.train import trainer as tr

    heap.tune()
    tgt = load_target(progress=False)
    m = tgt.model
    dcfg = DraftConfig.make(m.cfg, uniform_boundaries(m.cfg.num_layers, 3), (0, 10, 20, 30), a.draft_layers, 16384,
                            tgt.fingerprint)
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m, 0)
    tr.warm_start(head, shipped_head(tgt, 3), tgt)
    t = tr.PdmTrainer(m, head, tr.TrainConfig(batch_tokens=a.batch_tokens, bf16=True, lr=1e-4, steps=a.steps,
                                              fill_aug=0.0 if a.fixed else 0.5))
    T, B = a.seq_len, max(1, a.batch_tokens // a.seq_len)
    layers = sorted({b for b in dcfg.anchors if b > 0} | {m.cfg.num_layers})
    g = torch.Generator().manual_seed(0)
    for step in range(a.steps):
        ids = torch.randint(0, m.cfg.vocab_size, (B, T), generator=g)
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[:, min(40, T // 2): T - 1] = True
        states = (torch.randn(B, T, len(layers), m.cfg.hidden_size, generator=g) * 2).half()
        arg = torch.randint(0, m.cfg.vocab_size, (B, T), generator=g)  # about a third inside the draft vocabulary
        if a.fixed:
            arg[:] = head.draft_vocab[0]
        else:
            arg[:, ::2] = head.draft_vocab[torch.randint(0, len(head.draft_vocab), (B, (T + 1) // 2), generator=g)]
        t0 = time.perf_counter()
        t.train_step((ids, torch.full((B,), T), mask), (states, arg, layers))
        if t.step % heap.TRIM_EVERY == 0:
            heap.trim()
        rss = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS"))
        print(json.dumps({"step": step, "seconds": round(time.perf_counter() - t0, 2),
                          "tensors": sum(1 for o in gc.get_objects() if torch.is_tensor(o)),
                          "rss_gb": round(rss / 2**20, 2),
                          "peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}), flush=True)


if __name__ == "__main__":
    main()

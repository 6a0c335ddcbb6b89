"""The temperature-0.7 self-distillation data of the shipped n=3 head (its fine-tuning stage).

The training prompts are shuffled with --seed, the first --pool are taken, and the --keep shortest
of those (by encoded length, the order in which self_distill batches them) are answered at
temperature 0.7 with 128 new tokens:

    .venv/bin/python scripts/self_distill_sampled.py --out runs/sd_t07.jsonl   # ~25 min on 2 cores

The shipped head used --pool 2000 --keep 1120 (generation was stopped after 35 batches of 32), then
--seed 11 --pool 1880 --keep 704 --exclude runs/sd_t07.jsonl --out runs/sd_t07b.jsonl.
"""
from __future__ import annotations

import argparse
import random

import torch

from spd_fast.runtime import load_target
from spd_fast.train.data import load_prompts, self_distill


def main() -> None:
    from spd_fast.cli_common import positive_thread_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--pool", type=int, default=2000)
    p.add_argument("--keep", type=int, default=1120)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--exclude", action="append", default=[],
                   help="a self-distillation jsonl whose prompt ids are left out (repeatable)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from spd_fast.train.data import read_jsonl

    used = {r["id"] for f in a.exclude for r in read_jsonl(f)}
    prompts = [q for q in load_prompts() if q["id"] not in used]
    random.Random(a.seed).shuffle(prompts)
    prompts = prompts[: a.pool]
    target = load_target(None)
    length = {q["id"]: len(target.encode([{"role": "user", "content": q["prompt"]}])) for q in prompts}
    prompts = sorted(prompts, key=lambda q: length[q["id"]])[: a.keep]  # stable, like self_distill's own sort
    self_distill(target, prompts, a.out, 128, 32, a.temperature, a.seed)


if __name__ == "__main__":
    main()

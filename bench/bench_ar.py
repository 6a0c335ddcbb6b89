"""AR decode speed: spd_fast's own runtime vs Hugging Face transformers generate(), same model, same
threads, same run. Each side runs in its own subprocess (clean peak-memory numbers).

    .venv/bin/python bench/bench_ar.py --threads 2 --new-tokens 64 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how a refrigerator works.",
           "Give me three tips for learning a new language."]


def _worker(impl: str, threads: int, new_tokens: int, repeats: int, dtype: str) -> dict:
    import torch

    torch.set_num_threads(threads)
    from spd_fast.ar import decode_ar
    from spd_fast.runtime import load_target
    from spd_fast.sampling import SamplingParams

    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    if impl == "hf":  # transformers alone in this process: its peak RSS is its own
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from spd_fast.runtime import encode_prompt
        from spd_fast.store import resolve_model_dir

        path = resolve_model_dir(None, progress=False)
        tok = AutoTokenizer.from_pretrained(str(path))
        ids_list = [encode_prompt(tok, m) for m in msgs]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

        def run(ids):
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=1, min_new_tokens=1,
                        pad_token_id=0)
            t1 = time.perf_counter()
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)
            t2 = time.perf_counter()
            n = out.shape[1] - len(ids)
            # decode time = full generate minus a prefill-only generate
            return ((t2 - t1) - (t1 - t0)) / max(1, n - 1)
    else:
        tg = load_target(None, dtype, progress=False)
        ids_list = [tg.encode(m) for m in msgs]
        tg.model.setup_caches(1, 1024)

        def run(ids):
            r = decode_ar(tg.model, ids, new_tokens, SamplingParams(), eos_ids=[])
            return r.decode_seconds / max(1, len(r.token_ids) - 1)

    with torch.inference_mode():
        run(ids_list[0])  # warm-up
        per_tok = [run(ids) for _ in range(repeats) for ids in ids_list]
    return {"impl": impl, "ms_per_token_median": 1e3 * statistics.median(per_tok),
            "ms_per_token_all": [1e3 * x for x in per_tok],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    from spd_fast.cli_common import positive_thread_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=positive_thread_count, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--worker", choices=["ours", "hf"])
    p.add_argument("--no-dense", action="store_true", help="skip the fp32-weights (SPD_FAST_PACKED=0) row")
    p.add_argument("--out", default="bench/results/ar_vs_hf.json")
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(_worker(a.worker, a.threads, a.new_tokens, a.repeats, a.dtype)))
        return 0
    res = {}
    # ours: GGUF-packed decode weights (the default); ours_dense: the same runtime on the fp32 copy
    rows = {"hf": ("hf", "1"), "ours_dense": ("ours", "0"), "ours": ("ours", "1")}
    if a.no_dense:
        rows.pop("ours_dense")
    for key, (impl, packed) in rows.items():
        out = subprocess.run([sys.executable, __file__, "--worker", impl, "--threads", str(a.threads), "--new-tokens",
                              str(a.new_tokens), "--repeats", str(a.repeats), "--dtype", a.dtype],
                             capture_output=True, text=True, check=True, env={**os.environ, "SPD_FAST_PACKED": packed})
        res[key] = json.loads(out.stdout.strip().splitlines()[-1])
    speedup = res["hf"]["ms_per_token_median"] / res["ours"]["ms_per_token_median"]
    from spd_fast.runtime import cpu_name
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_name(),
            "threads": a.threads, "dtype": a.dtype, "new_tokens": a.new_tokens, "repeats": a.repeats}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": res, "speedup": speedup}, indent=2))
    # peak RSS: the worker process's whole life (load + decode); the two "ours" rows share one loader
    print(f"| impl | ms/token (median) | tokens/s | peak RSS MiB |\n|---|---|---|---|")
    for k in rows:
        r = res[k]
        print(f"| {k} | {r['ms_per_token_median']:.1f} | {1e3 / r['ms_per_token_median']:.1f} | {r['peak_rss_mib']:.0f} |")
    print(f"spd_fast AR is {speedup:.2f}x HF transformers ({a.dtype}, {a.threads} threads, batch 1)")
    if "ours_dense" in res:
        print(f"(on the fp32 weight copy, SPD_FAST_PACKED=0: "
              f"{res['hf']['ms_per_token_median'] / res['ours_dense']['ms_per_token_median']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

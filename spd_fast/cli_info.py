"""`spd-fast info`: versions, device, optional accelerations, cached models and shipped heads."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    i = sub.add_parser("info", help="versions, device, GPUs, Triton / attention / C++ ops, cached models, heads",
                       description="What this installation can do; paste it into bug reports.")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=run)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dir_mib(path: Any) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _accelerations(cuda: bool) -> dict[str, str]:
    acc: dict[str, str] = {}
    if importlib.util.find_spec("triton") is None:
        acc["triton"] = "not installed (pip install triton; Linux x86_64 only; CUDA torch wheels bring it)"
    elif cuda:
        acc["triton"] = "available (GPU kernels)"
    else:
        acc["triton"] = "installed; no GPU: kernels run only under TRITON_INTERPRET=1 (tests); CPU runs " \
                        "the C++ ops or the PyTorch twins"
    acc["attention"] = "prefill: torch SDPA (its flash backend on CUDA); decode (up to 8 rows): two small matmuls " \
                       "per KV group, the fused C++ op on CPU; the flash-attn package is not used"
    acc["cpp_ops"] = _cpp_ops_status()
    try:
        acc["kernel_backend"] = importlib.import_module("spd_fast.kernels").get_backend()
    except Exception:  # older tree without spd_fast.kernels
        pass
    return acc


def _cpp_ops_status() -> str:
    """Whether the C++ CPU ops are built, without building them (that takes a while; it happens on
    first use)."""
    try:
        mod = importlib.import_module("spd_fast.cpp_ops")
    except ModuleNotFoundError as e:
        return "not built" if e.name == "spd_fast.cpp_ops" else f"not loadable: {e}"
    except Exception as e:
        return f"not loadable ({type(e).__name__}: {e})"
    build_dir = getattr(mod, "build_dir", None)
    if build_dir is None:
        return "available"
    d = build_dir()
    if any(d.glob("*.so")):
        return f"built ({d})"
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    return "not built yet: compiled on first use " + (f"with {cxx}" if cxx else
                                                       "(no C++ compiler found: apt-get install g++)")


def _models() -> dict[str, Any]:
    from .store import DEFAULT_MODEL_NAME, ModelNotFoundError, cache_root, default_gguf_path

    root = cache_root()
    try:
        default = str(default_gguf_path())
    except ModelNotFoundError as e:
        default = f"missing: {e}"
    cached = []
    models = root / "models"
    if models.is_dir():
        for d in sorted(models.iterdir()):
            if (d / "spd_fast_converted.json").is_file():
                try:  # a marker damaged by hand or by a full disk: listed, not fatal
                    marker = json.loads((d / "spd_fast_converted.json").read_text())
                    src = marker.get("source", "?") if isinstance(marker, dict) else "unreadable marker"
                except (OSError, ValueError):
                    src = "unreadable marker"
                cached.append({"path": str(d), "source": src, "size_mib": round(_dir_mib(d), 1)})
    return {"default_model": DEFAULT_MODEL_NAME, "default_gguf": default, "cache_root": str(root),
            "cached_models": cached}


def _heads() -> list[dict[str, Any]]:
    from .api import HEADS_DIR
    from .pdm import DraftConfig

    heads = []
    if HEADS_DIR.is_dir():
        for d in sorted(HEADS_DIR.iterdir()):
            cfg = d / "draft_config.json"
            if not cfg.is_file():
                continue
            try:
                dc = DraftConfig.from_json(cfg.read_text())
                heads.append({"name": d.name, "num_stages": dc.num_stages, "boundaries": list(dc.boundaries),
                              "anchors": list(dc.anchors), "draft_layers": dc.num_layers,
                              "draft_vocab_size": dc.draft_vocab_size, "base_model_type": dc.base_model_type,
                              "draft_temperature_scale": dc.draft_temperature_scale,
                              "lookup_gate": [dc.lookup_gate_confidence, dc.lookup_gate_ratio],
                              "lookup_copy_boost": dc.lookup_copy_boost,
                              "weights": dc.weights,
                              "size_mib": round(_dir_mib(d), 1)})
            except Exception as e:  # a broken head must not break `info`
                heads.append({"name": d.name, "error": f"{type(e).__name__}: {e}"})
    return heads


def collect() -> dict[str, Any]:
    import torch

    import spd_fast
    from .runtime import cpu_name

    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for k in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(k)
            gpus.append({"index": k, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
    return {
        "versions": {"spd_fast": spd_fast.__version__, "python": platform.python_version(),
                     "torch": torch.__version__, "transformers": _version("transformers"),
                     "triton": _version("triton"), "cuda": torch.version.cuda},
        "platform": {"machine": platform.machine(), "processor": platform.processor(), "cpu": cpu_name(),
                     "os": platform.platform(),
                     "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "device": "cuda" if cuda else "cpu",
        "gpus": gpus,
        "accelerations": _accelerations(cuda),
        **_models(),
        "shipped_heads": _heads(),
    }


def _print_text(d: dict[str, Any]) -> None:
    v = d["versions"]
    print(f"{'versions:':16}" + ", ".join(f"{k} {v[k] or 'not installed'}" for k in v if k != "cuda")
          + (f", CUDA {v['cuda']}" if v["cuda"] else ""))
    pl = d["platform"]
    print(f"{'platform:':16}{pl['os']}, {pl['cpu']}, {pl['cpu_count']} CPUs, torch threads {pl['torch_threads']}")
    print(f"{'device:':16}{d['device']}" + ("" if d["gpus"] else " (no CUDA GPU visible to torch)"))
    for g in d["gpus"]:
        print(f"  GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}")
    for k, s in d["accelerations"].items():
        print(f"{k + ':':16}{s}")
    print(f"default model: {d['default_model']} ({d['default_gguf']})")
    print(f"{'cache:':16}{d['cache_root']}")
    for m in d["cached_models"] or [{"path": "(none yet; the first load converts the GGUF)", "size_mib": 0}]:
        print(f"  {m['path']}" + (f" ({m['size_mib']} MiB)" if m["size_mib"] else ""))
    from .pdm import WEIGHTS_FILE

    print("shipped heads:" + ("" if d["shipped_heads"] else " none (generate falls back to a random head)"))
    for h in d["shipped_heads"]:
        if "error" in h:
            print(f"  {h['name']}: unreadable ({h['error']})")
        else:
            print(f"  {h['name']}: n={h['num_stages']}, boundaries {h['boundaries']}, L_s={h['draft_layers']}, "
                  f"V_d={h['draft_vocab_size']}, drafts at {h['draft_temperature_scale']:g} x T when sampling, "
                  f"lookup gate {h['lookup_gate'][0]:g}/{h['lookup_gate'][1]:g}, copies "
                  + ("one-hot" if h["lookup_copy_boost"] is None else f"boosted {h['lookup_copy_boost']:g}")
                  + f" when sampling, {h['size_mib']} MiB"
                  + ("" if h["weights"] == WEIGHTS_FILE else f" (weights shared: {h['weights']})"))


def run(args: argparse.Namespace) -> int:
    d = collect()
    if args.json:
        print(json.dumps(d))
    else:
        _print_text(d)
    sys.stdout.flush()
    return 0

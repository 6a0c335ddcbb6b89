"""Shared fixtures: the default model (fp32, CPU) and tiny random-weight checkpoints of each family."""
from __future__ import annotations

import os
import sys
import zlib

# before any kernel is defined: the Triton tests run in the interpreter on CPU tensors. Not under --benchmark, which
# runs only tests/benchmarks/: there the Triton rows run compiled on a GPU (and are skipped on CPU), and interpreted
# kernels on a GPU would time numpy, not the kernels
if "--benchmark" not in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def _threads() -> int:
    """OMP_NUM_THREADS when it is set to a positive integer (the caller pinned it), else up to 2."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        n = 0
    return n if n > 0 else max(1, min(2, os.cpu_count() or 1))


torch.set_num_threads(_threads())

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6)


def _tiny_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(num_hidden_layers=6, tie_word_embeddings=False, **TINY)
    if family == "llama-tied":
        return LlamaConfig(num_hidden_layers=5, tie_word_embeddings=True, **TINY)
    if family == "llama3":  # Llama-3.x RoPE scaling
        return LlamaConfig(num_hidden_layers=4, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                           **TINY)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=4, **TINY)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=4, head_dim=16, **TINY)
    raise KeyError(family)


FAMILIES = ["llama", "llama-tied", "llama3", "qwen2", "qwen3"]


def _copy_tokenizer(d) -> None:
    """Tiny checkpoints borrow the default model's tokenizer files so the public API can load them
    (the API tests only exercise errors and token-id paths, never decode text of a tiny model)."""
    import shutil

    from spd_fast.store import resolve_model_dir

    src = resolve_model_dir(None, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, d / name)


def save_random_checkpoint(cfg, d, seed: int, std: float = 0.08, tokenizer: bool = True) -> str:
    """A transformers model of `cfg` with seeded N(0, std) matrices (larger than the default init, so logits are
    not flat), saved to directory `d` (fp32), with the default model's tokenizer files unless told not to."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    hf.save_pretrained(d)
    if tokenizer:
        _copy_tokenizer(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """family -> directory with a random-weight checkpoint saved by transformers (fp32)."""
    made: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in made:  # seeded by the name: stable across runs (str hash is salted)
            made[family] = save_random_checkpoint(_tiny_config(family), tmp_path_factory.mktemp(family),
                                                  zlib.crc32(family.encode()) % 1000)
        return made[family]

    return make


@pytest.fixture(scope="session")
def default_target():
    """SmolLM2-135M-Instruct, fp32 on CPU, caches for 1 x 1024 positions."""
    from spd_fast.runtime import load_target

    tg = load_target(None, "float32", "cpu", progress=False)
    tg.model.setup_caches(1, 1024)
    return tg


def tiny_target(path: str, max_len: int = 256, max_batch: int = 1):
    from spd_fast.loading import load_hf_dir

    m = load_hf_dir(path)
    m.setup_caches(max_batch, max_len)
    return m


# ---- pytest --benchmark ---------------------------------------------------------------------------
# Benchmark tests live in tests/benchmarks/ (pytest-benchmark). A plain run skips them; with
# --benchmark only they run. SPD_BENCH_SHORT=1 shrinks them (fewer tokens and rounds) for CI.
_BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks")


def pytest_addoption(parser):
    parser.addoption("--benchmark", action="store_true", default=False,
                     help="run only the benchmark tests in tests/benchmarks/ (skipped otherwise); "
                          "SPD_BENCH_SHORT=1 for a short run")


def _is_benchmark(item) -> bool:
    return os.path.abspath(str(item.path)).startswith(_BENCH_DIR + os.sep)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--benchmark"):
        keep = [it for it in items if _is_benchmark(it)]
        dropped = [it for it in items if not _is_benchmark(it)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
        off = config.getoption("benchmark_disable", default=False)
        for it in keep:  # full-size benchmarks outlast the suite's per-test limit (pytest-timeout)
            it.add_marker(pytest.mark.timeout(3600))
            if off:  # pedantic rounds with timing off record nothing to report
                it.add_marker(pytest.mark.skip(reason="--benchmark-disable: these tests only measure time; "
                                                      "drop the flag to run them"))
        return
    skip = pytest.mark.skip(reason="benchmark: run with `pytest --benchmark`")
    for it in items:
        if _is_benchmark(it):
            it.add_marker(skip)

"""Shared pieces of the `pytest --benchmark` tests: sizes, engines, same-session baselines, summary table.

Every benchmark stores its numbers (tokens/s, ratio to the baseline measured in this session) in
`benchmark.extra_info`, so `--benchmark-json=out.json` carries them, and adds a row to a table
printed at the end of the run. This is a plain module, not a conftest.py: a second conftest module
would shadow tests/conftest.py for the `from conftest import ...` lines of the other tests.
"""
from __future__ import annotations

import os
import statistics
import warnings
from typing import Any

SHORT = os.environ.get("SPD_BENCH_SHORT", "") not in ("", "0")
NEW_TOKENS = 4 if SHORT else 16   # decode benchmarks
CYCLES = 4 if SHORT else 16       # cycles per round in the per-cycle benchmark
ROUNDS = 1 if SHORT else 3
PROMPT = [{"role": "user", "content": "Explain photosynthesis in simple terms."}]
THREADS = int(os.environ.get("SPD_BENCH_THREADS", "0"))  # 0: keep tests/conftest.py's setting
if THREADS:
    import torch

    torch.set_num_threads(THREADS)

BASELINES: dict[str, float] = {}  # baselines measured in this session, e.g. "ar_tokens_per_s"
_ROWS: list[dict[str, Any]] = []
_ENGINES: dict[int, Any] = {}


def engine_for(n: int) -> Any:
    """An Engine on the default model for n stages (shipped head if one fits, else random), loaded
    once per session (each holds its own fp32 copy of the 135M model, ~0.6 GiB)."""
    if n not in _ENGINES:
        import spd_fast

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _ENGINES[n] = spd_fast.load(num_stages=n, progress=False)
    return _ENGINES[n]


def decode_tokens_per_s(metrics: dict[str, float]) -> float:
    """Decode tokens/s after the prefill token (the same definition for AR and SPD)."""
    return (metrics["new_tokens"] - 1) / max(metrics["decode_seconds"], 1e-9)


def ar_tokens_per_s(engine: Any) -> float:
    """AR decode tokens/s on PROMPT: the value test_decode_ar stored if it ran, else measured now."""
    if "ar_tokens_per_s" not in BASELINES:
        engine.generate(PROMPT, NEW_TOKENS, method="ar")  # warm-up
        runs = [decode_tokens_per_s(engine.generate(PROMPT, NEW_TOKENS, method="ar").metrics)
                for _ in range(ROUNDS)]
        BASELINES["ar_tokens_per_s"] = statistics.median(runs)
    return BASELINES["ar_tokens_per_s"]


class _Summary:
    """A pytest plugin (registered on first use) that prints the collected rows at the end."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not _ROWS:
            return
        terminalreporter.section("spd_fast benchmarks (ratios against baselines measured in this session)")
        for r in _ROWS:
            parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "name"]
            terminalreporter.write_line(f"{r['name']:<28} " + "  ".join(parts))


def record(request: Any, benchmark: Any, **info: Any) -> None:
    """Put `info` into the benchmark's extra_info (JSON output) and the end-of-run table."""
    pm = request.config.pluginmanager
    if not pm.has_plugin("spd_fast_bench_summary"):
        pm.register(_Summary(), "spd_fast_bench_summary")
    import torch

    info = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in info.items()}
    info.setdefault("threads", torch.get_num_threads())  # CPU figures depend on it: the JSON says which gave them
    benchmark.extra_info.update(info, short_mode=SHORT)
    _ROWS.append({"name": request.node.name, **info})


def median_seconds(benchmark: Any) -> float:
    """Median seconds of one call of the benchmarked function (after pytest-benchmark's iterations)."""
    return float(benchmark.stats.stats.median)

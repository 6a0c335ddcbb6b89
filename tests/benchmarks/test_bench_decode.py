"""AR vs SPD decode on the default model (SmolLM2-135M, fp32) for n = 2, 3, greedy, one short prompt.

The AR test runs first and stores the baseline tokens/s; each SPD test reports its ratio to it
(or measures AR itself when run alone, e.g. with -k).
"""
from __future__ import annotations

import statistics
from typing import Any

import pytest

from bench_common import (BASELINES, NEW_TOKENS, PROMPT, ROUNDS, ar_tokens_per_s, decode_tokens_per_s, engine_for,
                          record)


def _run(benchmark: Any, eng: Any, method: str) -> list[dict[str, float]]:
    metrics: list[dict[str, float]] = []
    benchmark.pedantic(lambda: metrics.append(eng.generate(PROMPT, NEW_TOKENS, method=method).metrics),
                       rounds=ROUNDS, iterations=1, warmup_rounds=1)
    return metrics[1:]  # drop the warm-up round


def test_decode_ar(benchmark: Any, request: Any) -> None:
    eng = engine_for(2)
    runs = _run(benchmark, eng, "ar")
    tps = statistics.median(decode_tokens_per_s(m) for m in runs)
    # the baseline decoded what it was asked for, and its tokens are the reference decoder's
    out = eng.generate(PROMPT, NEW_TOKENS, method="ar")
    assert all(m["new_tokens"] == len(out.token_ids) for m in runs)
    assert len(out.token_ids) == NEW_TOKENS or out.finished_by_eos
    from spd_fast.ar import decode_ar
    from spd_fast.sampling import SamplingParams

    ref = decode_ar(eng.target.model, eng.target.encode(PROMPT), NEW_TOKENS, SamplingParams(), eng.target.eos_ids)
    assert out.token_ids == ref.token_ids
    BASELINES["ar_tokens_per_s"] = tps
    record(request, benchmark, method="ar", n=1, new_tokens=NEW_TOKENS, tokens_per_s=tps, ratio_vs_ar=1.0)


@pytest.mark.parametrize("n", [2, 3])
def test_decode_spd(benchmark: Any, request: Any, n: int) -> None:
    eng = engine_for(n)
    ar = ar_tokens_per_s(eng)
    runs = _run(benchmark, eng, "spd")
    tps = statistics.median(decode_tokens_per_s(m) for m in runs)
    m = runs[-1]
    # a speed figure for wrong output is worthless: greedy SPD must equal AR token for token
    assert eng.generate(PROMPT, NEW_TOKENS, method="spd").token_ids == eng.generate(PROMPT, NEW_TOKENS, method="ar").token_ids
    record(request, benchmark, method="spd", n=n, draft=eng.draft_source, new_tokens=NEW_TOKENS, tokens_per_s=tps,
           ar_tokens_per_s=ar, ratio_vs_ar=tps / ar, acceptance_rate=m["acceptance_rate"],
           tokens_per_cycle=m["tokens_per_cycle"], equivalent_accept_length=m["equivalent_accept_length"],
           ms_per_cycle=m["ms_per_cycle"])

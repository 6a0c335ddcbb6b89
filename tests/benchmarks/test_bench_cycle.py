"""The SPD engine's per-cycle cost on the default model vs one AR decode step (same session).

A round starts a fresh pipeline (prefill, untimed setup) and runs CYCLES cycles, the first of them filling the
pipeline: `mean_cycle_ms_from_prefill`, and the tokens/s and `ratio_vs_ar` made from it, count those. `cycle_ms`
and its split (stages / PDM / verify / overhead) are medians over the full-pipeline cycles of one extra profiled
run after the timing, as `bench/bench_cycle.py` reports them, so the parts add up to the whole.
"""
from __future__ import annotations

import statistics
from typing import Any

import pytest

from bench_common import CYCLES, PROMPT, ROUNDS, ar_tokens_per_s, engine_for, median_seconds, record


@pytest.mark.parametrize("n", [2, 3])
def test_cycle(benchmark: Any, request: Any, n: int) -> None:
    from spd_fast.sampling import SamplingParams

    eng = engine_for(n)
    spd, params = eng.spd, SamplingParams()
    ids = eng.target.encode(PROMPT)
    states = []

    def setup() -> tuple[tuple, dict]:
        st, _ = spd.start(ids, params, None)
        states.append(st)
        return (st,), {}

    def cycles(st: Any) -> None:
        for _ in range(CYCLES):
            spd.cycle(st, params, None)

    benchmark.pedantic(cycles, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    cycle_s = median_seconds(benchmark) / CYCLES
    st = states[-1]
    decoded = int(st.p_new) - int(st.fill) + 1 - st.prompt_len  # committed after the prefill token
    # a time for cycles that did nothing, or committed wrong tokens, is worthless: CYCLES ran, tokens were
    # committed, and they are greedy AR's
    assert int(st.cycles) == CYCLES and decoded > 0, (int(st.cycles), decoded)
    committed = st.tokens[st.prompt_len: st.prompt_len + decoded + 1].tolist()
    assert committed == eng.generate(PROMPT, decoded + 1, method="ar").token_ids
    tpc = decoded / CYCLES
    ar_step_s = 1.0 / ar_tokens_per_s(eng)

    spd.profile, spd.cycle_profile = True, []
    try:
        cycles(setup()[0][0])
        # steady state (full pipeline, a verification every cycle), as bench/bench_cycle.py
        prof = [c for c in spd.cycle_profile if c.get("fill") == n] or spd.cycle_profile
    finally:
        spd.profile = False
    split = {f"{k}_ms": 1e3 * statistics.median(c[k] for c in prof)
             for k in ("cycle", "stages", "slowest_stage", "draft", "verify", "overhead")}
    # each cycle holds its stages, so the medians keep that order (a mean over fill cycles did not)
    assert split["cycle_ms"] >= split["stages_ms"] >= split["slowest_stage_ms"], split
    record(request, benchmark, n=n, draft=eng.draft_source, mean_cycle_ms_from_prefill=1e3 * cycle_s,
           ar_step_ms=1e3 * ar_step_s, cycle_vs_ar_step=split["cycle_ms"] / (1e3 * ar_step_s), tokens_per_cycle=tpc,
           tokens_per_s=tpc / cycle_s, ratio_vs_ar=(tpc / cycle_s) * ar_step_s, **split)

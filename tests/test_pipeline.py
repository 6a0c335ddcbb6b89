"""Pipelined executors on CPU: the sync-free DeviceCycle over simulated streams equals the
sequential executor, never reads the device inside a cycle, orders its hand-offs, stops at EOS;
placement errors; NVTX switches."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FAMILIES, tiny_target
from spd_fast.ar import decode_ar
from spd_fast.config import SpdConfigError, uniform_boundaries
from spd_fast.drafters import PdmDrafter, ReferenceDrafter
from spd_fast.engine import SPDEngine
from spd_fast.pipeline import PipelinedEngine, resolve_placement
from spd_fast.sampling import SamplingParams, make_generator
from spd_fast.streams import SimulatedStreams
from test_engine import random_head

GREEDY = SamplingParams()


def _engines(model, boundaries, drafter_fn, anchors=None):
    seq = SPDEngine(model, drafter_fn(), boundaries, anchors)
    pipe = PipelinedEngine(SPDEngine(model, drafter_fn(), boundaries, anchors), "simulated")
    return seq, pipe


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("lag", [0, 2])
def test_simulated_pipeline_equals_sequential_and_ar(tiny_checkpoint, n, lag):
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, n)
    head = random_head(m, b, vocab=97)
    ids = [5, 17, 3, 9]
    ref = decode_ar(m, ids, 30, GREEDY, []).token_ids
    seq, pipe = _engines(m, b, lambda: PdmDrafter(head))
    pipe.lag = lag
    a = seq.run(ids, 30, GREEDY, [])
    got = pipe.run(ids, 30, GREEDY, [])
    assert got.token_ids == ref == a.token_ids
    # same drafts -> same accept/reject pattern and the same counters
    for k in ("cycles", "verifications", "accepted", "new_tokens"):
        assert got.metrics[k] == a.metrics[k], k


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["oracle", "wrong", "bernoulli"])
def test_simulated_pipeline_families_and_accept_patterns(tiny_checkpoint, family, mode):
    m = tiny_target(tiny_checkpoint(family))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    ids = [7, 1, 30]
    ref = decode_ar(m, ids, 25, GREEDY, []).token_ids
    full = [0] * len(ids) + ref
    mk = lambda: ReferenceDrafter(full, m.cfg.vocab_size, mode, p_right=0.5, seed=3)  # noqa: E731
    seq, pipe = _engines(m, b, mk)
    a, got = seq.run(ids, 25, GREEDY, []), pipe.run(ids, 25, GREEDY, [])
    assert got.token_ids == ref == a.token_ids
    expect = {"oracle": 1.0, "wrong": 0.0}.get(mode)
    if expect is not None:
        assert got.metrics["acceptance_rate"] == expect
    else:
        assert 0.0 < got.metrics["acceptance_rate"] < 1.0
        assert got.metrics["accepted"] == a.metrics["accepted"]


def test_pipeline_default_model_equals_ar(default_target):
    m = default_target.model
    b = uniform_boundaries(30, 3)
    ids = default_target.encode([{"role": "user", "content": "Name two colours."}])
    ref = decode_ar(m, ids, 16, GREEDY, default_target.eos_ids).token_ids
    head = random_head(m, b)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(head), b), "simulated")
    assert pipe.run(ids, 16, GREEDY, default_target.eos_ids).token_ids == ref


def test_stops_at_eos_and_length_without_returning_unverified_tokens(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    ids = [2, 4, 6]
    ref = decode_ar(m, ids, 30, GREEDY, []).token_ids
    # an EOS that first appears a few tokens in, so cycles run past it before the host notices
    stop_at = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    eos = ref[stop_at]
    cut = ref[: stop_at + 1]
    full = [0] * len(ids) + ref
    pipe = PipelinedEngine(SPDEngine(m, ReferenceDrafter(full, m.cfg.vocab_size), b), "simulated", lag=3)
    got = pipe.run(ids, 30, GREEDY, [eos])
    assert got.token_ids == cut and got.finished_by_eos
    # the cycles run past the EOS (the host reads lag cycles late) but nothing beyond it is returned
    assert int(pipe.last_state.cycles) > got.metrics["cycles"]
    short = pipe.run(ids, 5, GREEDY, [])
    assert short.token_ids == ref[:5] and not short.finished_by_eos


def test_every_decoder_stops_where_stop_fn_says(tiny_checkpoint):
    """stop_fn (stop strings) is asked after each committed token, the prefill's included, by all four decoders;
    the pipelined and graphed ones run cycles ahead of the host but return nothing past the stop."""
    from spd_fast.ar import ArDecoder
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    ids = [2, 4, 6]
    ref = decode_ar(m, ids, 30, GREEDY, []).token_ids
    full = [0] * len(ids) + ref
    for at in (0, 7):  # the prefill's token, and one decoded later
        stop = ref[at]
        cut = ref[: ref.index(stop) + 1]
        decoders = {
            "ar": lambda f: ArDecoder(m, ids, 30, GREEDY, [], None, f),
            "spd": lambda f: SPDEngine(m, ReferenceDrafter(full, m.cfg.vocab_size), b).generate(ids, 30, GREEDY, [],
                                                                                                  None, f),
            "pipelined": lambda f: PipelinedEngine(SPDEngine(m, ReferenceDrafter(full, m.cfg.vocab_size), b),
                                                   "simulated", lag=3).generate(ids, 30, GREEDY, [], None, f),
            "graphed-ar": lambda f: GraphedAR(m, lag=3).generate(ids, 30, GREEDY, [], None, f)}
        for name, make in decoders.items():
            asked: list[int] = []
            got = list(make(lambda t: asked.append(t) or t == stop))
            assert got == cut and asked == cut, (name, at)


class _NoHostReads(TorchDispatchMode):
    """Fails on any op that copies a device value to the host (.item(), int(), bool(), nonzero)."""
    BANNED = ("_local_scalar_dense", "nonzero", "masked_select", "unique")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(b in func.name() for b in self.BANNED):
            raise AssertionError(f"host read inside a cycle: {func.name()}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("lookup", [0, 2])
def test_device_cycle_never_reads_the_device(tiny_checkpoint, temperature, lookup):
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(random_head(m, b, vocab=97), lookup), b), "simulated")
    params = SamplingParams(temperature=temperature, seed=1)
    gen = make_generator(params, "cpu")
    st, _ = pipe.engine.start([3, 1, 4], params, gen)
    cyc = pipe._static(st, params, gen)
    with torch.inference_mode(), _NoHostReads():
        for _ in range(6):  # warm-up, full pipeline, then verifications (a random head's are mostly rejects)
            cyc.run(pipe.rt)
    assert int(cyc.st.cycles) == 6 and int(cyc.st.verifications) > int(cyc.st.accepts)
    if temperature > 0:  # sampled: a random q still gets accepts, so both branches ran without a host read
        assert int(cyc.st.accepts) > 0
    # the checker itself works
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        int(torch.tensor(3) + 1)


def test_device_cycle_never_reads_the_device_on_greedy_accepts(tiny_checkpoint):
    """Greedy accepts and rejects in one run: a drafter right half the time (it knows the target's answer)."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    prompt = [3, 1, 4]
    answer = decode_ar(m, prompt, 40, GREEDY, []).token_ids
    drafter = ReferenceDrafter([0] * len(prompt) + answer, m.cfg.vocab_size, "bernoulli", p_right=0.5, seed=2)
    pipe = PipelinedEngine(SPDEngine(m, drafter, b), "simulated")
    st, _ = pipe.engine.start(prompt, GREEDY, None)
    cyc = pipe._static(st, GREEDY, None)
    with torch.inference_mode(), _NoHostReads():
        for _ in range(12):
            cyc.run(pipe.rt)
    assert 0 < int(cyc.st.accepts) < int(cyc.st.verifications)


def test_handoffs_are_ordered_and_stages_are_concurrent(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    n = 3
    b = uniform_boundaries(m.cfg.num_layers, n)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(random_head(m, b, vocab=97)), b), "simulated")
    pipe.run([1, 2, 3], 8, GREEDY, [])
    rt: SimulatedStreams = pipe.rt
    hb = SimulatedStreams.happens_before
    # split the log into cycles: each starts with a "pre" mark
    cycles, cur = [], []
    for label, stream, clock in rt.log:
        if label == ("pre",) and cur:
            cycles.append(cur)
            cur = []
        cur.append((label, stream, clock))
    cycles.append(cur)
    assert len(cycles) >= 7
    prev_post = None
    for c in cycles:
        by = {lab: (s, clk) for lab, s, clk in c}
        pre, post = by[("pre",)], by[("post",)]
        assert pre[0] == "main" and post[0] == "main"
        work = [by[("draft",)]] + [by[("stage", s)] for s in range(n)]
        assert work[0][0] == "pdm" and [w[0] for w in work[1:]] == [f"stage{s}" for s in range(n)]
        for _, clk in work:
            assert hb(pre[1], clk) and hb(clk, post[1])  # fork before, join after
        # and by the phases' ends: the fork is recorded after pre's work, each join after its branch's work
        pre_end, post_end = by[("pre", "end")], by[("post", "end")]
        ends = [by[("draft", "end")]] + [by[("stage", s, "end")] for s in range(n)]
        for (s0, start), (s1, end) in zip(work, ends):
            assert s0 == s1 and hb(pre_end[1], start) and hb(start, end) and hb(end, post[1])
        for i in range(len(work)):  # nothing orders the draft and the stages among themselves
            for j in range(len(work)):
                if i != j:
                    assert not hb(work[i][1], work[j][1]) and not hb(ends[i][1], work[j][1])
        if prev_post is not None:  # cycles are serial
            assert hb(prev_post, pre[1])
        prev_post = post_end[1]


def test_placement_errors_name_what_exists():
    assert resolve_placement("sequential", "cpu", 3) == [torch.device("cpu")] * 3
    assert resolve_placement("local", "cpu", 2) == [torch.device("cpu")] * 2
    if not torch.cuda.is_available():
        with pytest.raises(SpdConfigError, match="placement='streams' runs the stages on CUDA GPUs.*CUDA available: "
                                                 "False.*placement='sequential'"):
            resolve_placement("streams", "cpu", 3)
        with pytest.raises(SpdConfigError, match="placement='devices'.*none"):
            resolve_placement("devices", "cuda", 2)
    with pytest.raises(SpdConfigError, match="placement must be one of"):
        resolve_placement("gpus", "cpu", 2)


def test_pipelined_engine_rejects_bad_options(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 2)
    eng = SPDEngine(m, PdmDrafter(random_head(m, b, vocab=97)), b)
    with pytest.raises(SpdConfigError, match="placement must be 'streams', 'devices' or 'simulated'"):
        PipelinedEngine(eng, "threads")
    with pytest.raises(SpdConfigError, match="cuda_graphs=True needs placement='streams' on a CUDA device"):
        PipelinedEngine(eng, "simulated", cuda_graphs=True)

    class HostDrafter:
        def prefill(self, *a):
            pass

        def draft(self, *a):
            pass

    with pytest.raises(SpdConfigError, match="HostDrafter has no draft_static"):
        PipelinedEngine(SPDEngine(m, HostDrafter(), b), "simulated")


def test_nvtx_switch(monkeypatch):
    from spd_fast import profiling

    calls = []
    monkeypatch.setattr(profiling, "_backend", lambda: (lambda name: calls.append(("push", name)),
                                                         lambda: calls.append(("pop",))))
    profiling.set_nvtx(True)
    try:
        with profiling.nvtx_range("spd.stage0"):
            calls.append(("work",))
    finally:
        profiling.set_nvtx(False)
    with profiling.nvtx_range("spd.stage0"):
        calls.append(("off",))
    assert calls == [("push", "spd.stage0"), ("work",), ("pop",), ("off",)]
    monkeypatch.setattr(profiling, "_backend", lambda: None)
    with pytest.raises(RuntimeError, match="pip install nvtx"):
        profiling.set_nvtx(True)


@pytest.mark.parametrize("lag", [0, 3])
def test_static_ar_step_equals_ar(tiny_checkpoint, default_target, lag):
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("qwen3"))
    ids = [3, 9, 27]
    ref = decode_ar(m, ids, 30, GREEDY, []).token_ids
    g = GraphedAR(m, lag=lag)
    assert g.run(ids, 30, GREEDY, []).token_ids == ref
    eos = ref[6]
    got = g.run(ids, 30, GREEDY, [eos])
    assert got.token_ids == ref[: ref.index(eos) + 1] and got.finished_by_eos
    params = SamplingParams(temperature=0.9, seed=4)
    a = decode_ar(m, ids, 20, params, [], make_generator(params, "cpu")).token_ids
    b = g.run(ids, 20, params, [], make_generator(params, "cpu")).token_ids
    assert a == b  # the same random stream: one draw per token in both
    dm = default_target.model
    dids = default_target.encode("Hello")
    assert GraphedAR(dm, lag=lag).run(dids, 12, GREEDY, default_target.eos_ids).token_ids == \
        decode_ar(dm, dids, 12, GREEDY, default_target.eos_ids).token_ids
    with pytest.raises(SpdConfigError, match="cuda_graphs=True needs the model on a CUDA device"):
        GraphedAR(m, cuda_graphs=True)


def test_api_placement_errors_before_loading_anything():
    import spd_fast

    with pytest.raises(SpdConfigError, match="placement must be one of"):
        spd_fast.load(placement="threads")
    if not torch.cuda.is_available():
        with pytest.raises(SpdConfigError, match="placement='streams' runs the stages on CUDA GPUs"):
            spd_fast.load(placement="streams")
        with pytest.raises(SpdConfigError, match="placement='devices' runs the stages on CUDA GPUs"):
            spd_fast.generate("hi", placement="devices")


def test_gpu_check_script_dry_run_on_cpu(tmp_path):
    """bench/gpu_check.py's logic (exactness checks, timing plumbing, report) on CPU, tiny shapes."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-dry-run", "--num-stages", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["errors"] == [] and rep["exactness"] and all(c["ok"] for c in rep["exactness"])
    spd = rep["timing_tiny"]["spd"][0]
    assert spd["n"] == 2 and spd["exact"] and len(spd["stage_us"]) == 2
    assert "== gpu_check summary ==" in r.stdout and "| tiny |" in r.stdout
    # the imposed acceptance defaults to the measured one of the shipped head for that n (not a stale constant)
    rows = json.loads(open("bench/results/acceptance.json").read())["rows"]
    shipped = [x["acceptance_rate"] for x in rows
               if x["n"] == 2 and x["temperature"] == 0 and x["category"] == "overall"]
    assert rep["meta"]["acceptance_imposed"] == {"2": shipped[0]} and spd["acceptance_imposed"] == shipped[0]
    # and the timed PDM has the shipped heads' depth (a 2-layer one undercounted drafting), their anchors at the
    # default model's shape
    sys.path.insert(0, "bench")
    import gpu_check

    assert spd["draft_layers"] == json.loads(open("spd_fast/heads/smollm2-135m-instruct-n3/draft_config.json")
                                             .read())["num_layers"] == 3
    m = gpu_check.random_model(gpu_check.SHAPES["smollm2-135m"], "cpu", torch.float32, max_len=16)
    assert [list(gpu_check.timing_head(m, n).dcfg.anchors) for n in (2, 5)] == [[0, 10, 20, 30]] * 2
    acc = gpu_check.measured_acceptance([2, 3, 5, 7])
    assert acc[5] == next(x["acceptance_rate"] for x in json.loads(open("bench/results/n456/shipped_s33.json").read())
                          ["rows"] if x["n"] == 5 and x["category"] == "overall") and acc[7] == acc[3] != acc[5]
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-dry-run", "--acceptance", "1.5",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--acceptance must be a probability in [0, 1], got 1.5" in r.stderr
    # without a GPU and without --cpu-dry-run it says what to do
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "no CUDA device here" in r.stderr


def test_gpu_check_models_draw_nothing_from_the_default_generator():
    """A capture that failed leaves the default CUDA generator unusable ("Offset increment outside graph capture"),
    and the GPU run's later sections all died at 0.0 s building their models: the modules' own initialisers drew
    from it before the script's own generator was used. The CPU default generator stands in for it here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    m = gc.random_model(gc.TINY, "cpu", torch.float32, 64, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert m.lm_head.weight is m.embed.weight and not any(p.is_meta for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), gc.random_model(gc.TINY, "cpu", torch.float32, 64)
                                                 .parameters()))


def test_gpu_check_acceptance_file_errors(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    f = tmp_path / "acceptance.json"
    f.write_text('{"rows": [{"n": 3, "temperature": 0.0, "category": "overall", "acceptance_rate": 0.5}]}')
    g = tmp_path / "n456.json"
    g.write_text('{"rows": [{"n": 5, "temperature": 0.0, "category": "overall", "acceptance_rate": 0.4}, '
                 '{"n": 5, "temperature": 0.7, "category": "overall", "acceptance_rate": 0.3}]}')
    assert gc.measured_acceptance([2, 3, 5], (f, g)) == {2: 0.5, 3: 0.5, 5: 0.4}  # n=2: none recorded, n=3's
    assert gc.measured_acceptance([5], (g,)) == {5: 0.4}  # an n=3 row is needed only for an n with none
    with pytest.raises(SystemExit, match=r"no overall T=0 row for n=\[2\] nor n=3"):
        gc.measured_acceptance([2, 5], (g,))
    for text in ('{"rows": []}', "not json"):
        f.write_text(text)
        with pytest.raises(SystemExit, match="cannot read the measured acceptance .* pass --acceptance P"):
            gc.measured_acceptance([3], (f, g))
    with pytest.raises(SystemExit, match="FileNotFoundError"):
        gc.measured_acceptance([3], (tmp_path / "missing.json",))


def test_nvtx_env_switch_and_profile_script_message(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import spd_fast.profiling as p; assert p.nvtx_enabled()\n"
            "with p.nvtx_range('spd.stage0'):\n    pass\nprint('ranges ok')")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, SPD_FAST_NVTX="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ranges ok" in r.stdout, r.stderr
    r = subprocess.run(["bash", "bench/profile_nsys.sh", str(tmp_path)], env=dict(os.environ, PATH="/usr/bin:/bin"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nsys (Nsight Systems) is not on PATH" in r.stderr
    # options without OUT_DIR: the default folder (under the caller's directory), the options to nsys_run.py
    # (the first option was taken as OUT_DIR: "mkdir: unrecognized option '--random-weights'")
    bin_dir, log = tmp_path / "bin", tmp_path / "nsys.log"
    bin_dir.mkdir()
    (bin_dir / "nsys").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (bin_dir / "nsys").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(["bash", str(repo / "bench" / "profile_nsys.sh"), "--random-weights", "--num-stages", "5"],
                       env=dict(env, PATH=f"{bin_dir}:/usr/bin:/bin"), cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    out = tmp_path / "bench" / "results" / "nsys"
    py = ".venv/bin/python" if (repo / ".venv" / "bin" / "python").exists() else "python3"
    assert calls[0].endswith(f"-o {out}/spd {py} bench/nsys_run.py --random-weights --num-stages 5"), calls
    assert calls[1].endswith(f"{out}/spd.nsys-rep") and out.is_dir()


@pytest.mark.parametrize("n", [2, 3])
def test_devices_handoff_double_buffer_equals_sequential(tiny_checkpoint, n):
    """placement='devices' hands hidden states over from each stage's own stream into a second
    buffer that is swapped in after the join; the same logic on one CPU device."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, n)
    ids = [8, 6, 7, 5]
    ref = decode_ar(m, ids, 24, GREEDY, []).token_ids
    full = [0] * len(ids) + ref
    pipe = PipelinedEngine(SPDEngine(m, ReferenceDrafter(full, m.cfg.vocab_size, "bernoulli", 0.6, 1), b), "simulated")
    pipe.swap_handoff = True
    got = pipe.run(ids, 24, GREEDY, [])
    assert pipe._cycle.swap_handoff and got.token_ids == ref
    assert 0 < got.metrics["acceptance_rate"] < 1
    seq = SPDEngine(m, ReferenceDrafter(full, m.cfg.vocab_size, "bernoulli", 0.6, 1), b).run(ids, 24, GREEDY, [])
    for k in ("cycles", "verifications", "accepted"):  # the same cycle by cycle, not only the same tokens
        assert got.metrics[k] == seq.metrics[k], k


def test_reallocated_caches_rebuild_the_static_cycle_and_ar_step(tiny_checkpoint):
    """A captured CUDA graph holds the KV buffers it was captured with, so the pipelined cycle and GraphedAR
    key their static state (and capture) on the model's cache_version: reallocating the caches at the same
    max_len (another batch size, another Engine's size and back) builds them again, with the same output."""
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 2)
    ids = [8, 6, 7, 5]
    ref = decode_ar(m, ids, 16, GREEDY, []).token_ids
    full = [0] * len(ids) + ref
    pipe = PipelinedEngine(SPDEngine(m, ReferenceDrafter(full, m.cfg.vocab_size, "bernoulli", 0.6, 1), b), "simulated")
    g = GraphedAR(m)
    assert pipe.run(ids, 16, GREEDY, []).token_ids == ref and g.run(ids, 16, GREEDY, []).token_ids == ref
    cycle, tokens, version = pipe._cycle, g.tokens, m.cache_version
    assert pipe.run(ids, 16, GREEDY, []).token_ids == ref and g.run(ids, 16, GREEDY, []).token_ids == ref
    assert pipe._cycle is cycle and g.tokens is tokens  # same caches: the static state (and graph) is kept
    max_len = m.max_len
    m.setup_caches(1, max_len // 2)
    m.setup_caches(1, max_len)
    assert m.max_len == max_len and m.cache_version == version + 2
    assert pipe.run(ids, 16, GREEDY, []).token_ids == ref and g.run(ids, 16, GREEDY, []).token_ids == ref
    assert pipe._cycle is not cycle and g.tokens is not tokens


def test_graphed_ar_warm_up_starts_from_the_real_state(tiny_checkpoint, monkeypatch):
    """On a GPU, GraphedAR runs eager warm-up steps before it captures its step. They must start from the
    first decode step's token and position (a stale pos wrote K/V over the prompt's first slots) and hand back
    their random numbers. Here the warm-up runs on CPU wherever _prepare would run it before a capture."""
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("qwen3"))
    ids = [3, 9, 27, 4, 11]
    warmed = []
    orig = GraphedAR._prepare

    def prepare_with_warm_up(self, params, generator):
        orig(self, params, generator)
        warmed.append(int(self.pos))
        self.warm_up(params, generator, steps=3)

    monkeypatch.setattr(GraphedAR, "_prepare", prepare_with_warm_up)
    g = GraphedAR(m)
    assert g.run(ids, 40, GREEDY, []).token_ids == decode_ar(m, ids, 40, GREEDY, []).token_ids
    g.run([7, 7], 5, GREEDY, [])  # a later call: stale pos from the first one
    assert g.run(ids, 40, GREEDY, []).token_ids == decode_ar(m, ids, 40, GREEDY, []).token_ids
    assert warmed == [len(ids), 2, len(ids)]
    params = SamplingParams(temperature=0.9, seed=4)
    a = decode_ar(m, ids, 20, params, [], make_generator(params, "cpu")).token_ids
    assert g.run(ids, 20, params, [], make_generator(params, "cpu")).token_ids == a


def test_graph_keys_hold_the_generator_not_its_id_and_ignore_the_seed(tiny_checkpoint):
    """A freed generator's id is soon reused: a key of ids could replay a graph bound to a dead generator. The
    seed is the generator's business, so reseeding one generator (make_generator's reuse) keeps the static
    state (and on a GPU the captured graph), and it samples as a fresh generator of that seed."""
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("qwen3"))
    ids = [3, 9, 27]
    g = GraphedAR(m)
    p4, p5 = SamplingParams(temperature=0.9, seed=4), SamplingParams(temperature=0.9, seed=5)
    gen = make_generator(p4, "cpu")
    first = g.run(ids, 12, p4, [], gen).token_ids
    assert g._key[3] is gen
    tokens = g.tokens
    again = make_generator(p5, "cpu", reuse=gen)
    assert again is gen
    assert g.run(ids, 12, p5, [], gen).token_ids == decode_ar(m, ids, 12, p5, [], make_generator(p5, "cpu")).token_ids
    assert g.tokens is tokens  # same generator, other seed: same key
    assert g.run(ids, 12, p4, [], make_generator(p4, "cpu", reuse=gen)).token_ids == first
    other = make_generator(p4, "cpu")
    g.run(ids, 12, p4, [], other)
    assert g._key[3] is other and g.tokens is not tokens
    assert make_generator(GREEDY, "cpu", reuse=gen) is None


def test_bernoulli_reference_drafter_draws_outside_the_cycle(tiny_checkpoint):
    """The 'right with probability p' drafter fixes each position's outcome at prefill (no random draw inside a
    cycle, which a CUDA graph would have to register), so the pipelined and sequential executors agree and the
    acceptance follows p."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    ids = [8, 6, 7, 5]
    ref = decode_ar(m, ids, 120, GREEDY, []).token_ids
    full = [0] * len(ids) + ref

    def drafter():
        return ReferenceDrafter(full, m.cfg.vocab_size, "bernoulli", 0.7, 3)

    d = drafter()
    seq = SPDEngine(m, d, b).run(ids, 120, GREEDY, [])
    assert seq.token_ids == ref and d.right is not None and d.right.dtype == torch.bool
    buf, outcomes = d.right.data_ptr(), d.right.clone()
    again = SPDEngine(m, d, b).run(ids, 120, GREEDY, [])
    assert [again.metrics[k] for k in ("cycles", "accepted")] == [seq.metrics[k] for k in ("cycles", "accepted")]
    assert d.right.data_ptr() == buf and torch.equal(d.right, outcomes)  # refilled in place: a graph reads it
    assert 0.5 < seq.metrics["acceptance_rate"] < 0.9
    pipe = PipelinedEngine(SPDEngine(m, drafter(), b), "simulated").run(ids, 120, GREEDY, [])
    assert pipe.token_ids == ref
    for k in ("cycles", "verifications", "accepted"):
        assert pipe.metrics[k] == seq.metrics[k], k


def test_a_decode_whose_device_state_never_advances_raises(tiny_checkpoint):
    """A cycle (or AR step) that changes nothing, as a CUDA graph captured on the wrong device would, must end
    in an error instead of launching for ever."""
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(random_head(m, b, vocab=97)), b), "simulated")
    launches = []
    pipe._one_cycle = launches.append  # a replay that does no work
    with pytest.raises(RuntimeError, match="launched 38 steps without finishing.*cuda_graphs=False"):
        pipe.run([5, 17, 3], 8, GREEDY, [])
    assert len(launches) == 38  # (n + 1) * (max_new_tokens + 1) + lag
    g = GraphedAR(m, lag=2)
    g._one_step = lambda params, generator: (lambda: None)
    with pytest.raises(RuntimeError, match="launched 11 steps without finishing"):
        g.run([5, 17, 3], 8, GREEDY, [])
    del pipe._one_cycle  # the bound never stops a working decode early
    assert pipe.run([5, 17, 3], 40, GREEDY, []).token_ids == decode_ar(m, [5, 17, 3], 40, GREEDY, []).token_ids


def test_final_norm_and_lm_head_read_the_last_stage_output_on_their_own_device(tiny_checkpoint):
    """With one stage per GPU the last layer's output lies on the last GPU while the final norm and LM head stay
    on the model's device (here the meta device stands in for it)."""
    m = tiny_target(tiny_checkpoint("llama"))
    h = torch.randn(2, m.cfg.hidden_size)
    m.norm.to("meta")
    m.lm_head.to("meta")
    out = m.logits(h)
    assert out.device.type == "meta" and tuple(out.shape) == (2, m.cfg.vocab_size)


def test_gpu_decodes_run_with_the_models_gpu_current(monkeypatch):
    """Events, streams and graph captures that name no device use the current one: the GPU decoders run each
    step of their generator with the model's device current, and give it back at every yield."""
    from spd_fast import pipeline

    current: list[str] = ["cuda:0"]

    class FakeDevice:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            self.prev = current[0]
            current[0] = str(self.d)

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    seen, closed = [], []

    def steps():
        try:
            for t in range(3):
                seen.append(current[0])
                yield t
        finally:
            closed.append(current[0])

    outside = []
    for t in pipeline.on_device(steps(), torch.device("cuda:1")):
        outside.append(current[0])
        if t == 1:
            break
    assert seen == ["cuda:1", "cuda:1"] and outside == ["cuda:0", "cuda:0"] and closed == ["cuda:1"]
    assert list(pipeline.on_device(steps(), torch.device("cpu"))) == [0, 1, 2]


def test_devices_placement_starts_at_the_models_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "GPU")
    assert resolve_placement("devices", "cuda:1", 3) == [torch.device("cuda", i) for i in (1, 2, 3)]
    assert resolve_placement("devices", "cuda", 2) == [torch.device("cuda", i) for i in (0, 1)]
    assert resolve_placement("streams", "cuda:2", 3) == [torch.device("cuda:2")] * 3
    with pytest.raises(SpdConfigError, match=r"from the model's device cuda:2 on: num_stages=3 needs "
                                             r"cuda:2\.\.cuda:4, but 4 are visible .*load on a lower device index"):
        resolve_placement("devices", "cuda:2", 3)


def test_gpu_check_counts_every_failure_and_keeps_going(tmp_path, monkeypatch, capsys):
    """A check that raises fails alone; an inexact timing run, a failed kernel section or a section skipped past
    --deadline makes the exit status 1, and the summary is printed in every case."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    rows: list[dict] = []
    gc.attempt(rows, "raises", lambda: 1 / 0)
    gc.attempt(rows, "passes", lambda: (True, {"acceptance": 0.5}))
    assert [(r["check"], r["ok"]) for r in rows] == [("raises", False), ("passes", True)]
    assert "ZeroDivisionError" in rows[0]["error"] and rows[1]["acceptance"] == 0.5

    def fake_exactness(*a):
        a[-1].append({"check": "fake", "ok": True})
        a[-1].append({"check": "near-tie", "ok": False, "info": True})  # information only: not a failure
        return a[-1]

    def fake_timings(name, *a, exact=True):
        row = dict(n=2, tokens_per_s=1.0, speedup_vs_graphed_ar=1.0, acceptance=0.5, exact=exact, cycle_us=1.0,
                   slowest_stage_us=1.0, draft_us=1.0, overhead_us=0.0)
        return {"shape": name, "ar_ms_per_token": 1.0, "ar_graph_step_us": 1.0, "ar_roofline_fraction": 0.5,
                "spd": [row]}
    monkeypatch.setattr(gc, "exactness", fake_exactness)
    base = ["--cpu-dry-run", "--skip-kernels", "--num-stages", "2", "--acceptance", "0.5", "--out", str(tmp_path)]
    monkeypatch.setattr(gc, "timings", fake_timings)
    assert gc.main(base) == 0
    assert "exactness: 1/1 checks pass\n  differs near-tie" in capsys.readouterr().out
    monkeypatch.setattr(gc, "timings", lambda name, *a: fake_timings(name, exact=False))
    assert gc.main(base) == 1
    assert "| tiny | 1.000 | 1.0 | 50% | 2 | 1 | 1.00x | 0.50 | NO |" in capsys.readouterr().out
    monkeypatch.setattr(gc, "timings", fake_timings)
    assert gc.main(base + ["--deadline", "0"]) == 1
    out = capsys.readouterr().out
    assert "skipped (past --deadline): exactness, copy_bandwidth_gbs, timing_tiny" in out and "== gpu_check summary" in out
    monkeypatch.setattr(gc, "kernel_paths", lambda dry: {"ok": False, "checks": [{"check": "k", "ok": False,
                                                                                   "error": "E"}]})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gc.main([x for x in base if x != "--skip-kernels"]) == 1
    assert "kernel paths: 0/1 pass, 0 skipped\n  FAIL k: E" in capsys.readouterr().out


def test_gpu_check_keeps_the_other_n_when_one_fails(tmp_path, monkeypatch, capsys):
    """A timing run that raises at one n lost every n of that shape (and the AR figures); now that n is one error
    in the summary and the exit status."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    real = gc._spd_timing

    def flaky(m, cfg, n, *a, **k):
        if n == 3:
            raise RuntimeError("capture failed")
        return real(m, cfg, n, *a, **k)

    monkeypatch.setattr(gc, "_spd_timing", flaky)
    with torch.inference_mode():  # as main() runs every section
        t = gc.timings("tiny", gc.TINY, "cpu", torch.float32, [2, 3], 8, {2: 0.5, 3: 0.5}, 1, 1.0, gc.Clock("cpu"),
                       "simulated")
    assert [r["n"] for r in t["spd"]] == [2] and t["errors"][0]["n"] == 3 and t["ar_ms_per_token"] > 0
    monkeypatch.setattr(gc, "timings", lambda name, *a: t)
    monkeypatch.setattr(gc, "exactness", lambda *a: a[-1])
    assert gc.main(["--cpu-dry-run", "--skip-kernels", "--num-stages", "2,3", "--acceptance", "0.5", "--out",
                    str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL timing tiny n=3: RuntimeError: capture failed" in out and "| tiny |" in out


def test_decoders_leave_inference_mode_at_each_yield(tiny_checkpoint):
    """The pipelined and graphed-AR generators run in inference mode only while they run: between tokens the
    caller's own tensors stay normal ones (they became inference tensors, which autograd then refuses)."""
    from spd_fast.graphed_ar import GraphedAR

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(random_head(m, b, vocab=97)), b), "simulated")
    for gen in (pipe.generate([1, 2, 3], 6, GREEDY, []), GraphedAR(m, lag=2).generate([1, 2, 3], 6, GREEDY, [])):
        seen = []
        for _ in gen:
            seen.append(torch.is_inference_mode_enabled() or torch.ones(1).is_inference())
        assert len(seen) == 6 and not any(seen), seen


def test_the_graph_key_holds_the_kernel_backend_and_the_drafter(tiny_checkpoint):
    """A capture bakes in the fused-op backend and the drafter's settings: changing them builds the cycle (and on
    a GPU its graph) again instead of replaying the old one. Same settings: the cycle is reused."""
    from dataclasses import replace

    from spd_fast import kernels

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = random_head(m, b, vocab=97)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(head, 2), b), "simulated")
    want = pipe.run([1, 2, 3], 8, GREEDY, []).token_ids
    first = pipe._cycle
    assert pipe.run([1, 2, 3], 8, GREEDY, []).token_ids == want and pipe._cycle is first
    with kernels.use_backend("auto"):
        assert pipe.run([1, 2, 3], 8, GREEDY, []).token_ids == want and pipe._cycle is not first
    second = pipe._cycle
    pipe.run([1, 2, 3], 8, GREEDY, [])
    third = pipe._cycle
    head.dcfg = replace(head.dcfg, lookup_gate_confidence=0.5, lookup_gate_ratio=0.1)
    pipe.run([1, 2, 3], 8, GREEDY, [])
    assert third is not second and pipe._cycle is not third


def test_swapped_handoffs_under_cuda_graphs_are_refused(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(random_head(m, b, vocab=97)), b), "simulated")
    pipe.swap_handoff, pipe.cuda_graphs = True, True  # as a test switch would set them; refused before any capture
    with pytest.raises(SpdConfigError, match=r"swap_handoff swaps the stage hand-off buffers in Python, .*: set "
                                             r"cuda_graphs=False to use it"):
        pipe.run([1, 2, 3], 4, GREEDY, [])


def test_graphs_are_captured_on_a_stream_of_the_models_device(monkeypatch):
    """torch.cuda.graph's own capture stream belongs to the GPU of the process's first capture; each device gets
    its own here (and "cuda" means the current device)."""
    from spd_fast import pipeline

    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(device)
            self.device = device
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(pipeline, "_CAPTURE_STREAMS", {})
    s0 = pipeline.capture_stream(torch.device("cuda:0"))
    s1 = pipeline.capture_stream(torch.device("cuda:1"))
    assert s0 is pipeline.capture_stream(torch.device("cuda", 0)) and s1 is pipeline.capture_stream(torch.device("cuda"))
    assert s0 is not s1 and made == [torch.device("cuda:0"), torch.device("cuda:1")]


@pytest.mark.parametrize("lookup", [0, 3])
def test_pipelined_pdm_cache_equals_a_fresh_prefill(tiny_checkpoint, lookup):
    """After a pipelined run the PDM cache holds exactly the depth-n rows of the committed positions, as a fresh
    prefill of them computes (the sequential executor's test_rollback check; an off-by-one that kept a
    depth-(n-1) row passed every pipeline test: random heads are almost always rejected)."""
    path = tiny_checkpoint("llama")
    m = tiny_target(path)
    b = (0, 2, 4, 6)
    head = random_head(m, b, layers=2)
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(head, lookup), b), "simulated")
    pipe.run([11, 12, 13, 14], 12, SamplingParams(), [])
    st = pipe.last_state
    p_old, pl = int(st.p_new) - int(st.fill) + 1, int(st.pdm_len)
    seq = st.tokens[:p_old].tolist()
    fresh = tiny_target(path)
    fresh_head = random_head(fresh, b, layers=2)
    SPDEngine(fresh, PdmDrafter(fresh_head), b).start(seq, SamplingParams(), None)
    assert pl > 6
    for la, lb in zip(head.layers, fresh_head.layers):
        torch.testing.assert_close(la.attn.k_cache[0, :, :pl], lb.attn.k_cache[0, :, :pl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.attn.v_cache[0, :, :pl], lb.attn.v_cache[0, :, :pl], atol=1e-5, rtol=1e-5)

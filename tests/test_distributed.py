"""placement="distributed" for real: 2 and 3 CPU processes on gloo, compared with the single-process
engine (greedy == AR token for token; seeded sampling == SPDEngine with the same seed and head),
plus rank failures (killed / hung rank) and every launch error a user can hit.

Each job is one `python -m spd_fast.distributed` process per rank with torchrun's environment
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and a free port; one test goes through
torchrun itself and the public `spd_fast.generate(..., placement="distributed")`.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spd_fast.ar import decode_ar
from spd_fast.config import ModelConfig, SpdConfigError
from spd_fast.drafters import PdmDrafter
from spd_fast.engine import SPDEngine
from spd_fast.pdm import DraftConfig, DraftHead, init_from_target
from spd_fast.sampling import SamplingParams, make_generator

MAX_LEN, NEW, DRAFT_VOCAB = 1024, 12, 4096
HEAD_ARGS = ["--draft", "random", "--draft-vocab-size", str(DRAFT_VOCAB), "--seed-head", "0",
             "--max-len", str(MAX_LEN), "--threads", "1"]
GREEDY = SamplingParams()
SAMPLING = dict(temperature=0.9, top_k=0, top_p=0.95, seed=7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict | None = None) -> dict:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env.pop("SPD_FAST_FAULT", None)
    env.update(extra or {})
    return env


class Job:
    """World-size-n job, one subprocess per rank; stderr goes to files so it can be watched live."""

    def __init__(self, tmp: Path, n: int, args: list[str], per_rank: dict[int, list[str]] | None = None,
                 env: dict | None = None):
        port = free_port()
        self.err = [tmp / f"rank{r}.err" for r in range(n)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "spd_fast.distributed", *args,
                                        *(per_rank or {}).get(r, [])],
                                       env=rank_env(r, n, port, env), stdout=subprocess.PIPE,
                                       stderr=open(self.err[r], "w"), text=True) for r in range(n)]
        self.exit_time: dict[int, float] = {}

    def wait(self, limit: float, ranks=None) -> None:
        ranks = range(len(self.procs)) if ranks is None else ranks
        end = time.monotonic() + limit
        while time.monotonic() < end:
            for r in ranks:
                if r not in self.exit_time and self.procs[r].poll() is not None:
                    self.exit_time[r] = time.monotonic()
            if all(r in self.exit_time for r in ranks):
                return
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"ranks {[r for r in ranks if r not in self.exit_time]} still running after "
                             f"{limit} s:\n" + "\n".join(self.stderr(r)[-2000:] for r in ranks))

    def stderr(self, r: int) -> str:
        return self.err[r].read_text()

    def marker_time(self, r: int, text: str, limit: float) -> float:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if text in self.stderr(r):
                return time.monotonic()
            time.sleep(0.05)
        raise AssertionError(f"rank {r} never printed {text!r}:\n{self.stderr(r)[-2000:]}")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def one_thread():
    """The in-process references run beside the rank processes: one thread, like each rank."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def random_head(model, boundaries, anchors=None):
    dcfg = DraftConfig.make(model.cfg, boundaries, anchors, 1, DRAFT_VOCAB)
    return init_from_target(DraftHead(dcfg, model.cfg, model.norm), model, 0).eval().requires_grad_(False)


# ---- exactness against the single-process engine ------------------------------------------------
@pytest.mark.parametrize("boundaries,anchors,greedy_prompts", [
    ((0, 15, 30), None, ("chat", "hi")),
    ((0, 4, 20, 30), (0, 4, 29), ("one-token", "chat")),  # stage 1 records no anchor: it never reports
], ids=["n2-uniform", "n3-uneven-silent-stage"])
def test_distributed_matches_single_process(default_target, tmp_path, one_thread, boundaries, anchors,
                                            greedy_prompts):
    m, tg = default_target.model, default_target
    n = len(boundaries) - 1
    eos = tuple(tg.eos_ids)
    chat = tg.encode([{"role": "user", "content": "Write a haiku about rain."}])
    every = {"chat": chat, "one-token": tg.encode("A"), "hi": tg.encode("Hi there")}  # "A": shorter than n
    prompts = {k: every[k] for k in greedy_prompts}
    # EOS mid-pipeline: stop on a token the AR output produces at step 5 (its first occurrence)
    full = decode_ar(m, chat, NEW, GREEDY, eos).token_ids
    stop = next(t for t in full[5:] if t not in full[:5])

    reqs = [{"prompt_ids": ids, "max_new_tokens": NEW} for ids in prompts.values()]
    reqs.append({"prompt_ids": chat, "max_new_tokens": NEW, "eos_ids": [stop]})
    reqs.append({"prompt_ids": chat, "max_new_tokens": NEW, **SAMPLING})
    (tmp_path / "req.json").write_text(json.dumps(reqs))
    out = tmp_path / "out.json"
    args = [*HEAD_ARGS, "--boundaries", ",".join(map(str, boundaries)), "--requests", str(tmp_path / "req.json"),
            "--output", str(out), "--json"]
    if anchors:
        args += ["--anchors", ",".join(map(str, anchors))]
    job = Job(tmp_path, n, args)
    try:  # the single-process references run while the ranks start up
        refs = {k: full if k == "chat" else decode_ar(m, ids, NEW, GREEDY, eos).token_ids
                for k, ids in prompts.items()}
        ref_stop = decode_ar(m, chat, NEW, GREEDY, eos + (stop,)).token_ids
        assert len(ref_stop) < NEW
        sp = SamplingParams(**SAMPLING)
        head = random_head(m, boundaries, anchors)
        ref_sample = SPDEngine(m, PdmDrafter(head), boundaries, head.dcfg.anchors).run(
            chat, NEW, sp, eos, make_generator(sp, "cpu"))
        ref_greedy = SPDEngine(m, PdmDrafter(head), boundaries, head.dcfg.anchors).run(chat, NEW, GREEDY, eos)
        job.wait(240)
    finally:
        job.kill()
    assert [p.returncode for p in job.procs] == [0] * n, [job.stderr(r)[-3000:] for r in range(n)]
    doc = json.loads(out.read_text())
    assert doc["num_stages"] == n and doc["boundaries"] == list(boundaries)
    res = doc["results"]
    for name, r in zip(prompts, res):
        assert r["token_ids"] == refs[name], name
        if name == "chat":  # the same drafts, cycle by cycle, as the single-process engine
            for k in ("cycles", "verifications", "accepted"):
                assert r["metrics"][k] == ref_greedy.metrics[k], k
    stop_res, sample_res = res[len(prompts)], res[len(prompts) + 1]
    assert stop_res["token_ids"] == ref_stop and stop_res["finished_by_eos"] and stop_res["finish_reason"] == "eos"
    assert all(r["finish_reason"] == ("eos" if r["finished_by_eos"] else "length") for r in res)
    assert sample_res["token_ids"] == ref_sample.token_ids
    assert sample_res["metrics"]["accepted"] == ref_sample.metrics["accepted"]
    assert sample_res["metrics"]["cycles"] == ref_sample.metrics["cycles"]
    assert set(doc["rank_stats"]) == {str(r) for r in range(1, n)}


def test_a_stage_reporting_several_anchors_feeds_the_pdm_as_one_process_does(default_target, tmp_path, one_thread):
    """The shipped n=2 head reads anchors 0, 10, 20, 30 at boundaries 0, 15, 30, so rank 1 reports two anchors
    per row. Rank 0 once unpacked a prompt's report position-first: tokens stayed exact, but the PDM drafted from
    scrambled prompt states (acceptance 0.61 instead of 0.77). The same head must make the same drafts, cycle by
    cycle, greedy and sampled, as the single-process engine."""
    from spd_fast.api import shipped_head
    from spd_fast.pdm import load_draft

    m, tg = default_target.model, default_target
    eos = tuple(tg.eos_ids)
    chat = tg.encode([{"role": "user", "content": "List three facts about the Moon."}])
    reqs = [{"prompt_ids": chat, "max_new_tokens": 24}, {"prompt_ids": chat, "max_new_tokens": 24, **SAMPLING}]
    (tmp_path / "req.json").write_text(json.dumps(reqs))
    out = tmp_path / "out.json"
    job = Job(tmp_path, 2, ["--max-len", str(MAX_LEN), "--threads", "1", "--requests", str(tmp_path / "req.json"),
                            "--output", str(out), "--json"])
    try:
        head = load_draft(shipped_head(tg, 2), m, tg.fingerprint, num_stages=2)
        assert head.dcfg.anchors == (0, 10, 20, 30)
        eng = SPDEngine(m, PdmDrafter(head, 3), head.dcfg.boundaries, head.dcfg.anchors)
        sp = SamplingParams(**SAMPLING)
        refs = [eng.run(chat, 24, GREEDY, eos), eng.run(chat, 24, sp, eos, make_generator(sp, "cpu"))]
        job.wait(240)
    finally:
        job.kill()
    assert [p.returncode for p in job.procs] == [0, 0], [job.stderr(r)[-3000:] for r in range(2)]
    res = json.loads(out.read_text())["results"]
    assert refs[0].metrics["accepted"] > 5  # a head that drafts well, so scrambled states would show
    for r, ref in zip(res, refs):
        assert r["token_ids"] == ref.token_ids
        for k in ("cycles", "verifications", "accepted"):
            assert r["metrics"][k] == ref.metrics[k], k


def test_torchrun_and_public_api(default_target, tmp_path, one_thread):
    """`torchrun ... job.py` where job.py calls spd_fast.generate(..., placement="distributed"):
    rank 0 gets the AR-identical output, the other rank None."""
    tg = default_target
    ref = decode_ar(tg.model, tg.encode("Hi there"), 8, GREEDY, tg.eos_ids).token_ids
    script = tmp_path / "job.py"
    script.write_text(  # each rank writes its own file: two ranks printing to one stdout interleave
        "import json, os, sys, torch, spd_fast\n"
        "torch.set_num_threads(1)\n"
        "out = spd_fast.generate('Hi there', max_new_tokens=8, num_stages=2, placement='distributed', "
        "draft='random', max_len=1024)\n"
        "doc = {'rank': os.environ['RANK'], 'type': type(out).__name__, "
        "'tokens': None if out is None else out.token_ids}\n"
        "with open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + '.json'), 'w') as f:\n"
        "    json.dump(doc, f)\n")
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SPD_FAST_FAULT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    docs = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert docs[0] == {"rank": "0", "type": "GenerationOutput", "tokens": ref}, (docs, p.stderr[-3000:])
    assert docs[1] == {"rank": "1", "type": "NoneType", "tokens": None}, docs


# ---- faults ---------------------------------------------------------------------------------------
def test_killed_rank_makes_the_others_exit(tmp_path):
    timeout = 20.0
    job = Job(tmp_path, 3, [*HEAD_ARGS, "--max-new-tokens", "64", "--timeout", str(timeout), "Hi there"],
              env={"SPD_FAST_FAULT": "1:3:exit"})
    job.wait(180)
    rc = [p.returncode for p in job.procs]
    assert rc[1] == 17 and rc[0] == 1 and rc[2] == 1, (rc, [job.stderr(r)[-2000:] for r in range(3)])
    for r in (0, 2):
        # rank 1 died; the other survivor may already be gone too, so either names a rank other than itself
        assert re.search(rf"lost rank (?!{r}\b)\d", job.stderr(r)), job.stderr(r)[-2000:]
        # "within the timeout": much sooner, the broken connection is noticed at once
        assert job.exit_time[r] - job.exit_time[1] < timeout, (r, job.exit_time)
    assert "the connection was lost" in job.stderr(0) + job.stderr(2)


@pytest.mark.parametrize("rank,src,world,suspects", [
    (0, 1, 2, None), (1, 0, 2, None),             # two ranks: the peer is the only suspect
    (0, 2, 3, "1"), (2, 1, 3, "0"), (0, 4, 5, "1, 2, 3"), (3, 2, 5, "4, 0, 1")])
def test_a_timeout_names_every_rank_the_silent_peer_waits_on(rank, src, world, suspects):
    """Rank 0 times out on the last stage when any middle stage hangs: the message must not blame that rank alone."""
    import torch

    from spd_fast.distributed.comm import Links

    links = Links(rank, 4.0, lambda r: f"stage {r}", torch.device("cpu"), world)
    msg = str(links._fail(RuntimeError("Timed out waiting 4000ms"), src, "waiting for a report"))
    assert msg.startswith(f"rank {rank}: lost rank {src} (stage {src}) while waiting for a report: no message within 4 s")
    assert (f"it, or a rank it waits on ({suspects}), is hung" if suspects else "s: it is hung") in msg, msg
    # a send that does not complete waits on its receiver alone
    assert ": it is hung" in str(links._fail(RuntimeError("timeout"), src, "sending a hidden state"))


def test_hung_rank_times_out_with_a_clear_error(tmp_path):
    timeout = 4.0
    job = Job(tmp_path, 2, [*HEAD_ARGS, "--max-new-tokens", "64", "--timeout", str(timeout), "Hi there"],
              env={"SPD_FAST_FAULT": "1:3:hang"})
    try:
        hung_at = job.marker_time(1, "fault injection: hang", 180)
        job.wait(timeout + 20, ranks=[0])
    finally:
        job.kill()
    err = job.stderr(0)
    assert job.procs[0].returncode == 1, err[-2000:]
    assert "lost rank 1 (stage 1, layers 15..29)" in err and f"no message within {timeout:g} s" in err, err[-2000:]
    assert timeout - 0.5 <= job.exit_time[0] - hung_at <= timeout + 10


# ---- launch errors ----------------------------------------------------------------------------------
def test_startup_errors_reach_every_rank_as_one_line(tmp_path, tiny_checkpoint):
    """A bad --output (checked on rank 0 only) stops every rank at once with rank 0's message; a rank that never
    joins leaves the others one line, not a gloo traceback, once the startup timeout has passed."""
    ck = tiny_checkpoint("llama")
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["--model", ck, "--draft", "random", "--max-len", "64", "--threads", "1", "--timeout", "5",
            "--startup-timeout", "8", "Hi"]
    job = Job(tmp_path, 2, base + ["--output", f"{afile}/o.json"])
    try:
        job.wait(120)
    finally:
        job.kill()
    for r in range(2):
        err = job.stderr(r).strip()
        assert job.procs[r].returncode == 2, err[-2000:]
        assert f"startup failed while checking the options: rank 0: --output {afile}/o.json: {afile} is a file" \
            in err and len(err.splitlines()) == 1, err[-2000:]
    job = Job(tmp_path, 2, base, per_rank={1: ["--threads", "-1"]})  # rank 1 exits before it joins
    try:
        job.wait(120)
    finally:
        job.kill()
    err = job.stderr(0).strip()
    assert job.procs[0].returncode == 1 and job.procs[1].returncode == 2, err[-2000:]
    assert "error (rank 0): startup failed while joining the process group at 127.0.0.1:" in err, err[-2000:]
    assert "another rank stopped, or did not answer within 8 s" in err and len(err.splitlines()) == 1, err[-2000:]


def test_missing_rendezvous_settings():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "spd_fast.distributed", "Hi"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert "missing: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in p.stderr and "torchrun" in p.stderr


def test_bad_device_is_refused_before_joining():
    from spd_fast.config import SpdConfigError
    from spd_fast.distributed.launch import init_rank

    with pytest.raises(SpdConfigError, match="device 'gpu' is not a valid device; use 'cpu', 'cuda'"):
        init_rank("gpu")
    with pytest.raises(SpdConfigError, match=r"device 'meta' is not supported \(spd_fast runs on CPU or CUDA\)"):
        init_rank("meta")


def test_a_local_rank_past_the_nodes_gpus_is_refused_before_joining(monkeypatch):
    """Each rank takes cuda:LOCAL_RANK; one past the node's GPU count failed in torch.cuda.set_device after joining,
    a raw traceback on that rank while the others waited out the startup timeout."""
    import torch

    from spd_fast.distributed import launch

    monkeypatch.setattr(launch, "parse_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch.dist, "init_process_group", lambda *a, **k: pytest.fail("joined"))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(launch.DistributedConfigError, match=r"LOCAL_RANK=2, but this node has 2 GPU\(s\) .*start "
                                                            r"at most 2 processes on this node \(torchrun "
                                                            r"--nproc-per-node 2\)"):
        launch.init_rank("cuda")


def test_boundaries_are_checked_before_joining():
    """The checks that need no checkpoint come before any rank waits for the others (no torchrun here)."""
    from spd_fast.config import SpdConfigError
    from spd_fast.distributed.engine import load_distributed

    with pytest.raises(SpdConfigError, match=r"num_stages=3 disagrees with boundaries \[0, 3, 6\], which make 2 "
                                             r"stages; pass only one of them"):
        load_distributed(num_stages=3, boundaries=[0, 3, 6])
    with pytest.raises(SpdConfigError, match=r"stage boundaries \[0\] need at least two entries"):
        load_distributed(boundaries=[0])
    from spd_fast.distributed.engine import DistributedEngine

    eng = DistributedEngine.__new__(DistributedEngine)  # stream() refuses before touching any rank state
    with pytest.raises(SpdConfigError, match="placement='distributed' does not stream: use generate\\(\\)"):
        eng.stream("hi")
    from types import SimpleNamespace

    ended = []  # a refused call still releases the other ranks, which wait for its requests
    eng = DistributedEngine(SimpleNamespace(rank=0), SimpleNamespace(n=2, boundaries=(0, 3, 6)), "random", None,
                            SimpleNamespace(end_call=lambda: ended.append(1)), None, None)
    with pytest.raises(SpdConfigError, match="placement='distributed' takes no stop strings; pass their tokens as "
                                             "eos_ids"):
        eng.generate("hi", stop=["x"])
    assert ended == [1]


def test_world_size_must_equal_num_stages(tmp_path):
    job = Job(tmp_path, 2, [*HEAD_ARGS, "--num-stages", "3", "Hi"])
    job.wait(120)
    for r in range(2):
        assert job.procs[r].returncode == 2
        assert "world size 2 but num_stages=3" in job.stderr(r), job.stderr(r)[-2000:]
        # the fix spelt as the command's flag, not the API's num_stages=2
        assert "(torchrun --nproc-per-node 3) or use --num-stages 2\n" in job.stderr(r), job.stderr(r)[-2000:]


def test_mismatched_checkpoints_across_ranks(tmp_path, tiny_checkpoint):
    job = Job(tmp_path, 2, [*HEAD_ARGS, "Hi"], per_rank={1: ["--model", tiny_checkpoint("llama")]})
    job.wait(120)
    for r in range(2):
        assert job.procs[r].returncode == 2
        assert "ranks hold different checkpoints" in job.stderr(r), job.stderr(r)[-2000:]


def test_placement_is_validated():
    import spd_fast
    from spd_fast.distributed import DistributedConfigError

    with pytest.raises(spd_fast.SpdConfigError, match="placement must be one of"):
        spd_fast.load(placement="cluster")
    with pytest.raises(spd_fast.SpdConfigError, match="placement must be one of"):
        spd_fast.generate("Hi", placement="cluster")
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    try:
        with pytest.raises(DistributedConfigError, match="rendezvous settings"):
            spd_fast.generate("Hi", num_stages=2, placement="distributed")
    finally:
        os.environ.update(saved)


def test_trained_head_refuses_other_anchors_or_depth(tiny_checkpoint, tmp_path):
    """Rank 0's plan: a trained head brings its own anchors and L_s; asking for others is an error
    with the same message as the single-process load(), not silently ignored."""
    import torch

    from spd_fast.config import ModelConfig
    from spd_fast.distributed.engine import _plan_on_rank0
    from spd_fast.pdm import DraftMismatchError

    from conftest import tiny_target  # noqa: I001

    path = tiny_checkpoint("llama")
    m, cfg = tiny_target(path), ModelConfig.from_dir(path)
    init_from_target(DraftHead(DraftConfig.make(cfg, (0, 3, 6), num_layers=2), cfg, m.norm), m).save(tmp_path / "h")

    def plan(**kw):
        args = dict(anchors=None, draft_layers=None) | kw
        return _plan_on_rank0(path, cfg, torch.float32, 2, None, args["anchors"], str(tmp_path / "h"),
                              args["draft_layers"], 0)

    assert plan()["anchors"] == (0, 3, 6) and DraftConfig.from_json(plan(draft_layers=2)["dcfg"]).num_layers == 2
    with pytest.raises(DraftMismatchError, match=r"trained for anchors \[0, 3, 6\], not \[0, 2\]; omit anchors"):
        plan(anchors=(0, 2))
    with pytest.raises(DraftMismatchError, match=r"has 2 decoder layers, not draft_layers=1; omit draft_layers"):
        plan(draft_layers=1)
    vd = DraftConfig.from_json(plan()["dcfg"]).draft_vocab_size  # --draft-vocab was silently ignored here
    with pytest.raises(SpdConfigError, match=rf"has a {vd}-token draft vocabulary, not draft_vocab_size=7; omit "):
        _plan_on_rank0(path, cfg, torch.float32, 2, None, None, str(tmp_path / "h"), None, 7)
    assert DraftConfig.from_json(_plan_on_rank0(path, cfg, torch.float32, 2, None, None, str(tmp_path / "h"), None,
                                                vd)["dcfg"]).draft_vocab_size == vd
    # a head for another n: the fix is the number of ranks (--num-stages must equal it), not --num-stages
    with pytest.raises(DraftMismatchError, match=r"trained for num_stages=2, and placement='distributed' runs one "
                                                 r"stage per rank on 3 ranks; start 2 processes \(torchrun "
                                                 r"--nproc-per-node 2\), or use draft='random'") as e:
        _plan_on_rank0(path, cfg, torch.float32, 3, None, None, str(tmp_path / "h"), None, 0)
    assert "pass num_stages" not in str(e.value)


def test_rank0_plan_runs_the_shipped_head_at_other_boundaries_with_a_warning(tiny_checkpoint, tmp_path, monkeypatch):
    """As in api.load: with draft=None the shipped head of n runs at the requested split (its anchors
    kept), with a warning; a head the user names is refused there, with the same message."""
    import torch

    import spd_fast.api
    from spd_fast.config import ModelConfig
    from spd_fast.distributed.engine import _plan_on_rank0
    from spd_fast.distributed.partial_load import full_weights_fingerprint
    from spd_fast.pdm import DraftMismatchError

    from conftest import tiny_target  # noqa: I001

    path = tiny_checkpoint("llama")
    m, cfg = tiny_target(path), ModelConfig.from_dir(path)
    fp = full_weights_fingerprint(path, cfg)
    init_from_target(DraftHead(DraftConfig.make(cfg, (0, 3, 6), fingerprint=fp), cfg, m.norm), m).save(
        tmp_path / "heads" / "tiny-n2")
    monkeypatch.setattr(spd_fast.api, "HEADS_DIR", tmp_path / "heads")
    with pytest.warns(UserWarning, match=r"shipped draft head tiny-n2 was trained for stage boundaries \[0, 3, 6\]; "
                                         r"running its weights at \[0, 2, 6\]"):
        p = _plan_on_rank0(path, cfg, torch.float32, 2, (0, 2, 6), None, None, None, 0)
    assert p["draft_source"] == "shipped:tiny-n2" and p["boundaries"] == (0, 2, 6) and p["anchors"] == (0, 3, 6)
    assert DraftConfig.from_json(p["dcfg"]).boundaries == (0, 2, 6)
    with pytest.raises(DraftMismatchError, match=r"trained for stage boundaries \[0, 3, 6\], not \[0, 2, 6\]; omit "
                                                 r"boundaries"):
        _plan_on_rank0(path, cfg, torch.float32, 2, (0, 2, 6), None, str(tmp_path / "heads" / "tiny-n2"), None, 0)


@pytest.mark.parametrize("second,msg", [
    ({"prompt_ids": [1, 2], "max_new_tokens": 4, "eos_ids": [10 ** 6]}, "eos id 1000000 is not a token id of this model"),
    # inside the 1024-slot KV cache, past the tiny model's 512 positions
    ({"prompt_ids": [1, 2], "max_new_tokens": 600}, "the prompt (2 tokens) plus max_new_tokens=600 is longer than "
     "this model's context of 512 positions (max_position_embeddings); lower --max-new-tokens to at most 510")])
def test_bad_request_is_refused_before_any_is_sent(tmp_path, tiny_checkpoint, second, msg):
    """Every request is checked on rank 0 before the first one runs: a bad eos id (or prompt id, or
    max_new_tokens, or a length past the model's context) in the second request stops rank 0 with the message
    and releases the other rank."""
    req = tmp_path / "req.json"
    req.write_text(json.dumps([{"prompt_ids": [1, 2, 3], "max_new_tokens": 4}, second]))
    job = Job(tmp_path, 2, ["--model", tiny_checkpoint("llama"), "--draft", "random", "--threads", "1",
                            "--max-len", "1024", "--requests", str(req)])
    job.wait(120)
    assert job.procs[0].returncode == 2, job.stderr(0)[-2000:]
    assert msg in job.stderr(0), job.stderr(0)[-2000:]
    assert job.procs[1].returncode == 0, job.stderr(1)[-2000:]


def test_requests_file_errors(tmp_path):
    from types import SimpleNamespace

    from spd_fast.config import SpdConfigError
    from spd_fast.distributed.__main__ import _requests, build_parser

    target = SimpleNamespace(eos_ids=(2,), encode=lambda p: [1, 2])

    def reqs(content):
        (tmp_path / "r.json").write_text(content)
        return _requests(build_parser().parse_args(["--requests", str(tmp_path / "r.json")]), target)

    with pytest.raises(SpdConfigError, match="cannot read --requests .*missing.json"):
        _requests(build_parser().parse_args(["--requests", str(tmp_path / "missing.json")]), target)
    with pytest.raises(SpdConfigError, match="cannot read --requests"):
        reqs("[{")
    for content in ('{"prompt": "Hi"}', "[]"):  # an empty list ran nothing and exited 0 without a word
        with pytest.raises(SpdConfigError, match="must hold a non-empty JSON list of objects"):
            reqs(content)
    with pytest.raises(SpdConfigError, match="request 0: prompt_ids and eos_ids must be lists of token ids"):
        reqs('[{"prompt_ids": 5}]')
    with pytest.raises(SpdConfigError, match="request 0 has neither 'prompt' nor 'prompt_ids'"):
        reqs('[{"max_new_tokens": 5}]')
    with pytest.raises(SpdConfigError, match=r"request 0 has unknown keys \['max_tokens', 'temprature'\]; a request "
                                             r"may hold prompt, prompt_ids, max_new_tokens, temperature"):
        reqs('[{"prompt": "Hi", "max_tokens": 2, "temprature": 0.9}]')
    with pytest.raises(SpdConfigError, match="request 0 has both 'prompt' and 'prompt_ids'; keep one of them"):
        reqs('[{"prompt": "Hi", "prompt_ids": [1]}]')
    with pytest.raises(SpdConfigError, match="request 1: prompt_ids and eos_ids must be lists"):
        reqs('[{"prompt": "Hi"}, {"prompt": "Hi", "eos_ids": 7}]')
    (r,) = reqs('[{"prompt": "Hi", "eos_ids": [7], "max_new_tokens": 5}]')
    assert r.prompt_ids == (1, 2) and r.eos_ids == (2, 7) and r.max_new_tokens == 5


@pytest.mark.parametrize("argv,msg", [
    (["Hi", "--requests", "r.json"], r"--requests FILE holds the prompts; drop the positional prompt"),
    (["--user", "Hi", "--requests", "r.json"], r"--requests FILE holds the prompts"),
    (["Hi", "--user", "Hi"], "pass either a raw prompt or --system/--user messages, not both"),
    (["--system", "Be brief."], "--system needs at least one --user message"),
    ([], "give a prompt: a positional string, --user 'message' or --requests FILE"),
    (["--lookup", "65", "Hi"], "lookup must be an integer from 0 to 64"),
])
def test_distributed_cli_refuses_conflicting_prompts_before_loading(monkeypatch, argv, msg):
    """Every rank parses the same command line: a conflict is refused before any rank loads or waits."""
    from spd_fast.config import SpdConfigError
    from spd_fast.distributed import __main__ as cli
    from spd_fast.distributed import engine

    def load_distributed(**kw):  # the real check_lookup, nothing loaded
        from spd_fast.config import check_lookup

        check_lookup(kw["lookup"])
        raise AssertionError("loaded despite a bad command line")

    monkeypatch.setattr(engine, "load_distributed", load_distributed)
    with pytest.raises(SpdConfigError, match=msg):
        cli.run(cli.build_parser().parse_args(argv))


def test_distributed_generate_takes_what_the_local_one_takes_and_refuses_ar_before_loading(monkeypatch):
    """DistributedEngine.generate lacked the local generate()'s wrapper: sampling_params= was a TypeError and numpy
    numbers were refused; spd_fast.generate(placement="distributed", method="ar") was refused only after every rank
    had loaded its stage."""
    from types import SimpleNamespace

    import numpy as np

    import spd_fast
    import spd_fast.api
    from spd_fast import SamplingParams
    from spd_fast.distributed.engine import DistributedEngine

    def no_load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(spd_fast.api, "_cached_engine", no_load)
    with pytest.raises(SpdConfigError, match="placement='distributed' runs method='spd' only, got 'ar'"):
        spd_fast.generate("Hi", method="ar", placement="distributed")
    eng = DistributedEngine(SimpleNamespace(rank=0), SimpleNamespace(n=2, boundaries=(0, 1, 2)), "random",
                            SimpleNamespace(eos_ids=(2,), cfg=SimpleNamespace(vocab_size=100), encode=lambda p: [5, 6]),
                            SimpleNamespace(end_call=lambda: None), None, None)
    seen = []
    eng.run_requests = lambda reqs: seen.extend(reqs) or [SimpleNamespace(token_ids=[1])] * len(reqs)
    eng.generate("Hi", max_new_tokens=np.int64(4), sampling_params=SamplingParams(temperature=0.5, seed=3))
    eng.generate("Hi", np.int32(3), temperature=np.float32(0.25))
    assert [(r.max_new_tokens, r.params.temperature, r.params.seed) for r in seen] == [(4, 0.5, 3), (3, 0.25, None)]
    assert all(type(r.max_new_tokens) is int for r in seen)
    with pytest.raises(SpdConfigError, match="temperature given both on its own and in sampling_params"):
        eng.generate("Hi", temperature=0.5, sampling_params=SamplingParams())


def fake_rank0_engine(run):
    """Rank 0's DistributedEngine over a fake driver: `run` stands in for PipelineDriver.run."""
    from types import SimpleNamespace

    from spd_fast.distributed.engine import DistributedEngine

    ends = []
    target = SimpleNamespace(eos_ids=(2,), encode=lambda p: [5, 6], decode=lambda ids: "x" * len(ids),
                             cfg=SimpleNamespace(vocab_size=100, max_position_embeddings=512))
    model = SimpleNamespace(max_len=64, embed=None)
    driver = SimpleNamespace(run=run, end_call=lambda: ends.append(1) or {}, model=model)
    ctx = SimpleNamespace(rank=0, device="cpu")
    return DistributedEngine(ctx, SimpleNamespace(n=2, boundaries=(0, 1, 2)), "random", target, driver, None,
                             None), ends


def result(n):
    from types import SimpleNamespace

    return SimpleNamespace(token_ids=[7] * n, finished_by_eos=False, metrics={})


def test_a_call_cut_off_midway_leaves_the_engine_refusing_every_later_one(monkeypatch):
    """A call interrupted after its first message (a KeyboardInterrupt, a caught RankFailure) left the other ranks
    out of step with rank 0; the next call read their stale reports as its own (a gloo abort, or "protocol out of
    step"). Now every later call is refused at once with the reason; a refused request alone breaks nothing."""
    import spd_fast.ar
    from spd_fast.distributed.comm import RankFailure

    monkeypatch.setattr(spd_fast.ar, "check_capacity", lambda *a, **k: None)
    calls = []

    def run(prompt, new, params, eos, gen):
        calls.append(new)
        if new == 3:
            raise KeyboardInterrupt
        return result(new)

    eng, ends = fake_rank0_engine(run)
    assert eng.generate("Hi", max_new_tokens=2).token_ids == [7, 7] and ends == [1]
    with pytest.raises(SpdConfigError, match="runs method='spd' only"):  # refused before any message: still usable
        eng.generate("Hi", method="ar")
    assert eng.generate("Hi", max_new_tokens=1).token_ids == [7]
    with pytest.raises(KeyboardInterrupt):
        eng.generate("Hi", max_new_tokens=3)
    n_calls, n_ends = len(calls), len(ends)
    for again in (lambda: eng.generate("Hi", max_new_tokens=2), lambda: eng.generate("Hi", method="ar")):
        with pytest.raises(RankFailure, match=r"rank 0: this distributed engine is out of step with the other ranks "
                                              r"since a call was cut off \(KeyboardInterrupt: \); restart the job"):
            again()
    assert (len(calls), len(ends)) == (n_calls, n_ends)  # nothing more was sent


def test_rank0_runs_calls_from_several_threads_one_after_the_other(monkeypatch):
    """The local engine holds the model's decode lock; rank 0 held none, so two threads' calls interleaved their
    messages to the same ranks ("protocol out of step")."""
    import threading
    import time

    import spd_fast.ar

    monkeypatch.setattr(spd_fast.ar, "check_capacity", lambda *a, **k: None)
    inside, overlaps = [], []

    def run(prompt, new, params, eos, gen):
        inside.append(1)
        overlaps.append(len(inside))
        time.sleep(0.05)
        inside.pop()
        return result(new)

    eng, ends = fake_rank0_engine(run)
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(eng.generate(["a", "b"], max_new_tokens=2)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 3 and len(overlaps) == 6 and max(overlaps) == 1 and len(ends) == 3


def test_distributed_cli_refuses_a_head_seed_for_a_trained_head(tmp_path, tiny_checkpoint):
    """--seed-head seeds a random head; with a trained one it was silently ignored. Rank 0 refuses it and releases
    the other rank; a missing shipped head's warning is one line."""
    req = tmp_path / "req.json"
    req.write_text(json.dumps([{"prompt_ids": [1, 2, 3], "max_new_tokens": 2}]))
    job = Job(tmp_path, 2, ["--model", tiny_checkpoint("llama"), "--threads", "1", "--seed-head", "5",
                            "--requests", str(req)])
    job.wait(120)
    err = job.stderr(0)
    assert job.procs[0].returncode == 0, err[-2000:]  # the tiny model has no shipped head: a random one runs
    assert "spd-fast: warning: no shipped draft head for this model at num_stages=2" in err, err[-2000:]
    assert "RandomHeadWarning" not in err and "warnings.warn" not in err
    from conftest import tiny_target

    path = tiny_checkpoint("llama")
    m, cfg = tiny_target(path), ModelConfig.from_dir(path)
    init_from_target(DraftHead(DraftConfig.make(cfg, (0, 3, 6)), cfg, m.norm), m).save(tmp_path / "h")
    job = Job(tmp_path, 2, ["--model", path, "--draft", str(tmp_path / "h"), "--threads", "1", "--seed-head", "5",
                            "--requests", str(req)])
    job.wait(120)
    for r in (0, 1):  # a configuration problem: the same message and status 2 on every rank
        assert job.procs[r].returncode == 2, job.stderr(r)[-2000:]
        assert ("--seed-head 5 seeds a random head, but this engine loads the head " in job.stderr(r)
                and "drop --seed-head" in job.stderr(r) and "--draft random" in job.stderr(r)), job.stderr(r)[-2000:]
    # --seed-head 0 names the default, and the job itself refuses it for a trained head
    job = Job(tmp_path, 2, ["--model", path, "--draft", str(tmp_path / "h"), "--threads", "1", "--seed-head", "0",
                            "--requests", str(req)])
    job.wait(120)
    assert job.procs[0].returncode == 2, job.stderr(0)[-2000:]
    assert "--seed-head seeds a random head, but this run uses " in job.stderr(0), job.stderr(0)[-2000:]


def test_rank0_plan_names_a_malformed_draft_config(tiny_checkpoint, tmp_path):
    """The distributed loader reads a head's config as spd_fast.load does: a bad one is a DraftMismatchError that
    names the file, not a bare TypeError."""
    import torch

    from spd_fast.config import ModelConfig, SpdConfigError
    from spd_fast.distributed.engine import _plan_on_rank0
    from spd_fast.pdm import DraftConfig, DraftHead, init_from_target
    from spd_fast.runtime import load_target

    path = tiny_checkpoint("llama")
    tg = load_target(path, progress=False)
    head = tmp_path / "h"
    init_from_target(DraftHead(DraftConfig.make(tg.model.cfg, (0, 3, 6), None, 1, 50, tg.fingerprint),
                               tg.model.cfg, tg.model.norm), tg.model).save(head)
    cfg = json.loads((head / "draft_config.json").read_text())
    (head / "draft_config.json").write_text(json.dumps({**cfg, "anchors": "0,3,6"}))
    with pytest.raises(SpdConfigError, match=r"h/draft_config.json is not a valid draft head config \(TypeError: "
                                             r"anchors must be a non-empty list of layer indices"):
        _plan_on_rank0(path, ModelConfig.from_dir(path), torch.float32, 2, None, None, str(head), None, 0)
    with pytest.raises(SpdConfigError, match=r"is not a draft head checkpoint \(expected draft_config.json and "
                                             r"draft.safetensors in it\)"):
        _plan_on_rank0(path, ModelConfig.from_dir(path), torch.float32, 2, None, None, str(tmp_path), None, 0)


def test_a_stage_loads_only_what_the_single_process_loader_accepts(tiny_checkpoint, tmp_path):
    """load_stage (placement="distributed") read only its own tensors and so skipped the whole-checkpoint checks:
    an untied model without its output layer ran on the embedding, a stray tensor was dropped, a vocabulary
    mismatch was a raw RuntimeError. Each is now refused on every rank with load_hf_dir's message."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from spd_fast.distributed.partial_load import load_stage
    from spd_fast.loading import load_hf_dir

    src = Path(tiny_checkpoint("llama"))  # untied
    cfg0 = json.loads((src / "config.json").read_text())
    sd0 = load_file(str(src / "model.safetensors"))

    def stage(d: Path, layers: range = range(0, 3), **kw):
        return load_stage(d, ModelConfig.from_dir(d), layers, embedding=True, head=True, dtype=torch.float32,
                          device=torch.device("cpu"), max_len=16, **kw)

    ref = load_hf_dir(src)
    got = stage(src, range(0, 6))
    assert torch.equal(got.layers[2].attn.wqkv.weight, ref.layers[2].attn.wqkv.weight)
    assert torch.equal(got.lm_head.weight, ref.lm_head.weight)
    cases = [
        ({k: v for k, v in sd0.items() if k != "lm_head.weight"}, {},
         r"missing tensor 'lm_head.weight' while its config.json says tie_word_embeddings is false"),
        ({**sd0, "lm_head.weight": sd0["lm_head.weight"] + 1}, {"tie_word_embeddings": True},
         r"lm_head.weight that differs from model.embed_tokens.weight while its config.json says tie_word_embeddings"),
        ({**sd0, "model.layers.5.self_attn.o_proj.bias": torch.zeros(64)}, {},
         r"1 tensors the llama layout of spd_fast does not use, e.g. \['model.layers.5.self_attn.o_proj.bias'\]"),
        (sd0, {"vocab_size": 96}, r"the config does not match the weights \(size mismatch for embed.weight: .*97, "
                                  r"64.*96, 64.*use the checkpoint's own config.json"),
    ]
    for i, (sd, change, message) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        shutil.copytree(src, d, dirs_exist_ok=True)
        save_file(sd, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**cfg0, **change}))
        with pytest.raises(SpdConfigError, match=message):
            load_hf_dir(d)  # the single-process loader's refusal ...
        with pytest.raises(SpdConfigError, match=message):
            stage(d)  # ... is the stage's, although layer 5 and the head rows are another rank's
    (tmp_path / "c0" / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(SpdConfigError, match=r"model.safetensors.index.json is not a valid safetensors index"):
        stage(tmp_path / "c0")

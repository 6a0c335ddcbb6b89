"""PDM checkpoints and training: mask vs brute force, loss goes down, resume, n mismatch."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_target
from spd_fast.config import SpdConfigError
from spd_fast.pdm import DraftConfig, DraftHead, DraftMismatchError, init_from_target, load_draft
from spd_fast.train.mask import brute_force_mask, structured_mask
from spd_fast.train.trainer import PdmTrainer, TrainConfig, collate, train


@pytest.mark.parametrize("boundaries,anchors", [((0, 10), None), ((0, 1, 2, 3), None), ((0, 2, 5, 6), None),
                                                ((0, 10, 20, 30), (0, 10, 20, 29)),
                                                ((0, 6, 12, 18, 24, 30), (0, 12, 24)),
                                                ((0, 1, 2, 3, 4, 5), (0, 2, 5))])
def test_structured_mask_matches_brute_force(boundaries, anchors):
    from spd_fast.config import ModelConfig

    L = boundaries[-1]
    cfg = ModelConfig("llama", 10, 8, 8, L, 2, 1, 4)
    dt = DraftConfig.make(cfg, boundaries, anchors).depth_types()
    n = len(boundaries) - 1
    for fill in range(1, n + 1):
        for T in (1, 6, 13):
            assert torch.equal(structured_mask(T, dt, fill), brute_force_mask(T, dt, fill)), (fill, T)


class FakeTarget:
    def __init__(self, model):
        self.model, self.fingerprint, self.eos_ids = model, "tiny", (0,)


def _samples(model, count=24, seed=0):
    """Self-distilled toy data: greedy continuations of random prompts by the tiny model itself."""
    from spd_fast.batch_generate import generate_batch
    from spd_fast.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 97, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(count)]
    model.setup_caches(count, 128)
    outs = generate_batch(model, prompts, 24, SamplingParams(), [])
    return [{"id": str(i), "prompt_ids": p, "response_ids": o} for i, (p, o) in enumerate(zip(prompts, outs))]


def test_training_lowers_loss_and_raises_agreement(tiny_checkpoint):
    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m)
    b = (0, 2, 4, 6)
    dcfg = DraftConfig.make(m.cfg, b, None, 1, 97)
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m)
    tr = PdmTrainer(m, head, TrainConfig(steps=60, lr=3e-3, warmup=5, fill_aug=0.0))
    batch = collate(data, 64)
    with torch.no_grad():
        loss0, s0 = tr.loss(*batch, fill=None)
    for _ in range(60):
        tr.train_step(batch)
    with torch.no_grad():
        loss1, s1 = tr.loss(*batch, fill=None)
    assert s1["loss"] < 0.7 * s0["loss"]  # the KL to the teacher
    assert float(loss1) < float(loss0)  # the cross-entropy that is optimised
    assert s1["top1"] > s0["top1"] + 0.1


def test_a_diverging_run_stops_before_it_corrupts_the_head(tiny_checkpoint):
    """A non-finite loss (too high an lr, bad data) stops training with a clear error, weights untouched."""
    from spd_fast.config import SpdConfigError

    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, count=4)
    dcfg = DraftConfig.make(m.cfg, (0, 2, 4, 6), None, 1, 97)
    tr = PdmTrainer(m, init_from_target(DraftHead(dcfg, m.cfg, m.norm), m), TrainConfig(steps=4, fill_aug=0.0))
    batch = collate(data, 64)
    tr.train_step(batch)
    before = {k: v.clone() for k, v in tr.head.state_dict().items()}
    real = tr.loss
    tr.loss = lambda *a, **k: (lambda out: (out[0] * float("nan"), out[1]))(real(*a, **k))
    with pytest.raises(SpdConfigError, match=r"training diverged at step 1: .*gradient norm nan .*checkpoints "
                                             r"saved so far are intact. Lower --lr"):
        tr.train_step(batch)
    assert tr.step == 1 and all(torch.equal(before[k], v) for k, v in tr.head.state_dict().items())


def test_argmax_weight_adds_the_hard_label_cross_entropy(tiny_checkpoint):
    """--argmax-weight w: loss = soft-target CE + w * CE on the teacher's argmax; the KL stat is unchanged."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 8)
    dcfg = DraftConfig.make(m.cfg, (0, 2, 4, 6), None, 1, 40)  # a draft vocabulary smaller than the vocabulary
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m)
    batch = collate(data, 64)
    soft = PdmTrainer(m, head, TrainConfig(fill_aug=0.0))
    hard = PdmTrainer(m, head, TrainConfig(fill_aug=0.0, argmax_weight=0.5))
    with torch.no_grad():
        l0, s0 = soft.loss(*batch, fill=None)
        l1, s1 = hard.loss(*batch, fill=None)
        ids, lens, mask = batch
        anchors, t_logp, t_arg = soft.teacher(ids, lens)
        sel = (mask & torch.isin(t_arg, head.draft_vocab)).reshape(-1).nonzero().squeeze(1)
        s_logits, _ = soft.student_logits(anchors, lens, None, sel)
        # the target's argmax token, as an index into the draft vocabulary
        want = torch.searchsorted(head.draft_vocab, t_arg.reshape(-1)[sel])
        assert torch.equal(head.draft_vocab[want], t_arg.reshape(-1)[sel])
        ce_hard = F.cross_entropy(s_logits, want)
    assert 0 < sel.numel() < mask.sum()  # some loss rows fall outside the draft vocabulary
    torch.testing.assert_close(l1 - l0, 0.5 * ce_hard)
    assert s1["loss"] == s0["loss"] and s1["top1"] == s0["top1"]


@pytest.mark.parametrize("cached", [False, True])
def test_the_chunked_loss_equals_the_whole_one(tiny_checkpoint, monkeypatch, tmp_path, cached):
    """The LM head and KL run LOSS_CHUNK rows at a time under activation checkpointing: the loss, its stats and
    every gradient equal one chunk over all rows (the live teacher and the cached one), the hard-label term
    included, and a chunk count that does not divide the rows leaves none out."""
    from spd_fast.train import trainer as trmod

    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 8)
    dcfg = DraftConfig.make(m.cfg, (0, 2, 4, 6), None, 2, 40)
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m)
    tr = PdmTrainer(m, head, TrainConfig(fill_aug=0.0, argmax_weight=0.3))
    batch, extra = collate(data, 64), {}
    if cached:
        from spd_fast.train.features import build_feature_cache
        from spd_fast.train.trainer import collate_cached

        cache = build_feature_cache(m, "tiny", data, tmp_path / "fc", dcfg.anchors, 64, progress=False)
        batch, extra["cached"] = collate_cached([dict(s, _idx=i) for i, s in enumerate(data)], 64, cache)

    def run(chunk):
        monkeypatch.setattr(trmod, "LOSS_CHUNK", chunk)
        head.zero_grad(set_to_none=True)
        loss, st = tr.loss(*batch, fill=None, **extra)
        loss.backward()
        return loss.detach(), st, {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}

    whole, s_whole, g_whole = run(10 ** 9)
    part, s_part, g_part = run(7)
    assert s_whole["tokens"] > 7 * 3 and s_whole["tokens"] % 7  # several chunks, the last one short
    torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)
    assert s_part["top1"] == s_whole["top1"] and s_part["tokens"] == s_whole["tokens"]
    assert s_part["loss"] == pytest.approx(s_whole["loss"], rel=1e-5, abs=1e-7)
    assert g_whole and g_part.keys() == g_whole.keys()
    for k in g_whole:
        torch.testing.assert_close(g_part[k], g_whole[k], rtol=1e-4, atol=1e-6, msg=k)


def test_collate_pads_to_a_few_shapes_without_changing_the_loss(tiny_checkpoint):
    """Batches are padded to a multiple of PAD_MULTIPLE positions (capped at max_seq_len) so the CPU
    allocator sees few shapes; padded positions are neither keys nor loss rows, so the loss is the
    same as on the tight batch."""
    from spd_fast.train.trainer import PAD_MULTIPLE

    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 6)
    ids, lens, mask = collate(data, 4 * PAD_MULTIPLE)
    T = int(lens.max())
    assert ids.shape[1] == PAD_MULTIPLE > T and not mask[:, T - 1:].any()
    assert collate(data, T)[0].shape[1] == T  # never past max_seq_len
    dcfg = DraftConfig.make(m.cfg, (0, 2, 4, 6), None, 2, 97)
    tr = PdmTrainer(m, init_from_target(DraftHead(dcfg, m.cfg, m.norm), m), TrainConfig(fill_aug=0.0))
    with torch.no_grad():
        for fill in (None, 1):
            l_pad, s_pad = tr.loss(ids, lens, mask, fill=fill)
            l_tight, s_tight = tr.loss(ids[:, :T], lens, mask[:, :T], fill=fill)
            torch.testing.assert_close(l_pad, l_tight)
            assert s_pad["tokens"] == s_tight["tokens"] > 0 and s_pad["top1"] == s_tight["top1"]


def test_checkpoint_round_trip_and_resume(tiny_checkpoint, tmp_path, monkeypatch):
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=4, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    head = train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg, log=lambda s: None)
    loaded = load_draft(tmp_path / "run" / "head", m, "tiny", num_stages=3)
    for (k, v), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v.to(v2.dtype), v2, atol=1e-2, rtol=1e-2)  # saved in bf16
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    assert 0 in loaded.draft_vocab.tolist()  # EOS always in the draft vocabulary
    assert not list((tmp_path / "run" / "head").glob("*.tmp"))
    # a save stopped mid-write leaves the previous head whole (each file goes through a temporary name)
    import safetensors.torch

    before = (tmp_path / "run" / "head" / "draft.safetensors").read_bytes()

    def cut_short(sd, name, *a, **k):
        open(name, "wb").write(b"partial")
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(safetensors.torch, "save_file", cut_short)
        with pytest.raises(KeyboardInterrupt):
            head.save(tmp_path / "run" / "head")
    assert (tmp_path / "run" / "head" / "draft.safetensors").read_bytes() == before
    load_draft(tmp_path / "run" / "head", m, "tiny", num_stages=3)
    # a rerun of the finished run resumes its weights and optimiser state exactly (no step left to take)
    saved = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    again = train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg, log=lambda s: None)
    for (k, v), (k2, v2) in zip(head.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    resaved = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    moments = [(k, t) for k, st in saved["opt"]["state"].items() for t in st.values() if torch.is_tensor(t)]
    assert moments and all(torch.equal(t, resaved["opt"]["state"][k][name])
                           for k, st in saved["opt"]["state"].items() for name, t in st.items() if torch.is_tensor(t))
    # resume: a longer run continues from step 4 instead of starting over
    logs = []
    cfg2 = TrainConfig(steps=6, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg2, log=logs.append)
    # one JSON line marks the resume (readers drop the earlier lines past its step) and the schedule's new length
    assert json.loads(logs[0]) == {"message": f"resumed from {tmp_path / 'run'} at step 4", "resumed_at": 4,
                                   "steps": 6, "steps_before": 4}
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 6 and state["teacher_dtype"] == "torch.float32"
    # the rest of the recipe must match too; how often it logs and saves, and its weight decay, may change
    for change, flag in (({"lr": 1e-3}, "--lr 0.0005 vs 0.001"), ({"warmup": 3}, "--warmup 1 vs 3"),
                         ({"fill_aug": 0.9}, "--fill-aug 0.5 vs 0.9"), ({"bf16": True}, "--bf16 False vs True"),
                         ({"argmax_weight": 0.5}, "--argmax-weight 0.0 vs 0.5"),
                         ({"fill_after_miss": True}, "--fill-after-miss False vs True")):
        other = dataclasses.replace(cfg2, steps=8, **change)
        with pytest.raises(SpdConfigError, match=f"holds a run trained with other settings \\({flag}: saved vs "
                                                 f"asked\\); a resume continues the run as it began: pass its own "
                                                 f"values .* or another --out with --init .*/head to fine-tune"):
            train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=other,
                  log=lambda s: None)
    assert torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)["step"] == 6  # untouched
    st = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    torch.save(dict(st, teacher_dtype="torch.bfloat16"), tmp_path / "run" / "trainer_state.pt")
    with pytest.raises(SpdConfigError, match="other settings \\(--dtype bfloat16 vs float32: saved vs asked\\)"):
        train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg2, log=lambda s: None)
    # a checkpoint of the code before teacher_dtype was recorded resumes
    torch.save({k: v for k, v in st.items() if k != "teacher_dtype"}, tmp_path / "run" / "trainer_state.pt")
    logs.clear()
    free = dataclasses.replace(cfg2, steps=7, save_every=1, log_every=1, weight_decay=0.1)
    train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=free, log=logs.append)
    assert json.loads(logs[0])["resumed_at"] == 6
    assert torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)["step"] == 7
    # settings that decide the batches must match: another value would train the rest on another stream
    for change, flag in (({"max_seq_len": 32}, "--max-seq-len 64 vs 32"), ({"seed": 3}, "--seed 0 vs 3"),
                         ({"batch_tokens": 128}, "--batch-tokens 256 vs 128")):
        other = dataclasses.replace(cfg2, steps=8, **change)
        with pytest.raises(SpdConfigError, match=f"holds a run with other batches \\({flag}: saved vs asked\\); "
                                                 f".* or another --out with --init .*/head to fine-tune its head"):
            train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=other,
                  log=lambda s: None)


def test_a_resume_refuses_another_teacher_init_head_or_rank_count(tiny_checkpoint, tmp_path):
    """What a run began with and the recipe does not show: its teacher (every weight and the config, not only the
    head's sampled fingerprint), its --init head, and its number of ranks. A resume with others is refused."""
    import shutil

    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=2, batch_tokens=256, max_seq_len=64, save_every=2, warmup=1)
    longer = dataclasses.replace(cfg, steps=3)
    run, quiet = tmp_path / "run", (lambda s: None)
    train(FakeTarget(m), data, run, num_stages=3, draft_vocab_size=50, cfg=cfg, log=quiet)
    st = torch.load(run / "trainer_state.pt", weights_only=False)
    assert st["init"] is None and st["world"] == 1 and isinstance(st["model"], str)
    # a teacher whose middle layer changed: same sampled fingerprint, another model
    w = m.layers[1].mlp.w_down.weight
    orig = w.detach().clone()
    with torch.no_grad():
        w.mul_(1.5)
    with pytest.raises(SpdConfigError, match=r"holds a run trained against another target model \(model identity "
                                             r"\w+, now \w+: its config.json or weights differ\); .*pass the run's "
                                             r"own --model, or pass --no-resume"):
        train(FakeTarget(m), data, run, num_stages=3, draft_vocab_size=50, cfg=longer, log=quiet)
    with torch.no_grad():
        w.copy_(orig)
    # a run from scratch resumed with an --init head, which a resume would not read
    shutil.copytree(run / "head", tmp_path / "h1")
    with pytest.raises(SpdConfigError, match=r"holds a run that began from scratch, not from --init .*h1 \(digest "
                                             r"\w+\); a resume takes every weight from its checkpoint .* drop --init"):
        train(FakeTarget(m), data, run, num_stages=3, draft_vocab_size=50, cfg=longer, log=quiet, init=tmp_path / "h1")
    # a warm-started run: resumed with its own --init, with none, or with it gone; refused with another head
    warm = tmp_path / "warm"
    train(FakeTarget(m), data, warm, num_stages=3, draft_vocab_size=50, cfg=cfg, log=quiet, init=tmp_path / "h1")
    shutil.copytree(tmp_path / "h1", tmp_path / "h2")
    cal = json.loads((tmp_path / "h2" / "draft_config.json").read_text())
    (tmp_path / "h2" / "draft_config.json").write_text(json.dumps(dict(cal, draft_temperature_scale=0.8)))
    with pytest.raises(SpdConfigError, match=r"holds a run that began from the head .*h1 \(digest \w+\), not from "
                                             r"--init .*h2"):
        train(FakeTarget(m), data, warm, num_stages=3, draft_vocab_size=50, cfg=longer, log=quiet, init=tmp_path / "h2")
    train(FakeTarget(m), data, warm, num_stages=3, draft_vocab_size=50, cfg=longer, log=quiet, init=tmp_path / "h1")
    shutil.rmtree(tmp_path / "h1")
    train(FakeTarget(m), data, warm, num_stages=3, draft_vocab_size=50, cfg=dataclasses.replace(cfg, steps=4),
          log=quiet, init=tmp_path / "h1")
    assert torch.load(warm / "trainer_state.pt", weights_only=False)["step"] == 4
    # a run of 2 ranks resumed on 1 would take other batches at every step
    torch.save(dict(st, world=2), run / "trainer_state.pt")
    with pytest.raises(SpdConfigError, match=r"holds a run trained on 2 rank\(s\), not 1: each step takes one batch "
                                             r"per rank.* resume it on 2 rank\(s\) \(torchrun --nproc-per-node 2"):
        train(FakeTarget(m), data, run, num_stages=3, draft_vocab_size=50, cfg=longer, log=quiet)
    # a checkpoint of the code before these were recorded resumes
    torch.save({k: v for k, v in st.items() if k not in ("model", "init", "world")}, run / "trainer_state.pt")
    train(FakeTarget(m), data, run, num_stages=3, draft_vocab_size=50, cfg=longer, log=quiet, init=tmp_path / "h2")
    assert torch.load(run / "trainer_state.pt", weights_only=False)["step"] == 3


def test_a_validation_is_logged_before_it_counts_as_done(tiny_checkpoint, tmp_path, monkeypatch):
    """last_val.json (which a resume reads to skip a validation) is written after the validation's log line: a run
    stopped between the two validates again at resume, so the log never lacks a validation it took."""
    from spd_fast.train import trainer as T

    m = tiny_target(tiny_checkpoint("llama"))
    data, held = _samples(m, 8), _samples(m, 3, seed=9)
    cfg = TrainConfig(steps=2, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    real, logs = T._write_json, []

    def stop_at_last_val(path, d):
        if path.name == "last_val.json":
            raise KeyboardInterrupt
        real(path, d)

    monkeypatch.setattr(T, "_write_json", stop_at_last_val)
    with pytest.raises(KeyboardInterrupt):
        train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg, log=logs.append,
              feature_cache=False, val_samples=held)
    assert [json.loads(x)["step"] for x in logs if "val_top1" in x] == [2]


def test_replace_durably_flushes_the_file_before_the_rename(tmp_path, monkeypatch):
    import os

    from spd_fast import store

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(store.os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(store.os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    (tmp_path / "f").write_text("old")
    (tmp_path / "f.tmp").write_text("new")
    store.replace_durably(tmp_path / "f.tmp", tmp_path / "f")
    assert (tmp_path / "f").read_text() == "new" and not (tmp_path / "f.tmp").exists()
    assert events == ["fsync", "replace", "fsync"]  # the data, the rename, then the directory entry


def test_a_head_can_share_another_heads_weights_file(tiny_checkpoint, tmp_path):
    """draft_config.json's `weights` names the weights file relative to the head directory (the shipped
    n=2 head reads the n=3 head's file); a missing one is a clear error; save() writes its own file."""
    import dataclasses
    import json

    from spd_fast.pdm import DraftConfig, DraftHead, DraftMismatchError, init_from_target

    m = tiny_target(tiny_checkpoint("llama"))
    b = (0, 2, 4, 6)
    src = init_from_target(DraftHead(DraftConfig.make(m.cfg, b, None, 1, 97, "tiny"), m.cfg, m.norm), m, 1)
    src.save(tmp_path / "a")
    shared = tmp_path / "b"
    shared.mkdir()
    cfg = dataclasses.replace(src.dcfg, boundaries=(0, 3, 6), num_stages=2, weights="../a/draft.safetensors")
    (shared / "draft_config.json").write_text(cfg.to_json())
    a, sb = load_draft(tmp_path / "a", m, "tiny"), load_draft(shared, m, "tiny")
    assert sb.dcfg.num_stages == 2 and a.dcfg.num_stages == 3
    for (k, v), (k2, v2) in zip(a.state_dict().items(), sb.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    sb.save(tmp_path / "c")  # a re-saved head owns its weights
    assert json.loads((tmp_path / "c" / "draft_config.json").read_text())["weights"] == "draft.safetensors"
    assert (tmp_path / "c" / "draft.safetensors").is_file()
    (tmp_path / "a" / "draft.safetensors").unlink()
    with pytest.raises(DraftMismatchError, match=r"the weights file '\.\./a/draft\.safetensors' that its "
                                                 r"draft_config.json names .* does not exist; fix 'weights'"):
        load_draft(shared, m, "tiny")
    with pytest.raises(DraftMismatchError, match=r"is not a draft head checkpoint \(expected draft_config.json and "
                                                 r"draft.safetensors in it\)"):
        load_draft(tmp_path / "a", m, "tiny")


def test_the_shipped_heads_share_anchors_and_weights_files():
    """One head per n for the default model; heads that share weights name another head's file, and a
    weights file is stored once, under the package's size budget."""
    from spd_fast.api import HEADS_DIR
    from spd_fast.pdm import read_draft_config

    heads = {d.name: read_draft_config(d) for d in sorted(HEADS_DIR.iterdir()) if (d / "draft_config.json").is_file()}
    by_n = {c.num_stages: name for name, c in heads.items()}
    assert len(by_n) == len(heads) and {2, 3, 4, 5, 6} <= set(by_n), by_n
    assert len({(c.anchors, c.base_fingerprint, c.num_layers, c.draft_vocab_size) for c in heads.values()}) == 1
    files = {(HEADS_DIR / name / c.weights).resolve() for name, c in heads.items()}
    assert all(f.parent.parent == HEADS_DIR.resolve() and f.name == "draft.safetensors" for f in files)
    assert all(f.stat().st_size < 40e6 for f in files)
    n2, n3 = heads[by_n[2]], heads[by_n[3]]
    assert (HEADS_DIR / by_n[2] / n2.weights).resolve() == (HEADS_DIR / by_n[3] / n3.weights).resolve()
    assert heads[by_n[5]].weights == "draft.safetensors"  # fine-tuned at n=4, then at n=5: its own weights
    for n in (4, 6):  # the n=5 weights, run at n=4 and n=6
        assert (HEADS_DIR / by_n[n] / heads[by_n[n]].weights).resolve() == (HEADS_DIR / by_n[5] / "draft.safetensors").resolve()
    assert len(files) == 2  # two weights files for five heads


def test_validation_scores_held_out_data_and_keeps_the_best_head(tiny_checkpoint, tmp_path):
    import json

    m = tiny_target(tiny_checkpoint("llama"))
    data, held = _samples(m, 16), _samples(m, 6, seed=9)
    cfg = TrainConfig(steps=30, lr=3e-3, batch_tokens=512, max_seq_len=64, save_every=10, log_every=10, warmup=2,
                      fill_aug=0.0)
    logs: list[str] = []
    head = train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=97, cfg=cfg, log=logs.append,
                 feature_cache=False, val_samples=held)
    vals = [json.loads(x) for x in logs if x.startswith("{") and "val_top1" in x]
    assert [v["step"] for v in vals] == [10, 20, 30]
    assert vals[-1]["val_loss"] < vals[0]["val_loss"]  # learning generalises to the held-out toy data
    # validate() is the full-fill teacher-forced loss on the held-out rows, weighted by rows
    tr = PdmTrainer(m, head, cfg)
    with torch.no_grad():
        _, direct = tr.loss(*collate(held, 64), fill=None)
    v = tr.validate(held, batch_size=len(held))
    assert v["val_tokens"] == direct["tokens"] and abs(v["val_top1"] - direct["top1"]) < 1e-6
    # by answer position: every held-out answer row lands in exactly one bucket (V_d is the whole toy
    # vocabulary, so every assistant row counts), and the buckets average back to the overall top-1
    pv = tr.validate(held, batch_size=4, pos_edges=(3, 6))
    want = {"0-2": 0, "3-5": 0, "6+": 0}
    for smp in held:
        for j in range(min(len(smp["prompt_ids"]) + len(smp["response_ids"]), 64) - len(smp["prompt_ids"])):
            want["0-2" if j < 3 else "3-5" if j < 6 else "6+"] += 1
    assert pv["val_tokens_by_pos"] == {k: c for k, c in want.items() if c} and len(pv["val_tokens_by_pos"]) == 3
    mean = sum(pv["val_top1_by_pos"][k] * c for k, c in pv["val_tokens_by_pos"].items()) / pv["val_tokens"]
    assert mean == pytest.approx(v["val_top1"], abs=1e-6)
    assert vals[-1]["val_tokens_by_pos"] and set(vals[-1]["val_top1_by_pos"]) <= {"0-63", "64-127", "128-191",
                                                                              "192-255", "256+"}
    best = json.loads((tmp_path / "run" / "best_head" / "val.json").read_text())
    top = max(x["val_top1"] for x in vals)  # logged rounded to 4 digits
    assert best["val_top1"] == pytest.approx(top, abs=1e-4)
    assert best["step"] == next(x["step"] for x in vals if x["val_top1"] == top)  # the first to reach it
    load_draft(tmp_path / "run" / "best_head", m, "tiny", num_stages=3)


def test_warm_start_copies_weights_and_vocab_and_refuses_mismatch(tiny_checkpoint, tmp_path):
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=2, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    first = train(FakeTarget(m), data, tmp_path / "a", num_stages=3, draft_vocab_size=50, cfg=cfg, log=lambda s: None)
    # other data would give another draft vocabulary; the warm start keeps the saved one
    other = _samples(m, 12, seed=5)
    zero = TrainConfig(steps=0, batch_tokens=256, max_seq_len=64, warmup=1)
    warm = train(FakeTarget(m), other, tmp_path / "b", num_stages=3, draft_vocab_size=50, cfg=zero,
                 log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head")
    assert torch.equal(warm.draft_vocab, first.draft_vocab)
    for (k, v), (_, v2) in zip(first.state_dict().items(), warm.state_dict().items()):
        torch.testing.assert_close(v.to(v2.dtype), v2, atol=1e-2, rtol=1e-2, msg=k)  # saved in bf16
    # with held-out data, a warm start is scored at step 0 too, so best_head is never worse than init
    logs: list[str] = []
    train(FakeTarget(m), other, tmp_path / "v", num_stages=3, draft_vocab_size=50, cfg=zero, log=logs.append,
          feature_cache=False, init=tmp_path / "a" / "head", val_samples=data[:4])
    (v0,) = [json.loads(x) for x in logs if x.startswith("{") and "val_top1" in x]
    ref = PdmTrainer(m, warm, zero).validate(data[:4])
    assert v0["step"] == 0 and v0["best"] and v0["val_top1"] == pytest.approx(ref["val_top1"], abs=1e-4)
    assert json.loads((tmp_path / "v" / "best_head" / "val.json").read_text())["step"] == 0
    with pytest.raises(SpdConfigError, match="cannot warm-start.*draft_vocab_size: 50 vs 40.*--draft-vocab"):
        train(FakeTarget(m), other, tmp_path / "c", num_stages=3, draft_vocab_size=40, cfg=zero,
              log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head")


def test_the_first_and_last_steps_are_logged_so_a_short_run_shows_its_loss(tiny_checkpoint, tmp_path, monkeypatch):
    """Loss lines come every log_every steps and at the run's first and last steps, each the mean since the last
    multiple of log_every (a smoke run of --steps 3 used to log no loss at all)."""
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    real = PdmTrainer.train_step

    def numbered_step(self, *a, **k):  # step i's loss reads i, so each line's mean can be checked
        stats = real(self, *a, **k)
        return {**stats, "loss": float(self.step)}

    monkeypatch.setattr(PdmTrainer, "train_step", numbered_step)
    for steps, log_every, want in [(3, 10, {1: 1.0, 3: 2.0}), (12, 5, {1: 1.0, 5: 3.0, 10: 8.0, 12: 11.5})]:
        logs: list[str] = []
        cfg = TrainConfig(steps=steps, batch_tokens=128, max_seq_len=64, save_every=100, log_every=log_every,
                          warmup=1)
        train(FakeTarget(m), data, tmp_path / f"s{steps}", num_stages=3, draft_vocab_size=50, cfg=cfg,
              log=logs.append, feature_cache=False)
        lines = [json.loads(x) for x in logs if x.startswith("{") and '"loss"' in x]
        assert {d["step"]: d["loss"] for d in lines} == pytest.approx(want), lines
        assert all(set(d) == {"step", "epoch", "lr", "loss", "top1", "tokens_per_s"} for d in lines)


def test_trained_lm_head_is_stored_loaded_and_kept_by_warm_starts(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=6, lr=3e-3, batch_tokens=256, max_seq_len=64, save_every=6, log_every=2, warmup=1)
    head = train(FakeTarget(m), data, tmp_path / "a", num_stages=3, draft_vocab_size=50, cfg=cfg,
                 log=lambda s: None, feature_cache=False, train_lm_head=True)
    rows = m.lm_head.weight[head.draft_vocab]
    assert not head.dcfg.frozen_lm_head
    assert (head.lm_head.weight - rows).abs().max() > 1e-3  # the rows moved away from the target's
    saved = load_file(str(tmp_path / "a" / "head" / "draft.safetensors"))
    assert "lm_head.weight" in saved  # a frozen head does not store them (checked below)
    loaded = load_draft(tmp_path / "a" / "head", m, "tiny", num_stages=3)
    torch.testing.assert_close(loaded.lm_head.weight, head.lm_head.weight.float(), atol=1e-2, rtol=1e-2)
    assert (loaded.lm_head.weight - rows).abs().max() > 1e-3  # not rebuilt from the target at load
    frozen = train(FakeTarget(m), data, tmp_path / "f", num_stages=3, draft_vocab_size=50, cfg=cfg,
                   log=lambda s: None, feature_cache=False)
    torch.testing.assert_close(frozen.lm_head.weight, rows)  # the default shares the target's rows
    assert "lm_head.weight" not in load_file(str(tmp_path / "f" / "head" / "draft.safetensors"))
    # a warm start keeps the trained rows; warm-starting a frozen head from them is refused
    zero = TrainConfig(steps=0, batch_tokens=256, max_seq_len=64, warmup=1)
    warm = train(FakeTarget(m), data, tmp_path / "b", num_stages=3, draft_vocab_size=50, cfg=zero,
                 log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head", train_lm_head=True)
    torch.testing.assert_close(warm.lm_head.weight, loaded.lm_head.weight)
    with pytest.raises(SpdConfigError, match="lm_head: trained in the saved head.*--train-lm-head"):
        train(FakeTarget(m), data, tmp_path / "c", num_stages=3, draft_vocab_size=50, cfg=zero,
              log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head")


def _saved_n3_head(tiny_checkpoint, out: Path):
    """The tiny llama target, 12 self-distilled samples, an n=3 head trained 3 steps and saved in out/head,
    and a zero-step config for warm starts from it."""
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=3, batch_tokens=256, max_seq_len=64, save_every=3, log_every=3, warmup=1)
    train(FakeTarget(m), data, out, num_stages=3, draft_vocab_size=50, cfg=cfg, log=lambda s: None)
    return m, data, TrainConfig(steps=0, batch_tokens=256, max_seq_len=64, warmup=1)


def test_warm_start_grows_the_tower_and_drafts_like_the_smaller_head(tiny_checkpoint, tmp_path):
    m, data, zero = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    grown = train(FakeTarget(m), data, tmp_path / "b", num_stages=3, draft_layers=3, draft_vocab_size=50, cfg=zero,
                  log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head")
    assert len(grown.layers) == 3
    saved = load_draft(tmp_path / "a" / "head", m, "tiny")  # the bf16 round trip both start from
    for k, v in saved.state_dict().items():
        assert torch.equal(grown.state_dict()[k], v.to(grown.state_dict()[k].dtype)), k
    for layer in grown.layers[1:]:
        assert not layer.attn.wo.weight.any() and not layer.mlp.w_down.weight.any()
        assert layer.attn.wqkv.weight.abs().sum() > 0  # the rest is a normal fresh init
    # identity layers: the grown head scores the data exactly like the small one (loss and top-1)
    b = collate(data, 64)
    with torch.no_grad():
        (l_g, s_g), (l_s, s_s) = (PdmTrainer(m, h.float(), TrainConfig()).loss(*b, fill=None) for h in (grown, saved))
    assert s_g["top1"] == s_s["top1"] and float(l_g) == pytest.approx(float(l_s), rel=1e-5)
    # and training moves the new layers
    more = TrainConfig(steps=2, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    trained = train(FakeTarget(m), data, tmp_path / "c", num_stages=3, draft_layers=3, draft_vocab_size=50, cfg=more,
                    log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head")
    assert trained.layers[2].mlp.w_down.weight.any()
    with pytest.raises(SpdConfigError, match="num_layers: 3 vs 1 .a head can be grown, not shrunk.*--draft-layers"):
        train(FakeTarget(m), data, tmp_path / "d", num_stages=3, draft_layers=1, draft_vocab_size=50, cfg=zero,
              log=lambda s: None, feature_cache=False, init=tmp_path / "c" / "head")


def test_head_refuses_other_n_and_other_model(tiny_checkpoint, tmp_path):
    m = tiny_target(tiny_checkpoint("llama"))
    head = init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 3, 6), fingerprint="abc"), m.cfg, m.norm), m)
    head.save(tmp_path / "h")
    with pytest.raises(DraftMismatchError, match="trained for num_stages=2, not 3.*train a head for n=3"):
        load_draft(tmp_path / "h", m, "abc", num_stages=3)
    with pytest.raises(DraftMismatchError, match=r"trained for other weights .* load the checkpoint it was trained "
                                                 r"for \(model=<its model>; a copy of it in fp32 or bf16 matches, "
                                                 r"one saved in fp16 or quantised does not\)"):
        load_draft(tmp_path / "h", m, "zzz", num_stages=2)
    other = tiny_target(tiny_checkpoint("qwen3"))
    with pytest.raises(DraftMismatchError, match=r"different model.*model_type: head llama vs model qwen3.*; load "
                                                 r"the model it was trained for \(model=<its model>\)") as e:
        load_draft(tmp_path / "h", other, "abc")
    from spd_fast.__main__ import build_parser
    from spd_fast.cli_common import cli_message

    assert "(--model <its model>)" in cli_message(e.value, build_parser(), "generate")
    with pytest.raises(SpdConfigError, match=r"not a draft head checkpoint \(expected draft_config.json and "
                                             r"draft.safetensors in it\)$"):
        load_draft(tmp_path, m, "abc")
    run = tmp_path / "run"  # a training run's --out passed as the head
    head.save(run / "head")
    with pytest.raises(SpdConfigError, match=rf"; it holds a training run: pass {run}/head \(the last checkpoint\)$"):
        load_draft(run, m, "abc")
    head.save(run / "best_head")
    with pytest.raises(SpdConfigError, match=rf"pass {run}/best_head \(the best on validation\) or {run}/head "):
        load_draft(run, m, "abc")


def test_api_refuses_head_for_other_n(tiny_checkpoint, tmp_path):
    import spd_fast
    from spd_fast.runtime import weights_fingerprint

    m = tiny_target(tiny_checkpoint("llama"))
    fp = weights_fingerprint(m)
    init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 3, 6), fingerprint=fp), m.cfg, m.norm), m).save(tmp_path / "h")
    with pytest.raises(SpdConfigError, match="trained for num_stages=2, not 3"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "h"), num_stages=3)
    with pytest.raises(DraftMismatchError, match=r"trained for anchors \[0, 3, 6\], not \[0, 2\]; omit anchors"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "h"), num_stages=2, anchors=(0, 2))
    with pytest.raises(DraftMismatchError, match=r"has 1 decoder layers, not draft_layers=3; omit draft_layers"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "h"), num_stages=2, draft_layers=3)
    # asking for what the head has is fine, and without num_stages the head's own n is used
    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "h"), draft_layers=1, anchors=(0, 3, 6))
    assert eng.head.dcfg.num_layers == 1 and eng.boundaries == (0, 3, 6)


def test_head_at_other_boundaries_is_refused_and_the_shipped_one_runs_there_with_a_warning(tiny_checkpoint, tmp_path,
                                                                                              monkeypatch):
    import spd_fast
    import spd_fast.api
    from spd_fast.runtime import weights_fingerprint

    m = tiny_target(tiny_checkpoint("llama"))
    fp = weights_fingerprint(m)
    dc = DraftConfig.make(m.cfg, (0, 2, 4, 6), anchors=(0, 2, 4, 6), fingerprint=fp)
    init_from_target(DraftHead(dc, m.cfg, m.norm), m, seed=3).save(tmp_path / "heads" / "tiny-n3")
    # a head the user names is refused at another split, with the way out
    with pytest.raises(DraftMismatchError, match=r"trained for stage boundaries \[0, 2, 4, 6\], not \[0, 1, 4, 6\]; "
                                                 r"omit boundaries .* --init HEAD --boundaries"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "heads" / "tiny-n3"), boundaries=(0, 1, 4, 6),
                      progress=False)
    # draft=None: the shipped head for n runs at the requested split (same anchors), with a warning
    monkeypatch.setattr(spd_fast.api, "HEADS_DIR", tmp_path / "heads")
    with pytest.warns(UserWarning, match=r"shipped draft head tiny-n3 was trained for stage boundaries \[0, 2, 4, 6\]; "
                                         r"running its weights at \[0, 1, 4, 6\] \(output is still exact") as rec:
        eng = spd_fast.load(model=tiny_checkpoint("llama"), boundaries=(0, 1, 4, 6), progress=False)
    assert [w.filename for w in rec] == [__file__]  # at the caller's line (filters by module, once per place)
    with pytest.warns(spd_fast.RandomHeadWarning, match="no shipped draft head for this model at num_stages=2") as rec:
        spd_fast.load(model=tiny_checkpoint("llama"), num_stages=2, progress=False)
    assert [w.filename for w in rec] == [__file__]
    assert eng.draft_source == "shipped:tiny-n3" and eng.boundaries == (0, 1, 4, 6)
    assert eng.head.dcfg.boundaries == (0, 1, 4, 6) and eng.head.dcfg.anchors == (0, 2, 4, 6)
    assert eng.head.dcfg.depth_types() == [0, 0, 2, 3]  # depth 1 ends at layer 1: read at anchor 0
    spd = eng.generate("!", max_new_tokens=24).token_ids
    assert spd == eng.generate("!", max_new_tokens=24, method="ar").token_ids
    # at its own split (or with no boundaries) it loads silently
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        assert spd_fast.load(model=tiny_checkpoint("llama"), boundaries=(0, 2, 4, 6), progress=False).draft_source \
            == "shipped:tiny-n3"


class _RecordingDrafter:
    """Computes the PDM's draft logits every cycle (recorded by p_new and fill) but proposes the
    oracle token, so the pipeline stays full and every steady-state row is visited."""

    def __init__(self, head, reference):
        from spd_fast.drafters import PdmDrafter, ReferenceDrafter

        self.pdm, self.oracle = PdmDrafter(head), ReferenceDrafter(reference, head.tcfg.vocab_size)
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.head = head

    def prefill(self, engine, st):
        self.pdm.prefill(engine, st)
        self.oracle.prefill(engine, st)

    def draft(self, engine, st, params, generator):
        from spd_fast.model import kv_bound_for

        head, p_new, start = self.head, int(st.p_new), int(st.pdm_len)
        pos = torch.arange(start, p_new + 1)
        depth = torch.where(pos < st.p_old, engine.n, st.p_new - pos)
        g = head.aggregate(st.anchors[start:p_new + 1], engine.depth_type[depth])
        h = head.tower(g[None], pos[None], kv_bound_for(p_new, head.max_len))
        self.logits[(p_new, int(st.fill))] = head.draft_logits(h[0, -1])
        return self.oracle.draft(engine, st, params, generator)


@pytest.mark.parametrize("boundaries,anchors,layers", [((0, 2, 4, 6), None, 2), ((0, 1, 5, 6), (0, 1, 6), 1),
                                                       ((0, 3, 6), None, 2)],
                         ids=["n3-2layers", "n3-shared-type-1layer", "n2-2layers"])
def test_training_forward_equals_inference_drafts(tiny_checkpoint, boundaries, anchors, layers):
    """The trainer's type-0 logits at position t (full fill, and each warm-up fill) equal the draft
    logits the engine computes when t is the newest token: training sees what inference sees.
    (When several depths share a type, training places a type at its smallest depth, so with
    L_s >= 2 the rows of such a type are only approximated, as the spec says; 1 layer is exact.)"""
    from spd_fast.ar import decode_ar
    from spd_fast.engine import SPDEngine
    from spd_fast.sampling import SamplingParams

    m = tiny_target(tiny_checkpoint("llama"))
    head = init_from_target(DraftHead(DraftConfig.make(m.cfg, boundaries, anchors, layers, 97), m.cfg, m.norm), m, 1)
    head.eval().requires_grad_(False)
    with torch.no_grad():  # a non-trivial head: random projections and layers
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    prompt = [4, 8, 15, 16, 23]
    ref = decode_ar(m, prompt, 12, SamplingParams(), []).token_ids
    drafter = _RecordingDrafter(head, prompt + ref)
    SPDEngine(m, drafter, boundaries, head.dcfg.anchors).run(prompt, 12, SamplingParams(), [])
    tr = PdmTrainer(m, head, TrainConfig())
    seq = prompt + ref
    n = len(boundaries) - 1
    ids = torch.tensor([seq])
    lens = torch.tensor([len(seq)])
    checked = 0
    for fill in sorted({f for _, f in drafter.logits}):
        with torch.no_grad():
            s_logits = _student_logits(tr, ids, lens, fill if fill < n else None)
        for (p_new, f), want in drafter.logits.items():
            if f == fill and p_new < len(seq):
                torch.testing.assert_close(s_logits[0, p_new], want, atol=2e-4, rtol=2e-4)
                checked += 1
    assert checked >= 10


def _student_logits(tr, ids, lens, fill):
    """The trainer's type-0 draft logits [B, T, V_d] (PdmTrainer.student_logits, which loss() uses)."""
    anchors, _, _ = tr.teacher(ids, lens)
    B, T = ids.shape
    logits, _ = tr.student_logits(anchors, lens, fill, torch.arange(B * T))
    return logits.reshape(B, T, -1)


def test_feature_cache_gives_the_same_loss_as_the_live_teacher(tiny_checkpoint, tmp_path, monkeypatch):
    from spd_fast.train import features
    from spd_fast.train.features import build_feature_cache
    from spd_fast.train.trainer import collate_cached

    grad = []  # the teacher pass runs without autograd (the room check is called inside it)
    check = features._check_room
    monkeypatch.setattr(features, "_check_room", lambda *a: grad.append(torch.is_grad_enabled()) or check(*a))

    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 10)
    dcfg = DraftConfig.make(m.cfg, (0, 3, 6), (0, 2, 3), 1, 97)  # last anchor < L: h^L stored on its own
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m)
    tr = PdmTrainer(m, head, TrainConfig(fill_aug=0.0))
    cache = build_feature_cache(m, "tiny", data, tmp_path / "fc", dcfg.anchors, 64, progress=False)
    assert cache.layers == [2, 3, 6] and grad == [False]
    batch, cached = collate_cached([dict(s, _idx=i) for i, s in enumerate(data)], 64, cache)
    assert torch.equal(batch[0], collate(data, 64)[0])
    for fill in (None, 1):
        with torch.no_grad():
            live, s_live = tr.loss(*batch, fill=fill)
            fast, s_fast = tr.loss(*batch, fill=fill, cached=cached)
        torch.testing.assert_close(fast, live, atol=2e-3, rtol=2e-3)  # states stored in fp16
        assert s_fast["tokens"] == s_live["tokens"]
    # a finished cache is reused; other data gets another cache
    again = build_feature_cache(m, "tiny", data, tmp_path / "fc", dcfg.anchors, 64, progress=False)
    assert again.root == cache.root
    other = build_feature_cache(m, "tiny", data[:5], tmp_path / "fc", dcfg.anchors, 64, progress=False)
    assert other.root != cache.root
    st, am = other.get(4)
    st2, am2 = cache.get(4)
    torch.testing.assert_close(st, st2, atol=1e-3, rtol=1e-3)
    assert torch.equal(am, am2)
    # a progress file cut short by a killed build is not a traceback: that cache is built again, to the same states
    done = other.root / "done.npy"
    done.write_bytes(done.read_bytes()[:20])
    rebuilt = build_feature_cache(m, "tiny", data[:5], tmp_path / "fc", dcfg.anchors, 64, progress=False)
    assert rebuilt.root == other.root and torch.equal(rebuilt.get(4)[1], am)
    assert not list(other.root.glob("*.tmp"))
    # a build killed between creating states.npy and argmax.npy: the next one starts that cache again
    for f in ("argmax.npy", "done.npy", "meta.json"):
        (other.root / f).unlink()
    rebuilt = build_feature_cache(m, "tiny", data[:5], tmp_path / "fc", dcfg.anchors, 64, progress=False)
    assert torch.equal(rebuilt.get(4)[1], am) and torch.equal(rebuilt.get(4)[0], st)


def test_one_cache_per_source_reuses_the_old_sources(tiny_checkpoint, tmp_path):
    from spd_fast.train.features import build_feature_cache, build_feature_caches

    m = tiny_target(tiny_checkpoint("llama"))
    a = [dict(s, _source="a") for s in _samples(m, 6)]
    b = [dict(s, _source="b") for s in _samples(m, 4, seed=9)]
    anchors = (0, 3, 6)
    only_a = build_feature_cache(m, "tiny", a, tmp_path / "fc", anchors, 64, progress=False)
    stamp = (only_a.root / "states.npy").stat().st_mtime_ns
    both = build_feature_caches(m, "tiny", a + b, tmp_path / "fc", anchors, 64, progress=False)
    assert [p.root for p in both.parts][0] == only_a.root and len(both.parts) == 2
    assert (only_a.root / "states.npy").stat().st_mtime_ns == stamp  # reused, not rebuilt
    only_b = build_feature_cache(m, "tiny", b, tmp_path / "fc", anchors, 64, progress=False)
    for i in range(10):
        want = only_a.get(i) if i < 6 else only_b.get(i - 6)
        got = both.get(i)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_self_written_prompts_start_with_the_opener_and_end_their_turn(default_target):
    from spd_fast.train.data import chat_user_prefix, plausible_prompt, self_written_prompts

    prefix = chat_user_prefix(default_target)
    full = default_target.encode([{"role": "user", "content": "Hello there"}])
    assert full[: len(prefix)] == prefix and len(prefix) < len(full)
    assert default_target.tokenizer.decode(prefix).endswith("user\n")
    openers = ["", "Write a Python function", "A bakery sells", "Explain"] * 2
    got = self_written_prompts(default_target, openers, 48, torch.Generator().manual_seed(3))
    assert got, "no message ended within 48 tokens"
    rows = [i for i, _ in got]
    assert rows == sorted(set(rows)) and all(0 <= i < len(openers) for i in rows)
    for i, text in got:
        assert text.startswith(openers[i]) and text == text.strip()
        assert "<|im_end|>" not in text and "<|im_start|>" not in text
    again = self_written_prompts(default_target, openers, 48, torch.Generator().manual_seed(3))
    assert again == got  # seeded: the data script resumes reproducibly
    # a sampled message holding a special token (a made-up assistant turn; one such row reached the seed-45 data)
    # is dropped: decoded as text, the chat template would re-encode it as a real turn marker
    import spd_fast.train.data as data

    tok = default_target.tokenizer
    fake = tok.encode("Simplify this process\n<|im_start|>assistant\nFloating a cup", add_special_tokens=False)
    plain = tok.encode("Simplify this process for a beginner, please.", add_special_tokens=False)
    assert set(fake) & set(tok.all_special_ids)
    eos = default_target.eos_ids[0]
    real = data.generate_batch
    try:
        data.generate_batch = lambda model, starts, n, params, eos_ids, gen: [fake + [eos], plain + [eos]]
        assert self_written_prompts(default_target, ["", ""], 64) == [(1, tok.decode(plain).strip())]
    finally:
        data.generate_batch = real
    assert plausible_prompt("How do I sort a list?", 7)
    assert not plausible_prompt("Hi", 2)                       # too short
    assert not plausible_prompt("   ", 6)
    assert not plausible_prompt("Детикилах ильму Аллах кахф", 12)  # drifted out of English


def _run_dedupe(tmp_path, *args):
    import subprocess
    import sys
    script = Path(__file__).resolve().parents[1] / "scripts" / "dedupe_prompts.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=tmp_path)


def test_cut_answers_keeps_the_first_tokens_of_every_kth_answer(tmp_path):
    import gzip
    import subprocess
    import sys
    script = Path(__file__).resolve().parents[1] / "scripts" / "cut_answers.py"
    rows = [{"prompt": f"p{i}", "prompt_ids": [1, i], "response_ids": list(range(i, i + 5))} for i in range(10)]
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, str(script), "in.jsonl.gz", "out/cut.jsonl", "--max-response-tokens", "3",
                        "--every", "4", "--limit", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = [json.loads(x) for x in (tmp_path / "out" / "cut.jsonl").read_text().splitlines()]
    assert out == [dict(rows[0], response_ids=[0, 1, 2]), dict(rows[4], response_ids=[4, 5, 6])]
    # --complement: the rows --every 4 drops, so the two cuts together hold every row once
    r = subprocess.run([sys.executable, str(script), "in.jsonl.gz", "rest.jsonl", "--max-response-tokens", "2",
                        "--every", "4", "--complement"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rest = [json.loads(x) for x in (tmp_path / "rest.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in rest] == [f"p{i}" for i in (1, 2, 3, 5, 6, 7, 9)]
    assert rest[0]["response_ids"] == [1, 2]
    r = subprocess.run([sys.executable, str(script), "in.jsonl.gz", "none.jsonl", "--complement"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "--complement with --every 1 keeps nothing" in r.stderr
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    r = subprocess.run([sys.executable, str(script), "bad.jsonl", "o.jsonl"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2 and "bad.jsonl: sample 0 has no response_ids" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o.jsonl").exists()
    r = subprocess.run([sys.executable, str(script), "missing.jsonl", "o.jsonl"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2 and "missing.jsonl does not exist" in r.stderr


def test_dedupe_prompts_drops_excluded_and_repeated_prompts(tmp_path):
    import json
    rows = lambda *ps: "".join(json.dumps({"prompt": p, "response_ids": [i]}) + "\n" for i, p in enumerate(ps))
    (tmp_path / "old.jsonl").write_text(rows("a", "b"))
    (tmp_path / "new1.jsonl").write_text(rows("b", "c", "d", "c"))
    (tmp_path / "new2.jsonl").write_text(rows("d", "e", "a"))
    r = _run_dedupe(tmp_path, "new1.jsonl", "new2.jsonl", "--exclude", "old.jsonl", "--out", "out.jsonl")
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(o["prompt"], o["response_ids"]) for o in out] == [("c", [1]), ("d", [2]), ("e", [1])]
    assert json.loads(r.stdout) == {"read": 7, "kept": 3, "dropped": 4, "out": "out.jsonl"}
    # a repeated --exclude adds its files (it once kept only the last flag's, silently)
    (tmp_path / "old2.jsonl").write_text(rows("e"))
    r = _run_dedupe(tmp_path, "new1.jsonl", "new2.jsonl", "--exclude", "old.jsonl", "--exclude", "old2.jsonl",
                    "--out", "out2.jsonl")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["prompt"] for line in (tmp_path / "out2.jsonl").read_text().splitlines()] == ["c", "d"]


def test_dedupe_prompts_never_empties_its_own_output(tmp_path):
    """A glob exclude (data/*.jsonl.gz) that also matches --out: regenerating that file must not drop its own
    rows; --out given as an input is refused before it is truncated."""
    import json
    rows = lambda *ps: "".join(json.dumps({"prompt": p, "response_ids": [i]}) + "\n" for i, p in enumerate(ps))
    (tmp_path / "new.jsonl").write_text(rows("a", "b"))
    (tmp_path / "old.jsonl").write_text(rows("a"))
    (tmp_path / "out.jsonl").write_text(rows("b"))  # the earlier run's output
    r = _run_dedupe(tmp_path, "new.jsonl", "--exclude", "old.jsonl", "out.jsonl", "--out", "out.jsonl")
    assert r.returncode == 0 and "not excluding out.jsonl, the --out file itself" in r.stderr, r.stderr
    assert [json.loads(x)["prompt"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == ["b"]
    before = (tmp_path / "out.jsonl").read_text()
    r = _run_dedupe(tmp_path, "out.jsonl", "--out", "out.jsonl")
    assert r.returncode == 1 and "--out out.jsonl is also an input" in r.stderr
    assert (tmp_path / "out.jsonl").read_text() == before


def test_dedupe_prompts_reads_and_writes_gzip(tmp_path):
    import gzip
    import json
    rows = lambda *ps: "".join(json.dumps({"prompt": p, "response_ids": [i]}) + "\n" for i, p in enumerate(ps))
    with gzip.open(tmp_path / "old.jsonl.gz", "wt") as fh:
        fh.write(rows("a"))
    (tmp_path / "other.jsonl").write_text(rows("z"))
    with gzip.open(tmp_path / "new.jsonl.gz", "wt") as fh:
        fh.write(rows("a", "b", "z", "c"))
    r = _run_dedupe(tmp_path, "new.jsonl.gz", "--exclude", "old.jsonl.gz", "other.jsonl", "--out", "out.jsonl.gz")
    assert r.returncode == 0, r.stderr
    with gzip.open(tmp_path / "out.jsonl.gz", "rt") as fh:
        assert [json.loads(line)["prompt"] for line in fh] == ["b", "c"]
    assert json.loads(r.stdout)["kept"] == 2


def test_dedupe_prompts_names_a_file_without_prompts(tmp_path):
    (tmp_path / "ok.jsonl").write_text('{"prompt": "a", "response_ids": [1]}\n{"prompt": "c", "response_ids": [1]}\n')
    (tmp_path / "ids.jsonl").write_text('{"prompt": "b", "response_ids": [2]}\n{"prompt_ids": [1, 2], "response_ids": [3]}\n')
    r = _run_dedupe(tmp_path, "ok.jsonl", "ids.jsonl", "--out", "out.jsonl")
    assert r.returncode != 0
    assert "ids.jsonl: row 2 has no 'prompt' field" in r.stderr


def test_magpie_resume_cuts_an_interrupted_round(tmp_path, capsys):
    """scripts/self_distill_magpie.py: a partial last line (a killed run) drops that round so it is redone."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "magpie", Path(__file__).resolve().parents[1] / "scripts" / "self_distill_magpie.py")
    magpie = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(magpie)
    f = tmp_path / "sd.jsonl"
    assert magpie.finished_rounds(f) == set()
    rows = [{"id": f"magpie-5-{r}-{i}", "round": r} for r in range(3) for i in range(2)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert magpie.finished_rounds(f) == {0, 1, 2}
    f.write_text(f.read_text() + '{"id": "magpie-5-3-0", "rou')
    assert magpie.finished_rounds(f) == {0, 1}
    assert "cut an interrupted write (round 2)" in capsys.readouterr().out
    assert [json.loads(line)["round"] for line in f.read_text().splitlines()] == [0, 0, 1, 1]
    # a .gz --out got plain text under that name, which the next step (dedupe) could not read: refused up front
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "self_distill_magpie.py"),
                        "--out", str(tmp_path / "m.jsonl.gz")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "this script writes plain jsonl" in r.stderr and not (tmp_path / "m.jsonl.gz").exists()


def test_magpie_mixes_reproduce_the_committed_files_and_weight_human_chat():
    """Each --mix draws what its committed file was generated with: every round's kept rows are, in
    order, a subsequence of that round's (category, opener) draws (rows whose prompt failed the filter
    are missing; a wrong mix or seed breaks this). --mix human gives chat about half the rows, opened
    only with its own conversational openers."""
    import importlib.util
    import random
    from collections import Counter
    from itertools import groupby

    from spd_fast.train.data import read_jsonl

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("magpie", root / "scripts" / "self_distill_magpie.py")
    magpie = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(magpie)

    def drawn(rows, seed, mix, batch):
        for rnd, kept in groupby(rows, key=lambda r: r["round"]):
            draws = iter(zip(*magpie.draw_openers(magpie.MIXES[mix], random.Random(seed * 100_003 + rnd), batch)))
            if not all(any(c == r["category"] and r["prompt"].startswith(o) for c, o in draws) for r in kept):
                return False
        return True

    s9 = read_jsonl(root / "data" / "self_distill" / "magpie_s9_greedy_256.jsonl.gz")
    s30 = read_jsonl(root / "data" / "self_distill" / "human_s30_greedy_bf16_256.jsonl.gz")
    assert drawn(s9, 9, "default", 96) and drawn(s30, 30, "human", 192)
    assert not drawn(s9, 9, "human", 96) and not drawn(s30, 31, "human", 192)
    cats, openers = magpie.draw_openers(magpie.MIXES["human"], random.Random(0), 4000)
    share = Counter(cats)
    assert 0.47 < share["chat"] / 4000 < 0.53 and 0.22 < share["code"] / 4000 < 0.28
    assert {o for c, o in zip(cats, openers) if c == "chat"} == set(magpie.HUMAN_CHAT)


def test_bf16_warning_on_cpus_without_native_bf16():
    from spd_fast.train.__main__ import bf16_cpu_warning

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert "no AVX512-BF16, AMX or Arm bf16" in bf16_cpu_warning(avx2) and "drop --bf16" in bf16_cpu_warning(avx2)
    assert bf16_cpu_warning("flags\t\t: avx2 avx512f avx512_bf16\n") is None
    assert bf16_cpu_warning("flags\t\t: avx2 amx_tile amx_bf16\n") is None
    assert bf16_cpu_warning("Features\t: fp asimd sve bf16 i8mm\n") is None
    assert bf16_cpu_warning("model name\t: something without a flags line\n") is None  # cannot tell: no warning


def test_warm_start_carries_a_head_to_another_stage_split(tiny_checkpoint, tmp_path):
    """An n=3 head (anchors 0,2,4,6) seeds an n=2 head with the same anchors; it then refuses n=3."""
    from spd_fast.drafters import PdmDrafter
    from spd_fast.engine import SPDEngine
    from spd_fast.sampling import SamplingParams

    m, data, zero = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    with pytest.raises(SpdConfigError, match=r"anchors: \[0, 2, 4, 6\] vs \[0, 3, 6\].*add --anchors 0,2,4,6"):
        train(FakeTarget(m), data, tmp_path / "x", num_stages=2, draft_vocab_size=50, cfg=zero,
              log=lambda s: None, feature_cache=False, init=tmp_path / "a" / "head")
    logs: list[str] = []
    two = train(FakeTarget(m), data, tmp_path / "b", num_stages=2, anchors=(0, 2, 4, 6), draft_vocab_size=50,
                cfg=TrainConfig(steps=2, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1,
                                lr=1e-3),
                log=logs.append, feature_cache=False, init=tmp_path / "a" / "head", val_samples=data[:4])
    assert two.dcfg.boundaries == (0, 3, 6) and two.dcfg.anchors == (0, 2, 4, 6)
    assert two.dcfg.depth_types() == [0, 1, 3]  # a depth-1 token (3 layers done) reads anchors 0 and 2
    saved = load_draft(tmp_path / "a" / "head", m, "tiny", num_stages=3)
    assert torch.equal(two.draft_vocab, saved.draft_vocab)
    moved = [k for k, v in saved.state_dict().items() if not torch.equal(v, two.state_dict()[k].to(v.dtype))]
    assert moved  # it started from the n=3 weights (step-0 score logged) and fine-tuning moved them
    assert json.loads(next(x for x in logs if x.startswith("{") and "val_top1" in x))["step"] == 0
    loaded = load_draft(tmp_path / "b" / "head", m, "tiny", num_stages=2)
    with pytest.raises(DraftMismatchError):
        load_draft(tmp_path / "b" / "head", m, "tiny", num_stages=3)
    # and it drafts in a 2-stage pipeline that stays exact
    prompt = data[0]["prompt_ids"]
    ref = data[0]["response_ids"][:16]
    m.setup_caches(1, 128)
    out = SPDEngine(m, PdmDrafter(loaded), loaded.dcfg.boundaries, loaded.dcfg.anchors).run(
        prompt, 16, SamplingParams(), []).token_ids
    assert out == ref


def test_time_budget_cuts_the_schedule_to_what_fits(monkeypatch):
    """After `start` warm-up steps and `measure` timed ones, the total (and so the LR decay) is set to
    what fits in the budget minus the reserve; it is set once and never raised."""
    from spd_fast.train import trainer as tr

    clock = [0.0]
    monkeypatch.setattr(tr.time, "perf_counter", lambda: clock[0])

    class T:
        step, total_steps, world, train_seconds = 0, 10_000, 1, 0.0

    t = T()
    b = tr.TimeBudget(100.0, t, start=2, measure=4, reserve=0.1)
    got = []
    for _ in range(8):
        clock[0] += 5.0 if t.step < 2 else 1.0  # slow warm-up steps, then 1 s per step
        t.step += 1
        got.append(b.after_step())
    # at step 6: 14 s used, 90 - 14 = 76 s left at 1 s per step -> 6 + 76 = 82
    assert got == [None] * 5 + [82, None, None] and t.total_steps == 82
    t2 = T()
    t2.total_steps = 20
    b2 = tr.TimeBudget(1e6, t2, start=0, measure=1)
    clock[0] += 1.0
    t2.step += 1
    assert b2.after_step() == 20  # a generous budget keeps the planned steps
    t3 = T()
    t3.train_seconds = 40.0  # a resumed run had spent 40 s before it stopped: 90 - 40 - 14 = 36 s left -> 6 + 36
    b3 = tr.TimeBudget(100.0, t3, start=2, measure=4, reserve=0.1)
    for _ in range(6):
        clock[0] += 5.0 if t3.step < 2 else 1.0
        t3.step += 1
        b3.after_step()
    assert t3.total_steps == 42


def test_training_cli_names_a_bad_device_and_time_budget(tmp_path, capsys):
    from spd_fast.train.__main__ import main

    assert main(["--out", str(tmp_path / "a"), "--device", "tpu"]) == 2
    assert "device 'tpu' is not a valid device; use 'cpu', 'cuda' or 'cuda:<index>'" in capsys.readouterr().err
    for opt, bad, msg in [("--time-budget", "-5", "expected a finite number >= 0, got '-5'"),
                          ("--time-budget", "nan", "expected a finite number >= 0, got 'nan'"),
                          ("--lr", "inf", "expected a finite number >= 0, got 'inf'"),
                          ("--fill-aug", "nan", "expected a number from 0 to 1, got 'nan'"),
                          ("--fill-aug", "5", "expected a number from 0 to 1, got '5'"),
                          ("--argmax-weight", "-3", "expected a finite number >= 0, got '-3'"),
                          ("--weight-decay", "-1", "expected a finite number >= 0, got '-1'"),
                          ("--threads", "-1", "expected a thread count from 0 to 4096, got -1")]:
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path / "b"), opt, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {opt}: {msg}" in err and len(err.strip().splitlines()) == 1, err
    if not torch.cuda.is_available():
        assert main(["--out", str(tmp_path / "c"), "--device", "cuda"]) == 2
        assert "needs CUDA but this torch build has no GPU" in capsys.readouterr().err


def test_time_budget_shortens_the_lr_schedule_of_a_real_run(tiny_checkpoint, tmp_path):
    """A tiny run with a budget far below its planned steps stops early, with the LR at zero at its last step."""
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=100_000, batch_tokens=256, max_seq_len=64, save_every=10_000, log_every=5, warmup=1,
                      time_budget=3.0)
    logs = []
    train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg, log=logs.append)
    set_to = [json.loads(x)["steps"] for x in logs if '"time_budget_s"' in x]
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert len(set_to) == 1 and 20 <= set_to[0] < 100_000 and state["step"] == set_to[0]
    total = set_to[0]  # once fitted, the logged LR follows the linear decay to 0 at that step, not at 100,000
    after = logs[next(i for i, x in enumerate(logs) if '"time_budget_s"' in x):]
    lrs = [(d["step"], d["lr"]) for d in map(json.loads, (x for x in after if x.startswith("{"))) if "lr" in d]
    # on a loaded machine the budget may be spent by the 20 measured steps: then step 20 is the last, logged once.
    # Each line logs the lr its step used: the last step's is one decrement above 0 (lr_at(total) == 0 is never used)
    assert lrs and lrs[-1][0] == total and lrs[-1][1] == pytest.approx(cfg.lr / (total - 1), rel=1e-6), lrs
    for step, lr in lrs:
        assert lr == pytest.approx(cfg.lr * max(0.0, 1 - (step - 2) / (total - 1)), rel=1e-6, abs=1e-12), (step, lr)


def test_torchrun_data_parallel_equals_the_mean_loss_step(tiny_checkpoint, tmp_path):
    """`torchrun --nproc-per-node 2 -m spd_fast.train` (gloo on CPU): each rank takes every other batch and the
    gradients are averaged, so after 3 steps the weights equal a single process that steps on the mean loss
    of the same batch pairs (crossing an epoch). Stepping on rank 0's batches alone ends elsewhere."""
    import os
    import subprocess
    import sys

    from spd_fast.config import uniform_boundaries
    from test_distributed import free_port
    from spd_fast.runtime import load_target
    from spd_fast.train.data import text_file_samples
    from spd_fast.train.trainer import build_draft_vocab, pack_batches
    from spd_fast.pdm import set_draft_vocab

    ckpt = tiny_checkpoint("llama")
    tg = load_target(ckpt, progress=False)
    data = tmp_path / "d.jsonl"
    samples = _samples(tg.model, 8)
    data.write_text("".join(json.dumps(s) + "\n" for s in samples))
    steps, bt, L = 3, 64, 32
    args = ["--model", ckpt, "--out", str(tmp_path / "ddp"), "--data", str(data), "--num-stages", "3",
            "--draft-vocab", "50", "--steps", str(steps), "--warmup", "1", "--lr", "1e-3", "--batch-tokens", str(bt),
            "--max-seq-len", str(L), "--fill-aug", "0", "--save-every", "100", "--no-feature-cache", "--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
                        "spd_fast.train", *args], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(tmp_path / "ddp" / "trainer_state.pt", weights_only=False)
    assert got["step"] == steps
    cfg = json.loads((tmp_path / "ddp" / "train_config.json").read_text())
    assert cfg["ranks"] == 2

    def reference(both: bool) -> dict:
        m = tg.model
        torch.manual_seed(0)
        dcfg = DraftConfig.make(m.cfg, uniform_boundaries(m.cfg.num_layers, 3), None, 1, 50, tg.fingerprint)
        head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m, 0)
        rows = list(text_file_samples(data, tg))
        set_draft_vocab(head, build_draft_vocab(rows, 50, m.cfg.vocab_size, tg.eos_ids), m)
        tr = PdmTrainer(m, head, TrainConfig(steps=steps, lr=1e-3, warmup=1, batch_tokens=bt, max_seq_len=L,
                                            fill_aug=0.0))
        per_epoch = len(pack_batches(rows, bt, L, 0, 0)) // 2
        for step in range(steps):
            epoch, j = divmod(step, per_epoch)
            bs = pack_batches(rows, bt, L, 0, epoch)
            pair = [bs[2 * j], bs[2 * j + 1]] if both else [bs[2 * j]]
            for gp in tr.opt.param_groups:
                gp["lr"] = tr.lr_at(step)
            tr.opt.zero_grad(set_to_none=True)
            for b in pair:
                loss, _ = tr.loss(*collate(b, L), fill=None)
                (loss / len(pair)).backward()
            torch.nn.utils.clip_grad_norm_(tr.params, 1.0)
            tr.opt.step()
        return head.state_dict()

    ref, alone = reference(True), reference(False)
    for k, v in ref.items():
        torch.testing.assert_close(got["head"][k], v, atol=2e-5, rtol=1e-4, msg=k)
    assert any(not torch.allclose(got["head"][k], v, atol=1e-4) for k, v in alone.items() if v.is_floating_point())

    # with the teacher cache, which rank 0 builds alone while the others wait: scaled down, a default group whose
    # timeout is 3 s and a build that takes 8 s. The others wait in their own long-timeout group (they used to
    # fail in the default group's barrier, as an hour-long wait would on a 2-hour CPU cache build)
    wrapper = tmp_path / "slow_lead.py"
    wrapper.write_text(
        "import sys, time\n"
        "import torch.distributed as dist\n"
        "import spd_fast.distributed.launch as L\n"
        "import spd_fast.train.features as F\n"
        "init, build = L.init_rank, F.build_feature_caches\n"
        "L.init_rank = lambda device, startup_timeout=60.0, **k: init(device, timeout=3.0, startup_timeout=3.0)\n"
        "def slow(*a, **k):\n"
        "    if dist.get_rank() == 0:\n"
        "        time.sleep(8)\n"
        "    return build(*a, **k)\n"
        "F.build_feature_caches = slow\n"
        "from spd_fast.train.__main__ import main\n"
        "sys.exit(main())\n")
    cached = [a for a in args if a != "--no-feature-cache"]
    cached[cached.index("--out") + 1] = str(tmp_path / "ddp_cached")
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(wrapper),
                        *cached], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got_cached = torch.load(tmp_path / "ddp_cached" / "trainer_state.pt", weights_only=False)
    assert got_cached["step"] == steps
    for k, v in ref.items():  # the cached teacher's fp16 states: close to the live teacher's run
        torch.testing.assert_close(got_cached["head"][k], v, atol=2e-3, rtol=2e-3, msg=k)


def test_heap_policy_is_accepted_by_glibc_and_trims_during_training(tiny_checkpoint, tmp_path, monkeypatch):
    """glibc takes both thresholds, trim() gives freed heap memory back, and a CPU run trims every TRIM_EVERY
    steps and after the teacher cache's flushes."""
    import ctypes.util
    import os
    import sys

    from spd_fast.train import heap

    if sys.platform.startswith("linux") and ctypes.util.find_library("c"):
        assert heap.tune()

        def rss_mb() -> float:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        base = rss_mb()
        keep = []
        for i in range(40):  # mixed sizes (1-120 MB), every other block kept a while: a fragmented heap
            t = torch.ones((1 + 3 * i) * 2**18)
            if i % 2:
                keep.append(t)
            if len(keep) > 3:
                keep.pop(0)
        keep.clear()
        del t
        heap.trim()
        assert rss_mb() < base + 64
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=2 * heap.TRIM_EVERY + 3, batch_tokens=128, max_seq_len=64, save_every=10_000,
                      log_every=5, warmup=1)
    train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg, log=lambda _: None)
    assert len(calls) == 1 + 2  # one after the cache's last flush, two in 23 steps


def test_extend_draft_vocab_keeps_the_old_drafts_and_names_bad_input(tiny_checkpoint, tmp_path):
    import shutil
    import subprocess
    import sys
    m, _, _ = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    script = Path(__file__).resolve().parents[1] / "scripts" / "extend_draft_vocab.py"

    def run(*args):
        return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True)

    r = run(tmp_path / "a" / "head", tmp_path / "big", "--size", 80)
    assert r.returncode == 0, r.stderr
    small, big = load_draft(tmp_path / "a" / "head", m, "tiny"), load_draft(tmp_path / "big", m, "tiny")
    assert big.dcfg.draft_vocab_size == 80 and big.draft_vocab.unique().numel() == 80
    assert set(small.draft_vocab.tolist()) <= set(big.draft_vocab.tolist())
    # the tower is untouched: every old id scores as before; the new ids get the target's own LM-head rows
    h = torch.randn(4, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    slot = {t: i for i, t in enumerate(big.draft_vocab.tolist())}
    old_slots = torch.tensor([slot[t] for t in small.draft_vocab.tolist()])
    torch.testing.assert_close(big.draft_logits(h)[:, old_slots], small.draft_logits(h))
    assert run(tmp_path / "a" / "head", tmp_path / "c", "--size", 10).stderr.strip().endswith(
        "--size 10 must lie between the head's 50 and the base vocabulary's " + str(m.cfg.vocab_size))
    shutil.copytree(tmp_path / "a" / "head", tmp_path / "trained")
    cfg = json.loads((tmp_path / "trained" / "draft_config.json").read_text())
    (tmp_path / "trained" / "draft_config.json").write_text(json.dumps(dict(cfg, frozen_lm_head=False)))
    assert "extend only heads with a frozen LM head" in run(tmp_path / "trained", tmp_path / "d").stderr


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_validate_at_a_fill_scores_that_depth_pattern_and_names_bad_fills(tiny_checkpoint, tmp_path):
    m, data, _ = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    tr = PdmTrainer(m, load_draft(tmp_path / "a" / "head", m, "tiny").float(), TrainConfig(max_seq_len=64))
    b = collate(data, 64)
    with torch.no_grad():
        by_fill = {f: tr.loss(*b, fill=f)[1] for f in (None, 1, 2)}
    for f, want in by_fill.items():
        got = tr.validate(data, batch_size=len(data), fill=f)
        assert got["val_top1"] == pytest.approx(want["top1"], abs=1e-9), f
        assert got["val_loss"] == pytest.approx(want["loss"], rel=1e-6), f
    # the fills see different keys, so the head's distributions (and KL) differ between them
    assert len({round(st["loss"], 6) for st in by_fill.values()}) == 3
    for bad in (0, 3):
        with pytest.raises(ValueError, match=rf"fill {bad} is out of range for an n=3 head: pass 1..2, or None"):
            tr.validate(data, fill=bad)


def test_probe_head_limits_prints_and_writes_each_file_and_fill(tiny_checkpoint, tmp_path, capsys):
    from spd_fast.runtime import weights_fingerprint

    ckpt = tiny_checkpoint("llama")
    m, data, _ = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    head = tmp_path / "a" / "head"
    cfg = json.loads((head / "draft_config.json").read_text())
    (head / "draft_config.json").write_text(json.dumps(dict(cfg, base_fingerprint=weights_fingerprint(m))))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(s) + "\n" for s in data[:5]))
    probe = _script("probe_head_limits")
    rc = probe.main([str(head), "--model", ckpt, "--val", str(val), "--fills", "full,1", "--limit", "4",
                     "--max-seq-len", "64", "--out", str(tmp_path / "l.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "| file | fill | top-1 | top-1, answer tokens 0-63 | rows |" in out
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert [(r["fill"], r["samples"]) for r in rows] == [("full", 4), (1, 4)]
    tr = PdmTrainer(m, load_draft(head, m, weights_fingerprint(m)).float(), TrainConfig(max_seq_len=64))
    assert rows[1]["top1"] == pytest.approx(tr.validate(data[:4], fill=1)["val_top1"], abs=1e-9)
    assert f"| val.jsonl | 1 | {rows[1]['top1']:.4f} |" in out
    # errors name the problem and the fix
    with pytest.raises(SystemExit):
        probe.main([str(head), "--model", ckpt])
    assert "the following arguments are required: --val" in capsys.readouterr().err
    assert probe.main([str(head), "--model", ckpt, "--val", str(val), "--fills", "3"]) == 2
    assert "--fills 3 is out of range for this n=3 head: use full or 1..2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main([str(head), "--val", str(val), "--fills", "full,x"])
    assert "expected 'full' or a fill count per comma-separated item, got 'x'" in capsys.readouterr().err


def test_average_heads_interpolates_the_weights_and_refuses_heads_of_another_shape(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    m, _, _ = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    a = tmp_path / "a" / "head"
    shutil.copytree(a, tmp_path / "b")
    sa = load_file(str(a / "draft.safetensors"))
    sb = {k: (v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(v.dtype)
              if v.is_floating_point() else v) for k, v in sa.items()}
    save_file(sb, str(tmp_path / "b" / "draft.safetensors"))
    avg = _script("average_heads")

    def run(w, out):
        assert avg.main([str(a), str(tmp_path / "b"), str(tmp_path / out), "--weight", str(w)]) == 0
        return load_file(str(tmp_path / out / "draft.safetensors"))

    s0, s1, s_half = run(0, "w0"), run(1, "w1"), run(0.5, "w5")
    for k, v in sa.items():
        assert torch.equal(s0[k], v) and torch.equal(s1[k], sb[k]), k
        if v.is_floating_point():
            assert torch.equal(s_half[k], ((v.float() + sb[k].float()) / 2).to(v.dtype)), k
    assert not all(torch.equal(s_half[k], sa[k]) for k in sa)
    loaded = load_draft(tmp_path / "w5", m, "tiny")  # a loadable head with A's config
    assert loaded.dcfg == load_draft(a, m, "tiny").dcfg
    # errors name the problem and the fix
    with pytest.raises(SystemExit, match=r"--weight 1.5 must lie in \[0, 1\]"):
        avg.main([str(a), str(tmp_path / "b"), str(tmp_path / "x"), "--weight", "1.5"])
    cfg = json.loads((tmp_path / "b" / "draft_config.json").read_text())
    (tmp_path / "b" / "draft_config.json").write_text(json.dumps(dict(cfg, num_layers=cfg["num_layers"] + 1)))
    with pytest.raises(SystemExit, match=r"the heads differ in num_layers .* only heads of the same shape"):
        avg.main([str(a), str(tmp_path / "b"), str(tmp_path / "x")])
    (tmp_path / "b" / "draft_config.json").write_text(json.dumps(cfg))
    vocab = sb["draft_vocab"].clone()
    vocab[[0, 1]] = vocab[[1, 0]]
    save_file(dict(sb, draft_vocab=vocab), str(tmp_path / "b" / "draft.safetensors"))
    with pytest.raises(SystemExit, match=r"tensor draft_vocab .* differs between the heads"):
        avg.main([str(a), str(tmp_path / "b"), str(tmp_path / "x")])


@pytest.mark.parametrize("chunk", [1024, 7])
def test_rows_after_miss_keep_the_refill_rows_of_a_brute_force_and_train(tiny_checkpoint, tmp_path, monkeypatch,
                                                                         chunk):
    """Fill-f rows after a miss: row t is kept iff it is a loss row, the head's full-fill draft of token
    t - f + 1 (row t - f, itself a loss row) missed the target's token, and for f = 2 the fill-1 draft made
    since (row t - 1) was right; checked row by row, sample by sample, also with the head's drafts made
    LOSS_CHUNK rows at a time (7: several chunks)."""
    import spd_fast.train.trainer as trmod

    monkeypatch.setattr(trmod, "LOSS_CHUNK", chunk)
    m, data, _ = _saved_n3_head(tiny_checkpoint, tmp_path / "a")
    head = load_draft(tmp_path / "a" / "head", m, "tiny").float()
    tr = PdmTrainer(m, head, TrainConfig(max_seq_len=64))
    ids, lens, loss_mask = collate(data[:6], 64)
    T = ids.shape[1]
    with torch.no_grad():
        anchors, _, t_arg = tr.teacher(ids, lens)
        sel = (loss_mask & torch.isin(t_arg, head.draft_vocab)).reshape(-1).nonzero().squeeze(1)
        full, _ = tr.student_logits(anchors, lens, None, sel)
        one, _ = tr.student_logits(anchors, lens, 1, sel)
    drafted = dict(zip(sel.tolist(), head.draft_vocab[full.argmax(-1)].tolist()))
    drafted1 = dict(zip(sel.tolist(), head.draft_vocab[one.argmax(-1)].tolist()))
    flat = t_arg.reshape(-1).tolist()
    missed = {r for r in sel.tolist() if r % T >= 1 and r - 1 in drafted and drafted[r - 1] != flat[r - 1]}
    want1 = sorted(missed)
    want2 = [r for r in sel.tolist() if r % T >= 2 and r - 1 in missed and drafted1[r - 1] == flat[r - 1]]
    # fill 2 without the fill-1 condition would keep more rows: the check can tell the two rules apart
    loose2 = [r for r in sel.tolist() if r % T >= 2 and r - 2 in drafted and drafted[r - 2] != flat[r - 2]]
    assert len(want2) < len(loose2)
    for fill, want in ((1, want1), (2, want2)):
        got = tr.rows_after_miss(anchors, lens, sel, fill, t_arg).tolist()
        assert got == want and 0 < len(want) < sel.numel(), fill
    # the loss then counts only those rows at a fill, every row at full fill
    cfg = TrainConfig(max_seq_len=64, fill_after_miss=True)
    tr2 = PdmTrainer(m, head, cfg)
    with torch.no_grad():
        n_full = tr2.loss(ids, lens, loss_mask, fill=None)[1]["tokens"]
        n_one = tr2.loss(ids, lens, loss_mask, fill=1)[1]["tokens"]
    assert n_full == sel.numel() and n_one == len(tr.rows_after_miss(anchors, lens, sel, 1, t_arg))


def test_model_identity_sees_every_layer_and_the_config(tiny_checkpoint, tmp_path):
    """The teacher cache and self-distilled answers are keyed on `model_identity`: a change to a middle layer,
    which the sampled fingerprint of draft heads misses, or to config.json alone gives another identity (and so
    another cache); loading the same checkpoint again gives the same one."""
    import shutil

    from spd_fast.runtime import model_identity, weights_fingerprint
    from spd_fast.train.features import build_feature_cache

    path = tiny_checkpoint("llama")
    m = tiny_target(path)
    ident, fp = model_identity(m), weights_fingerprint(m)
    assert model_identity(tiny_target(path)) == ident
    data = _samples(m, 4)
    first = build_feature_cache(m, model_identity(m), data, tmp_path / "fc", (0, 2, 4), 64, progress=False)
    with torch.no_grad():
        m.layers[1].mlp.w_down.weight.mul_(3)
    assert weights_fingerprint(m) == fp and model_identity(m) != ident
    second = build_feature_cache(m, model_identity(m), data, tmp_path / "fc", (0, 2, 4), 64, progress=False)
    assert second.root != first.root and not torch.equal(second.get(0)[0], first.get(0)[0])
    other = tmp_path / "rope"
    shutil.copytree(path, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] *= 2  # transformers 5 writes the RoPE base here
    (other / "config.json").write_text(json.dumps(cfg))
    assert model_identity(tiny_target(str(other))) not in (ident, model_identity(m))


def test_train_keys_its_teacher_cache_on_the_model_identity(tiny_checkpoint, tmp_path, monkeypatch):
    """train() hands build_feature_caches the full model identity, not the sampled fingerprint of heads."""
    from spd_fast.runtime import model_identity
    from spd_fast.train import features

    m = tiny_target(tiny_checkpoint("llama"))
    seen = []
    real = features.build_feature_caches
    monkeypatch.setattr(features, "build_feature_caches", lambda model, key, *a, **k: seen.append(key) or
                        real(model, key, *a, **k))
    cfg = TrainConfig(steps=1, batch_tokens=128, max_seq_len=64, save_every=100, warmup=1)
    train(FakeTarget(m), _samples(m, 4), tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg,
          log=lambda _: None, feature_cache=True)
    assert seen == [model_identity(m)]


def test_feature_cache_key_tells_the_targets_dtype_apart():
    """The same checkpoint in fp32 and bf16 has one fingerprint but other teacher states: separate caches."""
    from spd_fast.train.features import cache_key

    rows = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]}]
    k32 = cache_key("fp", [10, 30], 64, rows, False)
    assert cache_key("fp", [10, 30], 64, rows, False, torch.float32) == k32
    assert len({k32, cache_key("fp", [10, 30], 64, rows, False, torch.bfloat16),
                cache_key("fp", [10, 30], 64, rows, True), cache_key("fp", [10, 30], 64, rows[:0], False)}) == 4


def test_lr_schedule_warms_up_then_decays_to_zero_even_when_the_run_is_short(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    head = init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 3, 6), None, 1, 50), m.cfg, m.norm), m)
    long = PdmTrainer(m, head, TrainConfig(steps=100, lr=1.0, warmup=10))
    assert [round(long.lr_at(s), 3) for s in (0, 9, 10, 55)] == [0.1, 1.0, 1.0, 0.5] and long.lr_at(100) == 0.0
    short = PdmTrainer(m, head, TrainConfig(steps=8, lr=1.0, warmup=50))  # warm-up longer than the run
    lrs = [short.lr_at(s) for s in range(8)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0 and lrs[-1] == 0.25 and short.lr_at(8) == 0.0


def test_dedupe_prompts_survives_a_killed_writer_and_matches_prompt_ids(tmp_path):
    """A magpie file cut mid-line by a killed run raised a raw JSONDecodeError (and the lease's data were lost with
    it); blank lines did too; exclude rows with prompt_ids but no "prompt" excluded nothing; a missing exclude file
    was a traceback; a failed run left a partial --out."""
    import json
    row = lambda p, ids: json.dumps({"prompt": p, "prompt_ids": ids, "response_ids": [9]})
    (tmp_path / "cut.jsonl").write_text(row("a", [1]) + "\n\n" + row("b", [2]) + "\n" + row("c", [3])[:20])
    (tmp_path / "ids_only.jsonl").write_text(json.dumps({"prompt_ids": [2], "response_ids": [5]}) + "\n")
    r = _run_dedupe(tmp_path, "cut.jsonl", "--exclude", "ids_only.jsonl", "--out", "out.jsonl")
    assert r.returncode == 0, r.stderr
    assert "cut.jsonl: dropped row 4, cut short (no newline at its end)" in r.stderr
    assert [json.loads(x)["prompt"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == ["a"]
    assert json.loads(r.stdout)["read"] == 2
    (tmp_path / "bad_mid.jsonl").write_text(row("a", [1]) + "\n{oops\n" + row("b", [2]) + "\n")
    (tmp_path / "nothing.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    (tmp_path / "fake.jsonl.gz").write_text(row("a", [1]) + "\n")
    for args, msg in [(["cut.jsonl", "--exclude", "missing.jsonl"], "missing.jsonl does not exist"),
                      (["bad_mid.jsonl"], "bad_mid.jsonl: row 2 is not JSON; fix or remove it"),
                      (["cut.jsonl", "--exclude", "nothing.jsonl"], "row 1 has neither 'prompt' nor 'prompt_ids'"),
                      (["fake.jsonl.gz"], "cannot read fake.jsonl.gz")]:
        r = _run_dedupe(tmp_path, *args, "--out", "out2.jsonl")
        assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "out2.jsonl").exists() and not (tmp_path / "out2.jsonl.tmp").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_target_trains_from_the_feature_cache(tiny_checkpoint, tmp_path, dtype):
    """`--dtype bfloat16` (or float16) with the default feature cache died on the first step: the cached h^L went
    through the target's final norm as fp32 and met the target's half-precision LM-head rows in F.linear. The
    cached loss now follows the live teacher's."""
    from spd_fast.train.features import build_feature_cache
    from spd_fast.train.trainer import collate_cached

    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 6)
    m = m.to(dtype)
    dcfg = DraftConfig.make(m.cfg, (0, 3, 6), (0, 2, 3), 1, 97)
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m).float()
    tr = PdmTrainer(m, head, TrainConfig(fill_aug=0.0))
    cache = build_feature_cache(m, "tiny", data, tmp_path / "fc", dcfg.anchors, 64, progress=False)
    batch, cached = collate_cached([dict(s, _idx=i) for i, s in enumerate(data)], 64, cache)
    with torch.no_grad():
        live, _ = tr.loss(*batch, fill=None)
        fast, _ = tr.loss(*batch, fill=None, cached=cached)
    assert torch.isfinite(fast)
    torch.testing.assert_close(fast, live, atol=3e-2, rtol=3e-2)  # h^L stored in fp16, half-precision teacher
    logs = []
    train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, log=logs.append,
          cfg=TrainConfig(steps=2, batch_tokens=256, max_seq_len=64, warmup=1), feature_cache=True)
    steps = [json.loads(x) for x in logs if x.startswith("{") and '"loss"' in x]
    assert [d["step"] for d in steps] == [1, 2] and all(math.isfinite(d["loss"]) for d in steps), logs
    assert (tmp_path / "run" / "head" / "draft_config.json").is_file()


def test_shared_types_sit_at_their_smallest_depth():
    """Spec 5.3 places each type at its smallest depth; brute_force_mask shares min_depth_of_type, so the rule is
    pinned here on its own (taking the largest depth passed every mask test)."""
    from spd_fast.train.mask import min_depth_of_type

    assert min_depth_of_type([0, 0, 1, 2, 3]) == [0, 2, 3, 4]       # shipped n=4 heads: anchors 0,10,20,30
    assert min_depth_of_type([0, 1, 1, 2]) == [0, 1, 3]
    # a type-0 query (depth 0) at t=1 with full fill n=4 sees key t=0 at depth 1 -> type 0 (depth_type[1] = 0)
    m = structured_mask(2, [0, 0, 1, 2, 3]).view(4, 2, 4, 2)
    assert m[0, 1, 0, 0] and not m[0, 1, 1, 0]
    # a type-1 query (d_1 = 2) at t=1 sees key t=0 at depth 3 -> type 2
    assert m[1, 1, 2, 0] and not m[1, 1, 3, 0]

"""Draft-temperature calibration: the teacher-forced acceptance estimate and the CLI that stores it."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import tiny_target
from spd_fast.config import SpdConfigError
from spd_fast.pdm import DraftConfig, DraftHead, DraftMismatchError, init_from_target, load_draft
from spd_fast.train.calibrate import calibrate, main
from spd_fast.train.trainer import PdmTrainer, TrainConfig
from test_train import FakeTarget, _samples


def _head(m, fingerprint="tiny"):
    head = init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 2, 4, 6), None, 1, 97, fingerprint), m.cfg,
                                      m.norm), m, 1)
    with torch.no_grad():  # a head that is neither the target nor uniform
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return head.eval().requires_grad_(False)


def test_estimate_matches_per_sample_brute_force_and_scales_the_draft_temperature(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 5)
    head = _head(m)
    temps, scales = (0.7, 1.0), (0.25, 0.5, 1.0, 2.0)
    res = calibrate(FakeTarget(m), head, data, temps, scales, batch_size=3, max_seq_len=64)  # padded batches
    # brute force: one unpadded sample at a time, sum_x min(p_T(x), q(x)) row by row
    tr = PdmTrainer(m, head, TrainConfig())
    want = {(t, s): 0.0 for t in temps for s in scales}
    rows = 0
    for smp in data:
        ids = torch.tensor([smp["prompt_ids"] + smp["response_ids"]])
        P, T = len(smp["prompt_ids"]), ids.shape[1]
        anchors, logits = tr.teacher_forward(ids, torch.tensor([T]))
        q_logits, _ = tr.student_logits(anchors, torch.tensor([T]), None, torch.arange(T))
        for r in range(P - 1, T - 1):  # the rows that predict a response token
            rows += 1
            for t in temps:
                p = torch.softmax(logits[0, r].float() / t, -1)
                for s in scales:
                    q = torch.zeros_like(p)
                    q[head.draft_vocab] = torch.softmax(q_logits[r].float() / (t * s), -1)
                    want[(t, s)] += float(torch.minimum(p, q).sum())
    assert res["rows"] == rows
    for (t, s), v in want.items():
        assert res["acceptance"][str(t)][str(s)] == pytest.approx(v / rows, abs=1e-5)
        assert 0 < v / rows < 1
    assert res["mean"][str(res["best_scale"])] == max(res["mean"].values())
    # halving the head's logits is the same as drafting at twice the temperature
    flat = copy.deepcopy(head)
    with torch.no_grad():
        flat.lm_head.weight.mul_(0.5)
    res2 = calibrate(FakeTarget(m), flat, data, temps, scales, batch_size=3, max_seq_len=64)
    for t in temps:
        for s in (0.25, 0.5, 1.0):
            assert res2["acceptance"][str(t)][str(s)] == pytest.approx(res["acceptance"][str(t)][str(2 * s)], abs=1e-5)
    with pytest.raises(SpdConfigError, match="calibration needs held-out samples"):
        calibrate(FakeTarget(m), head, [])
    with pytest.raises(SpdConfigError, match="temperatures must be positive numbers, got 0"):
        calibrate(FakeTarget(m), head, data, (0.0,), (1.0,))
    with pytest.raises(SpdConfigError, match=r"scales must be numbers in \[0.05, 20.0\], got 0.01"):
        calibrate(FakeTarget(m), head, data, (0.7,), (0.01, 1.0))


def test_cli_writes_the_scale_the_drafter_then_uses(tiny_checkpoint, tmp_path, capsys):
    from spd_fast.api import load
    from spd_fast.runtime import weights_fingerprint

    ckpt = tiny_checkpoint("llama")
    m = tiny_target(ckpt)
    _head(m, weights_fingerprint(m)).save(tmp_path / "h")
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(s) + "\n" for s in _samples(m, 4, seed=3)))
    rc = main([str(tmp_path / "h"), "--model", ckpt, "--val", str(val), "--scales", "0.5,0.8,1.0",
               "--temperatures", "0.7", "--write", "--out", str(tmp_path / "cal.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "| scale | T=0.7 | mean |" in out and "wrote draft_temperature_scale=" in out
    res = json.loads((tmp_path / "cal.json").read_text())
    best = res["best_scale"]
    assert best in (0.5, 0.8, 1.0) and res["previous_scale"] == 1.0
    assert json.loads((tmp_path / "h" / "draft_config.json").read_text())["draft_temperature_scale"] == best
    eng = load(model=ckpt, draft=str(tmp_path / "h"), progress=False)
    assert eng.head.dcfg.draft_temperature_scale == best
    # errors name the problem and the fix
    assert main([str(tmp_path / "h"), "--model", ckpt]) == 2
    assert "pass held-out data with --val FILE" in capsys.readouterr().err
    assert main([str(tmp_path / "h"), "--model", ckpt, "--val", str(tmp_path / "nope.jsonl")]) == 2
    assert "validation file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "h"), "--scales", "0.5,x"])
    assert "expected comma-separated numbers, got '0.5,x'" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "h" / "draft_config.json").read_text())
    (tmp_path / "h" / "draft_config.json").write_text(json.dumps(dict(cfg, draft_temperature_scale=0)))
    with pytest.raises(DraftMismatchError, match=r"draft_temperature_scale 0 is out of range.*\[0.05, 20.0\]"):
        load_draft(tmp_path / "h", m, weights_fingerprint(m))

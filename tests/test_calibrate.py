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


def _head(m, fingerprint="tiny", vocab=97):
    head = init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 2, 4, 6), None, 1, vocab, fingerprint), m.cfg,
                                      m.norm), m, 1)
    with torch.no_grad():  # a head that is neither the target nor uniform
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return head.eval().requires_grad_(False)


def _rows_one_by_one(m, head, data):
    """Yield (sequence, row r, the PDM's logits [V_d] and the target's [V] at r) for every assistant row,
    each sample run alone (the brute force the batched calibration is checked against)."""
    tr = PdmTrainer(m, head, TrainConfig())
    for smp in data:
        seq = smp["prompt_ids"] + smp["response_ids"]
        P, T = len(smp["prompt_ids"]), len(seq)
        anchors, logits = tr.teacher_forward(torch.tensor([seq]), torch.tensor([T]))
        q_logits, _ = tr.student_logits(anchors, torch.tensor([T]), None, torch.arange(T))
        for r in range(P - 1, T - 1):
            yield seq, r, q_logits[r].float(), logits[0, r].float()


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
               "--temperatures", "0.7", "--lookup", "2", "--gate-confidences", "1.0,0.5,0.1", "--gate-ratios", "1.0",
               "--copy-boosts", "0,1,30", "--write", "--out", str(tmp_path / "cal.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "| scale | T=0.7 | mean |" in out and "wrote draft_temperature_scale=" in out
    assert "| confidence | ratio 1.0 |" in out and "lookup_gate_confidence=" in out
    assert "| one-hot (gated) |" in out and "| boost 30.0 |" in out and "lookup_copy_boost=" in out
    res = json.loads((tmp_path / "cal.json").read_text())
    best, gate, boost = res["best_scale"], res["lookup_gate"]["best"], res["copy_boost"]["best"]
    assert boost in (None, 0.0, 1.0, 30.0)
    assert best in (0.5, 0.8, 1.0) and res["previous_scale"] == 1.0
    written = json.loads((tmp_path / "h" / "draft_config.json").read_text())
    assert written["draft_temperature_scale"] == best
    assert [written["lookup_gate_confidence"], written["lookup_gate_ratio"]] == gate
    assert written["lookup_copy_boost"] == boost
    eng = load(model=ckpt, draft=str(tmp_path / "h"), progress=False)
    assert eng.head.dcfg.draft_temperature_scale == best
    assert (eng.head.dcfg.lookup_gate_confidence, eng.head.dcfg.lookup_gate_ratio) == tuple(gate)
    assert eng.head.dcfg.lookup_copy_boost == boost
    # an empty --copy-boosts writes one-hot copies, as its help says (it kept a boost written before); --lookup 0
    # keeps the gate and the boost, and says so
    cfg = json.loads((tmp_path / "h" / "draft_config.json").read_text())
    (tmp_path / "h" / "draft_config.json").write_text(json.dumps(dict(cfg, lookup_copy_boost=6.0)))
    base = [str(tmp_path / "h"), "--model", ckpt, "--val", str(val), "--scales", "1.0", "--temperatures", "0.7",
            "--gate-confidences", "0.5", "--gate-ratios", "1.0", "--write"]
    assert main(base + ["--lookup", "2", "--copy-boosts", ""]) == 0
    assert json.loads((tmp_path / "h" / "draft_config.json").read_text())["lookup_copy_boost"] is None
    assert "lookup_copy_boost=None" in capsys.readouterr().out
    (tmp_path / "h" / "draft_config.json").write_text(json.dumps(dict(cfg, lookup_copy_boost=6.0)))
    assert main(base[:9] + ["--write", "--lookup", "0"]) == 0  # no gate grids: --lookup 0 refuses them
    assert json.loads((tmp_path / "h" / "draft_config.json").read_text())["lookup_copy_boost"] == 6.0
    assert "(kept as they were: lookup gate, copy boost)" in capsys.readouterr().out
    # a lookup no validation row matches gives no evidence about the gate: the calibrated one is kept, not reset
    gated = dict(cfg, lookup_gate_confidence=0.4, lookup_gate_ratio=0.1, lookup_copy_boost=2.5)
    (tmp_path / "h" / "draft_config.json").write_text(json.dumps(gated))
    assert main(base + ["--lookup", "60"]) == 0
    kept = json.loads((tmp_path / "h" / "draft_config.json").read_text())
    assert (kept["lookup_gate_confidence"], kept["lookup_gate_ratio"], kept["lookup_copy_boost"]) == (0.4, 0.1, 2.5)
    out = capsys.readouterr().out
    assert "0 of" in out and "the lookup gate is not fitted; pass longer --val samples" in out
    assert "(kept as they were: lookup gate, copy boost)" in out
    (tmp_path / "h" / "draft_config.json").write_text(json.dumps(cfg))
    # errors name the problem and the fix
    assert main([str(tmp_path / "h"), "--model", ckpt]) == 2
    assert "pass held-out data with --val FILE" in capsys.readouterr().err
    assert main([str(tmp_path / "h"), "--model", ckpt, "--val", str(tmp_path / "nope.jsonl")]) == 2
    assert "validation file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "h"), "--scales", "0.5,x"])
    assert "expected comma-separated numbers, got '0.5,x'" in capsys.readouterr().err
    # --lookup 0 skips the gate and the boost: their grids are refused, not ignored (they were, with exit 0)
    val_args = [str(tmp_path / "h"), "--model", ckpt, "--val", str(val), "--lookup", "0"]
    assert main(val_args + ["--copy-boosts", "1"]) == 2
    assert ("--copy-boosts tunes the lookup gate and copy boost, which --lookup 0 skips; drop it, or pass --lookup "
            "K > 0") in capsys.readouterr().err
    assert main(val_args + ["--gate-ratios", "0.5", "--gate-confidences", "0.9"]) == 2
    assert "--gate-confidences and --gate-ratios tune the lookup gate" in capsys.readouterr().err
    assert main(val_args + ["--gate-ratios", "0.05,0.025,0.1,0.25,0.5,1.0"]) == 0  # the default grid, reordered
    cfg = json.loads((tmp_path / "h" / "draft_config.json").read_text())
    (tmp_path / "h" / "draft_config.json").write_text(json.dumps(dict(cfg, draft_temperature_scale=0)))
    with pytest.raises(DraftMismatchError, match=r"draft_temperature_scale 0 is out of range.*\[0.05, 20.0\]"):
        load_draft(tmp_path / "h", m, weights_fingerprint(m))


def test_lookup_gate_table_counts_each_gate_and_keeps_the_default_on_ties():
    from spd_fast.train.calibrate import lookup_gate_table

    # (PDM top probability, copied token's probability, copy in the draft vocabulary, copy right, PDM right);
    # 4 rows, 2 right by the PDM
    fired = [(0.9, 0.0, True, False, True), (0.3, 0.2, True, True, False)]
    t = lookup_gate_table(fired, 4, 2, (1.0, 0.5), (0.5,))
    assert t["pdm_alone"] == 0.5 and t["no_gate"] == 0.5 and t["rows_matched"] == 2
    assert t["grid"] == {"1.0,0.5": 0.5, "0.5,0.5": 0.75}  # the sure PDM keeps its right draft, the unsure one copies
    assert t["best"] == [0.5, 0.5] and t["best_accuracy"] == 0.75
    level = lookup_gate_table([(0.9, 0.0, True, True, True)], 2, 1, (1.0, 0.5), (0.5,))
    assert level["best"] == [1.0, 0.0]  # no gain: the no-gate default stays
    # a copy outside the draft vocabulary (its PDM probability is 0) is always drafted: no gate can keep the PDM
    outside = lookup_gate_table([(0.9, 0.0, False, False, True)], 2, 1, (1.0, 0.5), (0.5,))
    assert outside["grid"] == {"1.0,0.5": 0.0, "0.5,0.5": 0.0} and outside["best"] == [1.0, 0.0]


def test_lookup_gate_calibration_matches_per_row_brute_force(tiny_checkpoint):
    from test_lookup import _brute

    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 5)
    head = _head(m)
    confs, ratios = (1.0, 0.9, 0.5, 0.0), (0.1, 0.5, 1.0)
    res = calibrate(FakeTarget(m), head, data, (0.7,), (1.0,), batch_size=3, max_seq_len=64, lookup=1,
                    gate_confidences=confs, gate_ratios=ratios)
    gate = res["lookup_gate"]
    dv = head.draft_vocab.tolist()
    right = {(c, r): 0 for c in confs for r in ratios}
    rows = matched = 0
    for seq, r, lg, t_lg in _rows_one_by_one(m, head, data):
        rows += 1
        q = torch.softmax(lg, -1)
        y, own, top = int(t_lg.argmax()), dv[int(q.argmax())], float(q.max())
        copy = _brute(seq, r, 1) if r >= 1 else None
        matched += copy is not None
        p_copy = float(q[dv.index(copy)]) if copy in dv else 0.0
        for c in confs:
            for ra in ratios:
                use_copy = copy is not None and not (top > c and p_copy < ra * top and copy in dv)
                right[c, ra] += (copy if use_copy else own) == y
    assert gate["rows"] == rows and gate["rows_matched"] == matched > 0
    for (c, ra), k in right.items():
        assert gate["grid"][f"{c},{ra}"] == pytest.approx(k / rows)
    assert len(set(gate["grid"].values())) > 1  # the gate changes drafts on these samples
    with pytest.raises(SpdConfigError, match=r"lookup gate confidences and ratios must be numbers in \[0, 1\], got 2"):
        calibrate(FakeTarget(m), head, data, (0.7,), (1.0,), lookup=2, gate_confidences=(2.0,))
    with pytest.raises(SpdConfigError, match="lookup must be an integer from 0 to 64"):
        calibrate(FakeTarget(m), head, data, (0.7,), (1.0,), lookup=-1)


def test_copy_boost_calibration_matches_per_row_brute_force(tiny_checkpoint):
    """copy_boost_table against a per-row brute force: at T > 0 the one-hot drafter copies where the gate
    lets it (always for a copy outside the draft vocabulary), the boosted drafter draws every copy inside
    the draft vocabulary from the PDM's q with the copy's logit raised by d; expected acceptance is
    sum_x min(p_T, q) averaged over rows, and the best boost must beat one-hot to be picked."""
    from test_lookup import _brute

    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 5)
    head = _head(m, vocab=60)  # tokens 60-96 lie outside the draft vocabulary
    temps, boosts, gate = (0.7, 1.0), (0.5, 2.0, 8.0), (0.5, 0.5)
    res = calibrate(FakeTarget(m), head, data, temps, (0.9,), batch_size=3, max_seq_len=64, lookup=1,
                    gate_confidences=(gate[0],), gate_ratios=(gate[1],), copy_boosts=boosts)
    cb = res["copy_boost"]
    assert res["lookup_gate"]["best"] in ([0.5, 0.5], [1.0, 0.0])
    g = res["lookup_gate"]["best"]
    dv = head.draft_vocab.tolist()
    one_hot = {t: 0.0 for t in temps}
    boosted = {(t, d): 0.0 for t in temps for d in boosts}
    rows = outside = 0
    for seq, r, lg, t_lg in _rows_one_by_one(m, head, data):
        rows += 1
        q0 = torch.softmax(lg, -1)
        copy = _brute(seq, r, 1) if r >= 1 else None
        inside = copy in dv
        outside += copy is not None and not inside
        p_copy = float(q0[dv.index(copy)]) if inside else 0.0
        gate_copies = copy is not None and not (float(q0.max()) > g[0] and p_copy < g[1] * float(q0.max()) and inside)
        for t in temps:
            p = torch.softmax(t_lg / t, -1)

            def overlap(x):  # x: draft-vocabulary logits already divided by the draft temperature
                q = torch.zeros_like(p)
                q[head.draft_vocab] = torch.softmax(x, -1)
                return float(torch.minimum(p, q).sum())

            own = overlap(lg / (t * 0.9))
            one_hot[t] += float(p[copy]) if gate_copies else own
            for d in boosts:
                if copy is not None and inside:
                    x = lg / (t * 0.9)
                    x[dv.index(copy)] += d
                    boosted[t, d] += overlap(x)
                else:
                    boosted[t, d] += float(p[copy]) if copy is not None else own
    assert cb["rows_matched"] == res["lookup_gate"]["rows_matched"] > 0 and outside > 0 and cb["scale"] == 0.9
    for t in temps:
        assert cb["one_hot"][str(t)] == pytest.approx(one_hot[t] / rows, abs=1e-5)
        for d in boosts:
            assert cb["grid"][str(d)][str(t)] == pytest.approx(boosted[t, d] / rows, abs=1e-5)
    means = {d: sum(boosted[t, d] for t in temps) / rows / len(temps) for d in boosts}
    oh = sum(one_hot.values()) / rows / len(temps)
    best = max(boosts, key=means.get)
    assert cb["best"] == (best if means[best] > oh else None)
    assert len({round(v, 6) for v in means.values()}) == len(boosts)  # the boost changes q on these rows
    with pytest.raises(SpdConfigError, match=r"copy boosts must be numbers in \[0, 30\], got -1.0"):
        calibrate(FakeTarget(m), head, data, (0.7,), (1.0,), lookup=1, copy_boosts=(-1.0,))


def test_empty_answers_score_no_padding_and_no_answer_at_all_is_an_error(tiny_checkpoint):
    """An empty sample's loss mask once covered the whole padded width (its slice [0:-1]), so calibration scored
    padding as answer rows; and with no answer row in reach it "calibrated" the first grid value."""
    from spd_fast.train.trainer import collate

    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 2)
    _, _, mask = collate([data[0], {"prompt_ids": [], "response_ids": []}], 64)
    assert not mask[1].any() and mask[0].any()
    head = _head(m)
    full = calibrate(FakeTarget(m), head, data, (1.0,), (1.0,), max_seq_len=64)
    with_empty = calibrate(FakeTarget(m), head, data + [{"prompt_ids": [], "response_ids": []}], (1.0,), (1.0,),
                           max_seq_len=64)
    assert with_empty["rows"] == full["rows"] > 0
    long = [{"prompt_ids": smp["prompt_ids"] * 40, "response_ids": smp["response_ids"]} for smp in data]
    assert all(len(s["prompt_ids"]) > 64 for s in long)
    with pytest.raises(SpdConfigError, match=r"none of the 2 --val samples has an answer token within the first 64 "
                                             r"tokens .*; pass held-out samples with answers and shorter prompts"):
        calibrate(FakeTarget(m), head, long, (1.0,), (1.0,), max_seq_len=64)


def test_a_repeated_grid_value_is_scored_once(tiny_checkpoint):
    """A scale or temperature given twice was summed twice into one cell: its acceptance doubled (above 1) and it
    won best_scale, which --write then stored."""
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 3)
    head = _head(m)
    once = calibrate(FakeTarget(m), head, data, (0.7, 1.0), (0.5, 1.0, 2.0), batch_size=3, max_seq_len=64, lookup=2,
                     gate_confidences=(1.0, 0.5), gate_ratios=(0.1,), copy_boosts=(1.0, 3.0))
    twice = calibrate(FakeTarget(m), head, data, (0.7, 1.0, 0.7), (0.5, 0.5, 1.0, 2.0, 2.0), batch_size=3,
                      max_seq_len=64, lookup=2, gate_confidences=(1.0, 0.5, 0.5), gate_ratios=(0.1, 0.1),
                      copy_boosts=(1.0, 3.0, 1.0))
    assert twice["acceptance"].keys() == once["acceptance"].keys()
    for t, acc in once["acceptance"].items():
        assert twice["acceptance"][t] == pytest.approx(acc), t
    for k in ("mean", "best_scale", "rows", "top1"):
        assert twice[k] == pytest.approx(once[k]), k
    assert all(0 < v < 1 for acc in twice["acceptance"].values() for v in acc.values())
    for k in ("lookup_gate", "copy_boost"):
        assert json.dumps(twice[k], sort_keys=True) == json.dumps(once[k], sort_keys=True), k


def test_cli_write_failures_are_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--write into a head directory that cannot take the new config failed with a raw traceback after the whole
    run; a read-only directory is now refused before the run, and a write that fails anyway names the cause."""
    import os

    import spd_fast.train.calibrate as cal
    from spd_fast.runtime import weights_fingerprint

    ckpt = tiny_checkpoint("llama")
    m = tiny_target(ckpt)
    _head(m, weights_fingerprint(m)).save(tmp_path / "h")
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(s) + "\n" for s in _samples(m, 2, seed=3)))
    args = [str(tmp_path / "h"), "--model", ckpt, "--val", str(val), "--scales", "1.0", "--temperatures", "0.7",
            "--lookup", "0", "--write"]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path / "h") else real_access(p, mode))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--write cannot replace" in err and "is not writable; copy the head somewhere writable" in err
    monkeypatch.setattr(os, "access", real_access)

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "h" / "draft_config.json.tmp"))

    monkeypatch.setattr(cal, "write_scale", refuse)
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "| scale | T=0.7 | mean |" in captured.out  # the figures were printed before the failed write
    assert "the results were not all written (PermissionError: [Errno 13] Permission denied" in captured.err
    assert "fix the path and run again" in captured.err and "Traceback" not in captured.err

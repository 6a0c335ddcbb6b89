"""Acceptance breakdown (scripts/acceptance_breakdown.py): which drafts count as verified, and the
recorded counts against the engine's own on the default model."""
import pytest
import torch

import spd_fast
from spd_fast.evaluate import acceptance_breakdown, classify_verified, window_label


def test_classify_verified_rules():
    P = 2
    full = [9, 9, 1, 2, 1, 2, 1, 2]      # answer 1 2 1 2 1 2: the 4-gram closed at position 7 was seen at 5
    t = torch.tensor(full)
    rows = [(3, 2, t[:3], False, 3),      # right context, accepted, steady state
            (4, 7, t[:4], True, 3),       # right context, rejected, made by the lookup
            (5, 1, torch.tensor([9, 9, 1, 2, 5]), False, 1),   # wrong context: flushed, never verified
            (7, 2, t[:7], False, 1),      # right context, accepted, closes a repeated 4-gram, after a reject
            (8, 1, t[:8], False, 2),      # beyond the output: never verified
            (2, 1, t[:2], False, 1)]      # the prefill's exact token needs no draft
    got = classify_verified(rows, full, P)
    assert [(v["pos"], v["accepted"], v["repeated"], v["lookup"], v["fill"]) for v in got] == [
        (3, True, False, False, 3), (4, False, False, True, 3), (7, True, True, False, 1)]
    assert [window_label(a) for a in (1, 63, 64, 127, 128, 255, 256, 4000)] == [
        "answer tokens 1-63", "answer tokens 1-63", "answer tokens 64-127", "answer tokens 64-127",
        "answer tokens 128-255", "answer tokens 128-255", "answer tokens 256+", "answer tokens 256+"]


def test_breakdown_counts_equal_the_engines(default_target):
    eng = spd_fast.load(progress=False)
    drafter = eng.spd.drafter
    prompts = {"chat": [{"prompt": "Repeat the word hello five times."}],
               "code": [{"prompt": "Write a Python function that adds two numbers."}]}
    res = acceptance_breakdown(eng, prompts, 70)
    c = res["counts"]
    assert eng.spd.drafter is drafter                       # the recorder is taken out again
    assert (c["overall"]["verified"], c["overall"]["accepted"]) == (res["engine"]["verifications"],
                                                                    res["engine"]["accepted"])
    assert c["overall"]["verified"] > 40
    for parts in (("chat", "code"), ("new 4-gram", "repeated 4-gram"), ("PDM draft", "lookup draft"),
                  ("answer tokens 1-63", "answer tokens 64-127"), ("fill 1", "fill 2", "fill 3")):
        assert sum(c[k]["verified"] for k in parts if k in c) == c["overall"]["verified"], parts
        assert sum(c[k]["accepted"] for k in parts if k in c) == c["overall"]["accepted"], parts
    for cross in (("PDM draft / new 4-gram", "PDM draft / repeated 4-gram", "lookup draft / new 4-gram",
                   "lookup draft / repeated 4-gram"),):
        assert sum(c[k]["verified"] for k in cross if k in c) == c["overall"]["verified"]
    assert c["lookup draft"]["verified"] > 0                 # the repeating prompt makes the lookup fire
    # fill-1 drafts come first after each prompt's prefill and after every reject; each is verified unless
    # its answer ended first, which can happen to at most one per prompt (the last one made)
    rejects = c["overall"]["verified"] - c["overall"]["accepted"]
    assert rejects <= c["fill 1"]["verified"] <= rejects + len(prompts)
    assert c["fill 3"]["verified"] > 0


def test_recorder_counts_a_gated_match_as_a_pdm_draft(tiny_checkpoint):
    """A match that the lookup gate overrides is the PDM's draft, not the lookup's: with gate (0, 1) the PDM
    keeps its draft on every match, so only matches whose copy equals that draft count as lookup drafts."""
    import dataclasses

    from conftest import tiny_target
    from spd_fast.config import uniform_boundaries
    from spd_fast.drafters import PdmDrafter
    from spd_fast.engine import SPDEngine
    from spd_fast.evaluate import _RecordingDrafter
    from spd_fast.ops import lookup_next
    from spd_fast.sampling import SamplingParams
    from test_engine import random_head

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = random_head(m, b, vocab=97)
    counts = {}
    for gate in ((1.0, 0.0), (0.0, 1.0)):
        h = random_head(m, b, vocab=97)
        h.dcfg = dataclasses.replace(head.dcfg, lookup_gate_confidence=gate[0], lookup_gate_ratio=gate[1])
        rec = _RecordingDrafter(PdmDrafter(h, lookup=1))
        SPDEngine(m, rec, b).run([5, 17, 3, 9, 5, 17, 3, 9], 40, SamplingParams(), [])
        matched = [bool(lookup_next(ctx, torch.tensor(len(ctx) - 1), 1)[0]) for _, _, ctx, *_ in rec.rows]
        fired = [f for _, _, _, f, _ in rec.rows]
        counts[gate] = (sum(matched), sum(fired))
    assert counts[(1.0, 0.0)][0] == counts[(1.0, 0.0)][1] > 0      # ungated: every match is copied
    assert counts[(0.0, 1.0)][1] < counts[(0.0, 1.0)][0]            # gated: some matches are the PDM's drafts


def _script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "acceptance_breakdown.py"
    spec = importlib.util.spec_from_file_location("acceptance_breakdown_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_breakdown_script_refuses_bad_input_before_loading_and_keeps_dotted_names(default_target, tmp_path, capsys,
                                                                                  monkeypatch):
    """The script gave raw tracebacks (--limit 0 or past the prompt files, after the model had loaded), a KeyError
    when no draft was verified, and wrote --out x_t0.7 as x_t0.json/.md (two runs overwrote each other)."""
    import json

    from spd_fast import evaluate

    mod = _script()
    (tmp_path / "f").write_text("")
    for argv, msg in ((["--limit", "41"], "limit 41 is more than the 40 chat prompts there are"),
                      (["--out", str(tmp_path / "f" / "x")], "--out")):
        assert mod.main(argv + ["--max-new-tokens", "2"]) == 2  # a check that let it through ends in seconds
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    for argv, msg in ((["--limit", "0"], "--limit"), (["--max-new-tokens", "1"], "--max-new-tokens"),
                      (["--lookup", "-1"], "--lookup")):
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    out = tmp_path / "bd_t0.7"
    assert mod.main(["--limit", "1", "--max-new-tokens", "2", "--out", str(out)]) == 0
    res = json.loads((tmp_path / "bd_t0.7.json").read_text())
    assert res["engine"]["verifications"] == res["counts"]["overall"]["verified"] == 3  # one draft per prompt
    assert res["meta"]["max_new_tokens"] == 2 and "| overall | 3 |" in (tmp_path / "bd_t0.7.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bd_t0.7.json", "bd_t0.7.md", "f"]
    # every answer ending at its first token (EOS) leaves no verified draft and no "overall" count at all
    monkeypatch.setattr(evaluate, "acceptance_breakdown",
                        lambda *a, **k: {"counts": {}, "engine": {"verifications": 0, "accepted": 0}})
    assert mod.main(["--limit", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "empty")]) == 0
    assert "no draft was verified" in (tmp_path / "empty.md").read_text()


def test_breakdown_script_lists_every_count_it_records():
    """The markdown table left out the "<window> / repeated 4-gram" counts that the JSON holds."""
    from spd_fast.evaluate import WINDOWS as STARTS

    mod = _script()
    assert [window_label(a) for a in STARTS] == list(mod.WINDOWS)  # the labels the counts are recorded under
    for w in mod.WINDOWS:
        assert f"{w} / repeated 4-gram" in mod.ORDER and f"{w} / new 4-gram" in mod.ORDER

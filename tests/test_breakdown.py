"""Acceptance breakdown (scripts/acceptance_breakdown.py): which drafts count as verified, and the
recorded counts against the engine's own on the default model."""
import torch

import spd_fast
from spd_fast.evaluate import acceptance_breakdown, classify_verified, window_label


def test_classify_verified_rules():
    P = 2
    full = [9, 9, 1, 2, 1, 2, 1, 2]      # answer 1 2 1 2 1 2: the 4-gram closed at position 7 was seen at 5
    t = torch.tensor(full)
    rows = [(3, 2, t[:3], False),         # right context, accepted
            (4, 7, t[:4], True),          # right context, rejected, made by the lookup
            (5, 1, torch.tensor([9, 9, 1, 2, 5]), False),   # wrong context: flushed, never verified
            (7, 2, t[:7], False),         # right context, accepted, closes a repeated 4-gram
            (8, 1, t[:8], False),         # beyond the output: never verified
            (2, 1, t[:2], False)]         # the prefill's exact token needs no draft
    got = classify_verified(rows, full, P)
    assert [(v["pos"], v["accepted"], v["repeated"], v["lookup"]) for v in got] == [
        (3, True, False, False), (4, False, False, True), (7, True, True, False)]
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
                  ("answer tokens 1-63", "answer tokens 64-127")):
        assert sum(c[k]["verified"] for k in parts if k in c) == c["overall"]["verified"], parts
        assert sum(c[k]["accepted"] for k in parts if k in c) == c["overall"]["accepted"], parts
    for cross in (("PDM draft / new 4-gram", "PDM draft / repeated 4-gram", "lookup draft / new 4-gram",
                   "lookup draft / repeated 4-gram"),):
        assert sum(c[k]["verified"] for k in cross if k in c) == c["overall"]["verified"]
    assert c["lookup draft"]["verified"] > 0                 # the repeating prompt makes the lookup fire

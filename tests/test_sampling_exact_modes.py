"""Sampled SPD against the EXACT AR distribution of the first new tokens (enumerated from the target's
probabilities), in every drafting mode: one-hot copies outside the draft vocabulary, the calibrated gate,
the copy boost with top-k / top-p, draft temperature scales, n = 1 and n = 4, the pipelined executor,
top_k = 1 and near-zero temperatures."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

import spd_fast.drafters as drafters_mod
from spd_fast.ar import prefill
from spd_fast.drafters import PdmDrafter
from spd_fast.engine import SPDEngine
from spd_fast.pdm import DraftConfig, DraftHead, init_from_target
from spd_fast.pipeline import PipelinedEngine
from spd_fast.sampling import SamplingParams, probs_from_logits

P_MIN = 1e-3
L = 3                      # new tokens compared jointly
REP = [6, 7, 6, 7, 6]      # lookup=1 copies 7 after 6 (outside a draft vocabulary of {0..4})
SUB5 = [4, 0, 3, 1, 2]    # a draft vocabulary whose rows are not its token ids (a row-for-id slip shows)
STAGES = {1: (0, 4), 2: (0, 2, 4), 3: (0, 1, 2, 4), 4: (0, 1, 2, 3, 4)}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from test_sampling_lossless import _tiny_small_vocab

    return _tiny_small_vocab(tmp_path_factory)


def _head(model, b, vocab=None, scale=1.0, boost=None, gate=(1.0, 0.0)):
    """A near-uniform draft (acceptance 0.1-0.3 here) over `vocab` (default: the whole vocabulary)."""
    V = model.cfg.vocab_size
    dcfg = DraftConfig.make(model.cfg, b, None, 1, V if vocab is None else len(vocab))
    head = init_from_target(DraftHead(dcfg, model.cfg, model.norm), model, 3).eval().requires_grad_(False)
    with torch.no_grad():
        if vocab is not None:
            head.draft_vocab.copy_(torch.tensor(vocab))
        head.lm_head.weight.copy_(0.2 * model.lm_head.weight[head.draft_vocab])
    head.dcfg = dataclasses.replace(head.dcfg, draft_temperature_scale=scale, lookup_copy_boost=boost,
                                    lookup_gate_confidence=gate[0], lookup_gate_ratio=gate[1])
    return head


@torch.inference_mode()
def _exact(model, prompt, params):
    """{first L new tokens: AR probability} by enumeration (paths of probability 0 left out)."""
    out = {}

    def rec(prefix, prob):
        if len(prefix) == L:
            out[tuple(prefix)] = prob
            return
        p = probs_from_logits(prefill(model, prompt + prefix), params).double()
        for t in torch.nonzero(p > 0).flatten().tolist():
            rec(prefix + [t], prob * float(p[t]))
    rec([], 1.0)
    return out


def _fit(model, runner, prompt, params, N, seed=1234):
    """(p-value of the sampled sequences against the exact AR law, acceptance rate); cells with expected
    count < 5 are pooled; a sequence AR can never produce gives p = 0."""
    exact = _exact(model, prompt, params)
    g = torch.Generator().manual_seed(seed)
    counts, acc, ver = {}, 0.0, 0.0
    for _ in range(N):
        res = runner.run(prompt, L, params, [], g)
        t = tuple(res.token_ids[:L])
        counts[t] = counts.get(t, 0) + 1
        acc, ver = acc + res.metrics["accepted"], ver + res.metrics["verifications"]
    if any(t not in exact for t in counts):
        return 0.0, acc / max(ver, 1)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for t, pr in exact.items():
        if N * pr >= 5:
            obs.append(counts.get(t, 0)); exp.append(N * pr)
        else:
            rest_o, rest_e = rest_o + counts.get(t, 0), rest_e + N * pr
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = [e * N / sum(exp) for e in exp]  # the law's mass on the paths left out (probability 0) is nil
    return (1.0 if len(obs) < 2 else float(chisquare(obs, exp).pvalue)), acc / max(ver, 1)


MODES = {
    "n4-onehot-outside-vocab-topp": (4, SamplingParams(temperature=0.8, top_p=0.9), dict(vocab=SUB5), False),
    "n3-boost-topk-topp-scale": (3, SamplingParams(temperature=0.7, top_k=3, top_p=0.85),
                                 dict(vocab=SUB5, scale=1.5, boost=2.0), False),
    "n3-gated-onehot-topk": (3, SamplingParams(temperature=0.9, top_k=4), dict(vocab=SUB5 + [5], gate=(0.3, 0.5)),
                             False),
    "n1-boost-topp": (1, SamplingParams(temperature=0.9, top_p=0.9), dict(vocab=SUB5, boost=2.0), False),
    "pipelined-n3-boost-scale": (3, SamplingParams(temperature=0.8, top_p=0.9),
                                 dict(vocab=SUB5, scale=0.7, boost=2.0), True),
}


def _runner(model, n, hk, pipelined, lookup=1):
    b = STAGES[n]
    eng = SPDEngine(model, PdmDrafter(_head(model, b, **hk), lookup), b)
    return PipelinedEngine(eng, placement="simulated") if pipelined else eng


@pytest.mark.parametrize("mode", list(MODES))
def test_sampled_spd_matches_exact_ar_law(small_model, mode):
    n, params, hk, pipelined = MODES[mode]
    pv, rate = _fit(small_model, _runner(small_model, n, hk, pipelined), REP, params, 1500)
    assert 0.05 < rate < 0.95, rate  # both branches (accept and residual) are exercised
    assert pv > P_MIN, (mode, pv)


def test_seven_tokens_jointly_match_the_exact_ar_law(small_model, monkeypatch):
    """Past the first few tokens: 7 new tokens at n=3 (the q ring wraps, several reject -> refill -> verify
    rounds per run) with the boosted lookup, one-hot copies outside the draft vocabulary and a draft scale,
    against the exact law of all 2^7 top_k=2 paths."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "L", 7)
    hk = dict(vocab=SUB5, scale=1.5, boost=2.0)
    pv, rate = _fit(small_model, _runner(small_model, 3, hk, False), REP, SamplingParams(temperature=1.0, top_k=2),
                    1500, seed=7)
    assert 0.05 < rate < 0.95, rate
    assert pv > P_MIN, pv


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1e-3)],
                         ids=["topk1", "T1e-3"])
@pytest.mark.parametrize("prompt", [REP, [6, 7, 7, 7, 7]], ids=["rejects", "copies-accepted"])
def test_degenerate_target_gives_the_ar_sequence(small_model, params, prompt):
    """top_k=1 or T -> 0: p is (all but) one-hot, so every run must return AR's own sequence."""
    exact = _exact(small_model, prompt, params)
    best = max(exact, key=exact.get)
    assert exact[best] > 0.999
    g = torch.Generator().manual_seed(0)
    for n in (2, 4):
        runner = _runner(small_model, n, dict(scale=20.0, boost=3.0), False)
        assert {tuple(runner.run(prompt, L, params, [], g).token_ids) for _ in range(40)} == {best}


def test_exact_law_check_has_power(small_model, monkeypatch):
    """Copies drafted with the PDM's q instead of their one-hot q must fail the same check."""
    monkeypatch.setattr(drafters_mod.PdmDrafter, "_copy_one_hot",
                        staticmethod(lambda found, copied, tok, q: (torch.where(found, copied, tok), q)))
    n, params, hk, pipelined = MODES["n4-onehot-outside-vocab-topp"]
    pv, _ = _fit(small_model, _runner(small_model, n, hk, pipelined), REP, params, 1500)
    assert pv < P_MIN

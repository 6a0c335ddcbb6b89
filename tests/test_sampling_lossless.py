"""SPD sampling is lossless: its output distribution equals the target's (statistical tests)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

import spd_fast.engine as engine_mod
from spd_fast.ar import decode_ar
from spd_fast.drafters import PdmDrafter
from spd_fast.engine import SPDEngine
from spd_fast.ops import verify_sampling
from spd_fast.sampling import SamplingParams, probs_from_logits, sample_from

P_MIN = 1e-3  # a correct implementation fails this with probability ~0.1% per test


def test_verify_sampling_op_reproduces_p():
    g = torch.Generator().manual_seed(0)
    V = 6
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    params = SamplingParams(temperature=1.0)
    p = probs_from_logits(logits, params)
    q = torch.tensor([0.05, 0.05, 0.5, 0.3, 0.05, 0.05])
    N = 20000
    counts = torch.zeros(V)
    for _ in range(N):
        x = sample_from(q, g)
        _, y = verify_sampling(logits, x, q, params, g)
        counts[y] += 1
    assert chisquare(counts.numpy(), (p * N).numpy()).pvalue > P_MIN


def _tiny_small_vocab(tmp_path_factory):
    from transformers import LlamaConfig

    from conftest import save_random_checkpoint
    from spd_fast.loading import load_hf_dir

    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    m = load_hf_dir(save_random_checkpoint(cfg, tmp_path_factory.mktemp("smallvocab"), 0, std=0.3, tokenizer=False))
    m.setup_caches(1, 32)
    return m


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return _tiny_small_vocab(tmp_path_factory)


def _samples(model, method, n_runs, params, positions=(1, 2, 3), draft_scale=1.0, lookup=0, copy_boost=None):
    import dataclasses

    from test_engine import random_head

    b = (0, 2, 4)
    eng = None
    if method == "spd":
        head = random_head(model, b, seed=3)
        with torch.no_grad():  # a sharp draft that clearly differs from the target: q != p
            head.lm_head.weight.mul_(4.0).add_(torch.randn(head.lm_head.weight.shape,
                                                           generator=torch.Generator().manual_seed(5)))
        head.dcfg = dataclasses.replace(head.dcfg, draft_temperature_scale=draft_scale, lookup_copy_boost=copy_boost)
        eng = SPDEngine(model, PdmDrafter(head, lookup), b)
        eng.total = {"ver": 0, "acc": 0}
    out = {k: torch.zeros(model.cfg.vocab_size) for k in positions}
    g = torch.Generator().manual_seed(1234 if method == "spd" else 99)
    for _ in range(n_runs):
        if eng is None:
            toks = decode_ar(model, [1, 2], 4, params, [], g).token_ids
        else:
            res = eng.run([1, 2], 4, params, [], g)
            toks = res.token_ids
            eng.total["ver"] += res.metrics["verifications"]
            eng.total["acc"] += res.metrics["accepted"]
        for k in positions:
            out[k][toks[k]] += 1
    return out, eng


def _same_distribution(a, b) -> float:
    table = torch.stack([a, b])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table.numpy()).pvalue


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.8)], ids=["t1", "t0.7-topk5", "topp0.8"])
def test_spd_sampling_matches_ar_distribution(small_model, params):
    ar, _ = _samples(small_model, "ar", 1500, params)
    sp, eng = _samples(small_model, "spd", 1500, params)
    rate = eng.total["acc"] / eng.total["ver"]
    assert 0.05 < rate < 0.95  # the draft really differs from the target, and is sometimes right
    for k in ar:
        assert _same_distribution(ar[k], sp[k]) > P_MIN, k


@pytest.mark.parametrize("scale", [0.5, 1.6])
def test_head_draft_temperature_scale_keeps_sampling_exact(small_model, scale):
    """A head that drafts at T * scale (its calibration) proposes other tokens, but verification uses
    the q it drew from, so the output distribution is still the target's at T."""
    params = SamplingParams(temperature=0.8)
    ar, _ = _samples(small_model, "ar", 1500, params)
    sp, eng = _samples(small_model, "spd", 1500, params, draft_scale=scale)
    rate = eng.total["acc"] / eng.total["ver"]
    assert 0.05 < rate < 0.95
    for k in ar:
        assert _same_distribution(ar[k], sp[k]) > P_MIN, k


def test_context_lookup_keeps_sampling_exact(small_model, monkeypatch):
    """Lookup drafts carry a one-hot q (they are not drawn from the PDM's q); verification against
    that q keeps the output distribution the target's. lookup=1 fires often on 8 tokens."""
    from test_lookup import count_lookups

    hits = count_lookups(monkeypatch)
    params = SamplingParams(temperature=0.9)
    ar, _ = _samples(small_model, "ar", 1500, params)
    sp, eng = _samples(small_model, "spd", 1500, params, lookup=1)
    assert sum(hits) > len(hits) // 4
    rate = eng.total["acc"] / eng.total["ver"]
    assert 0.05 < rate < 0.95
    for k in ar:
        assert _same_distribution(ar[k], sp[k]) > P_MIN, k


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["t0.9", "t0.7-topk3"])
def test_copy_boost_keeps_sampling_exact(small_model, monkeypatch, params):
    """With a copy boost, a match raises the copied token's logit before the PDM's draft is drawn; q is
    that boosted distribution, so the output is still the target's (here with a draft scale, and with a
    top-k that the boost can pull the copy into)."""
    from test_lookup import count_lookups

    hits = count_lookups(monkeypatch)
    ar, _ = _samples(small_model, "ar", 1500, params)
    sp, eng = _samples(small_model, "spd", 1500, params, draft_scale=0.8, lookup=1, copy_boost=3.0)
    assert sum(hits) > len(hits) // 4
    rate = eng.total["acc"] / eng.total["ver"]
    assert 0.05 < rate < 0.95
    for k in ar:
        assert _same_distribution(ar[k], sp[k]) > P_MIN, k


def test_draft_params_scale_the_temperature_only_when_sampling(small_model):
    import dataclasses

    from test_engine import random_head

    head = random_head(small_model, (0, 2, 4))
    d = PdmDrafter(head)
    p = SamplingParams(temperature=0.7, top_k=5)
    assert d.draft_params(p) is p  # scale 1: unchanged
    head.dcfg = dataclasses.replace(head.dcfg, draft_temperature_scale=0.8)
    assert d.draft_params(p) == SamplingParams(temperature=0.7 * 0.8, top_k=5)
    greedy = SamplingParams()
    assert d.draft_params(greedy) is greedy


def test_wrong_acceptance_rule_is_detected(small_model, monkeypatch):
    """Accepting with probability p(x), ignoring q, biases the output: the same test must fail."""
    def biased(target_logits, draft_token, q, params, generator):
        p = probs_from_logits(target_logits, params)
        u = torch.rand((), generator=generator)
        accept = u < p[draft_token]
        y = sample_from(p, generator)
        return accept, torch.where(accept, draft_token, y)

    params = SamplingParams(temperature=1.0)
    ar, _ = _samples(small_model, "ar", 2000, params)
    monkeypatch.setattr(engine_mod, "verify_sampling", biased)
    sp, _ = _samples(small_model, "spd", 2000, params)
    assert min(_same_distribution(ar[k], sp[k]) for k in ar) < P_MIN


def test_seeded_spd_sampling_reproducible(small_model):
    from test_engine import random_head

    b = (0, 2, 4)
    eng = SPDEngine(small_model, PdmDrafter(random_head(small_model, b)), b)
    p = SamplingParams(temperature=1.0, seed=3)
    a = eng.run([1, 2, 3], 12, p, [], torch.Generator().manual_seed(3)).token_ids
    b_ = eng.run([1, 2, 3], 12, p, [], torch.Generator().manual_seed(3)).token_ids
    assert a == b_
    others = {tuple(eng.run([1, 2, 3], 12, p, [], torch.Generator().manual_seed(s)).token_ids) for s in (4, 5, 6)}
    assert others - {tuple(a)}  # the generator drives the samples: other seeds give other tokens


def test_a_zero_exponential_draw_never_picks_a_zero_probability_token(monkeypatch):
    """The exponential race divides by the draws: a draw of exactly 0 (possible on CPU) made 0/0 = NaN at a
    zero-probability token, and argmax returns a NaN's index."""
    real = torch.Tensor.exponential_

    def zeros_first(self, *a, **k):
        real(self, *a, **k)
        return self.index_fill_(-1, torch.tensor([0]), 0.0)
    monkeypatch.setattr(torch.Tensor, "exponential_", zeros_first)
    probs = torch.tensor([[0.0, 0.25, 0.75], [0.0, 1.0, 0.0]])
    for seed in range(20):
        assert (sample_from(probs, torch.Generator().manual_seed(seed)) != 0).all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["t0.8", "t0.7-topk3"])
def test_each_draft_comes_with_the_q_it_was_drawn_from(small_model, params):
    """Draft by draft: the q handed to verification is the head's distribution at T * draft_temperature_scale
    (top-k applied there, zero outside the draft vocabulary), and the drafted tokens follow those q (chi-square
    of the counts against the summed q). The end-to-end tests above cannot see a q at T while the draw is at
    T * scale: with a sharp head q barely moves between the two."""
    import dataclasses

    from spd_fast.sampling import probs_from_logits
    from test_engine import random_head

    b = (0, 2, 4)
    head = random_head(small_model, b, seed=3)  # flat enough that the scale matters
    scale = 0.5
    head.dcfg = dataclasses.replace(head.dcfg, draft_temperature_scale=scale)
    drafter = PdmDrafter(head, 0)
    logits_seen, drafts = [], []
    real_logits, real_draft = head.draft_logits, drafter.draft

    def draft_logits(h):
        out = real_logits(h)
        logits_seen.append(out.detach().clone())
        return out

    def draft(*a, **k):
        tok, q = real_draft(*a, **k)
        drafts.append((int(tok), q.clone()))
        return tok, q
    head.draft_logits, drafter.draft = draft_logits, draft
    eng = SPDEngine(small_model, drafter, b)
    g = torch.Generator().manual_seed(11)
    for _ in range(150):
        eng.run([1, 2], 6, params, [], g)
    assert len(drafts) == len(logits_seen) > 400
    V = small_model.cfg.vocab_size
    scaled = dataclasses.replace(params, temperature=params.temperature * scale)
    obs, exp = torch.zeros(V), torch.zeros(V)
    for (tok, q), lg in zip(drafts, logits_seen):
        want = torch.zeros(V).scatter(0, head.draft_vocab, probs_from_logits(lg.float(), scaled))
        torch.testing.assert_close(q.float(), want, atol=1e-6, rtol=1e-5)
        assert q[tok] > 0
        obs[tok] += 1
        exp += q.float()
    keep = exp > 5
    assert int(keep.sum()) >= 3
    assert chisquare(obs[keep].numpy(), (exp[keep] * obs[keep].sum() / exp[keep].sum()).numpy()).pvalue > P_MIN


def test_top_p_keeps_or_drops_a_run_of_tied_logits_whole():
    """top-p keeps every token tied with the top one, and a run of equal logits at the cut is kept or dropped
    together, whatever order the sort puts it in: the engine's rule equals the C++/Triton ops' twin, and a tiny
    top_p then equals top_k=1 on tied top logits."""
    from spd_fast.ops_explicit import processed_probs

    tie = torch.tensor([1.0, 1.0, 0.0])
    for p in (1e-30, 0.3):
        got = probs_from_logits(tie, SamplingParams(temperature=1.0, top_p=p))
        assert torch.allclose(got, torch.tensor([0.5, 0.5, 0.0])), (p, got)
        assert torch.equal(got, probs_from_logits(tie, SamplingParams(temperature=1.0, top_k=1)))
    for x in (torch.tensor([2.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 2.0])):
        got = probs_from_logits(x, SamplingParams(temperature=1.0, top_p=0.6))
        assert torch.equal(got, processed_probs(x, 1.0, 0, 0.6))
        assert got[1] == got[2] > 0 and got[x.argmin()] == 0
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 50), generator=g).float()  # many ties
    for p in (0.2, 0.5, 0.9):
        assert torch.equal(probs_from_logits(x, SamplingParams(temperature=0.7, top_p=p)),
                           processed_probs(x, 0.7, 0, p))


def test_sampled_draft_is_a_token_id_with_the_law_of_q():
    """With a permuted, non-prefix draft vocabulary the sampled draft is a vocabulary token with q > 0, drawn with
    q's law (every other test's vocabulary was 0..V_d-1, where a draft-vocabulary row and its token id coincide)."""
    from spd_fast.ops import draft_sample

    vocab = torch.tensor([9, 3, 7, 0])
    logits = torch.tensor([1.0, 0.0, 0.5, -1.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(10)
    for _ in range(4000):
        tok, q = draft_sample(logits, vocab, 10, SamplingParams(temperature=1.0), g)
        assert q[tok] > 0, int(tok)
        counts[tok] += 1
    want = torch.softmax(logits, -1)
    assert chisquare(counts[vocab].numpy(), (4000 * want).numpy()).pvalue > 1e-3


def test_top_p_equal_to_the_mass_before_a_token_drops_it():
    """A token survives top-p iff the mass strictly before it is < top_p: a top_p exactly equal to the top token's
    mass drops the rest."""
    from spd_fast.sampling import processed_probs

    logits = torch.tensor([0.0, -1.0, -1.0])
    p0 = torch.softmax(logits.double(), -1)[0].item()  # the fp64 mass top_p_drop computes for token 0
    assert processed_probs(logits, 1.0, 0, p0).tolist() == [1.0, 0.0, 0.0]
    assert processed_probs(logits, 1.0, 0, p0 * (1 + 1e-12))[1] > 0  # just above it keeps the tied run

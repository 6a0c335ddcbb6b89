"""Context lookup beside the PDM: the op against a brute force, greedy exactness on every executor,
sampling stays lossless, and drafts really come from the lookup."""
from __future__ import annotations

import pytest
import torch

import spd_fast
import spd_fast.drafters as drafters_mod
from conftest import tiny_target
from spd_fast.ar import decode_ar
from spd_fast.config import SpdConfigError, uniform_boundaries
from spd_fast.drafters import PdmDrafter
from spd_fast.engine import SPDEngine
from spd_fast.ops import lookup_next
from spd_fast.pipeline import PipelinedEngine
from spd_fast.sampling import SamplingParams
from test_engine import random_head

GREEDY = SamplingParams()


def _brute(tokens: list[int], p_new: int, k: int) -> int | None:
    suffix = tokens[p_new - k + 1:p_new + 1]
    for end in range(p_new - 1, k - 2, -1):  # latest window ending before p_new
        if tokens[end - k + 1:end + 1] == suffix:
            return tokens[end + 1]
    return None


def test_lookup_next_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        L = int(torch.randint(6, 40, (), generator=g))
        toks = torch.randint(0, 3 if trial % 2 else 6, (L,), generator=g)
        k = int(torch.randint(1, 5, (), generator=g))
        p_new = int(torch.randint(k, L, (), generator=g))
        want = _brute(toks.tolist(), p_new, k)
        found, tok = lookup_next(toks, torch.tensor(p_new), k)
        assert bool(found) == (want is not None), (toks.tolist(), p_new, k)
        if want is not None:
            assert int(tok) == want
        # whatever lies after p_new (stale slots) never changes the answer
        junk = toks.clone()
        junk[p_new + 1:] = torch.randint(0, 3, (L - p_new - 1,), generator=g)
        f2, t2 = lookup_next(junk, torch.tensor(p_new), k)
        assert bool(f2) == bool(found) and (not bool(found) or int(t2) == int(tok))


def count_lookups(monkeypatch) -> list[int]:
    """Wrap the drafter's lookup; the returned list gets 1 per draft the lookup supplied, else 0."""
    hits = []
    real = drafters_mod.lookup_next

    def counting(tokens, p_new, k):
        found, tok = real(tokens, p_new, k)
        hits.append(int(found))
        return found, tok

    monkeypatch.setattr(drafters_mod, "lookup_next", counting)
    return hits


@pytest.mark.parametrize("n", [2, 3])
def test_lookup_greedy_exact_and_raises_acceptance(tiny_checkpoint, monkeypatch, n):
    """A random head rarely guesses right; on a looping greedy continuation the lookup copies the
    loop. Output equals AR on the sequential and the pipelined (sync-free) executor alike."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, n)
    head = random_head(m, b, vocab=97)
    ids = [5, 17, 3, 9, 5, 17, 3, 9]
    ref = decode_ar(m, ids, 40, GREEDY, []).token_ids
    plain = SPDEngine(m, PdmDrafter(head), b).run(ids, 40, GREEDY, [])
    hits = count_lookups(monkeypatch)
    seq = SPDEngine(m, PdmDrafter(head, lookup=2), b).run(ids, 40, GREEDY, [])
    pipe = PipelinedEngine(SPDEngine(m, PdmDrafter(head, lookup=2), b), "simulated").run(ids, 40, GREEDY, [])
    assert plain.token_ids == seq.token_ids == pipe.token_ids == ref
    for k in ("cycles", "verifications", "accepted"):
        assert seq.metrics[k] == pipe.metrics[k], k
    assert sum(hits) > 0
    assert seq.metrics["acceptance_rate"] > plain.metrics["acceptance_rate"] + 0.2


def test_a_lookup_longer_than_the_buffer_never_matches_on_either_executor(tiny_checkpoint):
    """load() takes lookup up to 64 with max_len down to 8; the sync-free executor ran the lookup over its
    max_len + 2 token buffer at once and crashed in torch.arange when k passed it."""
    from spd_fast.ops import lookup_next

    found, tok = lookup_next(torch.tensor([1, 2, 1, 2]), torch.tensor(3), 5)
    assert not bool(found) and int(tok) == 1
    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", max_len=32, lookup=40, progress=False)
    ids = [1, 2, 3]
    ref = decode_ar(eng.target.model, ids, 5, GREEDY, []).token_ids
    assert PipelinedEngine(eng.spd, "simulated").run(ids, 5, GREEDY, []).token_ids == ref
    assert eng.generate(ids, 5).token_ids == ref


def test_lookup_on_the_default_model_with_the_shipped_head(default_target, monkeypatch):
    """The default engine (shipped head, lookup 3) on a prompt that makes the model repeat itself."""
    eng = spd_fast.load(progress=False)
    assert eng.spd.drafter.lookup == 3
    prompt = [{"role": "user", "content": "Repeat the word hello five times."}]
    ids = default_target.encode(prompt)
    ref = decode_ar(default_target.model, ids, 40, GREEDY, default_target.eos_ids).token_ids
    hits = count_lookups(monkeypatch)
    assert eng.generate(prompt, 40).token_ids == ref
    assert sum(hits) > 5


def test_lookup_option_reaches_the_drafter(tiny_checkpoint):
    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", lookup=0, progress=False)
    assert eng.spd.drafter.lookup == 0
    from spd_fast.__main__ import build_parser

    from spd_fast.cli_common import load_engine

    args = build_parser().parse_args(["generate", "--user", "hi", "--lookup", "5", "--model", tiny_checkpoint("llama"),
                                      "--draft", "random"])
    assert load_engine(args, 2, quiet=True).spd.drafter.lookup == 5  # the CLI option reaches the drafter


def test_lookup_argument_errors():
    with pytest.raises(SpdConfigError, match=r"lookup must be an integer from 0 to 64.*got -2"):
        spd_fast.generate("hi", lookup=-2)
    with pytest.raises(SpdConfigError, match=r"lookup must be an integer from 0 to 64.*got 2.5"):
        PdmDrafter(None, lookup=2.5)


def _gated(head, conf, ratio):
    import copy
    import dataclasses

    h = copy.deepcopy(head)
    h.dcfg = dataclasses.replace(h.dcfg, lookup_gate_confidence=conf, lookup_gate_ratio=ratio)
    return h


def test_lookup_gate_matches_its_rule_draft_by_draft(tiny_checkpoint, monkeypatch):
    """Every draft of a gated run is the copy or the PDM's argmax exactly as the rule says (brute force
    from the PDM's probabilities); the gate both keeps and lets through copies on this run, and copies of
    tokens outside the draft vocabulary always go through."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = _gated(random_head(m, b, vocab=30), 0.02, 0.5)  # never very sure; 30 of the 97 tokens
    seen = []
    real_lookup, real_logits = drafters_mod.lookup_next, head.draft_logits

    def logits(h):  # once per draft, before the lookup
        out = real_logits(h)
        seen.append({"p": torch.softmax(out.float(), -1), "vocab": head.draft_vocab})
        return out

    def lookup(tokens, p_new, k):
        found, tok = real_lookup(tokens, p_new, k)
        seen[-1].update(found=bool(found), copied=int(tok))
        return found, tok

    head.draft_logits = logits
    monkeypatch.setattr(drafters_mod, "lookup_next", lookup)
    d = PdmDrafter(head, lookup=2)
    drafts = []
    real_draft = d.draft

    def draft(*a):
        tok, q = real_draft(*a)
        drafts.append(tok)
        return tok, q

    d.draft = draft
    ids = [5, 17, 3, 9, 5, 17, 3, 9]
    res = SPDEngine(m, d, b).run(ids, 40, GREEDY, [])
    assert res.token_ids == decode_ar(m, ids, 40, GREEDY, []).token_ids
    kept = copied = outside = 0
    for s, tok in zip(seen, drafts):
        own = int(s["vocab"][s["p"].argmax()])
        if "found" not in s or not s["found"]:
            assert int(tok) == own
            continue
        slot = (s["vocab"] == s["copied"]).nonzero()
        p_copy = float(s["p"][slot[0, 0]]) if slot.numel() else 0.0
        top = float(s["p"].max())
        keep = top > 0.02 and p_copy < 0.5 * top and slot.numel() > 0
        assert int(tok) == (own if keep else s["copied"])
        kept += keep and own != s["copied"]
        copied += not keep
        outside += slot.numel() == 0 and top > 0.02  # the rule would keep the PDM but for the vocabulary
    assert kept > 0 and copied > 0 and outside > 0, (kept, copied, outside)


def test_lookup_gate_extremes_and_executors_agree(tiny_checkpoint):
    """Gate (1, 0) is the ungated lookup; gate (0, 1) never lets a copy change the PDM's draft, so it
    drafts like lookup 0; a middle gate gives the same counts on the sequential and the sync-free
    pipelined executor, and greedy output equals AR throughout."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = random_head(m, b, vocab=97)
    ids = [5, 17, 3, 9, 5, 17, 3, 9]
    ref = decode_ar(m, ids, 40, GREEDY, []).token_ids

    def run(h, lookup, pipe=False):
        eng = SPDEngine(m, PdmDrafter(h, lookup=lookup), b)
        res = (PipelinedEngine(eng, "simulated") if pipe else eng).run(ids, 40, GREEDY, [])
        assert res.token_ids == ref
        return tuple(res.metrics[k] for k in ("cycles", "verifications", "accepted"))

    ungated, plain = run(head, 2), run(head, 0)
    assert ungated != plain
    assert run(_gated(head, 1.0, 0.0), 2) == ungated
    assert run(_gated(head, 0.0, 1.0), 2) == plain
    mid = _gated(head, 0.02, 0.5)
    assert run(mid, 2) == run(mid, 2, pipe=True)


def test_lookup_gate_config_errors(tiny_checkpoint):
    from spd_fast.pdm import DraftMismatchError

    m = tiny_target(tiny_checkpoint("llama"))
    head = random_head(m, uniform_boundaries(m.cfg.num_layers, 3), vocab=97)
    for conf, ratio, name, bad in ((1.5, 0.5, "lookup_gate_confidence", 1.5), (0.5, -0.1, "lookup_gate_ratio", -0.1),
                                   (0.5, True, "lookup_gate_ratio", True)):
        with pytest.raises(DraftMismatchError, match=rf"{name} {bad!r} is out of range: it must be a number in "
                                                     r"\[0, 1\].*fix draft_config.json"):
            _gated(head, conf, ratio)


def _boosted(head, boost, scale=1.0):
    import copy
    import dataclasses

    h = copy.deepcopy(head)
    h.dcfg = dataclasses.replace(h.dcfg, lookup_copy_boost=boost, draft_temperature_scale=scale)
    return h


def test_copy_boost_draws_from_the_boosted_q_draft_by_draft(tiny_checkpoint, monkeypatch):
    """Sampling with a copy boost d: on a match inside the draft vocabulary, the q the drafter hands to
    verification is softmax((logits + d * T' * e_copy) / T') (T' the draft temperature), scattered into
    the full vocabulary, and the draft has mass under it; a copy outside the draft vocabulary is drafted
    one-hot; without a match q is the PDM's own. Brute force from the raw PDM logits."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = _gated(_boosted(random_head(m, b, vocab=60), 2.0, scale=0.8), 0.02, 0.5)  # 60 of the 97 tokens
    d = PdmDrafter(head, lookup=1)
    raw, found = [], []
    real_logits, real_lookup = head.draft_logits, drafters_mod.lookup_next

    def logits(h):
        out = real_logits(h)
        raw.append(out.detach().clone())
        found.append(None)
        return out

    def lookup(tokens, p_new, k):
        f, tok = real_lookup(tokens, p_new, k)
        found[-1] = (bool(f), int(tok))
        return f, tok

    head.draft_logits = logits
    monkeypatch.setattr(drafters_mod, "lookup_next", lookup)
    out = []
    real_draft = d.draft

    def draft(*a):
        tok, q = real_draft(*a)
        out.append((int(tok), q.clone()))
        return tok, q

    d.draft = draft
    params = SamplingParams(temperature=0.9)
    V, vocab = m.cfg.vocab_size, head.draft_vocab.tolist()
    ids = [70, 17, 83, 9, 70, 17, 83, 9]  # 70 and 83 lie outside the draft vocabulary
    assert 70 not in vocab and 83 not in vocab
    SPDEngine(m, d, b).run(ids, 60, params, [], torch.Generator().manual_seed(0))
    t = 0.9 * 0.8
    kinds = {"boosted": 0, "one-hot": 0, "own": 0}
    for lg, f, (tok, q) in zip(raw, found, out):
        x = lg.float() / t
        p = torch.softmax(lg.float(), -1)
        if f is not None and f[0] and f[1] in vocab:
            x[vocab.index(f[1])] += 2.0
            kind = "boosted"
        elif f is not None and f[0]:  # outside the draft vocabulary: the gate always lets it through
            kind = "one-hot"
        else:
            kind = "own"
        if kind == "one-hot":
            want = torch.zeros(V).scatter_(0, torch.tensor([f[1]]), 1.0)
        else:
            want = torch.zeros(V).scatter_(0, head.draft_vocab, torch.softmax(x, -1))
        torch.testing.assert_close(q.float(), want, atol=1e-5, rtol=1e-4)
        assert float(q[tok]) > 0
        kinds[kind] += 1
    assert min(kinds.values()) > 0, kinds


def test_copy_boost_leaves_greedy_drafting_alone(tiny_checkpoint):
    """The boost is for sampled decoding: greedy runs of a boosted head count the same as without it,
    and still equal AR; sampled runs with the same seed differ (the boost acts)."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = _gated(random_head(m, b, vocab=97), 0.02, 0.5)
    ids = [5, 17, 3, 9, 5, 17, 3, 9]
    ref = decode_ar(m, ids, 40, GREEDY, []).token_ids

    def run(h, params):
        res = SPDEngine(m, PdmDrafter(h, lookup=1), b).run(ids, 40, params, [], torch.Generator().manual_seed(3))
        return res.token_ids, tuple(res.metrics[k] for k in ("cycles", "verifications", "accepted"))

    plain, boosted = run(head, GREEDY), run(_boosted(head, 6.0), GREEDY)
    assert plain == boosted and plain[0] == ref
    warm = SamplingParams(temperature=0.3)  # near-greedy: the output loops, so the lookup matches often
    assert run(head, warm) != run(_boosted(head, 6.0), warm)


def test_copy_boost_config_errors(tiny_checkpoint):
    from spd_fast.pdm import DraftMismatchError

    m = tiny_target(tiny_checkpoint("llama"))
    head = random_head(m, uniform_boundaries(m.cfg.num_layers, 3), vocab=97)
    for bad in (-1.0, 31.0, True, "2"):
        with pytest.raises(DraftMismatchError, match=rf"lookup_copy_boost {bad!r} is out of range: it must be null "
                                                     r"\(copies drafted one-hot\) or a number in \[0, 30\].*"
                                                     "fix draft_config.json"):
            _boosted(head, bad)
    assert _boosted(head, None).dcfg.lookup_copy_boost is None and _boosted(head, 0).dcfg.lookup_copy_boost == 0

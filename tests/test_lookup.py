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

    args = build_parser().parse_args(["generate", "--user", "hi", "--lookup", "5"])
    assert args.lookup == 5


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
    from the PDM's probabilities); the gate both keeps and lets through copies on this run."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = _gated(random_head(m, b, vocab=97), 0.02, 0.5)  # a random head is never very sure
    seen = []
    real_lookup, real_sample = drafters_mod.lookup_next, drafters_mod.draft_sample

    def sample(logits, vocab, V, params, gen):
        seen.append({"p": torch.softmax(logits.float(), -1), "vocab": vocab})
        return real_sample(logits, vocab, V, params, gen)

    def lookup(tokens, p_new, k):
        found, tok = real_lookup(tokens, p_new, k)
        seen[-1].update(found=bool(found), copied=int(tok))
        return found, tok

    monkeypatch.setattr(drafters_mod, "draft_sample", sample)
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
    kept = copied = 0
    for s, tok in zip(seen, drafts):
        own = int(s["vocab"][s["p"].argmax()])
        if "found" not in s or not s["found"]:
            assert int(tok) == own
            continue
        slot = (s["vocab"] == s["copied"]).nonzero()
        p_copy = float(s["p"][slot[0, 0]]) if slot.numel() else 0.0
        top = float(s["p"].max())
        keep = top > 0.02 and p_copy < 0.5 * top
        assert int(tok) == (own if keep else s["copied"])
        kept += keep and own != s["copied"]
        copied += not keep
    assert kept > 0 and copied > 0


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

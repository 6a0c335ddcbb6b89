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

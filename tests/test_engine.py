"""SPD engine: greedy exactness, cycle accounting, rollback, EOS handling, lossless sampling."""
from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, tiny_target
from spd_fast.ar import decode_ar
from spd_fast.config import uniform_boundaries
from spd_fast.drafters import PdmDrafter, ReferenceDrafter
from spd_fast.engine import SPDEngine
from spd_fast.pdm import DraftConfig, DraftHead, init_from_target
from spd_fast.sampling import SamplingParams

GREEDY = SamplingParams()


def random_head(model, boundaries, anchors=None, layers=1, seed=0, vocab=4096):
    # a small draft vocabulary keeps random-head tests on the 49k-vocab default model fast
    dcfg = DraftConfig.make(model.cfg, boundaries, anchors, layers, min(vocab, model.cfg.vocab_size))
    return init_from_target(DraftHead(dcfg, model.cfg, model.norm), model, seed).eval().requires_grad_(False)


def spd(model, prompt_ids, boundaries, new, params=GREEDY, eos=(), drafter=None, anchors=None, gen=None):
    drafter = drafter or PdmDrafter(random_head(model, boundaries, anchors))
    eng = SPDEngine(model, drafter, boundaries, anchors if anchors is not None else
                    (drafter.head.dcfg.anchors if isinstance(drafter, PdmDrafter) else None))
    return eng.run(prompt_ids, new, params, eos, gen)


DEFAULT_PROMPTS = ["A", "Hi there", [{"role": "user", "content": "Write a haiku about rain."}],
                   [{"role": "user", "content": "What is 17 * 3? Explain."}]]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 10])
def test_greedy_spd_equals_ar_default_model(default_target, n):
    m = default_target.model
    b = uniform_boundaries(30, n)
    for prompt in DEFAULT_PROMPTS[:2] + DEFAULT_PROMPTS[2:][n % 2:n % 2 + 1]:
        ids = default_target.encode(prompt)
        ref = decode_ar(m, ids, 20, GREEDY, default_target.eos_ids).token_ids
        got = spd(m, ids, b, 20, eos=default_target.eos_ids).token_ids
        assert got == ref, (n, prompt)


@pytest.mark.parametrize("boundaries,anchors", [((0, 4, 20, 30), None), ((0, 13, 30), None),
                                                ((0, 10, 20, 30), (0, 10, 20, 29)),
                                                ((0, 6, 12, 18, 24, 30), (0, 12, 24))],
                         ids=["uneven-3", "uneven-2", "anchors-0-10-20-29", "n5-shared-types"])
def test_greedy_spd_equals_ar_uneven_and_anchor_sets(default_target, boundaries, anchors):
    m = default_target.model
    ids = default_target.encode([{"role": "user", "content": "List three fruits."}])
    ref = decode_ar(m, ids, 24, GREEDY, default_target.eos_ids).token_ids
    assert spd(m, ids, boundaries, 24, eos=default_target.eos_ids, anchors=anchors).token_ids == ref


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_spd_equals_ar_tiny_families(tiny_checkpoint, family):
    m = tiny_target(tiny_checkpoint(family))
    L = m.cfg.num_layers
    g = torch.Generator().manual_seed(5)
    for n in sorted({1, 2, 3, L}):
        for plen in (1, 2, 7):
            ids = torch.randint(0, 97, (plen,), generator=g).tolist()
            ref = decode_ar(m, ids, 30, GREEDY, []).token_ids
            got = spd(m, ids, uniform_boundaries(L, n), 30, drafter=PdmDrafter(
                random_head(m, uniform_boundaries(L, n), layers=2, seed=n))).token_ids
            assert got == ref, (family, n, plen)


def test_first_token_near_tie_agrees_between_ar_and_spd(tiny_checkpoint, tmp_path):
    """A many-row and a one-row final norm + LM head can round differently (another kernel, another summation
    order). Two LM-head rows are tuned until the two computations of a 40-token prompt's last row disagree on
    the argmax; AR's prefill must then still pick the first token exactly as SPD's does."""
    import shutil

    from spd_fast import cpp_ops
    from spd_fast.packed import enable_fused_ops

    if not cpp_ops.available():
        pytest.skip("needs a C++ compiler for the fused one-row ops that make the two paths differ")
    d0 = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d0)
    m = tiny_target(str(d0))
    assert enable_fused_ops(m)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (40,), generator=g).tolist()
    x, pos = torch.tensor([ids]), torch.arange(40)[None]
    W = m.lm_head.weight.data  # the tiny model's LM head is its own tensor, so this touches nothing else
    with torch.inference_mode():
        h, _ = m.run_layers(m.embed_tokens(x), pos, 0, m.cfg.num_layers)
        hn = m.norm(h[:, -1])[0]
    W[5] += 3.0 * hn / hn.norm()  # row 5 clearly on top, then row 7 brought within rounding of it
    base, v = W[5].clone(), torch.randn(W.shape[1], generator=g)

    def logits(d: float, many: bool) -> torch.Tensor:
        W[7] = base + d * v
        with torch.inference_mode():
            if many:
                return m(x, pos)[0, -1]
            h, _ = m.run_layers(m.embed_tokens(x), pos, 0, m.cfg.num_layers)
            return m.logits(h[:, -1])[0]

    def crossing(many: bool) -> float:  # bisect d where row 7 overtakes row 5 in this computation
        lo, hi = -1e-5, 1e-5
        assert int(logits(lo, many).argmax()) == 5 and int(logits(hi, many).argmax()) == 7
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if int(logits(mid, many).argmax()) == 5 else (lo, mid)
        return hi

    c_many, c_one = crossing(True), crossing(False)
    d = next((d for d in (c_many, c_one, (c_many + c_one) / 2)
              if int(logits(d, True).argmax()) != int(logits(d, False).argmax())), None)
    assert d is not None, "no near-tie found: the test no longer separates the two computations"
    one = logits(d, False)
    ref = decode_ar(m, ids, 6, GREEDY, []).token_ids
    assert ref[0] == int(one.argmax())
    for n in (2, 3):
        assert spd(m, ids, uniform_boundaries(m.cfg.num_layers, n), 6).token_ids == ref, n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cycle_accounting_oracle_and_wrong(tiny_checkpoint, n):
    m = tiny_target(tiny_checkpoint("llama"))
    ids = [3, 14, 15, 92, 65]
    new = 25
    ref = decode_ar(m, ids, new, GREEDY, []).token_ids
    b = uniform_boundaries(6, n)
    oracle = spd(m, ids, b, new, drafter=ReferenceDrafter(ids + ref, 97, "oracle"))
    assert oracle.token_ids == ref
    mo = oracle.metrics
    assert mo["acceptance_rate"] == 1.0
    # n-1 warm-up cycles, then one token per cycle
    assert mo["cycles"] == (new - 1) + (n - 1)
    wrong = spd(m, ids, b, new, drafter=ReferenceDrafter(ids + ref, 97, "wrong"))
    assert wrong.token_ids == ref
    mw = wrong.metrics
    assert mw["acceptance_rate"] == 0.0
    assert mw["cycles"] == n * (new - 1)  # every token costs n cycles
    assert mw["tokens_per_cycle"] == pytest.approx(1 / n)
    assert mw["equivalent_accept_length"] == pytest.approx(1.0)


def test_eos_while_drafts_in_flight(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("qwen2"))
    ids = [5, 6, 7]
    free = decode_ar(m, ids, 30, GREEDY, []).token_ids
    eos = free[9]
    ref = decode_ar(m, ids, 30, GREEDY, [eos]).token_ids
    for n in (2, 4):
        res = spd(m, ids, uniform_boundaries(4, n), 30, eos=[eos],
                  drafter=ReferenceDrafter(ids + free, 97, "oracle"))
        assert res.token_ids == ref and res.finished_by_eos
        assert res.token_ids[-1] == eos


def test_max_new_tokens_one_and_capacity(tiny_checkpoint):
    """One new token (the prefill's) works; a KV cache of exactly prompt + new tokens + n + 1 slots (the in-flight
    tokens need room past the last committed one) decodes like AR, and one slot less is refused by name."""
    from spd_fast.config import SpdConfigError

    path = tiny_checkpoint("llama")
    m = tiny_target(path, max_len=64)
    ids = [1, 2, 3]
    ref = decode_ar(m, ids, 1, GREEDY, []).token_ids
    assert spd(m, ids, (0, 3, 6), 1).token_ids == ref
    n, new = 3, 12
    b = (0, 2, 4, 6)
    ref = decode_ar(tiny_target(path, max_len=64), ids, new, GREEDY, []).token_ids
    exact = tiny_target(path, max_len=len(ids) + new + n + 1)
    assert spd(exact, ids, b, new, drafter=ReferenceDrafter(ids + ref, 97, "oracle")).token_ids == ref
    short = tiny_target(path, max_len=len(ids) + new + n)
    with pytest.raises(SpdConfigError, match=f"\\+ {n + 1} in-flight slots"):
        spd(short, ids, b, new)


def test_rollback_caches_equal_fresh_run(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    m = tiny_target(path)
    b = (0, 2, 4, 6)
    ids = [11, 12, 13, 14]
    head = random_head(m, b, layers=2)
    eng = SPDEngine(m, PdmDrafter(head), b)
    toks = list(eng.generate(ids, 9, GREEDY, []))
    st = eng.last_state
    assert int(st.verifications) > int(st.accepts)  # at least one reject happened
    p_old = int(st.p_new) - int(st.fill) + 1
    seq = st.tokens[:p_old].tolist()
    assert seq == ids + toks[: p_old - len(ids)]
    fresh = tiny_target(path)
    fresh(torch.tensor([seq]), torch.arange(p_old)[None])
    for la, lb in zip(m.layers, fresh.layers):
        torch.testing.assert_close(la.attn.k_cache[0, :, :p_old], lb.attn.k_cache[0, :, :p_old], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.attn.v_cache[0, :, :p_old], lb.attn.v_cache[0, :, :p_old], atol=1e-5, rtol=1e-5)
    # the PDM cache holds exactly the depth-n rows of the committed positions
    fresh_head = random_head(m, b, layers=2)
    fresh_eng = SPDEngine(fresh, PdmDrafter(fresh_head), b)
    st2, _ = fresh_eng.start(seq, GREEDY, None)
    pl = int(st.pdm_len)
    for la, lb in zip(head.layers, fresh_head.layers):
        torch.testing.assert_close(la.attn.k_cache[0, :, :pl], lb.attn.k_cache[0, :, :pl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.attn.v_cache[0, :, :pl], lb.attn.v_cache[0, :, :pl], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [4, 5, 6])
def test_shipped_heads_for_n4_to_6_are_exact_and_draft_well(default_target, n):
    """The heads shipped for n=4..6 (one weights file, fine-tuned at n=4, then at n=5) load at their own
    split; greedy SPD with them equals AR and, unlike a random head, most drafts are accepted on a plain chat prompt."""
    from spd_fast.api import shipped_head
    from spd_fast.pdm import load_draft

    tg, net = default_target, default_target.model
    d = shipped_head(tg, n)
    assert d is not None and d.name == f"smollm2-135m-instruct-n{n}"
    head = load_draft(d, net, tg.fingerprint, n)
    assert head.dcfg.boundaries == uniform_boundaries(30, n) and head.dcfg.anchors == (0, 10, 20, 30)
    ids = tg.encode([{"role": "user", "content": "Explain photosynthesis in simple terms."}])
    ar = decode_ar(net, ids, 32, GREEDY, tg.eos_ids).token_ids
    out = SPDEngine(net, PdmDrafter(head), head.dcfg.boundaries, head.dcfg.anchors).run(ids, 32, GREEDY, tg.eos_ids)
    assert out.token_ids == ar
    assert out.metrics["accepted"] >= 0.4 * out.metrics["verifications"], out.metrics


def test_a_head_digest_names_its_weights_and_calibration(default_target, tmp_path):
    """Result files record which head ran (draft_digest): the same files give the same digest under any name, the
    n=4 and n=5 heads share weights but not calibration, and a changed calibration is another head."""
    import json
    import shutil

    from spd_fast.api import Engine, shipped_head
    from spd_fast.pdm import head_digest, load_draft

    tg, net = default_target, default_target.model
    d3, d4, d5 = (shipped_head(tg, n) for n in (3, 4, 5))
    copy = shutil.copytree(d3, tmp_path / "renamed")
    assert head_digest(copy) == head_digest(d3) and len(head_digest(d3)) == 16
    assert len({head_digest(d3), head_digest(d4), head_digest(d5)}) == 3
    cfg = json.loads((copy / "draft_config.json").read_text())
    cfg["lookup_gate_ratio"] = 0.123
    (copy / "draft_config.json").write_text(json.dumps(cfg))
    assert head_digest(copy) != head_digest(d3)
    head = load_draft(d3, net, tg.fingerprint, 3)
    b = head.dcfg.boundaries
    assert Engine(tg, head, b, 256, "shipped").draft_digest == head_digest(d3)
    assert Engine(tg, random_head(net, b), b, 256, "random").draft_digest == "random"


def test_stream_text_equals_generate_text_when_the_last_character_is_cut(default_target, monkeypatch):
    """stream() holds back an incomplete multi-byte character; when max_new_tokens cuts the answer inside one,
    the held-back rest still comes out at the end, so the chunks join to generate()'s text."""
    from spd_fast.api import Engine

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    tok = default_target.tokenizer
    emoji = tok.encode("Hi 🙂🙂", add_special_tokens=False)
    cut = next(k for k in range(1, len(emoji)) if tok.decode(emoji[:k]).endswith("\ufffd"))

    def fake(ids, max_new_tokens, params, method, eos, stop_fn=None, out=None):  # the decode: chosen tokens
        eng._last = (False, {})
        if out is not None:
            out["last"] = eng._last
        yield from emoji[:max_new_tokens]

    monkeypatch.setattr(eng, "_tokens", fake)
    for n in (cut, len(emoji)):
        chunks = list(eng.stream("x", n))
        assert "".join(chunks) == tok.decode(emoji[:n]) == eng.generate("x", n).text
        assert all(c for c in chunks)
    assert "".join(eng.stream("x", cut)).endswith("\ufffd")


@pytest.mark.parametrize("kind", ["text", "random ids"])
def test_stream_decodes_a_short_window_per_token_and_joins_to_the_whole_text(default_target, monkeypatch, kind):
    """stream() decodes only the newest few tokens per token (incremental detokenisation), not the whole answer
    so far, and its chunks still join to the whole list's text: for real text with multi-byte characters and
    special tokens, and for random ids (split characters, bytes that never complete)."""
    import random

    from spd_fast.api import Engine

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    tok = default_target.tokenizer
    if kind == "text":
        ids = tok.encode("Caf\u00e9 \u00fcber na\u00efve \U0001f642\U0001f680 \u4f60\u597d, the end.\n" * 20
                         + "<|im_end|>" + "def f(x):\n    return x ** 2\n" * 10, add_special_tokens=False)
    else:
        rng = random.Random(0)
        ids = [rng.randrange(default_target.cfg.vocab_size) for _ in range(600)]
    seen: list[int] = []
    decode = default_target.decode

    def counting(xs):
        seen.append(len(xs))
        return decode(xs)

    def fake(ids_, max_new_tokens, params, method, eos, stop_fn=None, out=None):
        eng._last = (False, {})
        if out is not None:
            out["last"] = eng._last
        yield from ids[:max_new_tokens]

    monkeypatch.setattr(eng, "_tokens", fake)
    monkeypatch.setattr(default_target, "decode", counting)
    chunks = list(eng.stream("x", len(ids)))
    assert "".join(chunks) == decode(ids) == eng.generate("x", len(ids)).text
    assert all(chunks)
    per_token = seen[:2 * len(ids)]  # two window decodes per token; then the final whole-list decode
    assert seen[2 * len(ids)] == len(ids)
    if kind == "text":
        assert len(ids) > 300 and max(per_token) <= 8, max(per_token)
    else:
        assert sum(per_token) < 20 * len(ids), sum(per_token)  # O(n); the whole list per token is ~n^2/2


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_an_open_stream_leaves_the_callers_grad_mode_alone(default_target, method):
    """Between chunks the caller's own code runs: torch's inference mode must be off there (inference tensors
    cannot be saved for backward), also after a stream is dropped half-way."""
    from spd_fast.api import Engine

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    s = eng.stream("Once upon a time", 8, method=method)
    for _ in s:
        assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    s = eng.stream("Once upon a time", 8, method=method)
    next(s)
    assert not torch.is_inference_mode_enabled()
    s.close()
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]


def test_a_random_head_takes_the_models_dtype_and_device_and_is_frozen(tiny_checkpoint):
    """`draft="random"` (and no shipped head) builds the head with `pdm.random_draft_head`: in the model's dtype,
    on its device (a head left on the CPU beside a CUDA model failed at the first cycle; bench/gpu_check.py
    builds its heads with the same function on the GPU), in eval mode and without gradients."""
    from spd_fast.loading import load_hf_dir
    from spd_fast.pdm import DraftConfig, random_draft_head

    m = load_hf_dir(tiny_checkpoint("llama"), torch.bfloat16)
    dcfg = DraftConfig.make(m.cfg, uniform_boundaries(m.cfg.num_layers, 3), None, 1, 50)
    head = random_draft_head(m, dcfg, seed=3)
    params = list(head.parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.device == m.embed.weight.device for p in params)
    assert not head.training and not any(p.requires_grad for p in params)
    again = random_draft_head(m, dcfg, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(params, again.parameters()))


def test_the_engine_reads_the_anchors_its_draft_head_was_trained_on(tiny_checkpoint):
    """SPDEngine took its anchors from `anchors` or the boundaries, never from the PDM head: a head trained on
    other anchors (same count) drafted from the wrong depths' states, silently (acceptance near 0)."""
    from spd_fast.config import SpdConfigError

    m = tiny_target(tiny_checkpoint("llama"))
    b = uniform_boundaries(m.cfg.num_layers, 3)
    head = random_head(m, b, anchors=(0, 1, 5, 6))
    assert SPDEngine(m, PdmDrafter(head), b).anchors == (0, 1, 5, 6)
    with pytest.raises(SpdConfigError, match=r"anchors \[0, 2, 4, 6\] differ from the draft head's \[0, 1, 5, 6\]; "
                                             r"omit anchors \(the head's are used\)"):
        SPDEngine(m, PdmDrafter(head), b, b)
    assert SPDEngine(m, ReferenceDrafter([1, 2], m.cfg.vocab_size), b).anchors == tuple(b)  # no head: the boundaries
    # a timing drafter runs its head through a PdmDrafter (bench/gpu_check.py): the same anchors
    assert SPDEngine(m, ReferenceDrafter([1, 2], m.cfg.vocab_size, head=head), b).anchors == (0, 1, 5, 6)


def test_pdm_draft_reads_every_slot_up_to_its_position(tiny_checkpoint):
    """The real PdmDrafter's draft logits at every cycle, across the 64-slot KV block boundary, equal a
    recomputation that reads the whole PDM cache (a kv_bound one position short passed every drafter test, all
    below position 64)."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = (0, 2, 4, 6)
    head = random_head(m, b, layers=2)
    seen = []
    orig_logits = head.draft_logits

    class Checked(PdmDrafter):
        def draft(self, engine, st, params, generator):
            out = super().draft(engine, st, params, generator)
            got = seen[-1]
            p_new, start = int(st.p_new), int(st.pdm_len)
            pos = torch.arange(start, p_new + 1)
            depth = torch.where(pos < st.p_old, engine.n, st.p_new - pos)
            g = head.aggregate(st.anchors[start:p_new + 1], engine.depth_type[depth])
            h = head.tower(g[None], pos[None], head.max_len)  # every slot; the mask hides stale ones
            torch.testing.assert_close(got, orig_logits(h[0, -1]), atol=1e-5, rtol=1e-5, msg=f"p_new={p_new}")
            self.checked.append(p_new)
            return out

    def rec(h):
        out = orig_logits(h)
        seen.append(out)
        return out
    head.draft_logits = rec
    d = Checked(head)
    d.checked = []
    prompt = [(7 * i) % 90 + 3 for i in range(60)]
    SPDEngine(m, d, b).run(prompt, 12, SamplingParams(), [])
    assert any(p % 64 == 0 for p in d.checked), d.checked


def test_a_decode_that_stops_advancing_raises_instead_of_looping(tiny_checkpoint, monkeypatch):
    """A cycle that commits nothing (a bug) made the sequential executor loop for ever; like the pipelined one it
    now raises once it has run more cycles than max_new_tokens can need."""
    m = tiny_target(tiny_checkpoint("llama"))
    b = (0, 3, 6)
    eng = SPDEngine(m, PdmDrafter(random_head(m, b)), b)

    def stuck(st, params, generator):
        with torch.inference_mode():  # the state's tensors are inference tensors
            st.cycles += 1  # counts, commits nothing

    monkeypatch.setattr(eng, "cycle", stuck)
    with pytest.raises(RuntimeError, match=r"ran 18 cycles for 1 of 5 tokens, more than it can need: its state "
                                           r"stopped advancing; this is a bug"):
        eng.run([5, 6, 7], 5, GREEDY, [])

"""The autoregressive baseline: token-identical to transformers' greedy generate; sampling options."""
from __future__ import annotations

import pytest
import torch

from spd_fast.ar import decode_ar
from spd_fast.sampling import SamplingParams, probs_from_logits

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}],
    "Once upon a time",
]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["capital", "code", "system", "raw"])
def test_greedy_matches_transformers_generate(default_target, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_target.path, dtype=torch.float32).eval()
    ids = default_target.encode(prompt)
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=40, eos_token_id=list(default_target.eos_ids),
                      pad_token_id=default_target.eos_ids[0])[0, len(ids):].tolist()
    got = decode_ar(default_target.model, ids, 40, SamplingParams(), default_target.eos_ids).token_ids
    assert got == ref


def test_stops_on_any_eos(default_target):
    ids = default_target.encode([{"role": "user", "content": "Say hello."}])
    free = decode_ar(default_target.model, ids, 30, SamplingParams(), eos_ids=[]).token_ids
    stop_tok = free[5]
    got = decode_ar(default_target.model, ids, 30, SamplingParams(), eos_ids=[99999, stop_tok]).token_ids
    assert got == free[: free.index(stop_tok) + 1]


def test_seeded_sampling_is_reproducible_and_varies(default_target):
    ids = default_target.encode("The weather today")
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    a = decode_ar(default_target.model, ids, 12, p, [], torch.Generator().manual_seed(7)).token_ids
    b = decode_ar(default_target.model, ids, 12, p, [], torch.Generator().manual_seed(7)).token_ids
    c = decode_ar(default_target.model, ids, 12, p, [], torch.Generator().manual_seed(8)).token_ids
    assert a == b and a != c


def test_unseeded_sampling_leaves_the_global_generator_alone():
    """seed=None draws a fresh seed without touching torch's default generator, which the caller may have
    seeded for its own work; two unseeded generators still differ."""
    from spd_fast.sampling import make_generator

    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    g1, g2 = (make_generator(SamplingParams(temperature=0.7), "cpu") for _ in range(2))
    assert torch.equal(torch.rand(3), want)
    assert not torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    assert make_generator(SamplingParams(), "cpu") is None  # greedy needs none


def test_top_k_top_p_processing():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    # softmax = [0.64, 0.24, 0.09, ...]: top_p=0.8 keeps the first two, renormalised
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.cat([torch.softmax(logits[:2], -1), torch.zeros(3)]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0
    p = probs_from_logits(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(p, torch.softmax(logits / 2, -1))


def test_the_ar_iterator_leaves_the_callers_code_out_of_inference_mode(tiny_checkpoint):
    """ArDecoder held inference mode across its yields: the caller's loop body, decode_ar's on_token and anything
    after an unfinished iterator made inference tensors (no autograd)."""
    from spd_fast.ar import ArDecoder
    from spd_fast.loading import load_hf_dir

    m = load_hf_dir(tiny_checkpoint("llama"))
    m.setup_caches(1, 64)
    seen = []
    ref = decode_ar(m, [1, 2, 3], 4, SamplingParams(), [],
                    on_token=lambda t: seen.append(torch.is_inference_mode_enabled()))
    assert seen == [False] * 4
    it = iter(ArDecoder(m, [1, 2, 3], 4, SamplingParams(), []))
    assert next(it) == ref.token_ids[0] and not torch.is_inference_mode_enabled()
    x = torch.ones(2, requires_grad=True) * 2
    assert not x.is_inference() and x.requires_grad
    assert [next(it) for _ in range(3)] == ref.token_ids[1:]



def test_decode_timings_include_waiting_for_the_device(tiny_checkpoint, monkeypatch):
    """On a GPU a step returns once its kernels are launched; AR and SPD stopped their decode clocks there, and the
    wait came later, at the token read, outside every timed window: decode_seconds (and `spd-fast bench`'s ratios)
    timed launches. Each timed window now ends after the device has caught up: a slow device shows in the time."""
    import time

    import spd_fast.ar as ar
    import spd_fast.engine as engine
    from conftest import tiny_target
    from spd_fast.config import uniform_boundaries
    from spd_fast.drafters import PdmDrafter
    from spd_fast.engine import SPDEngine
    from test_engine import random_head

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    ar.wait_for_device(torch.device("cpu"))
    assert synced == []
    ar.wait_for_device(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]

    waits = []

    def slow(device):  # a device that takes 20 ms to finish each step's work
        waits.append(device)
        time.sleep(0.02)

    monkeypatch.setattr(ar, "wait_for_device", slow)
    monkeypatch.setattr(engine, "wait_for_device", slow)
    m = tiny_target(tiny_checkpoint("llama"))
    m.setup_caches(1, 64)
    res = decode_ar(m, [1, 2, 3], 6, SamplingParams(), [])
    assert len(waits) == 1 + 5 and res.decode_seconds >= 5 * 0.02 and res.prefill_seconds >= 0.02
    waits.clear()
    b = uniform_boundaries(m.cfg.num_layers, 3)
    spd = SPDEngine(m, PdmDrafter(random_head(m, b)), b)
    out = spd.run([1, 2, 3], 6, SamplingParams(), [])
    cycles = int(spd.last_state.cycles)
    assert out.token_ids == res.token_ids and len(waits) == 1 + cycles
    assert out.metrics["decode_seconds"] >= cycles * 0.02

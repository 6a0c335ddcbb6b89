"""PDM checkpoints and training: mask vs brute force, loss goes down, resume, n mismatch."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_target
from spd_fast.config import SpdConfigError
from spd_fast.pdm import DraftConfig, DraftHead, DraftMismatchError, init_from_target, load_draft
from spd_fast.train.mask import brute_force_mask, structured_mask
from spd_fast.train.trainer import PdmTrainer, TrainConfig, collate, train


@pytest.mark.parametrize("boundaries,anchors", [((0, 10), None), ((0, 1, 2, 3), None), ((0, 2, 5, 6), None),
                                                ((0, 10, 20, 30), (0, 10, 20, 29)),
                                                ((0, 6, 12, 18, 24, 30), (0, 12, 24)),
                                                ((0, 1, 2, 3, 4, 5), (0, 2, 5))])
def test_structured_mask_matches_brute_force(boundaries, anchors):
    from spd_fast.config import ModelConfig

    L = boundaries[-1]
    cfg = ModelConfig("llama", 10, 8, 8, L, 2, 1, 4)
    dt = DraftConfig.make(cfg, boundaries, anchors).depth_types()
    n = len(boundaries) - 1
    for fill in range(1, n + 1):
        for T in (1, 6, 13):
            assert torch.equal(structured_mask(T, dt, fill), brute_force_mask(T, dt, fill)), (fill, T)


class FakeTarget:
    def __init__(self, model):
        self.model, self.fingerprint, self.eos_ids = model, "tiny", (0,)


def _samples(model, count=24, seed=0):
    """Self-distilled toy data: greedy continuations of random prompts by the tiny model itself."""
    from spd_fast.batch_generate import generate_batch
    from spd_fast.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 97, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(count)]
    model.setup_caches(count, 128)
    outs = generate_batch(model, prompts, 24, SamplingParams(), [])
    return [{"id": str(i), "prompt_ids": p, "response_ids": o} for i, (p, o) in enumerate(zip(prompts, outs))]


def test_training_lowers_loss_and_raises_agreement(tiny_checkpoint):
    torch.manual_seed(0)
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m)
    b = (0, 2, 4, 6)
    dcfg = DraftConfig.make(m.cfg, b, None, 1, 97)
    head = init_from_target(DraftHead(dcfg, m.cfg, m.norm), m)
    tr = PdmTrainer(m, head, TrainConfig(steps=60, lr=3e-3, warmup=5, fill_aug=0.0))
    batch = collate(data, 64)
    with torch.no_grad():
        loss0, s0 = tr.loss(*batch, fill=None)
    for _ in range(60):
        tr.train_step(batch)
    with torch.no_grad():
        loss1, s1 = tr.loss(*batch, fill=None)
    assert float(loss1) < 0.7 * float(loss0)
    assert s1["top1"] > s0["top1"] + 0.1


def test_checkpoint_round_trip_and_resume(tiny_checkpoint, tmp_path):
    m = tiny_target(tiny_checkpoint("llama"))
    data = _samples(m, 12)
    cfg = TrainConfig(steps=4, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    head = train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg, log=lambda s: None)
    loaded = load_draft(tmp_path / "run" / "head", m, "tiny", num_stages=3)
    for (k, v), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v.to(v2.dtype), v2, atol=1e-2, rtol=1e-2)  # saved in bf16
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    assert 0 in loaded.draft_vocab.tolist()  # EOS always in the draft vocabulary
    # resume: a longer run continues from step 4 instead of starting over
    logs = []
    cfg2 = TrainConfig(steps=6, batch_tokens=256, max_seq_len=64, save_every=2, log_every=2, warmup=1)
    train(FakeTarget(m), data, tmp_path / "run", num_stages=3, draft_vocab_size=50, cfg=cfg2, log=logs.append)
    assert logs[0].startswith("resumed from") and "step 4" in logs[0]
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 6


def test_head_refuses_other_n_and_other_model(tiny_checkpoint, tmp_path):
    m = tiny_target(tiny_checkpoint("llama"))
    head = init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 3, 6), fingerprint="abc"), m.cfg, m.norm), m)
    head.save(tmp_path / "h")
    with pytest.raises(DraftMismatchError, match="trained for num_stages=2, not 3.*train a head for n=3"):
        load_draft(tmp_path / "h", m, "abc", num_stages=3)
    with pytest.raises(DraftMismatchError, match="trained for other weights"):
        load_draft(tmp_path / "h", m, "zzz", num_stages=2)
    other = tiny_target(tiny_checkpoint("qwen3"))
    with pytest.raises(DraftMismatchError, match="different model.*model_type: head llama vs model qwen3"):
        load_draft(tmp_path / "h", other, "abc")
    with pytest.raises(SpdConfigError, match="not a draft head checkpoint"):
        load_draft(tmp_path, m, "abc")


def test_api_refuses_head_for_other_n(tiny_checkpoint, tmp_path):
    import spd_fast
    from spd_fast.runtime import weights_fingerprint

    m = tiny_target(tiny_checkpoint("llama"))
    fp = weights_fingerprint(m)
    init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 3, 6), fingerprint=fp), m.cfg, m.norm), m).save(tmp_path / "h")
    with pytest.raises(SpdConfigError, match="trained for num_stages=2, not 3"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "h"), num_stages=3)

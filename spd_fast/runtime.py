"""A loaded target model: weights, tokenizer, EOS ids and identity, plus prompt encoding."""
from __future__ import annotations

import hashlib
import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .config import ModelConfig, SpdConfigError
from .loading import fingerprint_tensors, load_hf_dir
from .model import Transformer
from .store import resolve_model_dir

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

Prompt = str | Sequence[dict[str, str]] | Sequence[int]  # text, chat messages, or token ids
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")  # roles chat templates know
_DEVICE_HINT = "use 'cpu', 'cuda' or 'cuda:<index>'"


def parse_device(device: str | torch.device) -> torch.device:
    """A CPU or CUDA device that exists here: CUDA must be present and the index must be visible."""
    if not isinstance(device, (str, torch.device)):
        raise SpdConfigError(f"device must be a string like 'cpu' or 'cuda:0', got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpdConfigError(f"device {device!r} is not a valid device; {_DEVICE_HINT}") from None
    if dev.type not in ("cpu", "cuda"):
        raise SpdConfigError(f"device {device!r} is not supported (spd_fast runs on CPU or CUDA); {_DEVICE_HINT}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpdConfigError(f"device={device!r} needs CUDA but this torch build has no GPU; use device='cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise SpdConfigError(f"device {device!r} does not exist: {count} CUDA GPU(s) are visible "
                                 f"(cuda:0..cuda:{count - 1}); pick one of those")
    return dev


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise SpdConfigError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise SpdConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class Target:
    model: Transformer
    tokenizer: Any
    path: Path
    eos_ids: tuple[int, ...]
    fingerprint: str

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def encode(self, prompt: Prompt) -> list[int]:
        from .ar import check_prompt_ids

        if is_token_ids(prompt):  # already tokenized (e.g. by the caller's own chat formatting)
            check_prompt_ids(prompt, self.cfg.vocab_size)
            return [int(t) for t in prompt]
        ids = encode_prompt(self.tokenizer, prompt)
        check_prompt_ids(ids, self.cfg.vocab_size, fix=f"the tokenizer in {self.path} does not match the model "
                         f"(vocab_size={self.cfg.vocab_size}); put the model's own tokenizer files there")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def cpu_info(cpuinfo: str | None = None) -> tuple[str, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo (or the given text); ("", set()) when it cannot tell.
    x86 lists its flags under "flags", Arm under "Features"."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    lines = cpuinfo.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return name, {f for ln in lines if ln.startswith(("flags", "Features")) for f in ln.split()}


def cpu_name(cpuinfo: str | None = None) -> str:
    """This CPU for benchmark records: its model name and the SIMD level the C++ decode ops compile
    for here (-march=native: "avx512", "avx2" (with FMA) or "portable"), e.g. "AMD EPYC [avx2]"."""
    import platform

    name, flags = cpu_info(cpuinfo)
    simd = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    return f"{name or platform.processor() or platform.machine()} [{simd}]"


def weights_fingerprint(model: Transformer) -> str:
    """`loading.fingerprint_tensors` of a model's weights as they are now (`load_target` uses the value of the
    checkpoint as stored, before any dtype cast)."""
    return fingerprint_tensors(model.embed.weight, model.norm.weight, model.layers[-1].mlp.w_down.weight,
                               model.layers[0].attn.wqkv.weight)


def model_identity(model: Transformer) -> str:
    """A full identity of what a model computes, for caches of its outputs (teacher features, self-distilled
    answers): its config (RoPE, norm epsilon, ...) and the bytes of every parameter as loaded. Unlike the
    sampled `fingerprint` that draft heads record, it sees a change to any layer or to config.json alone; it
    also differs between dtypes, which those caches key on anyway. Hashing the bytes costs about a second per
    GB, far less than the teacher pass it guards."""
    h = hashlib.sha256()
    cfg = model.cfg.to_dict()
    for k in ("bos_token_id", "eos_token_ids"):  # token ids the model never reads
        cfg.pop(k, None)
    h.update(json.dumps(cfg, sort_keys=True).encode())
    for name, p in model.named_parameters():  # tied weights are listed once
        t = p.detach()
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())  # no copy of the bytes on CPU
    return h.hexdigest()[:16]


def _eos_ids(path: Path, cfg: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = list(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            gcfg = json.loads(gen.read_text())
        except ValueError as e:
            raise SpdConfigError(f"{gen} is not valid JSON ({e}); fix it or delete it (it only adds end-of-sequence "
                                 f"ids)") from None
        e = gcfg.get("eos_token_id") if isinstance(gcfg, dict) else None
        e = e if isinstance(e, list) else ([e] if e is not None else [])
        bad = [x for x in e if not (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < cfg.vocab_size)]
        if bad:
            raise SpdConfigError(f"{gen}: eos_token_id must be token ids below the vocabulary size {cfg.vocab_size}, "
                                 f"got {bad[0]!r}; fix it or delete the key")
        ids += e
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def load_target(model: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", progress: bool = True, warn_dtype: bool = True) -> Target:
    """warn_dtype: warn when a dtype other than fp32 on CPU turns off the packed decode path (packed.maybe_attach);
    training passes False (it does not decode through it)."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(model, progress=progress)
    net = load_hf_dir(path, parse_dtype(dtype), device)
    from .packed import enable_fused_ops, maybe_attach

    maybe_attach(net, path, warn_dtype)  # GGUF models decode from their packed Q4_1/Q8_0 blocks (packed.py)
    enable_fused_ops(net)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((Path(path) / n).is_file() for n in names):
            raise SpdConfigError(f"{path} has no tokenizer files ({', '.join(names)}); copy the model's own tokenizer "
                                 f"files there (token-id data needs them too)") from None
        reason = " ".join(str(e).split())  # one line: transformers' messages span several
        raise SpdConfigError(f"cannot load the tokenizer from {path} ({type(e).__name__}: {reason[:300]}); check its "
                             f"tokenizer files") from None
    # the checkpoint's own identity: a head trained on it matches whatever dtype it was loaded in (an fp16
    # cast, rounded again to bf16 inside the hash, would differ from the fp32 or bf16 values)
    fp = getattr(net, "source_fingerprint", None) or weights_fingerprint(net)
    return Target(net, tok, path, _eos_ids(path, net.cfg, tok), fp)


def chat_ids(tokenizer: Any, messages: list, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template (transformers 5 returns a BatchEncoding,
    earlier versions a list)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def is_token_ids(prompt: Any) -> bool:
    """A prompt given as token ids: a non-empty list or tuple of integers (Python or numpy ints, not bools)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt))


def check_text(text: str, what: str) -> None:
    """Refuse text the tokenizer cannot take: a lone surrogate, which is what Python makes of bytes that were not
    UTF-8 (a Latin-1 command line, a truncated emoji in JSON); the tokenizer would fail with an obscure TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpdConfigError(f"{what} is not valid Unicode text: {e.object[e.start:e.end]!r} at character {e.start} "
                             f"is a lone surrogate (bytes that were not UTF-8, e.g. a Latin-1 terminal or a cut "
                             f"emoji); pass UTF-8 text") from None


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A str is raw text; a list of {"role", "content"} dicts goes through the chat template. (A list of token
    ids is taken as it is by `Target.encode`.)"""
    if isinstance(prompt, str):
        if not prompt:
            raise SpdConfigError("the prompt is empty; pass a non-empty string or a list of chat messages")
        check_text(prompt, "the prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, (list, tuple)) and not prompt:  # no messages, and no token ids either
        raise SpdConfigError("the prompt is an empty list (no chat messages, no token ids); pass at least one "
                             "{'role': 'user', 'content': ...} message or one token id")
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise SpdConfigError(f"chat message {m!r} needs string 'role' and 'content' keys")
            if m["role"] not in CHAT_ROLES:
                raise SpdConfigError(f"chat message {m!r} has role {m['role']!r}; use one of "
                                     + ", ".join(repr(r) for r in CHAT_ROLES))
            check_text(m["content"], f"the content of the {m['role']} message")
        if getattr(tokenizer, "chat_template", None) is None:
            raise SpdConfigError("this model's tokenizer has no chat template; pass the prompt as a plain string")
        try:
            ids = chat_ids(tokenizer, prompt)
        except Exception as e:  # jinja's TemplateError: a template that refuses this message order or role
            raise SpdConfigError(f"the model's chat template rejects these messages ({type(e).__name__}: {e}); "
                                 f"change the messages to the order and roles it accepts, or pass a plain string") from e
    else:
        raise SpdConfigError(
            f"prompt must be a str, a list of {{'role', 'content'}} dicts or a list of token ids, got "
            f"{type(prompt).__name__}")
    if not ids:
        raise SpdConfigError("the prompt encodes to zero tokens; pass a non-empty prompt")
    return [int(i) for i in ids]

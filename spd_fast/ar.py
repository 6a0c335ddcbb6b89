"""Plain autoregressive decoding with the same model code: the baseline SPD is measured against."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .config import SpdConfigError
from .model import Transformer
from .sampling import SamplingParams, next_token


@dataclass
class DecodeResult:
    token_ids: list[int]
    prefill_seconds: float
    decode_seconds: float
    finished_by_eos: bool
    metrics: dict[str, float] = field(default_factory=dict)


def check_capacity(model: Transformer, prompt_len: int, max_new_tokens: int, extra: int = 0) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise SpdConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    need = prompt_len + max_new_tokens + extra
    if need > model.max_len:
        raise SpdConfigError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens})"
            + (f" + {extra} in-flight slots" if extra else "")
            + f" = {need} exceeds the KV cache length {model.max_len}; "
            f"shorten the prompt, lower max_new_tokens or load with a larger max_len")


@torch.inference_mode()
def prefill(model: Transformer, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Run the prompt through every layer, fill the caches; return the last position's logits [V]."""
    dev = model.device
    ids = torch.tensor([list(prompt_ids)], device=dev)
    pos = torch.arange(len(prompt_ids), device=dev)[None]
    return model(ids, pos)[0, -1]


@torch.inference_mode()
def decode_ar(model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
              eos_ids: Sequence[int], generator: torch.Generator | None = None,
              on_token: Callable[[int], None] | None = None) -> DecodeResult:
    check_capacity(model, len(prompt_ids), max_new_tokens)
    dev = model.device
    eos = set(int(e) for e in eos_ids)
    t0 = time.perf_counter()
    tok = next_token(prefill(model, prompt_ids), params, generator)
    t1 = time.perf_counter()
    out: list[int] = []
    pos = torch.tensor([[len(prompt_ids)]], device=dev)
    finished = False
    while True:
        t = int(tok)
        out.append(t)
        if on_token is not None:
            on_token(t)
        if t in eos:
            finished = True
            break
        if len(out) >= max_new_tokens:
            break
        logits = model(tok.view(1, 1), pos)[0, -1]
        tok = next_token(logits, params, generator)
        pos += 1
    t2 = time.perf_counter()
    steps = max(1, len(out) - 1)  # decode steps after the prefill token
    return DecodeResult(out, t1 - t0, t2 - t1, finished,
                        {"ms_per_token": 1e3 * (t2 - t1) / steps, "tokens_per_second": steps / max(t2 - t1, 1e-9)})

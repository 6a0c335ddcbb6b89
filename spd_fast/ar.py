"""Plain autoregressive decoding with the same model code: the baseline SPD is measured against."""
from __future__ import annotations

import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .config import SpdConfigError
from .model import Transformer
from .sampling import SamplingParams, next_token


def wait_for_device(device: torch.device) -> None:
    """Block until `device` has run the work queued on it: a CUDA step returns once its kernels are launched, so a
    clock read without this times the launches, not the kernels. A no-op on CPU (and free on CUDA where the caller
    reads a token right after anyway)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeResult:
    token_ids: list[int]
    prefill_seconds: float
    decode_seconds: float
    finished_by_eos: bool
    metrics: dict[str, float] = field(default_factory=dict)


def check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise SpdConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int,
                     fix: str = "pass token ids from this model's tokenizer") -> None:
    """Every prompt token must be an integer id of the model's vocabulary (else the embedding fails)."""
    if len(prompt_ids) == 0:
        raise SpdConfigError("the prompt has no tokens; pass at least one token id")
    for i, t in enumerate(prompt_ids):
        try:
            v = operator.index(t)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            v = -1
        if isinstance(t, bool) or not 0 <= v < vocab_size:
            raise SpdConfigError(f"prompt token {t!r} at position {i} is not a token id of this model "
                                 f"(integers 0..{vocab_size - 1}); {fix}")


def check_eos_ids(eos_ids: Sequence[int], vocab_size: int | None) -> tuple[int, ...]:
    """Extra stop tokens must be token ids of the model (one it can never produce would silently never stop).
    vocab_size None (the model not loaded yet): only that they are integers >= 0."""
    if eos_ids is None:  # like stop=None: no extra stop token
        return ()
    if not isinstance(eos_ids, (list, tuple)):
        raise SpdConfigError(f"eos_ids must be a list of token ids, got {eos_ids!r}")
    out = []
    for t in eos_ids:
        try:
            v = operator.index(t)
        except TypeError:
            v = -1
        if isinstance(t, bool) or not 0 <= v < (sys.maxsize if vocab_size is None else vocab_size):
            span = "an integer >= 0" if vocab_size is None else f"integers 0..{vocab_size - 1}"
            raise SpdConfigError(f"eos id {t!r} is not a token id of this model ({span}); "
                                 "pass stop token ids from this model's tokenizer")
        out.append(v)
    return tuple(out)


def check_capacity(model: Transformer, prompt_len: int, max_new_tokens: int, extra: int = 0) -> None:
    check_max_new_tokens(max_new_tokens)
    need = prompt_len + max_new_tokens + extra
    if need > model.max_len:
        raise SpdConfigError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens})"
            + (f" + {extra} in-flight slots" if extra else "")
            + f" = {need} exceeds the KV cache length {model.max_len}; "
            f"shorten the prompt, lower max_new_tokens or load with a larger max_len")


def check_context(context: int, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a request longer than the model's context (`max_position_embeddings`), as vLLM refuses one past
    max_model_len: a KV cache may be longer than the positions the model was trained for."""
    if prompt_len + max_new_tokens > context:
        fix = (f"lower max_new_tokens to at most {context - prompt_len}" if prompt_len < context else
               f"shorten the prompt to under {context} tokens")
        raise SpdConfigError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens={max_new_tokens} is longer than this model's "
            f"context of {context} positions (max_position_embeddings); {fix}")


@torch.inference_mode()
def prefill(model: Transformer, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Run the prompt through every layer, fill the caches; return the last position's logits [V].
    The final norm and LM head see the last row alone, as in `SPDEngine.start`: a many-row call may take
    another kernel (another summation order), and a near-tie would then give AR and SPD different first
    tokens."""
    dev = model.device
    ids = torch.tensor([list(prompt_ids)], device=dev)
    pos = torch.arange(len(prompt_ids), device=dev)[None]
    h, _ = model.run_layers(model.embed_tokens(ids), pos, 0, model.cfg.num_layers)
    return model.logits(h[:, -1])[0]


class ArDecoder:
    """Token-by-token AR decoding as an iterator (for streaming); `result` is set when it ends."""

    def __init__(self, model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                 eos_ids: Sequence[int], generator: torch.Generator | None = None,
                 stop_fn: Callable[[int], bool] | None = None):
        check_capacity(model, len(prompt_ids), max_new_tokens)
        check_prompt_ids(prompt_ids, model.cfg.vocab_size)
        self.model, self.prompt_ids, self.max_new = model, list(prompt_ids), max_new_tokens
        self.params, self.eos, self.gen = params, set(int(e) for e in eos_ids), generator
        self.stop_fn = stop_fn  # as in SPDEngine.generate: True after a token ends the generation there
        self.result: DecodeResult | None = None

    def __iter__(self) -> Iterator[int]:
        """Inference mode only around the prefill and each step, not across the yields: the caller's loop body (or
        decode_ar's on_token) and anything after an iterator left unfinished run in its own mode."""
        model, dev = self.model, self.model.device
        t0 = time.perf_counter()
        with torch.inference_mode():
            tok = next_token(prefill(model, self.prompt_ids), self.params, self.gen)
            pos = torch.tensor([[len(self.prompt_ids)]], device=dev)
        wait_for_device(dev)
        t1 = time.perf_counter()
        out: list[int] = []
        finished = False
        decode_time = 0.0
        while True:
            t = int(tok)
            out.append(t)
            yield t
            if t in self.eos:
                finished = True
                break
            if len(out) >= self.max_new or (self.stop_fn is not None and self.stop_fn(t)):
                break
            ts = time.perf_counter()
            with torch.inference_mode():
                logits = model(tok.view(1, 1), pos)[0, -1]
                tok = next_token(logits, self.params, self.gen)
                pos += 1
            wait_for_device(dev)  # the step's kernels, not only their launches
            decode_time += time.perf_counter() - ts
        steps = max(1, len(out) - 1)  # decode steps after the prefill token
        self.result = DecodeResult(out, t1 - t0, decode_time, finished,
                                   {"ms_per_token": 1e3 * decode_time / steps,
                                    "tokens_per_second": (len(out) - 1) / max(decode_time, 1e-9)})


def decode_ar(model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
              eos_ids: Sequence[int], generator: torch.Generator | None = None,
              on_token: Callable[[int], None] | None = None) -> DecodeResult:
    dec = ArDecoder(model, prompt_ids, max_new_tokens, params, eos_ids, generator)
    for t in dec:
        if on_token is not None:
            on_token(t)
    assert dec.result is not None
    return dec.result

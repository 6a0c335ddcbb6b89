"""The public API: load(), generate(), stream()."""
from __future__ import annotations

import difflib
import functools
import inspect
import numbers
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .ar import ArDecoder, check_capacity, check_context, check_eos_ids, check_max_new_tokens
from .config import (DEFAULT_LOOKUP, RandomHeadWarning, SpdConfigError, check_head_seed, check_layer_indices,
                     check_lookup, check_seed, check_stage_count, uniform_boundaries, validate_boundaries,
                     validate_num_stages)
from .drafters import PdmDrafter
from .engine import SPDEngine, run_stepwise
from .pdm import DraftConfig, DraftHead, DraftMismatchError, load_draft, random_draft_head, read_draft_config
from .runtime import Prompt, Target, check_text, is_token_ids, load_target, parse_device, parse_dtype
from .sampling import SamplingParams, make_generator, plain_number

HEADS_DIR = Path(__file__).parent / "heads"
DEFAULT_NUM_STAGES = 3
METHODS = ("spd", "ar")
# local = sequential: the reference executor (CPU and GPU); streams: one GPU, a CUDA stream per stage,
# the cycle as a CUDA graph; devices: one stage per GPU (spd_fast/pipeline.py); distributed: one stage
# per torchrun rank (spd_fast/distributed/)
PLACEMENTS = ("local", "sequential", "streams", "devices", "distributed")


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


def _take_sampling_params(bound: inspect.BoundArguments) -> None:
    """`sampling_params=SamplingParams(...)` (as vLLM users write it) in place of the separate settings."""
    if isinstance(bound.arguments.get("max_new_tokens"), SamplingParams):
        raise SpdConfigError("max_new_tokens (the second argument) got a SamplingParams; pass it as "
                             "sampling_params=SamplingParams(...), and the token budget as max_new_tokens")
    sp = bound.arguments.pop("sampling_params", None)
    if sp is None:
        return
    if not isinstance(sp, SamplingParams):
        raise SpdConfigError(f"sampling_params must be a spd_fast.SamplingParams, got {sp!r}")
    clash = [k for k in _SAMPLING_FIELDS if k in bound.arguments]
    if clash:
        raise SpdConfigError(f"{', '.join(clash)} given both on its own and in sampling_params; pass the sampling "
                             "settings one way")
    for k in _SAMPLING_FIELDS:
        bound.arguments[k] = getattr(sp, k)


def _plain_numbers(fn):
    """Let numpy (or other numbers-ABC) scalars stand for ints and floats in the keyword settings:
    they are turned into plain Python numbers before the checks and before they reach metrics/JSON.
    Also takes `sampling_params` apart (where the function has it) and names the function, and the nearest
    parameter, for an unknown keyword (`max_tokens=` -> max_new_tokens)."""
    sig = inspect.signature(fn)
    names = [k for k in sig.parameters if k != "self"]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for k in kwargs:
            if k not in sig.parameters:
                near = difflib.get_close_matches(k, names, n=1, cutoff=0.6)
                raise TypeError(f"{fn.__qualname__}() got an unexpected keyword argument {k!r}"
                                + (f"; did you mean {near[0]!r}?" if near else ""))
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{fn.__qualname__}(): {e}") from None
        if "sampling_params" in sig.parameters:
            _take_sampling_params(bound)
        for k, v in bound.arguments.items():
            bound.arguments[k] = plain_number(v)
        return fn(*bound.args, **bound.kwargs)

    return wrapper


@dataclass
class GenerationOutput:
    """One prompt's answer: its text (cut before a stop string), the new token ids, the prompt's length in
    tokens, whether a stop token ended it, the decode's metrics (acceptance_rate, tokens_per_cycle,
    equivalent_accept_length, tokens_per_second, ...) and why it ended (`finish_reason`)."""
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finished_by_eos: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # "eos" (a stop token), "stop" (a stop string: `text` ends before it, `token_ids` include the token that
    # completed it) or "length" (max_new_tokens)
    finish_reason: str = "length"


def check_stop(stop: Any, placement: str = "local") -> tuple[str, ...]:
    """Stop strings: None, a str or a list of non-empty str (none with placement="distributed")."""
    items = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) and x for x in items):
        raise SpdConfigError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    if any("\ufffd" in x for x in items):  # the decoded text shows half a character as U+FFFD: no match would be real
        raise SpdConfigError(f"stop string {next(x for x in items if chr(0xfffd) in x)!r} holds U+FFFD, the replacement "
                             f"character, which the decoded text shows for an incomplete character; drop it")
    for x in items:  # a lone surrogate (bytes that were not UTF-8, e.g. a Latin-1 terminal) is in no decoded text
        check_text(x, f"stop string {x!r}")
    if items and placement == "distributed":
        raise SpdConfigError("placement='distributed' takes no stop strings; pass their tokens as eos_ids, or use "
                             "another placement")
    return tuple(items)


class StopStrings:
    """Ends a generation at the first token whose text completes one of the stop strings (the prompt's text is
    not searched). Called with each committed token by the decoders; `cut(text)` is where the answer ends."""

    def __init__(self, decode: Any, stops: Sequence[str]):
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []
        # the text of the newest tokens that can hold any stop string the newest token completes, with characters to
        # spare before it (a window's first token may decode differently, e.g. without its leading space)
        self.chars = max(map(len, self.stops)) + 8

    def __call__(self, token: int) -> bool:
        self.ids.append(int(token))
        # characters before the newest token's own text: a stop string it completes starts within them
        need = self.chars + len(self.decode(self.ids[-1:]))
        w = self.chars  # tokens; grown while they decode to fewer characters (special tokens decode to nothing)
        while True:
            text = self.decode(self.ids[-w:])
            if len(text) >= need or w >= len(self.ids):
                # U+FFFD at an end is half a character (the newest token's, or one the window starts inside),
                # not text: a stop string must not match it
                return self.cut(text.strip("\ufffd")) is not None
            w *= 2

    def cut(self, text: str) -> int | None:
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """How many characters at the end of `text` could be the start of a stop string (a stream holds them)."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)


class IncrementalText:
    """The text of a growing token list, decoding a short window of the newest tokens per token (the offsets
    scheme of vLLM's detokenizer) instead of the whole list: a stream of n tokens costs O(n), not O(n^2).

    `prefix` and `read` index the token list: text up to `read` is out; the tokens from `prefix` to `read` are
    decoded again with the new ones, so a token whose text depends on its neighbours, or a character split
    across tokens, comes out whole. While the window's text ends in an incomplete character (U+FFFD), nothing
    comes out and the window grows. `push` returns the new text (often ""); `text` is all of it."""

    def __init__(self, decode: Any):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.decode(self.ids[self.prefix:self.read])
        now = self.decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            return ""  # an incomplete character, or a token that adds no text yet (e.g. a skipped special token)
        new = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new


def shipped_head(target: Target, num_stages: int) -> Path | None:
    """The head shipped in spd_fast/heads/ for this model's weights and n, if there is one."""
    if not HEADS_DIR.is_dir():
        return None
    for d in sorted(HEADS_DIR.iterdir()):
        if (d / "draft_config.json").is_file():
            try:
                dc = read_draft_config(d)
            except DraftMismatchError as e:  # a damaged install: say which head, not a raw JSON/KeyError
                raise DraftMismatchError(f"the shipped draft head {d.name} is damaged ({e}); reinstall spd_fast, "
                                         "or pass draft= (a head directory or 'random') to skip the shipped "
                                         "heads") from None
            if dc.base_fingerprint == target.fingerprint and dc.num_stages == num_stages:
                return d
    return None


class Engine:
    """A loaded target model plus a draft head for one pipeline shape; reusable across calls."""

    def __init__(self, target: Target, head: DraftHead | None, boundaries: tuple[int, ...], max_len: int,
                 draft_source: str, placement: str = "local", cuda_graphs: bool | None = None,
                 lookup: int = DEFAULT_LOOKUP):
        self.target, self.head, self.boundaries = target, head, boundaries
        self.num_stages = len(boundaries) - 1
        self.max_len = max_len
        self.draft_source = draft_source
        # which head ran (its weights and calibration files), for result files: "random" for a random head
        self.draft_digest = getattr(head, "digest", "random") if head is not None else None
        self.placement = placement
        self.pipelined = None
        self.graphed_ar = None
        self._gen: torch.Generator | None = None
        # under the model's lock: a generate() in another thread on an engine sharing this loaded target (the
        # cached one of other settings) would otherwise have its KV cache reallocated under it mid-decode
        with target.model.decode_lock:
            target.model.setup_caches(1, max_len)
            anchors = head.dcfg.anchors if head is not None else None
            self.spd = (SPDEngine(target.model, PdmDrafter(head, lookup), boundaries, anchors) if head is not None
                        else None)
            if placement in ("streams", "devices"):
                from .graphed_ar import GraphedAR
                from .pipeline import PipelinedEngine

                if self.spd is not None:
                    self.pipelined = PipelinedEngine(self.spd, placement, cuda_graphs)
                self.graphed_ar = GraphedAR(target.model, cuda_graphs if placement == "streams" else False)

    # -- one prompt -------------------------------------------------------------------------------
    def _tokens(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, method: str,
                eos: tuple[int, ...], stop_fn: StopStrings | None = None, out: dict | None = None) -> Iterator[int]:
        """The decode of one prompt, refusing to go on once another generation has reused the caches: the
        model has one KV cache (and the engine one PDM cache), so an open stream() whose consumer meanwhile
        ran another generate() or stream() on this engine, or on another Engine built on the same loaded
        target, would otherwise continue from the other's state. The count lives on the model, which
        owns the caches. When it ends, out["last"] is this decode's (finished_by_eos, metrics)."""
        model = self.target.model
        lock = model.decode_lock  # held while the decoder runs, never across a yield into the caller's code
        with lock:
            self._own_caches()  # another user of the model may have resized them since the call's capacity check
            old = model.open_decode() if model.open_decode is not None else None
            if old is not None:  # superseded here: it could only refuse to go on, so its state goes now
                try:
                    old.close()
                except ValueError:  # it is running (this generation was started from inside it): it ends itself
                    pass
            model.generations += 1
            mine = model.generations
            steps = self._decode(prompt_ids, max_new_tokens, params, method, eos, stop_fn, out)
            model.open_decode = weakref.ref(steps)

        def still_mine() -> None:
            if model.generations != mine:
                raise SpdConfigError(
                    "another generate() or stream() ran on this engine (or on another Engine sharing its loaded "
                    "model) while this stream was open and reused its KV cache, so this stream cannot go on; "
                    "finish (or close) a stream before starting another generation on the same model, or load a "
                    "second engine with spd_fast.load() for the other")
        yield from run_stepwise(steps, lambda: lock, still_mine)

    @torch.inference_mode()  # on a generator: on only while it runs, never across a yield into the caller's code
    def _decode(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, method: str,
                eos: tuple[int, ...], stop_fn: StopStrings | None, out: dict | None = None) -> Iterator[int]:
        # the GPU placements keep one generator, reseeded per call, so their CUDA graphs (which register it)
        # are not captured again for every sampled call
        graphed = self.pipelined is not None or self.graphed_ar is not None
        gen = make_generator(params, self.target.model.device, self._gen if graphed else None)
        if graphed and gen is not None:
            self._gen = gen
        if method == "ar":
            if self.graphed_ar is not None:  # the strong baseline of the GPU placements
                dec = self.graphed_ar
                yield from dec.generate(prompt_ids, max_new_tokens, params, eos, gen, stop_fn)
            else:
                dec = ArDecoder(self.target.model, prompt_ids, max_new_tokens, params, eos, gen, stop_fn)
                yield from dec
            res = dec.result
            last = (res.finished_by_eos, {**res.metrics, "prefill_seconds": res.prefill_seconds,
                                          "decode_seconds": res.decode_seconds,
                                          "new_tokens": float(len(res.token_ids)), "num_stages": 1.0})
        else:
            if self.spd is None:
                raise SpdConfigError("this engine has no draft head; load it with a draft or use method='ar'")
            runner = self.pipelined if self.pipelined is not None else self.spd
            yield from runner.generate(prompt_ids, max_new_tokens, params, eos, gen, stop_fn)
            last = (runner.last_finished_by_eos, {**runner.last_metrics, "num_stages": float(self.num_stages)})
        # still under the decode lock: the engine's newest result, and this call's own (a stream reads it after
        # its last yield, when another generation on the engine may have run)
        self._last = last
        if out is not None:
            out["last"] = last

    @_plain_numbers
    def generate(self, prompt: Prompt | Sequence[Prompt], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, method: str = "spd",
                 eos_ids: Sequence[int] = (), stop: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | None = None) -> GenerationOutput | list[GenerationOutput]:
        """eos_ids: stop tokens besides the model's own (e.g. a chat format's end-of-turn id). stop: strings that
        end the answer when its text contains one (the text is cut before it, as vLLM does). sampling_params: a
        SamplingParams in place of temperature, top_k, top_p and seed."""
        with self.target.model.decode_lock:  # calls from several threads run one after the other
            return self._generate(prompt, max_new_tokens, temperature, top_k, top_p, seed, method, eos_ids, stop)

    def _generate(self, prompt: Prompt | Sequence[Prompt], max_new_tokens: int, temperature: float, top_k: int,
                  top_p: float, seed: int | None, method: str, eos_ids: Sequence[int],
                  stop: str | Sequence[str] | None) -> GenerationOutput | list[GenerationOutput]:
        prompts, single = _as_batch(prompt)
        params = SamplingParams(temperature, top_k, top_p, seed)
        _check_method(method)
        check_max_new_tokens(max_new_tokens)
        eos = self._eos(eos_ids)
        stops = check_stop(stop)
        encoded = []
        for i, p in enumerate(prompts):  # a bad prompt fails before any decoding, named by its index in a batch
            try:
                encoded.append(self.target.encode(p))
                self._check_fits(encoded[-1], max_new_tokens, method)
            except SpdConfigError as e:
                if single:
                    raise
                raise SpdConfigError(f"prompt {i} of the batch: {e}") from None
        outs = []
        for ids in encoded:
            checker = StopStrings(self.target.decode, stops) if stops else None
            toks = list(self._tokens(ids, max_new_tokens, params, method, eos, checker))
            finished, metrics = self._last
            text = self.target.decode(toks)
            cut = checker.cut(text) if checker is not None else None
            reason = "eos" if finished else "stop" if cut is not None else "length"
            outs.append(GenerationOutput(text if cut is None else text[:cut], toks, len(ids), finished, metrics,
                                         reason))
        return outs[0] if single else outs

    @_plain_numbers
    def stream(self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, method: str = "spd", eos_ids: Sequence[int] = (),
               stop: str | Sequence[str] | None = None, sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Yield verified text as it is committed (held back while a multi-byte character is incomplete, or
        while it could be the start of a stop string). Bad arguments raise here, before the first chunk is asked
        for."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        _check_method(method)
        check_max_new_tokens(max_new_tokens)
        eos = self._eos(eos_ids)
        stops = check_stop(stop)
        _check_single(prompt)
        ids = self.target.encode(prompt)
        with self.target.model.decode_lock:  # it may resize the caches another thread is decoding on
            self._check_fits(ids, max_new_tokens, method)
        return self._stream(ids, max_new_tokens, params, method, eos,
                            StopStrings(self.target.decode, stops) if stops else None)

    def _eos(self, eos_ids: Sequence[int]) -> tuple[int, ...]:
        """The model's own stop tokens plus the caller's (checked: an id the model cannot produce never stops)."""
        return tuple(dict.fromkeys(self.target.eos_ids + check_eos_ids(eos_ids, self.target.cfg.vocab_size)))

    def _own_caches(self) -> None:
        """Give the model back the KV cache this engine was built with: another Engine on the same loaded target,
        batched generation or training may have reallocated it at another size (a no-op otherwise). A
        reallocation ends any generation in progress on the old caches (`Transformer.setup_caches`)."""
        model = self.target.model
        kc = model.layers[0].attn.k_cache
        if kc is not None and kc.shape[0] > 1:  # batched generation grew it: give back all but one row's worth
            model.free_caches()
        model.setup_caches(1, self.max_len)

    def _extra_slots(self, method: str) -> int:
        """KV slots a decode needs beyond the prompt and its new tokens: SPD's in-flight tokens, graphed AR's lag."""
        if method == "spd":
            return self.num_stages + 1
        return self.graphed_ar.lag + 2 if self.graphed_ar is not None else 0

    def room(self, prompt_len: int, method: str = "spd") -> int:
        """The most new tokens a prompt of `prompt_len` tokens can get: the KV cache and the model's context."""
        return min(self.max_len - self._extra_slots(method), self.target.cfg.max_position_embeddings) - prompt_len

    def _check_fits(self, ids: list[int], max_new_tokens: int, method: str) -> None:
        """The KV cache check each decoder makes when it starts, made up front for every prompt of a call, and
        the model's own context length (as vLLM refuses a request past max_model_len)."""
        self._own_caches()
        check_capacity(self.target.model, len(ids), max_new_tokens, self._extra_slots(method))  # its fix is exact
        check_context(self.target.cfg.max_position_embeddings, len(ids), max_new_tokens)

    def _stream(self, ids: list[int], max_new_tokens: int, params: SamplingParams, method: str,
                eos: tuple[int, ...], checker: StopStrings | None = None) -> Iterator[str]:
        inc = IncrementalText(self.target.decode)
        toks = inc.ids
        shown = ""

        def visible(text: str, final: bool) -> str:
            if checker is None:
                return text
            cut = checker.cut(text)
            if cut is not None:
                return text[:cut]
            return text if final else text[:len(text) - checker.held(text)]  # maybe the start of a stop string

        out: dict = {}
        for t in self._tokens(ids, max_new_tokens, params, method, eos, checker, out):
            if not inc.push(t):
                continue
            text = visible(inc.text, False)
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        # what was held back at the end (a character cut by max_new_tokens, the start of a stop string never finished);
        # the whole list decoded once, so the chunks always join to generate()'s text
        full = self.target.decode(toks)
        finished, self.last_metrics = out["last"]  # this stream's own, whatever ran on the engine since
        # how the stream ended, as GenerationOutput.finish_reason says it, and its tokens (for a server's usage); they
        # are set once the stream is exhausted (before a held-back end goes out)
        cut = checker.cut(full) if checker is not None else None
        self.last_finish_reason = "eos" if finished else "stop" if cut is not None else "length"
        self.last_token_ids = toks
        text = visible(full, True)
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown):]


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise SpdConfigError(f"method must be one of {METHODS}, got {method!r}")


def _check_single(prompt: Any) -> None:
    if not _as_batch(prompt)[1]:
        raise SpdConfigError("stream() takes one prompt (a str, a list of chat messages or a list of token ids); "
                             "use generate() for a list of prompts")


def _as_batch(prompt: Any) -> tuple[list[Prompt], bool]:
    if isinstance(prompt, str):
        return [prompt], True
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise SpdConfigError("the prompt is empty; pass a string, a list of chat messages, a list of token ids "
                                 "or a list of prompts")
        if all(isinstance(m, dict) for m in prompt) or is_token_ids(prompt):
            return [prompt], True
        if all(isinstance(p, (str, list, tuple)) for p in prompt):
            return list(prompt), False
        def scalar(t: Any) -> bool:  # a number, or a 0-d tensor or array (what list(tensor) holds)
            return isinstance(t, numbers.Number) or getattr(t, "ndim", None) == 0

        def not_id(t: Any) -> bool:
            return not isinstance(t, numbers.Integral) or isinstance(t, bool)

        if all(scalar(t) for t in prompt):  # meant as token ids, but not all of them ints
            i, t = next((i, t) for i, t in enumerate(prompt) if not_id(t))
            raise SpdConfigError(f"a prompt of token ids must hold Python ints; item {i} is {t!r} "
                                 f"({type(t).__name__}); convert them (a tensor or array of ids: prompt.tolist())")
        arrays = [(i, t) for i, t in enumerate(prompt) if getattr(t, "ndim", 0) >= 1 and hasattr(t, "tolist")]
        if arrays and all(isinstance(t, (str, list, tuple)) or getattr(t, "ndim", 0) >= 1 for t in prompt):
            i, t = arrays[0]
            raise SpdConfigError(f"a list of prompts holds a {type(t).__name__} at item {i}; pass each prompt's token "
                                 f"ids as a list: [p.tolist() for p in prompts]")
    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list, tuple)):
        raise SpdConfigError(f"prompt must be a str, a list of chat messages or a list of token ids, not a "
                             f"{type(prompt).__name__}; pass token ids as a list: prompt.tolist()")
    raise SpdConfigError(
        f"prompt must be a str, a list of {{'role', 'content'}} dicts, a list of token ids, or a list of those; got "
        f"{type(prompt).__name__}" + (" mixing token ids with other items" if isinstance(prompt, (list, tuple))
                                       and any(isinstance(t, numbers.Integral) for t in prompt) else ""))


_EXAMPLE_SPLIT = [0, 10, 20, 30]  # for messages before the model is loaded: the embedded model at n=3


@_plain_numbers
def load(model: str | os.PathLike | None = None, draft: str | os.PathLike | None = None, num_stages: int | None = None,
         boundaries: Sequence[int] | None = None, anchors: Sequence[int] | None = None, draft_layers: int | None = None,
         dtype: str | torch.dtype = "float32", device: str = "cpu", max_len: int = 2048, seed: int = 0,
         progress: bool = True, placement: str = "local", cuda_graphs: bool | None = None,
         lookup: int = DEFAULT_LOOKUP, _target: Target | None = None) -> Engine:
    """Load a target and a draft head. draft: a head directory, None (the head shipped for this model
    and n, run at `boundaries` with a warning if they differ from its own; else a random head with a
    warning), or "random" (a seeded random head of the right shape).
    num_stages: n; None means len(boundaries) - 1 when boundaries are given, the world size with
    placement="distributed", the head's own n when draft is a head directory, else 3.
    placement: "local"/"sequential" (default), "streams" (one GPU, a CUDA stream per stage, the cycle
    replayed as a CUDA graph unless cuda_graphs=False), "devices" (one stage per GPU), or
    "distributed" (call it on every rank of a torchrun job; loads only this rank's stage).
    boundaries: the stage split, layer indices from 0 to the model's layer count (default: n even stages);
    anchors, draft_layers: a random head's anchor layers and tower depth (a trained head brings its own).
    dtype, device: the target's weights ("float32", "bfloat16", "float16"; "cpu" or "cuda[:i]"); max_len: the
    KV cache's length (prompt + new tokens + n + 1 must fit); seed: a random head's weights (refused for a head
    read from disk); progress: progress output while the model is converted and loaded (on a terminal only).
    lookup: context lookup beside the PDM: when the `lookup` newest tokens occurred earlier in the
    context, draft what followed them (0 turns it off; exactness never depends on it)."""
    if placement not in PLACEMENTS:
        raise SpdConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    parse_device(device)  # a CPU or CUDA device that exists here
    check_lookup(lookup)
    if anchors is not None:  # their range is checked against the model once it is loaded
        anchors = check_layer_indices(anchors, "anchors", _EXAMPLE_SPLIT)
    if cuda_graphs and placement != "streams":
        raise SpdConfigError(
            f"cuda_graphs=True needs placement='streams' on a CUDA device, got placement={placement!r}")
    if draft is not None and (not isinstance(draft, (str, os.PathLike)) or not str(draft).strip()):
        raise SpdConfigError(f"draft must be a head directory, 'random', or None (the shipped head), got {draft!r}")
    if draft_layers is not None and (not isinstance(draft_layers, int) or isinstance(draft_layers, bool)):
        raise SpdConfigError(f"draft_layers must be an integer, got {draft_layers!r}")
    check_seed(seed, "seed (of a random head)")
    if draft is not None and draft != "random":  # a head path: known now; the shipped head once it is found
        check_head_seed(seed, str(draft))
    num_stages = _default_num_stages(num_stages, draft, placement, boundaries)
    if placement in ("streams", "devices"):
        from .pipeline import resolve_placement

        n = num_stages or DEFAULT_NUM_STAGES
        if boundaries is not None:
            n = len(check_layer_indices(boundaries, "stage boundaries", _EXAMPLE_SPLIT)) - 1
        resolve_placement(placement, device, n)
    if placement == "distributed":
        from .distributed import load_distributed

        return load_distributed(  # type: ignore[return-value]  (a DistributedEngine: same generate())
            model=model, draft=draft, num_stages=num_stages, boundaries=boundaries, anchors=anchors,
            draft_layers=draft_layers, dtype=dtype, device=device, max_len=max_len, seed=seed, progress=progress,
            lookup=lookup)
    # _target: generate()'s engine cache hands in the target it already loaded for the same model, dtype and device
    target = _target if _target is not None else load_target(model, parse_dtype(dtype), device, progress=progress)
    L = target.cfg.num_layers
    if boundaries is not None:
        b = validate_boundaries(boundaries, L)
        check_stage_count(num_stages, b)
        num_stages = len(b) - 1
    else:
        num_stages = DEFAULT_NUM_STAGES if num_stages is None else num_stages
        validate_num_stages(L, num_stages)
        b = uniform_boundaries(L, num_stages)
    if not isinstance(max_len, int) or max_len < 8:
        raise SpdConfigError(f"max_len must be an integer >= 8, got {max_len!r}")
    net = target.model
    source = str(draft)
    if draft is None:
        found = shipped_head(target, num_stages)
        if found is None:
            warnings.warn(f"no shipped draft head for this model at num_stages={num_stages}; using a random head "
                          "(output is still exact, but few drafts will be accepted)", RandomHeadWarning,
                          stacklevel=3)  # load() is wrapped (_plain_numbers): 3 is load()'s caller
            draft = "random"
        else:
            draft, source = found, f"shipped:{found.name}"
    if draft == "random":
        dcfg = DraftConfig.make(net.cfg, b, anchors, draft_layers, fingerprint=target.fingerprint)
        head = random_draft_head(net, dcfg, seed)  # on the model's device: a CPU head beside a CUDA model failed
        source = "random"
    else:
        shipped = source.startswith("shipped:")  # draft=None: the shipped head runs at any split of its n
        head = load_draft(draft, net, target.fingerprint, num_stages,
                          b if boundaries is not None and not shipped else None, net.dtype, net.device)
        head.dcfg.check_requested(anchors, draft_layers)
        if shipped:
            check_head_seed(seed, source)  # a head path was checked before the model loaded
            head.dcfg = head.dcfg.at_split(b if boundaries is not None else None, Path(draft).name, stacklevel=4)
        b = head.dcfg.boundaries
    from .packed import pack_draft

    pack_draft(head, net)  # CPU + GGUF target: the head decodes from packed weights too
    return Engine(target, head, b, max_len, source, placement, cuda_graphs, lookup)


_ENGINES: dict[tuple, Engine] = {}
_DEFERRED: dict[tuple, list] = {}  # a cached engine's RandomHeadWarning, held back while it only runs AR


def _default_num_stages(num_stages: int | None, draft: Any, placement: str | None,
                        boundaries: Any = None) -> int | None:
    """The n load() runs with when num_stages is None: a trained head's own n, else 3. None stays None
    where load() decides later (boundaries given, placement="distributed") or where `draft` is not a
    head path (load() names that error)."""
    if num_stages is not None or boundaries is not None or placement == "distributed":
        return num_stages
    if draft in (None, "random"):
        return DEFAULT_NUM_STAGES
    if isinstance(draft, (str, os.PathLike)) and str(draft).strip():
        return read_draft_config(draft).num_stages
    return None


def _cache_key(kw: dict[str, Any]) -> tuple:
    """The settings that make an engine, each in one spelling ("fp32" and torch.float32, "sequential" and
    "local", a relative and an absolute model path), so equivalent calls share the cached engine."""
    norm = dict(kw)
    norm["dtype"] = parse_dtype(kw["dtype"])
    dev = parse_device(kw["device"])  # "cpu" and "cpu:0" are one CPU; "cuda" is the current GPU
    norm["device"] = "cpu" if dev.type == "cpu" else \
        f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    norm["placement"] = "local" if kw["placement"] == "sequential" else kw["placement"]
    for k in ("model", "draft"):
        v = kw.get(k)
        if isinstance(v, (str, os.PathLike)) and str(v) not in ("", "random") and Path(v).expanduser().exists():
            norm[k] = Path(v).expanduser().resolve()
    return tuple(sorted((k, str(v)) for k, v in norm.items()))


def _target_key(key: tuple) -> tuple:
    """The part of an engine-cache key that makes the loaded target: the model, its dtype and device."""
    return tuple(kv for kv in key if kv[0] in ("model", "dtype", "device"))


_ENGINES_LOCK = threading.Lock()  # threads asking for an engine at once load one, not one each


def _cached_engine(method: str = "spd", **kw: Any) -> Engine:
    """One engine per set of settings, the last one kept. A RandomHeadWarning is held back while the engine
    only runs method="ar", which never drafts, and given at its first SPD call."""
    with _ENGINES_LOCK:
        return _cached_engine_locked(method, **kw)


def _cached_engine_locked(method: str, **kw: Any) -> Engine:
    # the n load() would pick, so num_stages=None and its explicit value share one engine
    kw["num_stages"] = _default_num_stages(kw.get("num_stages"), kw.get("draft"), kw.get("placement"))
    key = _cache_key(kw)
    if key not in _ENGINES:
        # another engine setting (max_len, lookup, n, draft, placement) on the same model, dtype and device: the
        # loaded target is kept (an engine is cheap beside loading the model)
        old_key, old = next(iter(_ENGINES.items()), (None, None))
        # (not across placement="devices", which moves the stages' layers to their GPUs, or "distributed")
        reuse = old.target if (isinstance(old, Engine) and _target_key(old_key) == _target_key(key)
                               and {old.placement, kw["placement"]}.isdisjoint({"devices", "distributed"})) else None
        saved = dict(_ENGINES), dict(_DEFERRED)
        _ENGINES.clear()  # keep one model in memory
        _DEFERRED.clear()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng = load(**kw, _target=reuse)
            for w in caught:  # before the engine is kept: a warning the caller's filters make an error keeps nothing
                if not issubclass(w.category, RandomHeadWarning):
                    _reissue(w)
        except BaseException:
            # settings load() refused (or a warning made an error) leave the engine that was cached: the next call
            # with good settings does not load the model again (its KV cache is given back at its next decode)
            _ENGINES.update(saved[0])
            _DEFERRED.update(saved[1])
            raise
        _ENGINES[key] = eng
        _DEFERRED[key] = [w for w in caught if issubclass(w.category, RandomHeadWarning)]
    if method != "ar" and _DEFERRED.get(key):
        for w in _DEFERRED[key]:
            _reissue(w)  # an "error" filter raises here, and again at the next call, as before the cache
        del _DEFERRED[key]
    return _ENGINES[key]


_WARN_REGISTRY: dict = {}  # "once per place" of the default filter, across re-issues


def _reissue(w: warnings.WarningMessage) -> None:
    """Give a warning recorded during load() again as it was first issued: category, place and module name (so
    the caller's filters by module match), with one registry (the default filter shows it once per place)."""
    path = Path(w.filename)
    root = Path(__file__).resolve().parent
    try:
        module = ".".join(("spd_fast",) + path.resolve().relative_to(root).with_suffix("").parts)
    except ValueError:
        module = path.stem
    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module=module, registry=_WARN_REGISTRY)


@_plain_numbers
def generate(prompt: Prompt | Sequence[Prompt], max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, num_stages: int | None = None,
             method: str = "spd", model: str | None = None, draft: str | None = None,
             dtype: str = "float32", max_len: int = 2048, placement: str = "local", lookup: int = DEFAULT_LOOKUP,
             device: str = "cpu", eos_ids: Sequence[int] = (), stop: str | Sequence[str] | None = None,
             sampling_params: SamplingParams | None = None) -> GenerationOutput | list[GenerationOutput] | None:
    """Generate with SPD (method="spd") or the plain autoregressive baseline (method="ar").
    prompt: a str (raw text), a list of {"role", "content"} messages (chat template), a list of token ids, or a
    list of such prompts (one output each). eos_ids: stop tokens besides the model's own; stop: strings that end
    the answer (its text is cut before the first one); sampling_params: a SamplingParams in place of temperature,
    top_k, top_p and seed. The engine is loaded once per set of settings (see load()).
    placement="distributed": call on every rank of a torchrun job; rank 0 gets the output, others None."""
    _check_method(method)
    if placement == "distributed" and method != "spd":  # before every rank loads its stage
        raise SpdConfigError(f"placement='distributed' runs method='spd' only, got {method!r}")
    SamplingParams(temperature, top_k, top_p, seed)  # validate before loading anything
    check_max_new_tokens(max_new_tokens)
    _as_batch(prompt)
    check_lookup(lookup)
    check_eos_ids(eos_ids, None)  # the form now, the range once the model is known
    check_stop(stop, placement)
    eng = _cached_engine(method, model=model, draft=draft, num_stages=num_stages, dtype=dtype, max_len=max_len,
                         placement=placement, lookup=lookup, device=device)
    return eng.generate(prompt, max_new_tokens, temperature, top_k, top_p, seed, method, eos_ids=eos_ids, stop=stop)


@_plain_numbers
def stream(prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int | None = None, num_stages: int | None = None, method: str = "spd",
           model: str | None = None, draft: str | None = None, dtype: str = "float32",
           max_len: int = 2048, placement: str = "local", lookup: int = DEFAULT_LOOKUP, device: str = "cpu",
           eos_ids: Sequence[int] = (), stop: str | Sequence[str] | None = None,
           sampling_params: SamplingParams | None = None) -> Iterator[str]:
    """Yield the verified text of one prompt as it is committed; the settings and the cached engine are
    generate()'s (placement="distributed" does not stream)."""
    _check_method(method)
    SamplingParams(temperature, top_k, top_p, seed)  # validate before loading anything
    check_max_new_tokens(max_new_tokens)
    _check_single(prompt)
    check_lookup(lookup)
    check_eos_ids(eos_ids, None)
    check_stop(stop)
    if placement == "distributed":
        raise SpdConfigError("placement='distributed' does not stream: use generate(), which returns the whole "
                             "output on rank 0, or another placement for stream()")
    eng = _cached_engine(method, model=model, draft=draft, num_stages=num_stages, dtype=dtype, max_len=max_len,
                         placement=placement, lookup=lookup, device=device)  # the key generate() uses
    return eng.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, method, eos_ids=eos_ids, stop=stop)

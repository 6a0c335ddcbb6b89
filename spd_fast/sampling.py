"""Sampling parameters and logit processing shared by AR decoding, drafting and verification.

The same `probs_from_logits` turns the target's logits into p and the draft head's logits into q,
so SPD's rejection sampling is exact with respect to the user's own parameters.
"""
from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

import torch

from .config import SpdConfigError, check_seed

MIN_TOP_P = 1e-30  # keeps the top token (and its ties) alone for any vocabulary below 1e30 tokens
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e30  # fp32 logits / t must stay finite: a t past fp32's range (3.4e38) is inf, and -inf / inf NaN


def plain_number(v: object) -> object:
    """A numpy (or other numbers-ABC) scalar as the plain int or float it stands for; anything else (a bool,
    numpy's bool_ included, which is a flag rather than a count) as it is, for the checks to judge."""
    if isinstance(v, (bool, int, float)) or not isinstance(v, numbers.Real) or type(v).__name__.startswith("bool"):
        return v
    return int(v) if isinstance(v, numbers.Integral) else float(v)


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings: temperature (0: greedy), top_k (0: off), top_p (1: off) and seed (None:
    unseeded). SPD's output has exactly the target's distribution under them."""
    temperature: float = 0.0   # 0 -> greedy
    top_k: int = 0             # 0 -> off
    top_p: float = 1.0         # 1 -> off
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p", "seed"):  # numpy scalars as plain numbers, as generate() does
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        t, k, p = self.temperature, self.top_k, self.top_p
        try:  # an int too large for a float (10**400) overflows here, not in the first division by it
            finite = isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(float(t))
        except OverflowError:
            finite = False
        if not finite or not (t >= 0):
            raise SpdConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        object.__setattr__(self, "temperature", t := float(t))  # an int (1 or 10**30) divides logits as a float
        if 0 < t < MIN_TEMPERATURE:  # logits / t would overflow to inf and the probabilities to NaN
            raise SpdConfigError(f"temperature {t!r} is too small to sample with; use temperature=0 for greedy "
                                 f"decoding or a value >= {MIN_TEMPERATURE}")
        if t > MAX_TEMPERATURE:
            raise SpdConfigError(f"temperature {t!r} is too large to sample with (the logits divided by it leave "
                                 f"fp32's range); use a value <= {MAX_TEMPERATURE:g}, which already samples "
                                 "uniformly among the tokens top_k and top_p keep")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise SpdConfigError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 < p <= 1):
            raise SpdConfigError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")
        # below 1/V every top_p keeps the top token and its ties alone (top_p_drop); one under fp32's smallest number
        # (1e-46) would compare as 0 and drop every token (NaN probabilities), so it is read as MIN_TOP_P
        object.__setattr__(self, "top_p", max(float(p), MIN_TOP_P))
        if self.seed is not None:  # None: a fresh random seed per call
            check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p."""
    return processed_probs(logits, params.temperature, params.top_k, params.top_p)


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """probs_from_logits with the settings as plain arguments (top_k 0 and top_p 1: off), as the kernel twins in
    ops_explicit take them."""
    x = logits.float() / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(top_p_drop(x, top_p), float("-inf"))
    return torch.softmax(x, dim=-1)


def top_p_drop(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] tempered logits -> bool mask of the tokens top-p drops. A token survives iff the mass of the tokens
    strictly more likely than it is < top_p, so the top token and every token tied with it always survive, and a
    run of equal logits is kept or dropped whole (as the C++ and Triton ops do), whatever order the sort gives it."""
    V = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    # fp64: an fp32 softmax of a 49k-token row sums to 1 + ~5e-6, enough to move the cut by a token
    sp = torch.softmax(sorted_x.double(), dim=-1)
    before = sp.cumsum(-1) - sp
    # each sorted position takes the mass before the first member of its run of equal logits
    first = torch.ones_like(sorted_x, dtype=torch.bool)
    first[..., 1:] = sorted_x[..., 1:] != sorted_x[..., :-1]
    pos = torch.arange(V, device=x.device).expand_as(sorted_x)
    run_start = torch.where(first, pos, 0).cummax(-1).values
    drop_sorted = before.gather(-1, run_start) >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row of [..., V] probs without a host sync (exponential-race trick)."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # a draw of exactly 0 (CPU torch can return one) would make 0/0 = NaN for a zero-probability token, and argmax
    # picks NaN: the floor keeps such a token at 0
    return torch.argmax(probs / e.clamp_min_(torch.finfo(e.dtype).tiny), dim=-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    return sample_from(probs_from_logits(logits, params), generator)


def make_generator(params: SamplingParams, device: torch.device | str,
                   reuse: torch.Generator | None = None) -> torch.Generator | None:
    """The generator of one sampled generation (None when greedy), seeded from params.seed. `reuse`, a
    generator on the same device, is reseeded and returned instead of a new one: a CUDA graph that registered
    it then replays with the new seed instead of being captured again."""
    if params.greedy:
        return None
    g = reuse if reuse is not None and reuse.device == torch.device(device) else torch.Generator(device=device)
    # seed=None: a fresh seed from the OS (torch.seed() would also reseed the caller's global generator)
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g

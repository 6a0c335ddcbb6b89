"""The engine's fused-op boundary: multi-depth aggregation, draft sampling and verification.

These are the pure-PyTorch implementations (the CPU path and the oracle for any faster backend).
All of them are tensor-only: no host synchronisation, fixed shapes, usable inside a CUDA graph.
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams, probs_from_logits, sample_from

# Where aggregate / verify_greedy run: "torch" (the twins below), "triton", "cpp" or "auto";
# set it with spd_fast.kernels.set_backend.
BACKEND = "torch"


def aggregate(anchor_rows: torch.Tensor, types: torch.Tensor, w_padded: torch.Tensor) -> torch.Tensor:
    """anchor_rows [R, m, H], types [R] int64, w_padded [m, H, m*H] -> [R, H].

    Row r computes W_{types[r]} · concat(anchors 0..types[r]); anchors above the type meet zero
    columns of the padded weight, and are zeroed too so stale values (even NaN) cannot leak in.
    """
    if BACKEND != "torch" and not (torch.is_grad_enabled() and (anchor_rows.requires_grad or w_padded.requires_grad)):
        from .kernels import aggregate as fused  # the fused ops have no backward: training takes the twin

        return fused(anchor_rows, types, w_padded, backend=BACKEND)
    return aggregate_torch(anchor_rows, types, w_padded)


def aggregate_torch(anchor_rows: torch.Tensor, types: torch.Tensor, w_padded: torch.Tensor) -> torch.Tensor:
    R, m, H = anchor_rows.shape
    keep = torch.arange(m, device=types.device)[None, :] <= types[:, None]            # [R, m]
    x = torch.where(keep[:, :, None], anchor_rows, torch.zeros((), dtype=anchor_rows.dtype,
                                                                 device=anchor_rows.device))
    # One GEMM computes every type's projection of every row (the weight is read once, no
    # per-row weight gather); then each row keeps the block of its own type.
    y = torch.nn.functional.linear(x.reshape(R, m * H), w_padded.reshape(m * H, m * H).to(x.dtype))
    return y.view(R, m, H)[torch.arange(R, device=types.device), types]


def take(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for an index tensor of any shape (0-dim included) as a gather: indexing with a
    0-dim tensor may read it on the host, which a CUDA graph cannot contain."""
    return table.index_select(0, idx.reshape(-1)).reshape(idx.shape)


def draft_sample(logits_d: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, params: SamplingParams,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PDM logits over the draft vocabulary [V_d] -> (draft token id in the full vocab, q [V] or None).

    q is the exact distribution the token was drawn from, scattered into the full vocabulary
    (zero outside the draft vocabulary); greedy drafting needs no q.
    """
    if params.greedy:
        return take(draft_vocab, torch.argmax(logits_d, dim=-1)), None
    q_d = probs_from_logits(logits_d, params)
    j = sample_from(q_d, generator)
    q = torch.zeros(vocab_size, dtype=q_d.dtype, device=q_d.device).scatter_(0, draft_vocab, q_d)
    return take(draft_vocab, j), q


def verify_greedy(target_logits: torch.Tensor, draft_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accept bool [], corrected token [] = argmax p)."""
    if BACKEND != "torch":
        from .kernels import verify_greedy as fused

        return fused(target_logits, draft_token, backend=BACKEND)
    return verify_greedy_torch(target_logits, draft_token)


def verify_greedy_torch(target_logits: torch.Tensor, draft_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.argmax(target_logits, dim=-1)
    return y == draft_token, y


def verify_sampling(target_logits: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative rejection sampling for one draft token.

    accept with probability min(1, p(x)/q(x)); on reject draw y ~ normalize(max(0, p - q)), or
    y ~ p if that residual has no mass. Returns (accept, token to commit at this position).
    """
    p = probs_from_logits(target_logits, params)
    px, qx = take(p, draft_token), take(q, draft_token)
    u = torch.rand((), generator=generator, device=p.device)
    # u * q(x) < p(x)  <=>  u < p(x)/q(x) without dividing by a zero q(x)
    accept = u * qx < px
    resid = (p - q).clamp_min(0)
    mass = resid.sum()
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p)
    y = sample_from(resid, generator)
    return accept, torch.where(accept, draft_token, y)


def lookup_next(tokens: torch.Tensor, p_new: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context lookup ("prompt lookup" drafting) over tokens[0 .. p_new]: find the latest earlier
    occurrence of the last k tokens tokens[p_new-k+1 .. p_new] and return (found bool [], the token
    that followed it []). Only windows ending before p_new count, so entries after p_new (stale
    slots of a rolled-back buffer) are never read. Tensor-only, fixed shapes: graph-safe."""
    L = tokens.numel()
    if k > L - 1:  # no earlier window of k tokens fits the buffer (lookup above max_len): never a match
        return torch.zeros((), dtype=torch.bool, device=tokens.device), tokens[0]
    ar = torch.arange(L - k + 1, device=tokens.device)
    suffix = tokens.index_select(0, (p_new - k + 1 + torch.arange(k, device=tokens.device)).clamp_min(0))
    hit = (tokens.unfold(0, k, 1) == suffix).all(dim=1) & (ar + k <= p_new)   # window i = tokens[i .. i+k-1]
    best = torch.where(hit, ar, -1).max()
    return best >= 0, tokens.index_select(0, (best + k).clamp(0, L - 1).view(1))[0]

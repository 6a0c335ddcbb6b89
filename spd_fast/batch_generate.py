"""Batched autoregressive generation (many independent prompts at once) for self-distillation.

Prompts of different lengths share one batch without padding tricks in the attention: every row
keeps its own positions, pad tokens are written to the scratch cache slot (position max_len), and a
query at position p only sees slots <= p of its own row.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import SpdConfigError
from .model import Transformer, kv_bound_for
from .sampling import SamplingParams, next_token


@torch.inference_mode()
def generate_batch(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   params: SamplingParams, eos_ids: Sequence[int], generator: torch.Generator | None = None
                   ) -> list[list[int]]:
    from .ar import check_max_new_tokens

    check_max_new_tokens(max_new_tokens)  # 0 or less still returned each prompt's prefill token
    B = len(prompts)
    if not B:
        return []
    if any(len(p) == 0 for p in prompts):  # its last row would be a pad's (index -1): a made-up first token
        raise SpdConfigError(f"prompt {next(i for i, p in enumerate(prompts) if len(p) == 0)} of the batch is empty; "
                             f"give every prompt at least one token")
    dev = model.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    T = int(lens.max())
    if T + max_new_tokens > model.max_len:
        raise SpdConfigError(f"longest prompt {T} + max_new_tokens {max_new_tokens} exceeds the cache's max_len "
                             f"{model.max_len}; set up the caches longer (model.setup_caches) or shorten the prompts")
    model.setup_caches(max(B, model.layers[0].attn.k_cache.shape[0] if model.layers[0].attn.k_cache is not None else 0),
                       model.max_len)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(list(p), device=dev)
    ar = torch.arange(T, device=dev)[None].expand(B, T)
    pos = torch.where(ar < lens[:, None], ar, torch.full_like(ar, model.max_len))  # pads -> scratch slot
    logits = model(ids, pos, kv_bound=kv_bound_for(T - 1, model.max_len))
    last = logits[torch.arange(B, device=dev), lens - 1]
    tok = next_token(last, params, generator)
    eos = torch.tensor(list(eos_ids), device=dev)
    out = [tok]
    done = torch.isin(tok, eos)
    cur = lens.clone()
    for _ in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        logits = model(tok[:, None], cur[:, None], kv_bound=kv_bound_for(int(cur.max()), model.max_len))[:, -1]
        tok = next_token(logits, params, generator)
        out.append(tok)
        done |= torch.isin(tok, eos)
        cur += 1
    toks = torch.stack(out, dim=1).tolist()
    result = []
    eos_set = set(int(e) for e in eos_ids)
    for row in toks:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), len(row))
        result.append(row[:cut])
    return result

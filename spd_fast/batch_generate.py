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


def generate_batch(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   params: SamplingParams, eos_ids: Sequence[int], generator: torch.Generator | None = None
                   ) -> list[list[int]]:
    """Each prompt's new tokens (up to and including its first EOS). Holds the model's decode lock, and ends any
    stream open on its caches (as another generate() does): both would read the KV slots this overwrites."""
    from .ar import check_max_new_tokens, check_prompt_ids

    check_max_new_tokens(max_new_tokens)  # 0 or less still returned each prompt's prefill token
    # an id past the vocabulary failed in the embedding, a float was truncated, and an empty prompt's last row would
    # be a pad's (a made-up first token)
    for i, p in enumerate(prompts):
        try:
            check_prompt_ids(p, model.cfg.vocab_size)
        except SpdConfigError as e:
            raise SpdConfigError(f"prompt {i} of the batch: {e}") from None
    if not prompts:
        return []
    with model.decode_lock:
        model.generations += 1
        return _generate_batch(model, prompts, max_new_tokens, params, eos_ids, generator)


@torch.inference_mode()
def _generate_batch(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    params: SamplingParams, eos_ids: Sequence[int], generator: torch.Generator | None
                    ) -> list[list[int]]:
    B = len(prompts)
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
    # the final norm and LM head on each row's last position only: [B, T, V] logits would be GBs at batch 64
    h, _ = model.run_layers(model.embed_tokens(ids), pos, 0, model.cfg.num_layers, kv_bound_for(T - 1, model.max_len))
    last = model.logits(h[torch.arange(B, device=dev), lens - 1])
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

"""Drafters: the trained/random PDM, plus two test drafters (oracle and always-wrong)."""
from __future__ import annotations

from typing import Sequence

import torch

from .engine import PipelineState, SPDEngine
from .model import kv_bound_for
from .ops import draft_sample
from .pdm import DraftHead
from .sampling import SamplingParams


class PdmDrafter:
    """Drafts with a DraftHead: aggregated multi-depth features -> tower -> LM head over V_d."""

    def __init__(self, head: DraftHead):
        self.head = head

    def prefill(self, engine: SPDEngine, st: PipelineState) -> None:
        head, P = self.head, st.prompt_len
        if head.max_len != engine.model.max_len:
            head.setup_cache(engine.model.max_len)
        pos = torch.arange(P, device=st.tokens.device)
        types = engine.depth_type[engine.n].expand(P)
        g = head.aggregate(st.anchors[:P], types)
        head.tower(g[None], pos[None], kv_bound_for(P - 1, head.max_len))

    def draft(self, engine: SPDEngine, st: PipelineState, params: SamplingParams,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.head
        p_new = int(st.p_new)
        start = int(st.pdm_len)
        pos = torch.arange(start, p_new + 1, device=st.tokens.device)
        # rows older than the in-flight window are final (depth n); in-flight rows have depth p_new - pos
        depth = torch.where(pos < st.p_old, engine.n, st.p_new - pos)
        types = engine.depth_type[depth]
        g = head.aggregate(st.anchors[start:p_new + 1], types)
        h = head.tower(g[None], pos[None], kv_bound_for(p_new, head.max_len))
        logits = head.draft_logits(h[0, -1])
        return draft_sample(logits, head.draft_vocab, engine.model.cfg.vocab_size, params, generator)


class ReferenceDrafter:
    """Test drafter that knows the target's greedy continuation `reference` (token ids by position).

    mode="oracle" proposes the target's own next token; mode="wrong" a token it never picks.
    """

    def __init__(self, reference: Sequence[int], vocab_size: int, mode: str = "oracle"):
        if mode not in ("oracle", "wrong"):
            raise ValueError("mode must be 'oracle' or 'wrong'")
        self.ref = torch.tensor(list(reference) + [0] * 4096)
        self.vocab_size, self.mode = vocab_size, mode

    def prefill(self, engine: SPDEngine, st: PipelineState) -> None:
        self.ref = self.ref.to(st.tokens.device)

    def draft(self, engine, st, params, generator):
        tok = self.ref[st.p_new + 1]
        if self.mode == "wrong":
            tok = (tok + 1) % self.vocab_size
        if params.greedy:
            return tok, None
        q = torch.zeros(self.vocab_size, device=st.tokens.device)
        q[tok] = 1.0
        return tok, q

"""Drafters: the trained/random PDM (optionally with context lookup), plus test drafters (oracle,
always-wrong, Bernoulli)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .config import check_lookup
from .engine import PipelineState, SPDEngine
from .model import kv_bound_for
from .ops import draft_sample, lookup_next
from .pdm import DraftHead, draft_vocab_slots, gate_keeps_pdm
from .sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams


class PdmDrafter:
    """Drafts with a DraftHead: aggregated multi-depth features -> tower -> LM head over V_d.

    lookup=k > 0 adds context lookup: when the k newest tokens (in-flight drafts included) occurred
    earlier in the prompt or output, the draft is the token that followed their latest occurrence,
    with q = that token's one-hot (so sampling stays exact); otherwise the PDM's draft. The PDM runs
    every cycle either way (its cache needs the rows). A copy is a guess the PDM often misses:
    on the project's eval prompts it lifts greedy acceptance by about 0.035 at n=3.
    The head's calibrated lookup gate (DraftConfig.lookup_gate_confidence / _ratio) keeps the PDM's
    own draft over a copy when the PDM is sure of it (top probability above the confidence) and gives
    the copied token little mass (below ratio x the top probability). The gate reads the PDM's raw
    logits, not the sampled token, so the draft's q stays exactly what it was drawn from.
    When sampling (T > 0), a head with a calibrated lookup_copy_boost d does not draft the copy one-hot:
    it raises the copied token's temperature-scaled logit by d and samples the PDM's draft from that, so
    the copy becomes likely without taking all of q's mass (the target at T > 0 rarely puts all of its
    mass on one token either).
    """

    def __init__(self, head: DraftHead, lookup: int = 0):
        self.head = head
        self.lookup = check_lookup(lookup)
        self._scaled: tuple[tuple[SamplingParams, float], SamplingParams] | None = None
        self._slot: torch.Tensor | None = None  # full vocab id -> row of the draft vocabulary (V_d if none)

    @property
    def anchors(self) -> tuple[int, ...]:
        """The layers whose states the head was trained to read (SPDEngine takes these)."""
        return tuple(self.head.dcfg.anchors)

    def draft_params(self, params: SamplingParams) -> SamplingParams:
        """What the head drafts with: the requested temperature times the head's calibrated
        draft_temperature_scale (verification uses the q this gives, so sampling stays exact)."""
        scale = self.head.dcfg.draft_temperature_scale
        if params.greedy or scale == 1.0:
            return params
        if self._scaled is None or self._scaled[0] != (params, scale):
            t = min(max(params.temperature * scale, MIN_TEMPERATURE), MAX_TEMPERATURE)
            self._scaled = ((params, scale), dataclasses.replace(params, temperature=t))
        return self._scaled[1]

    def prefill(self, engine: SPDEngine, st: PipelineState) -> None:
        head, P = self.head, st.prompt_len
        if head.max_len != engine.model.max_len:
            head.setup_cache(engine.model.max_len)
        if self.lookup:
            self._copy_slot()
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
        if self.lookup and p_new >= self.lookup:
            return self._sample_with_lookup(engine, st.tokens[:p_new + 1], st.p_new, logits, params, generator)
        return draft_sample(logits, head.draft_vocab, engine.model.cfg.vocab_size, self.draft_params(params),
                            generator)

    def copy_allowed(self, logits_d: torch.Tensor, copied: torch.Tensor) -> torch.Tensor:
        """The lookup gate: bool [], False when the PDM keeps its own draft over `copied` (full vocab id).
        Tensor-only (graph-safe), no per-cycle allocation beyond the softmax."""
        p = torch.softmax(logits_d.float(), -1)
        row = self._copy_slot().index_select(0, copied.view(1))  # V_d outside the draft vocabulary
        inside = (row < p.numel())[0]
        p_copy = p.index_select(0, row.clamp_max(p.numel() - 1))[0]
        dc = self.head.dcfg
        return ~gate_keeps_pdm(p.max(), p_copy, inside, dc.lookup_gate_confidence, dc.lookup_gate_ratio)

    def _copy_slot(self) -> torch.Tensor:
        """draft_vocab_slots of the head, built eagerly (prefill calls this), never first inside a
        CUDA-graph capture, where its fill would only run at replay."""
        vocab = self.head.draft_vocab
        if self._slot is None or self._slot.device != vocab.device:
            self._slot = draft_vocab_slots(vocab, self.head.tcfg.vocab_size)
        return self._slot

    def _sample_with_lookup(self, engine: SPDEngine, tokens: torch.Tensor, p_new: torch.Tensor,
                            logits_d: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft with context lookup over tokens[0 .. p_new]. Greedy, or a head without a copy boost: the
        PDM's draft, replaced by the copy where the gate allows it (q one-hot). Sampling with the head's
        lookup_copy_boost d: the copied token's logit is raised by d (after temperature) before the draft is
        drawn, so q stays the distribution it came from; a copy outside the draft vocabulary, which the
        PDM cannot boost, goes the one-hot way."""
        head = self.head
        dp = self.draft_params(params)
        vocab_size = engine.model.cfg.vocab_size
        found, copied = lookup_next(tokens, p_new, self.lookup)
        boost = head.dcfg.lookup_copy_boost
        if params.greedy or boost is None:
            tok, q = draft_sample(logits_d, head.draft_vocab, vocab_size, dp, generator)
            if head.dcfg.lookup_gate_confidence < 1.0:  # (1, 0) copies on every match: no gate to run
                found = found & self.copy_allowed(logits_d, copied)
            return self._copy_one_hot(found, copied, tok, q)
        n = logits_d.shape[-1]
        row = self._copy_slot().index_select(0, copied.view(1))  # n (outside the draft vocabulary) or its row
        inside = row < n
        add = ((found & inside).to(logits_d.dtype) * (boost * dp.temperature)).view(1)
        boosted = logits_d.scatter_add(0, row.clamp_max(n - 1), add)
        tok, q = draft_sample(boosted, head.draft_vocab, vocab_size, dp, generator)
        # the gate never keeps the PDM's draft over a copy outside the draft vocabulary: no gate to run
        return self._copy_one_hot((found & ~inside)[0], copied, tok, q)

    @staticmethod
    def _copy_one_hot(found: torch.Tensor, copied: torch.Tensor, tok: torch.Tensor,
                      q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where `found`, the draft is `copied` with a one-hot q."""
        tok = torch.where(found, copied, tok)
        if q is not None:
            q = torch.where(found, torch.zeros_like(q).scatter_(0, copied.view(1), 1.0), q)
        return tok, q

    def draft_static(self, engine: SPDEngine, cyc, params: SamplingParams,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draft` without host reads, for pipeline.DeviceCycle: always n + 1 rows (cyc.pdm_pos,
        with unneeded rows on the scratch slot), attention over the whole static cache."""
        head = self.head
        g = head.aggregate(cyc.pdm_rows, cyc.pdm_types)
        h = head.tower(g[None], cyc.pdm_pos[None], head.max_len)
        logits = head.draft_logits(h[0, -1])
        if self.lookup:
            return self._sample_with_lookup(engine, cyc.st.tokens, cyc.st.p_new, logits, params, generator)
        return draft_sample(logits, head.draft_vocab, engine.model.cfg.vocab_size, self.draft_params(params),
                            generator)


class ReferenceDrafter:
    """Test drafter that knows the target's greedy continuation `reference` (token ids by position).

    mode="oracle" proposes the target's own next token; mode="wrong" a token it never picks;
    mode="bernoulli" is right with probability `p_right` (device random numbers, seeded), which
    imposes a chosen acceptance rate on timing runs. `head`, if given, is run every cycle and its
    draft discarded, so timings include the real PDM's cost.
    """

    def __init__(self, reference: Sequence[int], vocab_size: int, mode: str = "oracle", p_right: float = 1.0,
                 seed: int = 0, head: DraftHead | None = None):
        if mode not in ("oracle", "wrong", "bernoulli"):
            raise ValueError("mode must be 'oracle', 'wrong' or 'bernoulli'")
        if not 0.0 <= p_right <= 1.0:
            raise ValueError(f"p_right must lie in [0, 1], got {p_right}")
        self.ref = torch.tensor(list(reference) + [0] * 4096)
        self.vocab_size, self.mode, self.p_right, self.seed = vocab_size, mode, p_right, seed
        self.head = PdmDrafter(head) if head is not None else None
        self.anchors = self.head.anchors if self.head is not None else None  # its head's, as SPDEngine reads
        self.rng: torch.Generator | None = None
        self.right: torch.Tensor | None = None  # bernoulli: whether the draft of each position is right

    def prefill(self, engine: SPDEngine, st: PipelineState) -> None:
        dev = st.tokens.device
        self.ref = self.ref.to(dev)
        if self.rng is None or self.rng.device != dev:
            self.rng = torch.Generator(device=dev)
        self.rng.manual_seed(self.seed)
        # drawn here, once per position, not while drafting: a draw inside a captured CUDA graph would need this
        # generator registered with the graph, and every executor sees the same outcomes, whatever drafts it
        # makes and discards. Filled in place: a captured cycle reads this buffer at one address.
        draws = torch.rand(len(self.ref), generator=self.rng, device=dev) < self.p_right
        if self.right is None or self.right.device != draws.device:
            self.right = draws
        else:
            self.right.copy_(draws)
        if self.head is not None:
            self.head.prefill(engine, st)

    def _propose(self, p_new: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        tok = self.ref.index_select(0, (p_new + 1).view(1))[0]
        wrong = (tok + 1) % self.vocab_size
        if self.mode == "wrong":
            tok = wrong
        elif self.mode == "bernoulli":
            tok = torch.where(self.right.index_select(0, (p_new + 1).view(1))[0], tok, wrong)
        if params.greedy:
            return tok, None
        q = torch.zeros(self.vocab_size, device=tok.device).scatter_(0, tok.view(1), 1.0)
        return tok, q

    def draft(self, engine, st, params, generator):
        if self.head is not None:
            self.head.draft(engine, st, SamplingParams(), None)
        return self._propose(st.p_new, params)

    def draft_static(self, engine, cyc, params, generator):
        if self.head is not None:
            self.head.draft_static(engine, cyc, SamplingParams(), None)
        return self._propose(cyc.st.p_new, params)

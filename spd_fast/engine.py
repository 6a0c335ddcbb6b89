"""The SPD decode engine with the sequential executor (SPD_DESIGN.md sections 3, 4 and 6).

One cycle: the drafter guesses the token after the newest in-flight one from pre-step features;
every in-flight token advances one stage; the token leaving the last stage verifies the draft one
position after it; accept/reject, flush and rollback are tensor updates of `PipelineState`.

Positions: the in-flight window is p_old..p_new (fill = p_new - p_old + 1 tokens); the token at
p_new - k has depth k (it finished k stages). The oldest in-flight token is always verified (or
exact), so the committed output is tokens[prompt_len .. p_old]. Cache slots equal positions, so
rolling back a cache is nothing more than restarting the window (stale slots are masked).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from .ar import check_capacity, check_prompt_ids, wait_for_device
from .config import SpdConfigError, validate_boundaries
from .model import Transformer, make_stages
from .ops import verify_greedy, verify_sampling
from .sampling import SamplingParams, next_token


@dataclass
class PipelineState:
    """All decode state, as tensors on the model's device."""
    tokens: torch.Tensor        # [max_len + 2] token id at each position (prompt, committed, drafts)
    p_new: torch.Tensor         # [] newest in-flight position
    fill: torch.Tensor          # [] number of in-flight tokens (1..n)
    pdm_len: torch.Tensor       # [] positions < pdm_len have their final (depth-n) row in the PDM cache
    hbuf: torch.Tensor          # [n, 1, 1, H] input hidden state of the in-flight token at depth s
    anchors: torch.Tensor       # [max_len + 1, m, H] anchor hidden states h^{b_i} by position
    q_ring: torch.Tensor | None  # [n + 1, V] draft distribution of position p, at p % (n + 1)
    cycles: torch.Tensor        # [] counters for the metrics
    verifications: torch.Tensor
    accepts: torch.Tensor
    prompt_len: int = 0

    @property
    def p_old(self) -> torch.Tensor:
        return self.p_new - self.fill + 1


class Drafter(Protocol):
    """Proposes the token at p_new + 1. Returns (token id [], q [V] or None for greedy). A drafter whose head
    reads fixed layers also has `anchors` (a tuple), which SPDEngine takes and checks."""

    def prefill(self, engine: "SPDEngine", state: PipelineState) -> None: ...

    def draft(self, engine: "SPDEngine", state: PipelineState, params: SamplingParams,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class SpdResult:
    token_ids: list[int]
    finished_by_eos: bool
    metrics: dict[str, float] = field(default_factory=dict)


def metrics_from(cycles: int, verifications: int, accepts: int, committed: int, num_stages: int,
                 decode_seconds: float, prefill_seconds: float) -> dict[str, float]:
    """The metrics of SPD_DESIGN.md section 6. tokens_per_cycle excludes the prefill token."""
    decoded = committed - 1  # the first token comes from the prefill logits, exact, no cycle
    tpc = decoded / cycles if cycles else 0.0
    return {
        "acceptance_rate": accepts / verifications if verifications else 0.0,
        "tokens_per_cycle": tpc,
        "equivalent_accept_length": num_stages * tpc,
        "cycles": float(cycles),
        "verifications": float(verifications),
        "accepted": float(accepts),
        "new_tokens": float(committed),
        "prefill_seconds": prefill_seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_second": decoded / decode_seconds if decode_seconds > 0 else 0.0,
        "ms_per_cycle": 1e3 * decode_seconds / cycles if cycles else 0.0,
    }


def run_stepwise(steps: Iterator[int], context: Callable[[], object],
                 check: Callable[[], None] | None = None) -> Iterator[int]:
    """Yield from the generator `steps` with `context()` entered around each step, and around its close, but never
    across a yield into the caller's code; `check()` runs inside the context before each step."""
    try:
        while True:
            with context():
                if check is not None:
                    check()
                try:
                    t = next(steps)
                except StopIteration:
                    return
            yield t
    finally:
        with context():
            steps.close()


class Committer:
    """Hands out committed tokens in order (positions first_pos, first_pos + 1, ...), stopping at the
    first EOS or at max_new_tokens; `committed` counts the prefill token too."""

    def __init__(self, first_pos: int, eos: set[int], max_new_tokens: int,
                 stop_fn: Callable[[int], bool] | None = None):
        self.next_out, self.eos, self.max_new = first_pos, eos, max_new_tokens
        self.stop_fn = stop_fn  # called with each token after the prefill's; True ends the generation (stop strings)
        self.committed, self.finished, self.stop = 1, False, False

    def take(self, tokens: torch.Tensor, last_pos: int, on_commit=None) -> Iterator[int]:
        """Yield tokens[next_out .. last_pos] (a host or CPU tensor) until a stop condition."""
        while self.next_out <= last_pos and not self.stop:
            tok = int(tokens[self.next_out])
            self.next_out += 1
            self.committed += 1
            if on_commit is not None:
                on_commit(self.committed)
            yield tok
            self.finished = tok in self.eos
            self.stop = self.finished or self.committed >= self.max_new or \
                (self.stop_fn is not None and self.stop_fn(tok))


class SPDEngine:
    """Speculative pipeline decoding over `target` split at `boundaries`, drafting with `drafter`."""

    def __init__(self, target: Transformer, drafter: Drafter, boundaries: Sequence[int],
                 anchors: Sequence[int] | None = None):
        self.model = target
        self.boundaries = validate_boundaries(tuple(boundaries), target.cfg.num_layers)
        self.n = len(self.boundaries) - 1
        own = getattr(drafter, "anchors", None)  # a drafter with a PDM head reads the anchors it was trained on
        self.anchors = tuple(anchors) if anchors is not None else own if own is not None else self.boundaries
        if own is not None and self.anchors != own:  # drafts from other depths' states: acceptance near 0
            raise SpdConfigError(f"anchors {list(self.anchors)} differ from the draft head's {list(own)}; omit anchors "
                                 f"(the head's are used) or load a head trained for these")
        L = target.cfg.num_layers
        if not self.anchors or self.anchors[0] != 0 or self.anchors[-1] > L or \
                any(a >= b for a, b in zip(self.anchors, self.anchors[1:])):
            raise SpdConfigError(f"anchors {list(self.anchors)} must start at 0, strictly increase and be <= {L}")
        self.stages = make_stages(target, self.boundaries)
        self.drafter = drafter
        # which anchors each stage records: b_i in (c_s, c_{s+1}] (b_0 = 0 is the embedding)
        self.stage_anchor_idx = [[i for i, b in enumerate(self.anchors) if s.start < b <= s.end] for s in self.stages]
        # depth -> type table, t(d) = max{i : b_i <= c_d}
        self.profile = False  # when True, cycle() appends a time split to self.cycle_profile
        self.cycle_profile: list[dict[str, float]] = []
        self.depth_type = torch.tensor([max(i for i, b in enumerate(self.anchors) if b <= self.boundaries[d])
                                        for d in range(self.n + 1)], device=target.device)

    # ---- prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompt_ids: Sequence[int], params: SamplingParams,
              generator: torch.Generator | None) -> tuple[PipelineState, int]:
        model, dev, n = self.model, self.model.device, self.n
        cfg = model.cfg
        P = len(prompt_ids)
        ids = torch.tensor([list(prompt_ids)], device=dev)
        pos = torch.arange(P, device=dev)[None]
        h0 = model.embed_tokens(ids)
        h, rec = model.run_layers(h0, pos, 0, cfg.num_layers, record=self.anchors)
        anchors = torch.zeros(model.max_len + 1, len(self.anchors), cfg.hidden_size, dtype=model.dtype, device=dev)
        for i, b in enumerate(self.anchors):
            anchors[:P, i] = rec[b][0]
        first = next_token(model.logits(h[:, -1].to(dev))[0], params, generator)
        tokens = torch.zeros(model.max_len + 2, dtype=torch.long, device=dev)
        tokens[:P] = ids[0]
        tokens[P] = first
        zero = lambda: torch.zeros((), dtype=torch.long, device=dev)  # noqa: E731
        st = PipelineState(
            tokens=tokens, p_new=torch.tensor(P, device=dev), fill=torch.ones((), dtype=torch.long, device=dev),
            pdm_len=torch.tensor(P, device=dev),
            hbuf=torch.zeros(n, 1, 1, cfg.hidden_size, dtype=model.dtype, device=dev), anchors=anchors,
            q_ring=None if params.greedy else torch.zeros(n + 1, cfg.vocab_size, device=dev),
            cycles=zero(), verifications=zero(), accepts=zero(), prompt_len=P)
        self.drafter.prefill(self, st)
        return st, int(first)

    # ---- one cycle -------------------------------------------------------------------------------
    @torch.inference_mode()
    def cycle(self, st: PipelineState, params: SamplingParams, generator: torch.Generator | None) -> None:
        model, n = self.model, self.n
        clock = time.perf_counter if self.profile else (lambda: 0.0)
        t_start = clock()
        fill, p_new = int(st.fill), int(st.p_new)  # host copies: free on CPU (a sync on a GPU)
        p_old = p_new - fill + 1

        # the newest token enters at depth 0: its embedding is stage 1's input and anchor b_0 = 0
        st.hbuf[0] = model.embed_tokens(st.tokens[p_new].view(1, 1))
        st.anchors[p_new, 0] = st.hbuf[0, 0, 0]

        # 1. draft the token at p_new + 1 from pre-step features
        t_draft = clock()
        x_hat, q = self.drafter.draft(self, st, params, generator)
        t_draft = clock() - t_draft
        st.tokens[p_new + 1] = x_hat
        if q is not None:
            st.q_ring[(p_new + 1) % (n + 1)] = q
        st.pdm_len.fill_(p_old)

        # 2. every in-flight token advances one stage (sequential executor: one after another)
        outs, stage_times = [], []
        for s in range(fill):
            t_s = clock()
            pos = p_new - s
            stage = self.stages[s]
            want = tuple(self.anchors[i] for i in self.stage_anchor_idx[s])
            h, rec = stage(st.hbuf[s], st.p_new.new_full((1, 1), pos), record=want)
            for i in self.stage_anchor_idx[s]:
                st.anchors[pos, i] = rec[self.anchors[i]][0, 0]
            outs.append(h)
            stage_times.append(clock() - t_s)

        # 3. verify: the oldest token left the last stage -> target distribution at p_old + 1
        st.cycles += 1
        t_verify = clock()
        if fill == n:
            logits = model.logits(outs[n - 1])[0, 0]
            cand = st.tokens[p_old + 1]
            if params.greedy:
                accept, y = verify_greedy(logits, cand)
            else:
                accept, y = verify_sampling(logits, cand, st.q_ring[(p_old + 1) % (n + 1)], params, generator)
            st.verifications += 1
            st.accepts += accept.long()
            st.tokens[p_old + 1] = y  # == cand on accept
            # accept: window slides by one; reject: restart with y alone at depth 0 (fill 1)
            st.p_new.copy_(torch.where(accept, st.p_new + 1, st.p_new.new_tensor(p_old + 1)))
            st.fill.copy_(torch.where(accept, st.fill, torch.ones_like(st.fill)))
        else:  # warm-up: nothing leaves the pipeline, the draft enters stage 1
            st.p_new += 1
            st.fill += 1
        # depth s output becomes depth s+1 input (rows beyond the new fill are never read)
        for s in range(min(fill, n - 1)):
            st.hbuf[s + 1] = outs[s]
        if self.profile:
            t_end = clock()
            t_verify = t_end - t_verify
            total = t_end - t_start
            self.cycle_profile.append({
                "cycle": total, "draft": t_draft, "stages": sum(stage_times),
                "slowest_stage": max(stage_times), "verify": t_verify,
                "overhead": total - t_draft - sum(stage_times) - t_verify, "fill": float(fill)})

    # ---- the decode loop -------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                 eos_ids: Sequence[int], generator: torch.Generator | None = None,
                 stop_fn: Callable[[int], bool] | None = None) -> Iterator[int]:
        """Yield committed tokens (only verified or exact ones); sets self.last_metrics at the end. stop_fn(token),
        called once per committed token (the prefill's too), ends the generation after that token when True."""
        check_capacity(self.model, len(prompt_ids), max_new_tokens, extra=self.n + 1)
        check_prompt_ids(prompt_ids, self.model.cfg.vocab_size)
        eos = set(int(e) for e in eos_ids)
        t0 = time.perf_counter()
        st, first = self.start(prompt_ids, params, generator)
        wait_for_device(st.tokens.device)
        t1 = time.perf_counter()
        self.last_state = st
        finished = first in eos
        self.last_metrics = metrics_from(0, 0, 0, 1, self.n, 0.0, t1 - t0)
        yield first
        hit = stop_fn is not None and stop_fn(first)
        if finished or max_new_tokens == 1 or hit:
            self.last_finished_by_eos = finished
            return
        com = Committer(st.prompt_len + 1, eos, max_new_tokens, stop_fn)
        decode_time = 0.0

        def metrics(committed: int) -> None:
            self.last_metrics = metrics_from(int(st.cycles), int(st.verifications), int(st.accepts),
                                             committed, self.n, decode_time, t1 - t0)
        # a token is committed at least every n + 1 cycles (a reject refills n stages): a decode that runs more cycles
        # than max_new_tokens can need is not advancing (a bug), and raises instead of looping for ever
        bound, ran = (self.n + 1) * (max_new_tokens + 1), 0  # counted on the host: no device read for it
        while not com.stop:
            if ran >= bound:
                raise RuntimeError(f"the decode ran {ran} cycles for {com.committed} of {max_new_tokens} "
                                   "tokens, more than it can need: its state stopped advancing; this is a bug, "
                                   "please report it (method='ar' decodes meanwhile)")
            tc = time.perf_counter()
            self.cycle(st, params, generator)
            ran += 1
            wait_for_device(st.tokens.device)  # the cycle's kernels, not only their launches
            decode_time += time.perf_counter() - tc
            yield from com.take(st.tokens, int(st.p_new) - int(st.fill) + 1, metrics)  # <= 1 per cycle
        self.last_finished_by_eos = com.finished

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
            eos_ids: Sequence[int], generator: torch.Generator | None = None) -> SpdResult:
        toks = list(self.generate(prompt_ids, max_new_tokens, params, eos_ids, generator))
        return SpdResult(toks, self.last_finished_by_eos, dict(self.last_metrics))

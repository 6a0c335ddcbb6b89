"""The distributed executor: rank 0 drives the pipeline, ranks 1..n-1 each serve one stage.

Who sends what (item k = the k-th token rank 0 feeds into stage 1 during a request):

  rank s-1 -> rank s : ITEM [pos, greedy] + h (stage s-1 output, H floats), one per item, FIFO
  rank s   -> rank 0 : report [pos] + the anchors stage s recorded for that item
                       (+ on the last rank: argmax (greedy) or the logits [V] (sampling))
  rank 0   -> rank 1 : PREFILL [P] + the prompt's stage-0 output; STOP ends a request; END a call

Ranks 1..n-1 never wait for a decision. Every rank runs exactly one item per cycle, in FIFO order;
only rank 0 knows (it decides) whether an item is still valid. After a reject, the in-flight items
are stale: downstream ranks still run them (the work fills the pipeline bubble the refill leaves
anyway) and rank 0 ignores their reports. That is safe because cache slots are positions: a stale
item writes K/V only at positions beyond the committed ones, and the valid token for that position
reaches the same rank later (FIFO) and overwrites the slot before any query can read it. So the
rollback of every rank is free and needs no message: the decision reaches stage s implicitly, as
the position of the next valid item it receives.

The critical loop per cycle is: rank 0 runs stage 0 and sends; meanwhile it drafts (the PDM) on the
features of earlier cycles; then it waits for the last stage's report on the oldest token, verifies,
and feeds the next token. The reports rank 0 reads before drafting were sent a cycle earlier.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..ar import check_capacity
from ..drafters import PdmDrafter
from ..engine import PipelineState, SpdResult, metrics_from
from ..model import Transformer
from ..ops import verify_sampling
from ..pdm import DraftHead
from ..sampling import SamplingParams, next_token
from .comm import END, HDR, ITEM, PREFILL, STOP, FaultInjector, Links, RankFailure, header

STATS = 8  # floats in a worker's end-of-call statistics message


@dataclass(frozen=True)
class StagePlan:
    """Stage boundaries and PDM anchors: which rank runs which layers and records which anchors."""
    boundaries: tuple[int, ...]
    anchors: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.boundaries) - 1

    def layers(self, s: int) -> range:
        return range(self.boundaries[s], self.boundaries[s + 1])

    def recorded(self, s: int) -> tuple[int, ...]:
        """Anchor layers stage s records: b in (c_s, c_{s+1}] (b_0 = 0, the embedding, is rank 0's)."""
        return tuple(b for b in self.anchors if self.boundaries[s] < b <= self.boundaries[s + 1])

    def recorded_idx(self, s: int) -> list[int]:
        return [i for i, b in enumerate(self.anchors) if self.boundaries[s] < b <= self.boundaries[s + 1]]

    def reports(self, s: int) -> bool:
        return s > 0 and (bool(self.recorded(s)) or s == self.n - 1)

    def describe(self, s: int) -> str:
        return f"stage {s}, layers {self.boundaries[s]}..{self.boundaries[s + 1] - 1}"


def _pay(params_greedy: bool, vocab: int) -> int:
    return 1 if params_greedy else vocab


class StageWorker:
    """Rank s >= 1: receive an item, run layers [c_s, c_{s+1}), pass it on, report to rank 0."""

    def __init__(self, rank: int, plan: StagePlan, model: Transformer, links: Links, dtype: torch.dtype):
        self.s, self.plan, self.model, self.links, self.dtype = rank, plan, model, links, dtype
        self.want = plan.recorded(rank)
        self.last = rank == plan.n - 1
        self.H, self.V = model.cfg.hidden_size, model.cfg.vocab_size
        self.fault = FaultInjector(rank)
        self.items, self.compute_s, self.item_wait_s = 0, 0.0, 0.0

    def _run(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        t0 = time.perf_counter()
        out = self.model.run_layers(h, pos, self.plan.boundaries[self.s], self.plan.boundaries[self.s + 1],
                                    record=self.want)
        self.compute_s += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def serve_call(self) -> None:
        """Serve requests until rank 0 ends the call (END); then send this rank's statistics."""
        s, H, lk = self.s, self.H, self.links
        nxt = s + 1
        start = (self.items, self.compute_s, lk.send_s, self.item_wait_s)
        while True:
            w0 = lk.wait_s
            msg = lk.recv(HDR + H, s - 1, f"the next message from rank {s - 1}")
            kind, greedy = float(msg[0]), bool(msg[2] > 0)
            if kind in (END, STOP):
                if not self.last:
                    lk.send(msg, nxt, "the end marker")
                lk.flush()
                if kind == END:
                    stats = torch.zeros(STATS, device=lk.device)
                    stats[:4] = torch.tensor([self.items - start[0], self.compute_s - start[1],
                                              lk.send_s - start[2], self.item_wait_s - start[3]])
                    lk.send(stats, 0, "statistics")
                    lk.flush()
                    return
                continue
            if kind == PREFILL:
                P = int(msg[1])
                x = lk.recv(P * H, s - 1, "the prompt's hidden states")
                h = x.view(1, P, H).to(self.dtype, copy=True)
                out, rec = self._run(h, torch.arange(P)[None].to(h.device))
                if not self.last:
                    lk.send(msg, nxt, "the prefill header")
                    lk.send(out.reshape(-1).float(), nxt, "the prompt's hidden states")
                final = out[:, -1]
            elif kind == ITEM:
                self.item_wait_s += lk.wait_s - w0
                p = int(msg[1])
                h = msg[HDR:].view(1, 1, H).to(self.dtype, copy=True)
                out, rec = self._run(h, torch.full((1, 1), p, dtype=torch.long, device=h.device))
                if not self.last:
                    fwd = header(ITEM, p, float(greedy), H, h.device)
                    fwd[HDR:] = out.reshape(-1)
                    lk.send(fwd, nxt, "a hidden state")
                final = out
            else:
                raise RankFailure(f"rank {s}: unknown message kind {kind} from rank {s - 1} (protocol out of step)")
            if self.plan.reports(s):
                parts = [msg[:HDR]] + [rec[b][0].reshape(-1).float() for b in self.want]
                if self.last:  # the exact expressions of SPDEngine.start / SPDEngine.cycle
                    t0 = time.perf_counter()
                    logits = self.model.logits(final)[0] if kind == PREFILL else self.model.logits(final)[0, 0]
                    parts.append(torch.argmax(logits, dim=-1).float().view(1) if greedy else logits)
                    self.compute_s += time.perf_counter() - t0
                lk.send(torch.cat(parts), 0, "a report")
            if kind == ITEM:
                self.items += 1
                self.fault.tick(self.items)


class PipelineDriver:
    """Rank 0: embedding, stage 0, the PDM, verification, the decode loop (mirrors SPDEngine)."""

    def __init__(self, plan: StagePlan, model: Transformer, head: DraftHead, links: Links | None,
                 lookup: int = 0):
        self.plan, self.model, self.links = plan, model, links
        self.n = plan.n
        self.anchors = plan.anchors
        self.drafter = PdmDrafter(head, lookup)
        self.want0, self.idx0 = plan.recorded(0), plan.recorded_idx(0)
        self.reporters = [s for s in range(1, self.n) if plan.reports(s)]
        self.depth_type = torch.tensor([max(i for i, b in enumerate(self.anchors) if b <= plan.boundaries[d])
                                        for d in range(self.n + 1)], device=model.embed.weight.device)
        self.fault = FaultInjector(0)
        self.got: dict[int, int] = {}   # reports received per reporting rank (this request)
        self.sent = 0                   # items fed into stage 1 (this request)
        self.last_pos = -1              # position of the last report received

    # ---- messages --------------------------------------------------------------------------------
    def _report(self, st: PipelineState, s: int, rows: int, params: SamplingParams,
                pos0: int | None = None) -> tuple[int, torch.Tensor]:
        """Receive stage s's next report; write its anchors at its positions; return (pos, payload)."""
        A, H = len(self.plan.recorded(s)), self.model.cfg.hidden_size
        pay = _pay(params.greedy, self.model.cfg.vocab_size) if s == self.n - 1 else 0
        msg = self.links.recv(HDR + rows * A * H + pay, s, f"the report of rank {s} on item {self.got[s]}")
        pos = int(msg[1]) if pos0 is None else pos0
        if A:
            # the worker sends its anchors one after another, each [rows, H] (see the report's `parts`)
            st.anchors[pos:pos + rows, self.plan.recorded_idx(s)] = \
                msg[HDR:HDR + rows * A * H].view(A, rows, H).transpose(0, 1).to(st.anchors.dtype)
        self.got[s] += 1
        return pos, msg[HDR + rows * A * H:]

    def _catch_up(self, st: PipelineState, s: int, count: int, params: SamplingParams) -> torch.Tensor | None:
        pay = None
        while self.got[s] < count:
            self.last_pos, pay = self._report(st, s, 1, params)
        return pay

    # ---- prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompt_ids: Sequence[int], params: SamplingParams,
              generator: torch.Generator | None) -> tuple[PipelineState, int]:
        model, n = self.model, self.n
        cfg, dev = model.cfg, model.embed.weight.device
        P = len(prompt_ids)
        ids = torch.tensor([list(prompt_ids)], device=dev)
        pos = torch.arange(P, device=dev)[None]
        anchors = torch.zeros(model.max_len + 1, len(self.anchors), cfg.hidden_size, dtype=model.dtype, device=dev)
        tokens = torch.zeros(model.max_len + 2, dtype=torch.long, device=dev)
        zero = lambda: torch.zeros((), dtype=torch.long, device=dev)  # noqa: E731
        st = PipelineState(
            tokens=tokens, p_new=torch.tensor(P, device=dev), fill=torch.ones((), dtype=torch.long, device=dev),
            pdm_len=torch.tensor(P, device=dev), hbuf=torch.zeros(1, 1, 1, cfg.hidden_size, dtype=model.dtype,
                                                                 device=dev),
            anchors=anchors, q_ring=None if params.greedy else torch.zeros(n + 1, cfg.vocab_size, device=dev),
            cycles=zero(), verifications=zero(), accepts=zero(), prompt_len=P)
        self.got = {s: 0 for s in self.reporters}
        self.sent = 0
        h0 = model.embed_tokens(ids)
        h, rec = model.run_layers(h0, pos, 0, self.plan.boundaries[1], record=(0,) + self.want0)
        for i, b in zip([0] + self.idx0, (0,) + self.want0):
            anchors[:P, i] = rec[b][0]
        if n == 1:
            first = next_token(model.logits(h[:, -1])[0], params, generator)
        else:
            self.links.send(header(PREFILL, P, float(params.greedy), cfg.hidden_size, dev), 1, "the prefill header")
            self.links.send(h.reshape(-1).float(), 1, "the prompt's hidden states")
            pay = None
            for s in self.reporters:
                _, pay = self._report(st, s, P, params, pos0=0)
                self.got[s] = 0  # prefill reports are not items
            first = pay.long()[0] if params.greedy else next_token(pay, params, generator)
        tokens[:P] = ids[0]
        tokens[P] = first
        self.drafter.prefill(self, st)
        return st, int(first)

    # ---- one cycle -------------------------------------------------------------------------------
    @torch.inference_mode()
    def cycle(self, st: PipelineState, params: SamplingParams, generator: torch.Generator | None,
              tm: dict[str, float]) -> None:
        model, n, c = self.model, self.n, self.sent
        t0 = time.perf_counter()
        fill, p_new = int(st.fill), int(st.p_new)
        p_old = p_new - fill + 1
        st.hbuf[0] = model.embed_tokens(st.tokens[p_new].view(1, 1))
        st.anchors[p_new, 0] = st.hbuf[0, 0, 0]
        h, rec = model.run_layers(st.hbuf[0], st.p_new.new_full((1, 1), p_new), 0, self.plan.boundaries[1],
                                  record=self.want0)
        for i, b in zip(self.idx0, self.want0):
            st.anchors[p_new, i] = rec[b][0, 0]
        t1 = time.perf_counter()
        if n > 1:
            msg = header(ITEM, p_new, float(params.greedy), model.cfg.hidden_size, h.device)
            msg[HDR:] = h.reshape(-1)
            self.links.send(msg, 1, f"item {c}")
        self.sent += 1
        # the draft reads pre-step features: stage s's output for items <= c - 1 - s
        for s in self.reporters:
            self._catch_up(st, s, c - s, params)
        t2 = time.perf_counter()
        x_hat, q = self.drafter.draft(self, st, params, generator)
        st.tokens[p_new + 1] = x_hat
        if q is not None:
            st.q_ring[(p_new + 1) % (n + 1)] = q
        st.pdm_len.fill_(p_old)
        t3 = time.perf_counter()
        st.cycles += 1
        if fill == n:
            if n == 1:
                logits = model.logits(h)[0, 0]
                pay = torch.argmax(logits, dim=-1).float().view(1) if params.greedy else logits
            else:  # the last stage's report on item c - n + 1: the oldest token p_old
                pay = self._catch_up(st, n - 1, c - n + 2, params)
                if pay is None or self.last_pos != p_old:
                    raise RankFailure(f"rank 0: protocol out of step (expected the verification of position "
                                      f"{p_old}, got {getattr(self, 'last_pos', None)})")
            t4 = time.perf_counter()
            cand = st.tokens[p_old + 1]
            if params.greedy:  # == ops.verify_greedy(logits, cand); the last rank sent argmax(logits)
                y = pay.long()[0]
                accept = y == cand
            else:
                accept, y = verify_sampling(pay, cand, st.q_ring[(p_old + 1) % (n + 1)], params, generator)
            st.verifications += 1
            st.accepts += accept.long()
            st.tokens[p_old + 1] = y
            st.p_new.copy_(torch.where(accept, st.p_new + 1, st.p_new.new_tensor(p_old + 1)))
            st.fill.copy_(torch.where(accept, st.fill, torch.ones_like(st.fill)))
        else:
            t4 = time.perf_counter()
            st.p_new += 1
            st.fill += 1
        t5 = time.perf_counter()
        for k, v in (("stage0", t1 - t0), ("pdm", t3 - t2), ("wait", (t2 - t1) + (t4 - t3)), ("verify", t5 - t4),
                     ("cycle", t5 - t0)):
            tm[k] = tm.get(k, 0.0) + v
        self.fault.tick(self.sent)

    # ---- a request -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
            eos_ids: Sequence[int], generator: torch.Generator | None = None) -> SpdResult:
        check_capacity(self.model, len(prompt_ids), max_new_tokens, extra=self.n + 1)
        eos = set(int(e) for e in eos_ids)
        lk = self.links
        send0, wait0 = (lk.send_s, lk.wait_s) if lk else (0.0, 0.0)
        t0 = time.perf_counter()
        st, first = self.start(prompt_ids, params, generator)
        t1 = time.perf_counter()
        out, tm = [first], {}
        finished = first in eos
        next_out = st.prompt_len + 1
        while not finished and len(out) < max_new_tokens:
            self.cycle(st, params, generator, tm)
            p_old = int(st.p_new) - int(st.fill) + 1
            if next_out <= p_old:  # at most one new token per cycle
                tok = int(st.tokens[next_out])
                next_out += 1
                out.append(tok)
                finished = tok in eos
        t2 = time.perf_counter()
        self._end_request(st, params)
        t3 = time.perf_counter()
        m = metrics_from(int(st.cycles), int(st.verifications), int(st.accepts), len(out), self.n, t2 - t1, t1 - t0)
        cyc = max(1, int(st.cycles))
        m.update({f"rank0_{k}_ms": 1e3 * v / cyc for k, v in tm.items()})
        if lk:
            m["rank0_send_ms"] = 1e3 * (lk.send_s - send0) / cyc
            m["rank0_recv_total_ms"] = 1e3 * (lk.wait_s - wait0) / cyc
        m["drain_seconds"] = t3 - t2
        return SpdResult(out, finished, m)

    def _end_request(self, st: PipelineState, params: SamplingParams) -> None:
        """STOP the pipeline, then receive the reports still in flight (stale work) so the FIFO streams
        are empty before the next request."""
        if self.n == 1:
            return
        self.links.send(header(STOP, 0, 0.0, self.model.cfg.hidden_size, st.tokens.device), 1, "the stop marker")
        for s in self.reporters:
            self._catch_up(st, s, self.sent, params)
        self.links.flush()

    def end_call(self) -> dict[int, list[float]]:
        """Tell ranks 1..n-1 the call is over; collect their statistics {rank: [items, compute_s,
        send_s, item_wait_s, ...]}."""
        if self.n == 1:
            return {}
        self.links.send(header(END, 0, 0.0, self.model.cfg.hidden_size, self.model.embed.weight.device), 1,
                        "the end-of-call marker")
        stats = {r: self.links.recv(STATS, r, f"rank {r}'s statistics").tolist() for r in range(1, self.n)}
        self.links.flush()
        return stats

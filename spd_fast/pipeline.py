"""Pipelined executors: placement="streams" (one GPU, a CUDA stream per stage) and
placement="devices" (one stage per GPU), built on a cycle that never reads the device.

`DeviceCycle` is the decode cycle of engine.py rewritten as a fixed sequence of tensor operations:
every stage runs every cycle (rows beyond the fill write their K/V into the scratch slot
`max_len`, which no real query reads), the PDM always recomputes n + 1 rows (rows it does not need
go to the scratch slot as well), and accept/reject, flush and rollback are `torch.where` updates of
the device state. Nothing depends on a host value, so one cycle can be captured as a CUDA graph
and replayed. Its phases:

    pre   (main stream)    embed the newest token, stage positions, a snapshot of the PDM's rows
    draft (PDM stream)     aggregate -> tower -> LM head -> draft token (and q when sampling)
    stage s (stream s)     layers [c_s, c_{s+1}) on the token at depth s
    post  (main stream)    anchor write-back, verification, state update, hand-offs

The draft and the n stages of one cycle are independent (stage s reads what stage s-1 produced in
the previous cycle), so they fork from `pre` and join before `post`.

`PipelinedEngine.generate()` launches cycles without waiting for them. After each cycle it copies
the token array and the counters to a host buffer (pinned on CUDA) and records an event; the host
reads a cycle's snapshot only when it is `lag` cycles old, so it notices EOS a cycle or two late.
Tokens are only ever taken up to the verified position, and never past an EOS.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import replace
from typing import Callable, Iterator, Sequence

import torch

from .ar import check_capacity, check_prompt_ids
from .config import SpdConfigError
from . import ops
from .engine import Committer, PipelineState, SPDEngine, metrics_from, run_stepwise
from .ops import verify_greedy, verify_sampling
from .profiling import nvtx_range
from .sampling import SamplingParams
from .streams import CudaStreams, SimulatedStreams

LOCAL_PLACEMENTS = ("local", "sequential", "streams", "devices")


def graph_pool():
    """A fresh private memory pool for each captured graph.

    One pool shared by every graph of the process failed on the first GPU run (H200, torch 2.11):
    after the graphs that used it were freed while a tensor allocated during their capture lived
    on, the next capture into it hit CUDACachingAllocator's internal assert `use_count > 0`, and the
    aborted capture most likely left the CUDA generator unusable (the next `normal_` raised "Offset
    increment outside graph capture")."""
    return torch.cuda.graph_pool_handle()


_CAPTURE_STREAMS: dict = {}


def capture_stream(device: torch.device):
    """The stream graphs of `device` are captured on. `torch.cuda.graph` without `stream=` uses one stream of the
    process, made on whichever GPU was current at the first capture: a later capture for a model on another GPU
    would then capture nothing of that model's work (its current stream is not the capturing one)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[device]


def resolve_placement(placement: str, device: str | torch.device, num_stages: int) -> list[torch.device]:
    """Check that `placement` can run here; return the device of each stage."""
    dev = torch.device(device)
    if placement in ("local", "sequential"):
        return [dev] * num_stages
    if placement not in ("streams", "devices"):
        raise SpdConfigError(f"placement must be one of {LOCAL_PLACEMENTS + ('distributed',)}, got {placement!r}")
    if not torch.cuda.is_available():
        raise SpdConfigError(
            f"placement={placement!r} runs the stages on CUDA GPUs, but this machine has none (torch "
            f"{torch.__version__}, CUDA available: False); use placement='sequential' (the default) on CPU")
    if dev.type != "cuda":
        raise SpdConfigError(f"placement={placement!r} needs device='cuda', got device={str(device)!r}")
    if placement == "streams":
        return [dev] * num_stages
    count = torch.cuda.device_count()
    first = torch.cuda.current_device() if dev.index is None else dev.index  # the model's GPU runs stage 0
    if count - first < num_stages:
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count))
        raise SpdConfigError(
            f"placement='devices' runs one stage per GPU, from the model's device cuda:{first} on: num_stages="
            f"{num_stages} needs cuda:{first}..cuda:{first + num_stages - 1}, but {count} "
            f"{'is' if count == 1 else 'are'} visible ({names}); lower num_stages, load on a lower device index, or "
            "use placement='streams' (all stages on one GPU)")
    return [torch.device("cuda", first + i) for i in range(num_stages)]


def on_device(steps: Iterator[int], device: torch.device) -> Iterator[int]:
    """Run a decode generator in inference mode and, on CUDA, with `device` as the current device, while it runs
    (never across a yield into the caller's code, where inference mode would turn the caller's own tensors into
    inference tensors). Streams, events and graph captures that name no device use the current one, so on a
    model loaded on, say, cuda:1 they would otherwise go to cuda:0: events that wait for nothing (stale tokens
    read back) and a capture that records no kernel."""
    def ctx() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        stack.enter_context(torch.inference_mode())
        return stack
    return run_stepwise(steps, ctx)


def place_stages(engine: SPDEngine, devices: Sequence[torch.device]) -> None:
    """Move each stage's layers (and so its KV cache, at setup_caches) to its device."""
    model = engine.model
    per_layer = [model.device] * model.cfg.num_layers
    for stage, d in zip(engine.stages, devices):
        for li in range(stage.start, stage.end):
            model.layers[li].to(d)
            per_layer[li] = d
    model.__dict__["layer_devices"] = per_layer
    if model.max_len:
        max_len = model.max_len
        model.free_caches()
        model.setup_caches(1, max_len)


class DeviceCycle:
    """The static, sync-free cycle of one SPDEngine (see the module docstring)."""

    def __init__(self, engine: SPDEngine, state: PipelineState, params: SamplingParams,
                 generator: torch.Generator | None, stage_devices: Sequence[torch.device],
                 swap_handoff: bool = False):
        self.engine, self.st, self.params, self.gen = engine, state, params, generator
        # Hand-offs: with one device (and in a CUDA graph) post() copies stage outputs into the next
        # stage's input. With one stage per GPU, stage s copies its output to GPU s+1 itself, on its
        # own stream (so the copy is ordered after its work and before the join), into a second
        # buffer that post() swaps in (eager only).
        self.swap_handoff = swap_handoff
        model, n = engine.model, engine.n
        self.n, self.ML = n, model.max_len
        main = model.device
        H = model.cfg.hidden_size
        self.devices = list(stage_devices)
        self.ar_n = torch.arange(n, device=main)
        self.row_off = torch.arange(-n, 1, device=main)         # PDM rows: p_new - n .. p_new
        self.pos_stage = torch.zeros(n, dtype=torch.long, device=main)
        # each stage's position: a view of pos_stage on the main device, a copy on another GPU
        self.pos_dev = [self.pos_stage[s:s + 1].view(1, 1) if d == main else
                        torch.zeros(1, 1, dtype=torch.long, device=d) for s, d in enumerate(self.devices)]
        self.hin = [torch.zeros(1, 1, H, dtype=model.dtype, device=d) for d in self.devices]
        self.outs = [torch.zeros(1, 1, H, dtype=model.dtype, device=d) for d in self.devices]
        self.nxt = [torch.zeros(1, 1, H, dtype=model.dtype, device=d) for d in self.devices] if swap_handoff else []
        self.anchor_out = [torch.zeros(max(1, len(idx)), H, dtype=model.dtype, device=d)
                           for idx, d in zip(engine.stage_anchor_idx, self.devices)]
        m = len(engine.anchors)
        self.pdm_pos = torch.zeros(n + 1, dtype=torch.long, device=main)
        self.pdm_types = torch.zeros(n + 1, dtype=torch.long, device=main)
        self.pdm_rows = torch.zeros(n + 1, m, H, dtype=model.dtype, device=main)
        self.scratch = torch.tensor(self.ML, device=main)

    def load_state(self, st: PipelineState) -> None:
        """Copy a freshly prefilled state into the static one the cycle (or its graph) works on."""
        dst = self.st
        for name in ("tokens", "p_new", "fill", "pdm_len", "anchors", "cycles", "verifications", "accepts"):
            getattr(dst, name).copy_(getattr(st, name))
        if st.q_ring is not None and dst.q_ring is not None:
            dst.q_ring.copy_(st.q_ring)
        dst.prompt_len = st.prompt_len
        self.hin[0].copy_(st.hbuf[0].to(self.hin[0].device))

    # ---- phases ----------------------------------------------------------------------------------
    def pre(self) -> None:
        st, e, n = self.st, self.engine, self.n
        p_new, fill = st.p_new, st.fill
        p_old = p_new - fill + 1
        emb = e.model.embed_tokens(st.tokens.index_select(0, p_new.view(1)).view(1, 1))
        self.hin[0].copy_(emb)
        st.anchors[:, 0].index_copy_(0, p_new.view(1), emb.view(1, -1))
        # the token at depth s sits at p_new - s while s < fill; idle stages work on the scratch slot
        self.pos_stage.copy_(torch.where(self.ar_n < fill, p_new - self.ar_n, self.scratch))
        for s, d in enumerate(self.devices):
            if d != self.pos_stage.device:
                self.pos_dev[s].copy_(self.pos_stage[s:s + 1].view(1, 1), non_blocking=True)
        # PDM rows p_new - n .. p_new: rows older than pdm_len already sit in its cache (scratch slot)
        pos = p_new + self.row_off
        self.pdm_pos.copy_(torch.where(pos >= st.pdm_len, pos, self.scratch))
        depth = torch.where(pos < p_old, n, p_new - pos).clamp(0, n)
        self.pdm_types.copy_(e.depth_type[depth])
        # a snapshot: the stages of this cycle write anchor rows while the PDM runs
        self.pdm_rows.copy_(st.anchors.index_select(0, pos.clamp_min(0)))

    def draft(self) -> None:
        st, n = self.st, self.n
        tok, q = self.engine.drafter.draft_static(self.engine, self, self.params, self.gen)
        nxt = (st.p_new + 1).view(1)
        st.tokens.index_copy_(0, nxt, tok.view(1))
        if q is not None:
            st.q_ring.index_copy_(0, nxt % (n + 1), q.view(1, -1))

    def stage(self, s: int) -> None:
        e = self.engine
        want = tuple(e.anchors[i] for i in e.stage_anchor_idx[s])
        h, rec = e.stages[s](self.hin[s], self.pos_dev[s], kv_bound=self.ML, record=want)
        self.outs[s].copy_(h)
        for j, b in enumerate(want):
            self.anchor_out[s][j].copy_(rec[b][0, 0])
        if self.swap_handoff and s + 1 < self.n:
            self.nxt[s + 1].copy_(h, non_blocking=True)  # to GPU s+1, on this stage's stream

    def post(self) -> None:
        st, e, n, main = self.st, self.engine, self.n, self.engine.model.device
        for s, idx in enumerate(e.stage_anchor_idx):
            row = self.pos_stage[s:s + 1]
            for j, i in enumerate(idx):
                st.anchors[:, i].index_copy_(0, row, self.anchor_out[s][j:j + 1].to(main, non_blocking=True))
        p_new, fill = st.p_new, st.fill
        p_old = p_new - fill + 1
        logits = e.model.logits(self.outs[n - 1].to(main, non_blocking=True))[0, 0]
        at = (p_old + 1).view(1)
        cand = st.tokens.index_select(0, at)[0]
        if self.params.greedy:
            accept, y = verify_greedy(logits, cand)
        else:
            q = st.q_ring.index_select(0, at % (n + 1))[0]
            accept, y = verify_sampling(logits, cand, q, self.params, self.gen)
        full = fill == n  # warm-up cycles verify nothing; their results are discarded
        st.tokens.index_copy_(0, at, torch.where(full, y, cand).view(1))
        st.verifications += full.long()
        st.accepts += (full & accept).long()
        st.cycles += 1
        st.pdm_len.copy_(p_old)
        rejected = full & ~accept
        new_p_new = torch.where(rejected, p_old + 1, p_new + 1)
        new_fill = torch.where(rejected, torch.ones_like(fill), torch.where(full, fill, fill + 1))
        st.p_new.copy_(new_p_new)
        st.fill.copy_(new_fill)
        if self.swap_handoff:  # the stages already copied; swap the buffers
            for s in range(1, n):
                self.hin[s], self.nxt[s] = self.nxt[s], self.hin[s]
        else:
            for s in range(n - 1):  # depth s output becomes the depth s+1 input
                self.hin[s + 1].copy_(self.outs[s], non_blocking=True)

    # ---- one cycle over a stream back end ----------------------------------------------------------
    def run(self, rt) -> None:
        """pre -> fork -> (draft | stage 0 | ... | stage n-1) -> join -> post."""
        main = rt.main
        # marks at the start and the end of each phase (the simulated back end logs them; tests check the order)
        with nvtx_range("spd.pre"):
            rt.mark(("pre",))
            self.pre()
            rt.mark(("pre", "end"))
        fork = rt.record(main)
        joins = []
        with rt.use(rt.pdm):
            rt.wait(rt.pdm, fork)
            with nvtx_range("spd.draft"):
                rt.mark(("draft",))
                self.draft()
                rt.mark(("draft", "end"))
            joins.append(rt.record(rt.pdm))
        for s in range(self.n):
            ss = rt.stage[s]
            with rt.use(ss):
                rt.wait(ss, fork)
                with nvtx_range(f"spd.stage{s}"):
                    rt.mark(("stage", s))
                    self.stage(s)
                    rt.mark(("stage", s, "end"))
                joins.append(rt.record(ss))
        for ev in joins:
            rt.wait(main, ev)
        with nvtx_range("spd.verify"):
            rt.mark(("post",))
            self.post()
            rt.mark(("post", "end"))


class PipelinedEngine:
    """Runs an SPDEngine with DeviceCycle on a stream back end, optionally as a CUDA graph.

    placement: "streams" or "devices" (CUDA), or "simulated" (CPU tensors with SimulatedStreams,
    the test double of the CUDA back end). The result equals the sequential executor's for greedy
    decoding; with sampling it follows the same distribution (random numbers are drawn in another
    order: warm-up cycles draw too)."""

    def __init__(self, engine: SPDEngine, placement: str = "streams", cuda_graphs: bool | None = None,
                 lag: int = 2):
        if placement not in ("streams", "devices", "simulated"):
            raise SpdConfigError(f"PipelinedEngine placement must be 'streams', 'devices' or 'simulated', got {placement!r}")
        if not hasattr(engine.drafter, "draft_static"):
            raise SpdConfigError(f"{type(engine.drafter).__name__} has no draft_static(); the pipelined executors "
                                 "need a drafter without host reads (PdmDrafter and ReferenceDrafter have one)")
        self.engine, self.placement, self.lag = engine, placement, max(0, int(lag))
        model = engine.model
        if placement == "simulated":
            self.devices = [model.device] * engine.n
            self.rt = SimulatedStreams(engine.n)
        else:
            self.devices = resolve_placement(placement, model.device, engine.n)
            if placement == "devices":
                place_stages(engine, self.devices)
            else:  # the model's own device object ("cuda:0", not "cuda"), so stages share its buffers
                self.devices = [model.device] * engine.n
            self.rt = CudaStreams(self.devices)
        on_cuda = model.device.type == "cuda"
        # one graph for the whole cycle needs every stage on one device; "devices" runs eagerly
        self.cuda_graphs = (on_cuda and placement == "streams") if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and not (on_cuda and placement == "streams"):
            raise SpdConfigError("cuda_graphs=True needs placement='streams' on a CUDA device")
        self.swap_handoff = False  # tests turn it on to run the devices hand-off on one device
        self._cycle: DeviceCycle | None = None
        self._key: tuple | None = None
        self._graph = None

    # ---- static state and capture ------------------------------------------------------------------
    def _static(self, st: PipelineState, params: SamplingParams, generator: torch.Generator | None) -> DeviceCycle:
        if self.cuda_graphs and self.swap_handoff:
            raise SpdConfigError("swap_handoff swaps the stage hand-off buffers in Python, once per cycle, and a CUDA "
                                 "graph replays the buffers of its capture: set cuda_graphs=False to use it")
        # the generator object, not its id (a freed one's id is reused); the seed lives in the generator
        # and the Python state a capture bakes in: the kernel backend, the drafter, its lookup and the head's config
        # (gate, copy boost, draft temperature scale); a change to any of them captures again
        d = self.engine.drafter
        key = (self.engine.model.max_len, self.engine.model.cache_version, replace(params, seed=None), generator,
               st.q_ring is not None, ops.BACKEND, d, getattr(d, "lookup", None),
               getattr(getattr(d, "head", None), "dcfg", None))
        if self._cycle is None or self._key != key:
            static = PipelineState(
                tokens=torch.zeros_like(st.tokens), p_new=torch.zeros_like(st.p_new), fill=torch.zeros_like(st.fill),
                pdm_len=torch.zeros_like(st.pdm_len), hbuf=st.hbuf, anchors=torch.zeros_like(st.anchors),
                q_ring=None if st.q_ring is None else torch.zeros_like(st.q_ring),
                cycles=torch.zeros_like(st.cycles), verifications=torch.zeros_like(st.verifications),
                accepts=torch.zeros_like(st.accepts), prompt_len=st.prompt_len)
            self._cycle = DeviceCycle(self.engine, static, params, generator, self.devices,
                                      swap_handoff=self.placement == "devices" or self.swap_handoff)
            self._key, self._graph = key, None
        cyc = self._cycle
        cyc.load_state(st)
        if self.cuda_graphs and self._graph is None:
            self._graph = self._capture(cyc, generator)
        return cyc

    def _capture(self, cyc: DeviceCycle, generator: torch.Generator | None):
        """Warm up (lazy inits, Triton compiles) on the real state, then capture one cycle.

        The warm-up cycles run on a copy of the state that is restored afterwards; the K/V they
        write lies at positions the next cycles overwrite before any query reads them."""
        saved = {k: getattr(cyc.st, k).clone() for k in ("tokens", "p_new", "fill", "pdm_len", "anchors",
                                                          "cycles", "verifications", "accepts")}
        hin0 = cyc.hin[0].clone()
        rng = generator.get_state() if generator is not None else None
        dev = self.devices[0]
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                cyc.run(self.rt)
        torch.cuda.current_stream(dev).wait_stream(side)
        if generator is not None:  # the warm-up's draws handed back: the decode samples what eager cycles would
            generator.set_state(rng)
        g = torch.cuda.CUDAGraph()
        if generator is not None:
            g.register_generator_state(generator)
        with torch.cuda.graph(g, pool=graph_pool(), stream=capture_stream(dev)):
            cyc.run(self.rt)
        for k, v in saved.items():
            getattr(cyc.st, k).copy_(v)
        cyc.hin[0].copy_(hin0)
        torch.cuda.synchronize()
        return g

    def _one_cycle(self, cyc: DeviceCycle) -> None:
        if self._graph is not None:
            with nvtx_range("spd.cycle_graph"):
                self._graph.replay()
        else:
            cyc.run(self.rt)

    # ---- the decode loop -----------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                 eos_ids: Sequence[int], generator: torch.Generator | None = None,
                 stop_fn: Callable[[int], bool] | None = None) -> Iterator[int]:
        """Yield committed tokens; sets last_metrics and last_finished_by_eos at the end (stop_fn: as in
        SPDEngine.generate)."""
        return on_device(self._generate(prompt_ids, max_new_tokens, params, eos_ids, generator, stop_fn),
                         self.engine.model.device)

    def _generate(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                  eos_ids: Sequence[int], generator: torch.Generator | None,
                  stop_fn: Callable[[int], bool] | None) -> Iterator[int]:
        e = self.engine
        check_capacity(e.model, len(prompt_ids), max_new_tokens, extra=e.n + 1)
        check_prompt_ids(prompt_ids, e.model.cfg.vocab_size)
        eos = set(int(x) for x in eos_ids)
        t0 = time.perf_counter()
        with nvtx_range("spd.prefill"):
            st0, first = e.start(prompt_ids, params, generator)
        # (all of it in inference mode through on_device: a capture under autograd would record the head's
        # grad-mode weight rebuilds)
        cyc = self._static(st0, params, generator)
        st = cyc.st
        t1 = time.perf_counter()
        P = st.prompt_len
        self.last_metrics = metrics_from(0, 0, 0, 1, e.n, 0.0, t1 - t0)
        self.last_finished_by_eos = first in eos
        yield first
        hit = stop_fn is not None and stop_fn(first)
        if first in eos or max_new_tokens == 1 or hit:
            return
        reader = Readback(st.tokens, [st.p_new, st.fill, st.cycles, st.verifications, st.accepts])
        com = Committer(P + 1, eos, max_new_tokens, stop_fn)
        t_dec = time.perf_counter()
        counters: list[int] = [0, 0, 0]

        def metrics(committed: int) -> None:
            self.last_metrics = metrics_from(*counters, committed, e.n, time.perf_counter() - t_dec, t1 - t0)
        # each cycle commits at most one token: never launch more than could still be needed
        # a cycle commits a token at least every n + 1 cycles (a reject refills n stages), so a decode that
        # needs more cycles than that for max_new_tokens is stuck (e.g. a graph that replays nothing)
        bound = (e.n + 1) * (max_new_tokens + 1) + self.lag
        for toks, scal in run_ahead(lambda: self._one_cycle(cyc), reader, self.lag,
                                    lambda unread: com.committed + unread < max_new_tokens, "spd.readback",
                                    max_launches=bound):
            p_new_h, fill_h, counters[:] = scal[0], scal[1], scal[2:]
            yield from com.take(toks, p_new_h - fill_h + 1, metrics)
            if com.stop:
                break
        self.last_finished_by_eos = com.finished
        self.last_state = st

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
            eos_ids: Sequence[int], generator: torch.Generator | None = None):
        from .engine import SpdResult

        toks = list(self.generate(prompt_ids, max_new_tokens, params, eos_ids, generator))
        return SpdResult(toks, self.last_finished_by_eos, dict(self.last_metrics))


def run_ahead(launch, reader: "Readback", lag: int, may_launch, label: str = "readback",
              max_launches: int | None = None) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Launch steps ahead of the host and yield each step's snapshot (tokens, scalars) once it is
    `lag` steps old. `may_launch(unread)` says whether another step could still be needed, given
    `unread` steps launched whose snapshots were not yet yielded. Stops when nothing is pending.
    `max_launches`: more steps than the decode can need means the device state is not advancing (a
    graph that replays nothing, stale read-backs), which raises instead of looping for ever."""
    pending: deque = deque()
    launched = seen = 0
    while True:
        if may_launch(launched - seen):
            if max_launches is not None and launched >= max_launches:
                raise RuntimeError(
                    f"the device decode launched {launched} steps without finishing, more than it can need: its "
                    "state stopped advancing (a CUDA graph that replays no work, or read-backs that see stale "
                    "buffers); rerun with cuda_graphs=False, or placement='sequential', and report it")
            launch()
            launched += 1
            pending.append(reader.snapshot(launched))
            if len(pending) <= lag:
                continue
        if not pending:
            return
        with nvtx_range(label):
            seen, toks, scal = reader.read(pending.popleft())
        yield toks, scal


class Readback:
    """Device -> host copies of a token array and a few scalar counters, one buffer per launched
    step in flight (pinned and asynchronous on CUDA; a plain copy on CPU). `snapshot()` after a
    step, `read()` when the host wants it (waits only for that step)."""

    def __init__(self, tokens: torch.Tensor, scalars: Sequence[torch.Tensor]):
        self.tokens, self.scalars = tokens, list(scalars)
        self.cuda = tokens.device.type == "cuda"
        self.free: list[torch.Tensor] = []

    def _buffer(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        return torch.empty(self.tokens.numel() + len(self.scalars), dtype=torch.long, pin_memory=self.cuda)

    def snapshot(self, step_no: int):
        dev = torch.cat([self.tokens] + [x.view(1).long() for x in self.scalars])
        host = self._buffer()
        host.copy_(dev, non_blocking=self.cuda)
        ev = None
        if self.cuda:  # on the tokens' own GPU's stream: the one the copy above was queued on
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.tokens.device))
        return step_no, host, ev

    def read(self, snap) -> tuple[int, torch.Tensor, list[int]]:
        step_no, host, ev = snap
        if ev is not None:
            ev.synchronize()
        T = self.tokens.numel()
        scal = host[T:].tolist()
        toks = host[:T].clone()
        self.free.append(host)
        return step_no, toks, scal

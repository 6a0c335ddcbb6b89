"""The strong AR baseline: a static decode step (token, position and output on the device, attention
over the whole static cache), captured as one CUDA graph on a GPU and replayed per token, with the
same asynchronous host readback as the pipelined SPD executors. On CPU the step runs eagerly (it is
the same computation; tests use it there)."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterator, Sequence

import torch

from .ar import DecodeResult, check_capacity, check_prompt_ids, prefill
from .model import Transformer
from .engine import Committer
from .pipeline import Readback, capture_stream, graph_pool, on_device, run_ahead
from .profiling import nvtx_range
from .sampling import SamplingParams, next_token


class GraphedAR:
    def __init__(self, model: Transformer, cuda_graphs: bool | None = None, lag: int = 2):
        self.model, self.lag = model, max(0, int(lag))
        on_cuda = model.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and not on_cuda:
            from .config import SpdConfigError

            raise SpdConfigError("cuda_graphs=True needs the model on a CUDA device")
        dev = model.device
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.tokens: torch.Tensor | None = None
        self._graph = None
        self._key: tuple | None = None

    def step(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        """One token: logits at pos -> next token, written at pos + 1; pos advances. No host reads."""
        with nvtx_range("ar.step"):
            logits = self.model(self.tok, self.pos, kv_bound=self.model.max_len)[0, -1]
            nxt = next_token(logits, params, generator)
            self.pos += 1
            self.tokens.index_copy_(0, self.pos.view(1), nxt.view(1))
            self.tok.copy_(nxt.view(1, 1))

    def _one_step(self, params: SamplingParams, generator: torch.Generator | None):
        return self._graph.replay if self._graph is not None else (lambda: self.step(params, generator))

    def _prepare(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        """Static buffers (and on a GPU the captured step) for these settings, caches and generator; called
        with tok and pos already at the first decode step. The key holds the generator itself, not its id:
        a freed generator's id is soon reused, and a graph bound to the old one would replay its stream."""
        m = self.model
        key = (m.max_len, m.cache_version, replace(params, seed=None), generator)
        if self.tokens is None or self._key != key:
            self.tokens = torch.zeros(m.max_len + 2, dtype=torch.long, device=m.device)
            self._key, self._graph = key, None
        if self.cuda_graphs and self._graph is None:
            side = torch.cuda.Stream(device=m.device)
            side.wait_stream(torch.cuda.current_stream(m.device))
            with torch.cuda.stream(side):
                self.warm_up(params, generator)
            torch.cuda.current_stream(m.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            if generator is not None:
                g.register_generator_state(generator)
            with torch.cuda.graph(g, pool=graph_pool(), stream=capture_stream(m.device)):
                self.step(params, generator)
            torch.cuda.synchronize()
            self._graph = g

    def warm_up(self, params: SamplingParams, generator: torch.Generator | None, steps: int = 2) -> None:
        """Eager steps before a capture (lazy inits, Triton compiles), from the real state, which is restored
        after them: their K/V lands at the positions the decode steps write next (before any query reads
        them), and their random numbers are handed back, so the decode samples what eager AR samples."""
        tok, pos = self.tok.clone(), self.pos.clone()
        rng = generator.get_state() if generator is not None else None
        for _ in range(steps):
            self.step(params, generator)
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        if generator is not None:
            generator.set_state(rng)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                 eos_ids: Sequence[int], generator: torch.Generator | None = None,
                 stop_fn: Callable[[int], bool] | None = None) -> Iterator[int]:
        return on_device(self._generate(prompt_ids, max_new_tokens, params, eos_ids, generator, stop_fn),
                         self.model.device)

    def _generate(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                  eos_ids: Sequence[int], generator: torch.Generator | None,
                  stop_fn: Callable[[int], bool] | None) -> Iterator[int]:
        m = self.model
        check_capacity(m, len(prompt_ids), max_new_tokens, extra=self.lag + 2)
        check_prompt_ids(prompt_ids, m.cfg.vocab_size)
        eos = set(int(e) for e in eos_ids)
        P = len(prompt_ids)
        # (in inference mode through on_device, which leaves it at each yield)
        t0 = time.perf_counter()
        with nvtx_range("ar.prefill"):
            first = next_token(prefill(m, prompt_ids), params, generator)
        self.tok.copy_(first.view(1, 1))
        self.pos.fill_(P)
        self._prepare(params, generator)  # after tok and pos: its warm-up starts from the real state
        self.tokens[P] = first  # after: _prepare may allocate tokens anew
        t1 = time.perf_counter()
        out = [int(first)]
        self.result = DecodeResult(out, t1 - t0, 0.0, out[0] in eos, {})
        yield out[0]
        hit = stop_fn is not None and stop_fn(out[0])
        if out[0] in eos or max_new_tokens == 1 or hit:
            return
        reader = Readback(self.tokens, [self.pos])
        com = Committer(P + 1, eos, max_new_tokens, stop_fn)
        t_dec = time.perf_counter()
        for toks, (pos,) in run_ahead(self._one_step(params, generator), reader, self.lag,
                                      lambda unread: com.committed + unread < max_new_tokens, "ar.readback",
                                      max_launches=max_new_tokens + self.lag + 1):
            for t in com.take(toks, pos):
                out.append(t)
                yield t
            if com.stop:
                break
        finished = com.finished
        dt = time.perf_counter() - t_dec
        steps = max(1, len(out) - 1)
        self.result = DecodeResult(out, t1 - t0, dt, finished,
                                   {"ms_per_token": 1e3 * dt / steps, "tokens_per_second": (len(out) - 1) / max(dt, 1e-9)})

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
            eos_ids: Sequence[int], generator: torch.Generator | None = None) -> DecodeResult:
        for _ in self.generate(prompt_ids, max_new_tokens, params, eos_ids, generator):
            pass
        return self.result

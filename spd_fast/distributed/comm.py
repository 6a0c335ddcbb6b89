"""Point-to-point messages between stage ranks, with timeouts, clear errors and time accounting.

Every message is one flat fp32 tensor that starts with a 4-value header `[kind, pos, aux, 0]`
(fp32 holds token positions and vocabulary ids below 2^24 exactly, and bf16/fp16 hidden states
round-trip through fp32 unchanged, so packing never changes a value). Messages between two ranks
arrive in the order they were sent (FIFO); the protocol relies on that, not on tags.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

HDR = 4
ITEM, PREFILL, STOP, END = 1.0, 2.0, 3.0, 4.0  # header kinds (see executor.py for who sends what)
_PENDING_SENDS = 8  # wait for the oldest send to a rank once this many are still in flight


class RankFailure(RuntimeError):
    """Another rank died, hung or broke the protocol; this rank cannot continue."""


def header(kind: float, pos: int = 0, aux: float = 0.0, extra: int = 0, device=None) -> torch.Tensor:
    t = torch.zeros(HDR + extra, dtype=torch.float32, device=device)
    t[0], t[1], t[2] = kind, float(pos), aux
    return t


class Links:
    """This rank's sends and receives. `describe(r)` names a peer in error messages."""

    def __init__(self, rank: int, timeout: float, describe, device: torch.device, world: int = 0):
        self.rank, self.timeout, self.describe, self.device = rank, timeout, describe, device
        self.world = world  # ranks in the chain 0 -> 1 -> ... -> world-1 -> 0 (0: unknown)
        self._wait = timedelta(seconds=timeout)
        self._pending: dict[int, deque] = {}
        self.send_s = 0.0      # posting sends and waiting for old ones to drain
        self.wait_s = 0.0      # blocked in receives: transfer time plus waiting for the peer's work
        self.messages = 0

    def _fail(self, err: Exception, peer: int, what: str) -> RankFailure:
        msg = str(err)
        low = msg.lower()
        if "timed out" in low or "timeout" in low:
            who = "it is"
            if what.startswith("waiting") and (up := self.upstream(peer)):
                # a message from `peer` waits on every rank between this one and it along the chain
                who = f"it, or a rank it waits on ({', '.join(map(str, up))}), is"
            why = (f"no message within {self.timeout:g} s: {who} hung, stuck, or slower than the timeout "
                   "(raise --timeout / timeout= if stages are legitimately this slow)")
        elif any(w in low for w in ("reset", "closed", "broken pipe", "read error", "write error", "eof")):
            why = "the connection was lost: that process exited or crashed (see its own error output)"
        else:
            why = f"{type(err).__name__}: {msg.splitlines()[0] if msg else ''}"
        return RankFailure(f"rank {self.rank}: lost rank {peer} ({self.describe(peer)}) while {what}: {why}")

    def upstream(self, src: int) -> list[int]:
        """The ranks whose output a message from `src` to this rank depends on, `src` excluded: the chain
        runs 0 -> 1 -> ... -> world-1 -> 0, so those from this rank's successor to `src`'s predecessor."""
        if self.world < 2:
            return []
        chain, r = [], (self.rank + 1) % self.world
        while r != src and len(chain) < self.world:
            chain.append(r)
            r = (r + 1) % self.world
        return chain if r == src else []

    def send(self, t: torch.Tensor, dst: int, what: str) -> None:
        t0 = time.perf_counter()
        q = self._pending.setdefault(dst, deque())
        try:
            while q and (len(q) >= _PENDING_SENDS or q[0][0].is_completed()):
                work, _ = q.popleft()
                work.wait(self._wait)
            q.append((dist.isend(t, dst), t))  # keep t alive until the send completes
        except RuntimeError as e:
            raise self._fail(e, dst, f"sending {what}") from e
        self.messages += 1
        self.send_s += time.perf_counter() - t0

    def recv(self, numel: int, src: int, what: str) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(numel, dtype=torch.float32, device=self.device)
        try:
            dist.irecv(buf, src).wait(self._wait)
        except RuntimeError as e:
            raise self._fail(e, src, f"waiting for {what}") from e
        self.wait_s += time.perf_counter() - t0
        return buf

    def flush(self) -> None:
        """Wait until every send of this rank has completed (end of a request)."""
        t0 = time.perf_counter()
        for dst, q in self._pending.items():
            while q:
                work, _ = q.popleft()
                try:
                    work.wait(self._wait)
                except RuntimeError as e:
                    raise self._fail(e, dst, "finishing sends") from e
        self.send_s += time.perf_counter() - t0


class FaultInjector:
    """Test hook: SPD_FAST_FAULT="RANK:K:exit" (or ":hang") makes RANK exit with status 17 (or sleep
    forever) after it has processed K decode items. Never set it outside tests."""

    def __init__(self, rank: int):
        spec = os.environ.get("SPD_FAST_FAULT", "")
        self.after, self.mode = -1, ""
        if spec:
            r, k, mode = spec.split(":")
            if int(r) == rank:
                self.after, self.mode = int(k), mode

    def tick(self, done: int) -> None:
        if self.after >= 0 and done >= self.after:
            print(f"spd_fast fault injection: {self.mode} after {done} items", file=sys.stderr, flush=True)
            if self.mode == "exit":
                os._exit(17)
            while True:  # "hang"
                time.sleep(3600)

"""Stream/event back ends for the pipelined executors.

`CudaStreams` wraps real CUDA streams and events (one stream per stage, one for the PDM, on one or
several GPUs). `SimulatedStreams` has the same interface for CPU tensors: work runs at once, and
every stream keeps a vector clock, so tests can check the happens-before order of the handoffs
(each stage waits for the cycle's fork, verification waits for every stage and the PDM) and that
the stages of one cycle are left unordered, i.e. free to run concurrently.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


class CudaStreams:
    """Stage s runs on `stage[s]` (on `devices[s]`), the PDM on `pdm` (on devices[0])."""

    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.stage = [torch.cuda.Stream(device=d) for d in devices]
        self.pdm = torch.cuda.Stream(device=devices[0])

    @property
    def main(self) -> Any:
        # the current stream of the main device: the capture stream while a CUDA graph is captured
        return torch.cuda.current_stream(self.devices[0])

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def mark(self, label: tuple) -> None:  # the simulated back end logs these; CUDA needs nothing
        pass


@dataclass
class SimEvent:
    clock: dict[str, int]


@dataclass
class SimStream:
    name: str
    clock: dict[str, int] = field(default_factory=dict)


class SimulatedStreams:
    """CPU stand-in for CudaStreams with vector clocks. `log` holds (label, stream, clock) marks."""

    def __init__(self, num_stages: int):
        self._main = SimStream("main")
        self.stage = [SimStream(f"stage{s}") for s in range(num_stages)]
        self.pdm = SimStream("pdm")
        self.current = self._main
        self.log: list[tuple[tuple, str, dict[str, int]]] = []

    @property
    def main(self) -> SimStream:
        return self._main

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[None]:
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def _tick(self, stream: SimStream) -> dict[str, int]:
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        return dict(stream.clock)

    def record(self, stream: SimStream) -> SimEvent:
        return SimEvent(self._tick(stream))

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        for k, v in event.clock.items():
            stream.clock[k] = max(stream.clock.get(k, 0), v)

    def mark(self, label: tuple) -> None:
        s = self.current
        self.log.append((label, s.name, self._tick(s)))

    @staticmethod
    def happens_before(a: dict[str, int], b: dict[str, int]) -> bool:
        """True if the mark with clock `a` is ordered before the mark with clock `b`."""
        return all(b.get(k, 0) >= v for k, v in a.items()) and a != b

"""NVTX ranges for nsys, off by default.

Turn them on with the environment variable SPD_FAST_NVTX=1 (read at import) or
`spd_fast.profiling.set_nvtx(True)`. Ranges: spd.prefill, spd.pre, spd.draft, spd.stage{s},
spd.verify, spd.cycle_graph (one graph replay), spd.readback, ar.step, ar.prefill, ar.readback. They use the PyPI `nvtx`
package when it is installed (it also works without a GPU), else torch.cuda.nvtx on a CUDA build;
when neither can be used, turning them on raises an error that says what to install.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager

_enabled = False
_push: Callable[[str], object] | None = None
_pop: Callable[[], object] | None = None


def _backend() -> tuple[Callable[[str], object], Callable[[], object]] | None:
    try:
        import nvtx  # the PyPI package

        return (lambda name: nvtx.push_range(name, domain="spd_fast")), (lambda: nvtx.pop_range(domain="spd_fast"))
    except ImportError:
        pass
    import torch

    if torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    return None


def set_nvtx(enabled: bool) -> None:
    """Turn the NVTX ranges on or off."""
    global _enabled, _push, _pop
    if enabled:
        b = _backend()
        if b is None:
            raise RuntimeError("NVTX ranges need the `nvtx` package (pip install nvtx) or a CUDA build of torch; "
                               "neither is available, so SPD_FAST_NVTX=1 / set_nvtx(True) cannot work here")
        _push, _pop = b
    _enabled = bool(enabled)


def nvtx_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def _range(name: str):
    assert _push is not None and _pop is not None
    _push(name)
    try:
        yield
    finally:
        _pop()


_NULL = contextlib.nullcontext()


def nvtx_range(name: str) -> ContextManager:
    """A context manager that marks `name` on the nsys timeline when NVTX is on (free when off)."""
    return _range(name) if _enabled else _NULL


if os.environ.get("SPD_FAST_NVTX", "") not in ("", "0"):
    set_nvtx(True)

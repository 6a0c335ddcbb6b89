"""spd_fast: Speculative Pipeline Decoding for single-sequence LLM decoding."""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# The public names load on first use (PEP 562): `import spd_fast` and `spd-fast --version` do not import torch, and
# a Ctrl-C during the CLI's start lands inside its handler, not in a traceback through torch's import.
_PUBLIC = {"Engine": "api", "GenerationOutput": "api", "RandomHeadWarning": "api", "generate": "api", "load": "api",
           "stream": "api", "ModelConfig": "config", "SpdConfigError": "config", "SamplingParams": "sampling"}

__all__ = ["Engine", "GenerationOutput", "ModelConfig", "RandomHeadWarning", "SamplingParams", "SpdConfigError",
           "generate", "load", "stream", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):  # a submodule (spd_fast.engine), as after the eager imports this file once made
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))

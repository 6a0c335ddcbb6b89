"""spd_fast: Speculative Pipeline Decoding for single-sequence LLM decoding."""
from __future__ import annotations

__version__ = "0.1.0"

from .api import Engine, GenerationOutput, RandomHeadWarning, generate, load, stream  # noqa: E402
from .config import ModelConfig, SpdConfigError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["Engine", "GenerationOutput", "ModelConfig", "RandomHeadWarning", "SamplingParams", "SpdConfigError",
           "generate", "load", "stream", "__version__"]

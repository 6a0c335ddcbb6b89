"""spd_fast: Speculative Pipeline Decoding for single-sequence LLM decoding."""
from __future__ import annotations

__version__ = "0.1.0"


def _source_checkout_kernels() -> None:
    """Installed, the Triton kernels of ../triton_kernels are the subpackage spd_fast.triton_kernels
    (pyproject's package-dir). Imported from a source checkout that was never installed (PYTHONPATH
    set to the repository, as on a GPU machine without a registry), let the same name find them."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    root = here.parent
    if not (here / "triton_kernels").exists() and (root / "triton_kernels" / "__init__.py").is_file() \
            and (root / "pyproject.toml").is_file() and str(root) not in __path__:
        __path__.append(str(root))


_source_checkout_kernels()

from .api import Engine, GenerationOutput, generate, load, stream  # noqa: E402
from .config import ModelConfig, SpdConfigError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["Engine", "GenerationOutput", "ModelConfig", "SamplingParams", "SpdConfigError", "generate", "load",
           "stream", "__version__"]

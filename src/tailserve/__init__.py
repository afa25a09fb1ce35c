"""tailserve: an LLM serving system whose scheduler is the product.

``from tailserve import LLM, SamplingParams`` works as with vLLM. The names load on first use
(PEP 562), so ``import tailserve`` — and with it the simulator and the CLI — never imports
torch; only building an ``LLM`` with the real executor does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it, imported when the name is first read
_LAZY = {
    "LLM": "tailserve.llm.llm",
    "LLMEngine": "tailserve.llm.llm_engine",
    "SamplingParams": "tailserve.core.sampling_params",
    "RequestOutput": "tailserve.llm.outputs",
    "CompletionOutput": "tailserve.llm.outputs",
    "RequestMetrics": "tailserve.llm.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from tailserve.core.sampling_params import SamplingParams
    from tailserve.llm.llm import LLM
    from tailserve.llm.llm_engine import LLMEngine
    from tailserve.llm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'tailserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

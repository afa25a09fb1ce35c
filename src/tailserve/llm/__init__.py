"""The live engine API: ``LLMEngine`` (step by step) and ``LLM`` (offline batches), like vLLM's."""

from tailserve.llm.sampling_params import SamplingParams  # noqa: I001  (first: executors import it)
from tailserve.llm.outputs import RequestOutput
from tailserve.llm.llm_engine import EngineStats, LLMEngine
from tailserve.llm.llm import LLM

__all__ = ["LLM", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]

"""The live engine API: ``LLMEngine`` (step by step) and ``LLM`` (offline batches), like vLLM's."""

from tailserve.core.sampling_params import SamplingParams
from tailserve.llm.llm import LLM
from tailserve.llm.llm_engine import EngineStats, LLMEngine
from tailserve.llm.outputs import RequestOutput

__all__ = ["LLM", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]

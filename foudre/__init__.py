"""foudre: a fast, readable LLM inference engine."""

from foudre.config import EngineConfig
from foudre.engine.async_llm import AsyncLLM
from foudre.engine.llm import LLM
from foudre.outputs import CompletionOutput, RequestOutput
from foudre.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

"""foudre: a fast, readable LLM inference engine."""

from foudre.config import EngineConfig
from foudre.engine.async_llm import AsyncLLM
from foudre.engine.llm import LLM
from foudre.outputs import BeamSearchOutput, BeamSequence, CompletionOutput, RequestOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams, StructuredOutput

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSequence",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
__version__ = "0.1.0"

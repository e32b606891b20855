"""Model definitions (Llama family) and their configuration."""

from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig"]

"""The model's shape, independent of where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True)
class ModelConfig:
    """Everything the Llama-family model needs to build itself.

    Loaders (Hugging Face ``config.json``, llama2.c headers, GGUF metadata) all produce one of
    these; the model never reads a file format itself.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF-style: {"rope_type": "llama3", "factor": ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k (qwen3)
    sliding_window: int | None = None  # attention window; the engine caps its context to it
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

"""Phi-3 and Phi-4 (Hugging Face ``model_type`` "phi3": Phi-3-mini/medium, Phi-3.5-mini,
Phi-4-mini, Phi-4).

A Llama-shaped decoder: RMSNorm, SiLU-gated MLP, grouped-query attention, no biases. What
differs is carried by ``ModelConfig`` and the layers, so this class adds no computation of its
own:

- the checkpoint stores ``self_attn.qkv_proj`` (q|k|v rows) and ``mlp.gate_up_proj``
  (gate|up rows), the very layouts of the Llama model's fused parameters: they are copied in
  whole, under their own names, with no split and no re-concatenation;
- LongRoPE ("su") scaling, short factors within the original context and long ones beyond,
  picked per sequence as ``transformers`` does (``layers/rotary.RotaryEmbedding``);
- partial rotary (``partial_rotary_factor``: Phi-4-mini's 0.75 turns the first 3/4 of each
  head);
- an optional sliding window over every layer (``ModelConfig.sliding_window``, as Mistral).

It is a class of its own so that the paths built for an exact layout say which they run: the
native CPU decode step (``runner/cpu_decode.py``) runs it, rotating the first ``rotary_dim``
dimensions of each head at the rows' positions plus their LongRoPE offsets.
"""

from __future__ import annotations

from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: ``LlamaForCausalLM`` over a "phi3" ``ModelConfig``."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        if cfg.architecture != "phi3":
            raise ValueError(f"Phi3ForCausalLM runs 'phi3' configs, got {cfg.architecture!r}")
        if cfg.is_moe or cfg.attention_bias or cfg.qk_norm:
            raise ValueError("a phi3 model has dense MLPs, no attention bias and no q/k norm")
        super().__init__(cfg, max_positions)

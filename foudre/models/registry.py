"""Which model class runs each architecture.

A model family is a file of its own in this package (``llama.py`` holds the Llama family and
its mixtures of experts); it registers its architectures here. Every place that builds a model
from a ``ModelConfig`` (the loader, quantized checkpoints, parallel shards, compression) asks
``model_class`` rather than naming a class.
"""

from __future__ import annotations

from torch import nn

from foudre.models.bamba import BambaForCausalLM
from foudre.models.config import ModelConfig
from foudre.models.deepseek_v3 import DeepseekV3ForCausalLM
from foudre.models.falcon_h1 import FalconH1ForCausalLM
from foudre.models.gemma3 import Gemma3ForCausalLM
from foudre.models.gpt_oss import GptOssForCausalLM
from foudre.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from foudre.models.llama import LlamaForCausalLM
from foudre.models.mamba2 import Mamba2ForCausalLM
from foudre.models.phi3 import Phi3ForCausalLM
from foudre.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    arch: LlamaForCausalLM
    for arch in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
}
MODEL_CLASSES["deepseek_v3"] = DeepseekV3ForCausalLM
MODEL_CLASSES["gpt_oss"] = GptOssForCausalLM
MODEL_CLASSES["phi3"] = Phi3ForCausalLM
MODEL_CLASSES["gemma3"] = Gemma3ForCausalLM
# these refuse the engine (no recurrent state cache yet) and run through their own forward
MODEL_CLASSES["mamba2"] = Mamba2ForCausalLM
MODEL_CLASSES["bamba"] = BambaForCausalLM
MODEL_CLASSES["granitemoehybrid"] = GraniteMoeHybridForCausalLM
MODEL_CLASSES["falcon_h1"] = FalconH1ForCausalLM
MODEL_CLASSES["qwen3_next"] = Qwen3NextForCausalLM


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The class whose ``__init__(cfg, max_positions)`` builds ``cfg``'s model."""
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"no model class for architecture {cfg.architecture!r}; "
            f"registered: {', '.join(MODEL_CLASSES)}"
        ) from None


def build_model(cfg: ModelConfig, max_positions: int | None = None) -> LlamaForCausalLM:
    """``cfg``'s model (on the current default device). Every family's class offers the
    interface of ``LlamaForCausalLM`` that the runner uses (``forward``, ``compute_logits``,
    ``load_weights``, ``model.rotary``, the MoE statistics), so it is typed as that."""
    return model_class(cfg)(cfg, max_positions)  # type: ignore[return-value]

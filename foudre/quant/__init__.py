"""Weight-only quantization: int8 / int4 round-to-nearest (6 bits in Q6_K's form for int4's
head), GPTQ, AWQ, mixed 4/8 bits; FP8 (e4m3) weights.

``quantize_(model, config)`` swaps linears for ``QuantLinear`` (and the experts of
mixture-of-experts layers for ``QuantExperts``); ``quantize_model`` is the engine's entry point
by method name. ``foudre.loading.quantized`` writes and reads quantized checkpoints
(``quant_method: "foudre"``) and imports GPTQ / AWQ ones; ``foudre.compress.quantize`` is the
``foudre quantize`` command.
"""

from foudre.quant.api import (
    AWQ,
    GPTQ,
    METHODS,
    MXFP4,
    Fp8,
    Int4WeightOnly,
    Int6WeightOnly,
    Int8WeightOnly,
    MixedBits,
    QuantConfig,
    config_for_method,
    quantize_,
    quantize_model,
)
from foudre.quant.fp8 import Fp8Linear
from foudre.quant.qlinear import QuantLinear, set_compute_dtype

__all__ = [
    "AWQ",
    "GPTQ",
    "METHODS",
    "MXFP4",
    "Fp8",
    "Fp8Linear",
    "Int4WeightOnly",
    "Int6WeightOnly",
    "Int8WeightOnly",
    "MixedBits",
    "QuantConfig",
    "QuantLinear",
    "config_for_method",
    "quantize_",
    "quantize_model",
    "set_compute_dtype",
]

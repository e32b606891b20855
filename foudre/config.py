"""One ``EngineConfig`` for the whole engine; CLI flags map onto its fields one to one."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    """Engine options. ``None`` means "derive a sensible value from the model and the machine"."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None  # bytes (> 1) or a fraction of device memory (<= 1)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8 (per token and head)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # auto (triton on CUDA, else torch) | torch | triton | contiguous (non-paged baseline)
    attention_backend: str = "auto"
    # decode steps op by op: no CUDA graphs (which need the triton backend), no native CPU
    # decoder layers (runner/cpu_decode.py, which need the cpu backend)
    enforce_eager: bool = False
    scheduling_policy: str = "continuous"  # continuous | static | dynamic
    batch_wait_ms: float | None = None  # static/dynamic: how long a batch waits for arrivals
    quantization: str | None = None  # int8 | int4 | gptq | awq | mixed (weights, at load)
    # speculative decoding: a proposer guesses k tokens, the target verifies them in one step
    speculative_method: str | None = None  # draft | ngram (draft when a model is given)
    speculative_model: str | None = None  # the draft model (default: the embedded draft)
    speculative_quantization: str | None = None  # quantize the draft at load (int8 | int4 ...)
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    seed: int = 0
    skip_tokenizer_init: bool = False
    revision: str | None = None

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.scheduling_policy not in ("continuous", "static", "dynamic"):
            raise ValueError(
                "scheduling_policy must be continuous, static or dynamic, "
                f"got {self.scheduling_policy!r}"
            )
        if self.batch_wait_ms is not None and self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be non-negative, got {self.batch_wait_ms}")
        quant_methods = ("int8", "int4", "gptq", "awq", "mixed")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(
                f"kv_cache_dtype must be auto, int8 or fp8, got {self.kv_cache_dtype!r}"
            )
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        if self.speculative_method not in (None, "draft", "ngram"):
            raise ValueError(
                f"speculative_method must be draft or ngram, got {self.speculative_method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        for name in ("quantization", "speculative_quantization"):
            value = getattr(self, name)
            if value is not None and value not in quant_methods:
                raise ValueError(f"{name} must be one of {', '.join(quant_methods)}, got {value!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

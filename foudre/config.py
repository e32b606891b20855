"""One ``EngineConfig`` for the whole engine; CLI flags map onto its fields one to one.

Numbers are checked here, at construction. Names (a scheduling policy, a quantization method,
an attention backend...) are checked by the module that owns each list of names, when the engine
starts (``engine/options.check_config``), so that every list lives once."""

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
    # recurrent (state-space, linear attention) models: prefix caching keeps a snapshot of the
    # state every this many tokens (whole blocks) of a cached prefix; each costs a request's
    # state, counted in the KV memory (None snapshots: as many as there are state slots)
    state_snapshot_interval: int = 256
    num_state_snapshots: int | None = None
    # forked sequences (the samples of one prompt, the beams of a beam search) share their
    # parent's KV blocks until one writes (copy-on-write); False copies them all at the fork
    copy_on_write: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # auto (triton on CUDA, the C++ kernel on the CPU, else torch) | torch | cpu | triton
    attention_backend: str = "auto"
    # paged (blocks on demand) | contiguous (each request reserves max_model_len up front: the
    # non-paged baseline that shows what paging buys; no prefix caching)
    kv_allocation: str = "paged"
    # decode steps op by op: no CUDA graphs (which need the triton backend), no native CPU
    # decoder layers (runner/cpu_decode.py, which need the cpu backend)
    enforce_eager: bool = False
    scheduling_policy: str = "continuous"  # engine/policies.py: continuous | static | dynamic
    batch_wait_ms: float | None = None  # static/dynamic: how long a batch waits for arrivals
    quantization: str | None = None  # quant/api.METHODS: int8 | int4 | ... (weights, at load)
    # speculative decoding: a proposer guesses k tokens, the target verifies them in one step
    speculative_method: str | None = None  # draft | ngram | none (draft when a model is given)
    speculative_model: str | None = None  # the draft model (default: the embedded draft)
    speculative_quantization: str | None = None  # quantize the draft at load (int8 | int4 ...)
    num_speculative_tokens: int = 4
    # no drafts in a step where more requests run than this (None: always draft): drafting
    # pays where a step is bound by reading the weights, not where a batch already fills it
    speculative_max_batch_size: int | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    seed: int = 0
    # parallelism (foudre/distributed): the model's layers split across pipeline_parallel_size
    # stages, each stage's weights across tensor_parallel_size ranks; one process per rank
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # seconds a rank waits on its peers within a step before the engine fails (a hung worker)
    distributed_timeout_s: float = 25.0
    skip_tokenizer_init: bool = False
    revision: str | None = None

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.state_snapshot_interval < self.block_size:
            raise ValueError(
                f"state_snapshot_interval must be at least block_size {self.block_size}, got "
                f"{self.state_snapshot_interval}"
            )
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(
                f"num_state_snapshots must be non-negative, got {self.num_state_snapshots}"
            )
        for name in ("max_model_len", "num_kv_blocks", "speculative_max_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(
                f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}"
            )
        if self.batch_wait_ms is not None and self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be non-negative, got {self.batch_wait_ms}")
        if self.speculative_method == "none":  # off, also where a profile turned it on
            self.speculative_method = None
        elif self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.kv_allocation not in ("paged", "contiguous"):
            raise ValueError(
                f"kv_allocation must be paged or contiguous, got {self.kv_allocation!r}"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

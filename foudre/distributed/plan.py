"""Who holds what: the ranks of a ``T x P`` parallel engine, and each rank's shard of a model.

Ranks are laid out in ``P`` blocks of ``T`` consecutive ranks; a block is one pipeline stage,
its ``T`` ranks that stage's tensor-parallel group. Block 0, the engine's (global rank 0 runs
the scheduler), is the *last* stage, which computes the logits, so that sampling happens where
the requests live and nothing but hidden states ever crosses stages; block 1 is stage 0::

    global rank   0 .. T-1      T .. 2T-1    2T .. 3T-1   ...
    stage         P - 1         0            1            ...

A shard is the model built from ``local_config``: ``H / T`` attention heads, ``KV / T`` KV
heads (one, replicated ``T / KV`` times, when there are fewer KV heads than ranks), ``I / T``
of each MLP, ``ceil(V / T)`` vocabulary rows, its stage's layers; and its weights are read as
``select`` says, one slice per stored tensor (``loading.hf.iter_safetensors_slices``).
Mixtures of experts are split by whole experts (``experts.ExpertShard`` says why).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from foudre.distributed.errors import ParallelConfigError
from foudre.layers.parallel import vocab_shard
from foudre.models.config import ModelConfig
from foudre.models.gemma3 import text_model_name

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")

Index = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """Rank ``rank`` of a ``tensor_parallel_size x pipeline_parallel_size`` engine."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (block 0, the engine's, is the last)."""
        p = self.pipeline_parallel_size
        return (self.rank // self.tensor_parallel_size - 1) % p

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_parallel_size - 1

    def rank_of(self, stage: int, tp_rank: int) -> int:
        """The global rank of tensor rank ``tp_rank`` of pipeline stage ``stage``."""
        return ((stage + 1) % self.pipeline_parallel_size) * self.tensor_parallel_size + tp_rank

    def tp_ranks(self, stage: int) -> list[int]:
        """The global ranks of stage ``stage``'s tensor-parallel group, in tensor-rank order."""
        return [self.rank_of(stage, t) for t in range(self.tensor_parallel_size)]

    def layers(self, num_layers: int) -> range:
        """The decoder layers of this rank's stage: consecutive, as even as can be, the spare
        ones to the first stages (the last also computes the logits)."""
        p, s = self.pipeline_parallel_size, self.stage
        base, extra = divmod(num_layers, p)
        start = s * base + min(s, extra)
        return range(start, start + base + (1 if s < extra else 0))

    # -- the shard -----------------------------------------------------------------------------
    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config that builds this rank's shard (its heads, slices and layers); the router
        of a mixture of experts keeps every expert (``experts.ExpertShard`` holds its share)."""
        t = self.tensor_parallel_size
        layers = self.layers(cfg.num_hidden_layers)
        changes: dict[str, object] = {
            "num_hidden_layers": len(layers),
            "num_attention_heads": cfg.num_attention_heads // t,
            "num_key_value_heads": max(1, cfg.num_key_value_heads // t),
            "intermediate_size": cfg.intermediate_size // t,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size // t,
            "vocab_size": vocab_shard(cfg.vocab_size, t),
            # a pipeline puts the embedding and lm_head on different stages: untied
            "tie_word_embeddings": cfg.tie_word_embeddings and self.pipeline_parallel_size == 1,
        }
        if cfg.layer_types is not None:
            changes["layer_types"] = cfg.layer_types[layers.start : layers.stop]
        if cfg.num_experts:
            changes["decoder_sparse_step"] = 1
            changes["mlp_only_layers"] = tuple(
                j for j, i in enumerate(layers) if not cfg.is_sparse_layer(i)
            )
        return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]

    def expert_range(self, num_experts: int) -> range:
        """The routed experts this rank holds (all of them without tensor parallelism)."""
        n = num_experts // self.tensor_parallel_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def select(
        self, cfg: ModelConfig, name: str, shape: tuple[int, ...]
    ) -> tuple[str, Index | None] | None:
        """What this rank reads of the stored tensor ``name`` (a Hugging Face name, of shape
        ``shape``): None when it holds none of it, else its name in the shard and the slice.
        Names it does not know pass whole, so that the shard's loader names them. A multimodal
        checkpoint's language model is read under the text model's names, its vision tower not
        at all."""
        text = text_model_name(name)
        if text is None:
            return None
        name = text
        first, last = self.is_first_stage, self.is_last_stage
        vocab = self._rows(vocab_shard(cfg.vocab_size, self.tensor_parallel_size), shape)
        if name == "model.embed_tokens.weight":
            if first:
                return name, vocab
            if last and cfg.tie_word_embeddings:  # the last stage's untied lm_head
                return "lm_head.weight", vocab
            return None
        if name == "lm_head.weight":
            return (name, vocab) if last and not cfg.tie_word_embeddings else None
        m = _LAYER.match(name)
        if m is None:
            return name, None
        layers = self.layers(cfg.num_hidden_layers)
        index = int(m.group(1))
        if index not in layers:
            return None
        local = f"model.layers.{index - layers.start}."
        rest = m.group(2)
        if self.tensor_parallel_size == 1:
            return local + rest, None
        return self._select_in_layer(cfg, local, rest, shape)

    def _select_in_layer(
        self, cfg: ModelConfig, local: str, rest: str, shape: tuple[int, ...]
    ) -> tuple[str, Index | None] | None:
        t, r = self.tensor_parallel_size, self.tp_rank
        d = cfg.head_dim
        q = cfg.num_attention_heads // t * d
        if cfg.num_key_value_heads >= t:
            kv_width = cfg.num_key_value_heads // t * d
            kv_start = r * kv_width
        else:  # one KV head per rank, shared by T / KV ranks
            kv_width = d
            kv_start = r // (t // cfg.num_key_value_heads) * d
        parts = rest.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        m = _EXPERT.match(rest)
        if m is not None:
            experts = self.expert_range(cfg.num_experts)
            e = int(m.group(2))
            if e not in experts:
                return None
            return f"{local}{m.group(1)}.experts.experts.{e - experts.start}.{m.group(3)}", None
        m = _STACKED.match(rest)
        if m is not None:
            experts = self.expert_range(cfg.num_experts)
            return f"{local}mlp.experts.experts.{m.group(1)}", (slice(experts.start, experts.stop),)
        shared = rest.startswith("mlp.shared_expert.")
        width = (cfg.shared_expert_intermediate_size if shared else cfg.intermediate_size) // t
        rows: dict[str, tuple[int, int]] = {
            "q_proj": (r * q, q),
            "k_proj": (kv_start, kv_width),
            "v_proj": (kv_start, kv_width),
            "gate_proj": (r * width, width),
            "up_proj": (r * width, width),
        }
        cols: dict[str, tuple[int, int]] = {"o_proj": (r * q, q), "down_proj": (r * width, width)}
        if module in rows:
            start, n = rows[module]
            return local + rest, (slice(start, start + n),)
        if module in cols:
            start, n = cols[module]
            return local + rest, (slice(None), slice(start, start + n))
        return local + rest, None  # norms, the router, the shared expert's gate: replicated

    def _rows(self, n: int, shape: tuple[int, ...]) -> Index:
        start = self.tp_rank * n
        return (slice(min(start, shape[0]), min(start + n, shape[0])),)


def check_parallel(
    cfg: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int
) -> None:
    """``ParallelConfigError`` naming the field when ``cfg`` cannot be split ``T x P`` ways."""
    t, p = tensor_parallel_size, pipeline_parallel_size
    field = "tensor_parallel_size"
    if cfg.architecture == "gpt_oss" and t * p > 1:  # no shard of its sinks, biases, experts
        raise ParallelConfigError(
            field if t > 1 else "pipeline_parallel_size",
            "gpt-oss does not run parallel yet (its attention sinks, o_proj bias and biased "
            "experts have no shard plan); use tensor_parallel_size=1, pipeline_parallel_size=1",
        )
    if cfg.num_attention_heads % t:
        raise ParallelConfigError(
            field,
            f"tensor_parallel_size {t} does not divide the {cfg.num_attention_heads} attention "
            "heads",
        )
    kv = cfg.num_key_value_heads
    if kv % t and t % kv:
        raise ParallelConfigError(
            field,
            f"tensor_parallel_size {t} must divide the {kv} KV heads or be a multiple of them",
        )
    sizes = []
    if not all(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)):
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        sizes += [
            ("num_experts", cfg.num_experts),
            ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size),
        ]
    for name, value in sizes:
        if value % t:
            raise ParallelConfigError(
                field, f"tensor_parallel_size {t} does not divide the model's {name} {value}"
            )
    if t > 1 and cfg.qk_norm_over_heads:
        raise ParallelConfigError(
            field, f"{cfg.architecture}'s q/k norm over all heads does not run tensor-parallel"
        )
    if cfg.kv_lora_rank and t * p > 1:  # multi-head latent attention (DeepSeek-V3)
        raise ParallelConfigError(
            field if t > 1 else "pipeline_parallel_size",
            f"{cfg.architecture} (multi-head latent attention) runs on one device only: "
            "tensor and pipeline parallelism are not supported for it",
        )
    if p > cfg.num_hidden_layers:
        raise ParallelConfigError(
            "pipeline_parallel_size",
            f"pipeline_parallel_size {p} exceeds the model's {cfg.num_hidden_layers} layers",
        )

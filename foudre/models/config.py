"""The model's shape, independent of where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
    "deepseek_v3",
    "gpt_oss",
    "phi3",
    "gemma3",
    "mamba2", "bamba", "granitemoehybrid",
    "falcon_h1",
    "qwen3_next",
)  # fmt: skip
# How a mixture-of-experts router scores the experts before its top-k: a softmax over all of
# them (Mixtral, Qwen-MoE, OLMoE), or DeepSeek-V3's sigmoid scores with a selection bias and a
# group-limited top-k (``layers/moe.route_grouped``). Other variants are refused by the
# loaders, naming the variant.
MOE_SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(slots=True)
class ModelConfig:
    """Everything the Llama-family model (dense or mixture-of-experts) needs to build itself.

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
    qk_norm_over_heads: bool = False  # ... or one RMSNorm over all of q's, all of k's (olmoe)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (olmoe)
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p, in
    # every layer (Mistral), or in the layers that layer_types marks "sliding_attention" (Qwen2
    # and Qwen3 with use_sliding_window, alternating models); None: full attention everywhere.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer: "full_attention" | "sliding_attention"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (``num_experts > 0``): a sparse layer's MLP is ``num_experts`` gated
    # MLPs of ``moe_intermediate_size``; a router scores them (``moe_scoring_func``) and each
    # token goes to its ``num_experts_per_tok`` best, weighted by their scores, renormalised to
    # sum to 1 when ``norm_topk_prob``. ``shared_expert_intermediate_size > 0`` adds an MLP
    # every token goes through, scaled by ``sigmoid(shared_expert_gate(x))`` when
    # ``shared_expert_gate`` (qwen2_moe). Layer ``i`` is sparse unless it is in
    # ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; dense layers keep the
    # ``intermediate_size`` MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_scoring_func: str = "softmax"
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V3 (and Kimi-K2): multi-head latent attention (``kv_lora_rank > 0``). Queries
    # come through a ``q_lora_rank`` bottleneck (None: one projection); keys and values are
    # expanded from a ``kv_lora_rank`` latent per token, each head's key being
    # ``qk_nope_head_dim`` values from the latent and ``qk_rope_head_dim`` rotated values
    # shared by all heads (``rope_interleave``: the checkpoint's RoPE pairs are interleaved);
    # values are ``v_head_dim`` per head. Its routers (``moe_scoring_func`` "sigmoid") choose
    # among the best ``topk_group`` of ``n_group`` expert groups and scale the weights by
    # ``routed_scaling_factor``; ``num_nextn_predict_layers`` multi-token-prediction layers in
    # the checkpoint are skipped.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    # gpt-oss: its experts' clamped SwiGLU, (up + 1) * g * sigmoid(swiglu_alpha * g) with
    # g = min(gate, swiglu_limit) and up clamped to +-swiglu_limit (layers/moe.py); its attention
    # sinks, o_proj bias and router bias come with the architecture
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4_experts: bool = False  # experts stored packed (quantization_config mxfp4)
    # Phi-3 / Phi-4: RoPE turns only the first int(head_dim * partial_rotary_factor) dimensions
    # of each head (Phi-4-mini: 0.75); its LongRoPE scaling lives in rope_scaling
    partial_rotary_factor: float = 1.0
    # Gemma 3 (``models/gemma3.py``): attention scores scaled by ``query_pre_attn_scalar**-0.5``
    # (not ``head_dim**-0.5``); the sliding layers' RoPE has its own base and scaling
    # (``rope_local_theta``, ``rope_local_scaling``; the global layers' are ``rope_theta`` and
    # ``rope_scaling``); logits squashed to ``cap * tanh(logits / cap)`` when
    # ``final_logit_softcapping`` is set.
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float = 10000.0
    rope_local_scaling: dict[str, Any] | None = None
    final_logit_softcapping: float | None = None
    # Mamba-2 (``models/mamba2.py``) and its hybrids (``models/bamba.py``): the sizes of the
    # Mamba-2 mixer (``layers/mamba.Mamba2Shape``) and the indices of the layers that are
    # mixers (Mamba-2: all of them; the hybrids' other layers are attention)
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_time_step_limit: tuple[float, float] = (0.0, float("inf"))
    mamba_layers: tuple[int, ...] = ()
    # Granite 4.0 hybrids (``models/granite_moe_hybrid.py``): embeddings times
    # ``embedding_multiplier``, each sublayer's output times ``residual_multiplier`` before
    # its residual add, attention scores scaled by ``attention_multiplier`` (None: the usual
    # head_dim**-0.5), logits divided by ``logits_scaling``; ``use_rope`` False: no positions
    # in attention at all (NoPE)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    use_rope: bool = True
    # Falcon-H1 (``models/falcon_h1.py``): every layer runs attention and a Mamba-2 mixer side by
    # side on the same normed input (``mamba_layers``: all of them), with muP multipliers: the
    # embeddings times ``embedding_multiplier`` (Granite's field), the attention's input, keys
    # and output times ``attention_in_multiplier``, ``key_multiplier``,
    # ``attention_out_multiplier``; the mixer's input times ``ssm_in_multiplier``, its in_proj
    # output's z | x | B | C | dt sections times the five ``ssm_multipliers``, its output times
    # ``ssm_out_multiplier``; the MLP's gate and its output times ``mlp_multipliers``; the
    # logits times ``lm_head_multiplier``. The mixer's output norm: ``mamba_gate_norm``
    # (``layers/mamba.GATE_NORMS``); its out_proj bias: ``mamba_out_proj_bias``.
    attention_in_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    lm_head_multiplier: float = 1.0
    mamba_gate_norm: str = "after_gate"
    mamba_out_proj_bias: bool | None = None
    # Qwen3-Next (``models/qwen3_next.py``): the layers of ``linear_layers`` are gated DeltaNet
    # mixers (``layers/gated_deltanet.GatedDeltaNetShape``: q/k heads of ``linear_key_head_dim``,
    # value heads of ``linear_value_head_dim``, a causal conv of ``linear_conv_kernel`` taps),
    # the others gated attention; every RMSNorm is zero-centred (``1 + weight``)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    linear_layers: tuple[int, ...] = ()

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
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self._check_recurrent()
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                "full_attention",
                "sliding_attention",
            }:
                raise ValueError(
                    f"layer_types must give 'full_attention' or 'sliding_attention' for each of "
                    f"the {self.num_hidden_layers} layers, got {list(self.layer_types)}"
                )
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim < 2:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1] and leave at least 2 rotated "
                f"dimensions, got {self.partial_rotary_factor}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be within 1.."
                    f"num_experts={self.num_experts}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
                )
            if self.moe_scoring_func not in MOE_SCORING_FUNCS:
                raise ValueError(
                    f"unsupported mixture-of-experts routing {self.moe_scoring_func!r}; "
                    f"supported: {', '.join(MOE_SCORING_FUNCS)}"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(
                    f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
                )
            if self.shared_expert_intermediate_size < 0:
                raise ValueError("shared_expert_intermediate_size must be >= 0")
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide num_experts")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be within 1..n_group")
            if self.n_group > 1 and self.num_experts // self.n_group < 2:
                raise ValueError("group-limited routing needs at least 2 experts per group")
        if self.kv_lora_rank:
            for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be positive for latent attention")
            if self.qk_rope_head_dim % 2:
                raise ValueError("qk_rope_head_dim must be even (RoPE rotates pairs)")

    def _check_recurrent(self) -> None:
        """The state-space and hybrid families' fields (Mamba and linear-attention layers,
        Falcon-H1's multipliers), made tuples."""
        self.mamba_layers = tuple(self.mamba_layers)
        if len(self.ssm_multipliers) != 5 or len(self.mlp_multipliers) != 2:
            raise ValueError(
                f"ssm_multipliers must hold 5 values and mlp_multipliers 2, got "
                f"{list(self.ssm_multipliers)} and {list(self.mlp_multipliers)}"
            )
        self.ssm_multipliers = tuple(float(m) for m in self.ssm_multipliers)
        self.mlp_multipliers = (float(self.mlp_multipliers[0]), float(self.mlp_multipliers[1]))
        self.mamba_time_step_limit = (
            float(self.mamba_time_step_limit[0]),
            float(self.mamba_time_step_limit[1]),
        )
        if any(not 0 <= i < self.num_hidden_layers for i in self.mamba_layers):
            raise ValueError(f"mamba_layers {list(self.mamba_layers)} name layers past the model")
        self.linear_layers = tuple(self.linear_layers)
        if any(not 0 <= i < self.num_hidden_layers for i in self.linear_layers):
            raise ValueError(f"linear_layers {list(self.linear_layers)} name layers past the model")

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    def layer_window(self, index: int) -> int | None:
        """The sliding window of decoder layer ``index`` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` routes tokens to experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

"""A random Qwen3-Next of about 0.5B parameters for the native decode step's A/B
(``native_decode_ab.py --model``), built once (transformers' own initialisation, bf16
safetensors) and cached under ``common.CACHE / "recurrent" / "qwen3_next"``; prints its path.

Qwen3-Next-80B-A3B's layout scaled down: 24 layers, every fourth gated attention (8 heads of 128,
2 KV heads, RoPE over a quarter of each head), the others gated DeltaNet (8 key heads and 16 value
heads of 128, conv window 4), each with 16 experts (top 4, 256 wide) and a gated shared expert
(512 wide); hidden 1024, the Llama 2 vocabulary's 32,000 ids.

    .venv/bin/python benchmarks/native_decode_ab.py --model $(.venv/bin/python \\
        benchmarks/qwen3_next_model.py)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's foudre
sys.path.insert(0, str(HERE))

LAYERS = 24
CONFIG: dict[str, Any] = dict(
    vocab_size=32000,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    hidden_size=1024,
    num_hidden_layers=LAYERS,
    layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    partial_rotary_factor=0.25,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    intermediate_size=512,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)


def main() -> None:
    from common import CACHE, random_model

    path = CACHE / "recurrent" / "qwen3_next"
    path.parent.mkdir(parents=True, exist_ok=True)
    print(random_model("qwen3_next", CONFIG, path))


if __name__ == "__main__":
    main()

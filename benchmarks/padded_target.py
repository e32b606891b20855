"""The embedded target, zero-padded to a memory-bound size with the same predictions.

    .venv/bin/python benchmarks/padded_target.py [--out DIR]

Speculative decoding pays off when a target forward is bound by the bytes of weights it reads, so
that verifying k + 1 tokens costs about as much as decoding one, and the draft is many times
cheaper. The embedded target (2.76M parameters) fits in the CPU cache and is bound by per-layer
overhead instead. This script builds a ~400M-parameter Llama whose function is the embedded
target's: hidden 192 -> 1536, heads 6 -> 48 (KV 2 -> 16, same grouping), FFN 512 -> 4096 and
layers 6 -> 16, the new rows and columns zero (zero heads attend to zero values and add nothing;
the 10 extra layers are all-zero, i.e. identities on the residual stream). RMSNorm weights are
divided by sqrt(1536 / 192) and eps by 1536 / 192 so that the norm over the padded width equals
the original one exactly. Each decode step then reads ~0.8 GB in bf16, like a real 400M model,
while the draft/target agreement stays the real one of the embedded pair.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from foudre.loading.loader import default_model

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 1536, 48, 16, 4096, 16


def pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def build(src: Path, dst: Path) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    hd = cfg["head_dim"]
    ratio = HIDDEN / cfg["hidden_size"]
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == HEADS // KV_HEADS
    weights = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    shapes = {
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
        "self_attn.q_proj.weight": (HEADS * hd, HIDDEN),
        "self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
        "mlp.gate_proj.weight": (FFN, HIDDEN),
        "mlp.up_proj.weight": (FFN, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, FFN),
    }
    for i in range(LAYERS):
        for name, shape in shapes.items():
            key = f"model.layers.{i}.{name}"
            if key in weights:
                w = weights[key]
                if "layernorm" in name:
                    w = w / math.sqrt(ratio)
                out[key] = pad(w, shape)
            else:  # an extra layer: all zero, an identity on the residual stream
                out[key] = torch.zeros(shape)
    out["model.embed_tokens.weight"] = pad(
        weights["model.embed_tokens.weight"], (cfg["vocab_size"], HIDDEN)
    )
    out["model.norm.weight"] = pad(weights["model.norm.weight"] / math.sqrt(ratio), (HIDDEN,))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}, dst / "model.safetensors"
    )
    cfg.update(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        rms_norm_eps=cfg["rms_norm_eps"] / ratio,
        torch_dtype="bfloat16",
    )
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "foudre-bench" / "target-padded"))
    args = ap.parse_args()
    dst = build(Path(default_model()[0]), Path(args.out))
    n = sum(v.numel() for v in load_file(dst / "model.safetensors").values())
    print(f"wrote {dst} ({n / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()

"""The Triton fused-MoE kernel on a GPU: time per MoE layer and active-weight bytes per second.

    python benchmarks/moe_kernels_cuda.py [--tokens 1 8 64 512] [--out FILE.md]

Shapes: the experts of ``benchmarks/moe.py``'s MoE (hidden 1,024, 8 experts of intermediate
2,048, top-2) and of Qwen3-30B-A3B (hidden 2,048, 128 experts of 768, top-8), bfloat16. For each
number of tokens it times ``moe_triton.fused_experts`` against ``grouped_experts`` (one cuBLAS
gate|up and down matmul per active expert, after a host-side sort), the median of
``triton.testing.do_bench`` (CUDA events, L2 flushed), after checking both against each other.
Bytes: the weights of the experts the tokens chose (each read once). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
from common import machine

from foudre.layers import moe_triton
from foudre.layers.moe import Experts, grouped_experts, route

SHAPES = {"moe-bench 8x2048 top-2": (1024, 8, 2048, 2), "qwen3-30b-a3b": (2048, 128, 768, 8)}


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = [
        "# Triton fused MoE vs grouped cuBLAS (bfloat16)",
        "",
        f"- date: {datetime.date.today()}; machine: {machine(dev)}",
        "",
        "| experts | tokens | active experts | fused µs | grouped µs | fused GB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    torch.manual_seed(0)
    for name, (hidden, num, inter, k) in SHAPES.items():
        ex = Experts(num, hidden, inter)
        torch.nn.init.normal_(ex.gate_up_proj, 0, 0.02)
        torch.nn.init.normal_(ex.down_proj, 0, 0.02)
        ex = ex.to(device=dev, dtype=torch.bfloat16)
        for t in args.tokens:
            x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
            w, ids = route(torch.randn(t, num, device=dev), k, True)
            with torch.inference_mode():
                fused = moe_triton.fused_experts(x, ex.gate_up_proj, ex.down_proj, w, ids)
                ref = grouped_experts(x, w, ids, num, ex.expert)
                err = (fused.float() - ref.float()).abs().max().item()
                assert err <= 0.05 * ref.float().abs().max().item(), (name, t, err)
                gu, dn, expert = ex.gate_up_proj, ex.down_proj, ex.expert
                ms_fused = triton.testing.do_bench(
                    lambda x=x, w=w, ids=ids, gu=gu, dn=dn: moe_triton.fused_experts(
                        x, gu, dn, w, ids
                    )
                )
                ms_grouped = triton.testing.do_bench(
                    lambda x=x, w=w, ids=ids, n=num, f=expert: grouped_experts(x, w, ids, n, f)
                )
            active = len(set(ids.flatten().tolist()))
            nbytes = active * 3 * hidden * inter * 2
            lines.append(
                f"| {name} | {t} | {active} | {ms_fused * 1e3:.1f} | {ms_grouped * 1e3:.1f} | "
                f"{nbytes / (ms_fused * 1e-3) / 1e9:.0f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

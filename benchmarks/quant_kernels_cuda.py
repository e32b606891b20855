"""The Triton weight-only kernels on a GPU: time per matmul and weight bytes read per second.

    python benchmarks/quant_kernels_cuda.py [--rows 1 8 64] [--out FILE.md]

For each linear layer shape of the ~500M random Llama (``common.MEDIUM``) and each number of
activation rows M, it times ``y = x @ W.T`` in bfloat16 four ways: cuBLAS on the bf16 weight
(``F.linear``), and foudre's ``QuantLinear`` on CUDA (``foudre.quant.triton_kernels``) with int8
per-channel and int4 (group 128) weights. Each figure is the median of ``triton.testing.do_bench``
(CUDA events, L2 flushed between runs). Before timing, every kernel's output is checked against
the dequantize reference. Needs a CUDA device and Triton.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from common import MEDIUM, machine

from foudre.quant.qlinear import QuantLinear

SHAPES = {  # name: (out_features N, in_features K) of the medium model
    "qkv": (MEDIUM["hidden_size"] * 3 // 2, MEDIUM["hidden_size"]),
    "o_proj": (MEDIUM["hidden_size"], MEDIUM["hidden_size"]),
    "gate_up": (2 * MEDIUM["intermediate_size"], MEDIUM["hidden_size"]),
    "down": (MEDIUM["hidden_size"], MEDIUM["intermediate_size"]),
    "lm_head": (MEDIUM["vocab_size"], MEDIUM["hidden_size"]),
}


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lines = [
        "# Triton weight-only kernels against cuBLAS bf16 (shapes of the 500M model)",
        "",
        f"- date: {datetime.date.today()}",
        f"- machine: {machine(dev)}",
        "- command: `python benchmarks/quant_kernels_cuda.py`",
        "- figures: median µs per matmul (`triton.testing.do_bench`), and in brackets the weight "
        "bytes read per second (GB/s)",
        "",
        "| layer (N x K) | M | bf16 cuBLAS | int8 Triton | int4 g128 Triton | int8 / bf16 time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) * 0.02
        w16 = w.bfloat16()
        mods = {
            8: QuantLinear.from_float(w.cpu(), None, 8, None).to(torch.bfloat16).to(dev),
            4: QuantLinear.from_float(w.cpu(), None, 4, 128).to(torch.bfloat16).to(dev),
        }
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for bits, mod in mods.items():
                err = (mod(x).float() - mod.forward_reference(x).float()).abs().max().item()
                scale = mod.forward_reference(x).float().abs().max().item()
                assert err <= 2e-2 * scale + 1e-3, (name, m, bits, err, scale)
            t16 = triton.testing.do_bench(lambda: F.linear(x, w16), return_mode="median")  # noqa: B023
            t8 = triton.testing.do_bench(lambda: mods[8](x), return_mode="median")  # noqa: B023
            t4 = triton.testing.do_bench(lambda: mods[4](x), return_mode="median")  # noqa: B023
            b16, b8 = n * k * 2, n * k + n * 2
            b4 = n * k // 2 + 2 * n * (k // 128) * 2

            def cell(ms: float, nbytes: int) -> str:
                return f"{ms * 1e3:.1f} ({nbytes / ms / 1e6:,.0f})"

            lines.append(
                f"| {name} ({n} x {k}) | {m} | {cell(t16, b16)} | {cell(t8, b8)} | "
                f"{cell(t4, b4)} | {t8 / t16:.2f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

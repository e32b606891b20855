"""Quantized GEMV / split-K kernels and FP8 on a GPU against cuBLAS bfloat16, at decode batches.

    python benchmarks/quant_gemv_cuda.py [--rows 1 16 64] [--sweep] [--eager] [--out FILE.md]

For each weight shape N x K (4096 x 4096, 4096 x 14336 and 14336 x 4096: Llama-3-8B's square,
down and gate/up projections) and each number of activation rows M, it times ``y = x @ W.T`` with
bfloat16 activations: cuBLAS on the bf16 weight (``F.linear``); ``QuantLinear`` on CUDA
(``foudre.quant.triton_kernels``: the GEMV kernel at M = 1, the 16-row ``tl.dot`` split-K
kernel up to 16, larger tiles beyond) with int8 per channel, int8 in groups of 32 (GGUF's Q8_0)
and int4 in groups of 128; ``Fp8Linear`` (the weight-only Triton kernels up to 16 rows, then
``torch._scaled_mm`` with per-token e4m3 activations on Hopper); and ``torch._scaled_mm`` alone
on already-quantized activations (the FP8 tensor cores' bound, sm_89+). Every output is checked
against the dequantize reference first.

Figures are medians of ``triton.testing.do_bench_cudagraph`` (each call replayed from a CUDA
graph, as the engine's decode steps are: no Python launch overhead) in µs, with the weight bytes
read per second in brackets; ``--eager`` times plain calls (``do_bench``) instead. ``--sweep``
also times every config of ``_sweep_configs`` per layout, shape and M and prints the fastest beside
``choose_config``'s, to tune the heuristic (a few minutes per row count: sweep one at a time,
``--rows 1 --sweep``). Without a CUDA device (or Triton) it says so and exits.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (out_features N, in_features K)


def _sweep_configs(m: int) -> list[object]:
    from foudre.quant.triton_kernels import KernelConfig as C

    if m == 1:
        return [
            C(1, bn, bkb, split)
            for bn in (8, 16, 32)
            for bkb in (128, 256, 512)
            for split in (1, 2, 4, 8)
        ]
    bm = 16 if m <= 16 else 64
    return [
        C(bm, bn, bkb, split) for bn in (32, 64, 128) for bkb in (64, 128) for split in (1, 2, 4, 8)
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--sweep", action="store_true", help="time the configs of _sweep_configs")
    ap.add_argument("--eager", action="store_true", help="plain calls, not CUDA graph replays")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemv_cuda: no CUDA device; nothing to time")
        return 0
    try:
        import triton.testing
    except ImportError:
        print("quant_gemv_cuda: Triton is not installed; nothing to time")
        return 0
    from common import machine

    from foudre.quant import triton_kernels as tk
    from foudre.quant.fp8 import Fp8Linear, quantize_rows
    from foudre.quant.qlinear import QuantLinear

    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability(dev)

    def bench(fn: Callable[[], object]) -> float:
        if args.eager:
            return float(triton.testing.do_bench(fn, return_mode="median"))
        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))

    torch.manual_seed(0)
    names = ["bf16 cuBLAS", "int8", "int8 g32", "int4 g128", "fp8 Fp8Linear"]
    if cap >= (8, 9):
        names.append("fp8 _scaled_mm")
    lines = [
        "# Quantized GEMV / split-K kernels and FP8 against cuBLAS bf16",
        "",
        f"- date: {datetime.date.today()}",
        f"- machine: {machine(dev)}",
        f"- command: `python benchmarks/quant_gemv_cuda.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- figures: median µs per matmul ({'eager' if args.eager else 'CUDA graph replays'}), "
        "in brackets the weight bytes read per second (GB/s); last column: bf16 time over the "
        "fastest quantized time",
        "",
        "| N x K | M | " + " | ".join(names) + " | best speedup |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |",
    ]
    sweep_lines = ["", "## Config sweep (µs; fastest config vs choose_config's)", ""]
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * 0.02
        w16 = w.bfloat16()
        mods: dict[str, torch.nn.Module] = {
            "int8": QuantLinear.from_float(w, None, 8, None).to(torch.bfloat16),
            "int8 g32": QuantLinear.from_float(w, None, 8, 32).to(torch.bfloat16),
            "int4 g128": QuantLinear.from_float(w, None, 4, 128).to(torch.bfloat16),
            "fp8 Fp8Linear": Fp8Linear.from_float(w, None),
        }
        nbytes = {
            "bf16 cuBLAS": n * k * 2,
            "int8": n * k + n * 2,
            "int8 g32": n * k + n * (k // 32) * 2,
            "int4 g128": n * k // 2 + 2 * n * (k // 128) * 2,
            "fp8 Fp8Linear": n * k + n * 4,
            "fp8 _scaled_mm": n * k + n * 4,
        }
        fp8 = mods["fp8 Fp8Linear"]
        assert isinstance(fp8, Fp8Linear)
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for name, mod in mods.items():
                ref = mod.forward_reference(x).float()  # type: ignore[operator]
                err = (mod(x).float() - ref).abs().max().item()
                tol = 2e-2 * ref.abs().max().item() + 1e-3
                if name == "fp8 Fp8Linear" and m > 16 and cap >= (9, 0):
                    tol = 0.1 * ref.abs().max().item()  # activations rounded to e4m3
                assert err <= tol, (name, n, k, m, err, tol)
            fns: dict[str, Callable[[], object]] = {"bf16 cuBLAS": lambda: F.linear(x, w16)}  # noqa: B023
            for name, mod in mods.items():
                fns[name] = lambda mod=mod: mod(x)  # noqa: B023
            if "fp8 _scaled_mm" in names:
                xq, xs = quantize_rows(x)
                ws = fp8.weight_scale.view(1, -1)
                wt = fp8.weight.t()
                fns["fp8 _scaled_mm"] = lambda xq=xq, xs=xs, wt=wt, ws=ws: torch._scaled_mm(
                    xq, wt, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16
                )
            times = {name: bench(fn) for name, fn in fns.items()}
            cells = [f"{times[c] * 1e3:.1f} ({nbytes[c] / times[c] / 1e6:,.0f})" for c in names]
            best = min(t for c, t in times.items() if c != "bf16 cuBLAS")
            lines.append(
                f"| {n} x {k} | {m} | "
                + " | ".join(cells)
                + f" | {times['bf16 cuBLAS'] / best:.2f}x |"
            )
            print(lines[-1], flush=True)
            if not args.sweep:
                continue
            for name in ("int8", "int8 g32", "int4 g128", "fp8 Fp8Linear"):
                mod = mods[name]
                if isinstance(mod, Fp8Linear):
                    bufs = (mod.weight, mod.weight_scale, None, None)
                else:
                    assert isinstance(mod, QuantLinear)
                    bufs = (mod.qweight, mod.scales, mod.zeros, mod.group_size)
                results = []
                for cfg in _sweep_configs(m):
                    try:
                        t = bench(
                            lambda cfg=cfg, bufs=bufs, x=x: tk.quant_matmul(x, *bufs, config=cfg)
                        )
                    except Exception as e:  # an unsupported tiling (shared memory, registers)
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                        continue
                    results.append((t, cfg))
                chosen = tk.choose_config(m, n, bufs[0].shape[1], dev)
                t_chosen = bench(
                    lambda bufs=bufs, c=chosen, x=x: tk.quant_matmul(x, *bufs, config=c)
                )
                t_best, best_cfg = min(results, key=lambda r: r[0])
                sweep_lines.append(
                    f"- {name} {n} x {k} M={m}: best {t_best * 1e3:.1f} {best_cfg}; "
                    f"choose_config {t_chosen * 1e3:.1f} {chosen}"
                )
                print(sweep_lines[-1], flush=True)
    text = "\n".join(lines + (sweep_lines if args.sweep else [])) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

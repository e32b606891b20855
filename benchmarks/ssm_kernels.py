"""The recurrent layers' decode kernels (``foudre.layers.ssm_ops``) against their torch
references: time per call and state bytes moved per second.

    python benchmarks/ssm_kernels.py [--device cpu|cuda] [--rows 1 32] [--seconds 0.3]
        [--prefill 256]

Shapes of a ~0.5B model: a Mamba-2 layer (32 heads x 64 x d_state 128, one group; its conv of
2304 channels, window 3) and a gated DeltaNet layer (16 key heads, 32 value heads, 128 x 128).
For each number of rows (one token each, slots scattered in a pool of 4x as many), the kernel
that ``ssm_ops`` picks for the device (C++ on CPU, Triton on CUDA) and the torch reference
(gather, update, scatter) each run for about ``--seconds``; the figure is the mean per call.
GB/s counts the state read and written once per call (the bound: the pass is memory-bound).
Then one row of ``--prefill`` tokens through ``ssd_scan`` against the model's chunked torch scan.
Rough on a shared CPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from foudre.layers import ssm_ops
from foudre.layers.mamba import ssd_chunked


def _time(fn: Callable[[], object], seconds: float, device: torch.device) -> float:
    """Mean seconds per call of ``fn`` over about ``seconds`` (after a warm-up call)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    sync()
    return (time.perf_counter() - start) / calls


def _cases(rows: int, device: torch.device) -> dict[str, tuple[int, Callable[[str], object]]]:
    """name -> (state bytes moved per call, a call of the op with a given backend)."""
    pool = 4 * rows
    slots = torch.randperm(pool)[:rows].to(device)
    dev = {"device": device}
    h, p, n = 32, 64, 128
    ssm = torch.randn(pool, h, p, n, **dev)
    x, dt = torch.randn(rows, h, p, **dev), torch.rand(rows, h, **dev) * 0.1
    a, b, c = -torch.rand(h, **dev), torch.randn(rows, 1, n, **dev), torch.randn(rows, 1, n, **dev)
    channels, window = h * p + 2 * n, 3
    conv = torch.randn(pool, window, channels, **dev).bfloat16()
    xc = torch.randn(rows, channels, **dev).bfloat16()
    w, bias = (
        torch.randn(channels, window + 1, **dev).bfloat16(),
        torch.randn(channels, **dev).bfloat16(),
    )
    hk, hv, dk, dv = 16, 32, 128, 128
    delta = torch.randn(pool, hv, dk, dv, **dev) * 0.1
    q, k = torch.randn(rows, hk, dk, **dev), torch.randn(rows, hk, dk, **dev)
    v = torch.randn(rows, hv, dv, **dev)
    g, beta = -torch.rand(rows, hv, **dev), torch.rand(rows, hv, **dev)
    return {
        "ssm_update": (
            2 * rows * h * p * n * 4,
            lambda be: ssm_ops.selective_state_update(ssm, x, dt, a, b, c, slots, backend=be),
        ),
        "conv_update": (
            2 * rows * window * channels * 2,
            lambda be: ssm_ops.causal_conv1d_update(conv, xc, w, bias, slots, backend=be),
        ),
        "gated_delta": (
            2 * rows * hv * dk * dv * 4,
            lambda be: ssm_ops.gated_delta_rule_update(
                delta, q, k, v, g, beta, slots, l2norm=True, backend=be
            ),
        ),
    }


def _prefill(tokens: int, device: torch.device, seconds: float, kernel: str) -> None:
    """One row of ``tokens`` through the Mamba-2 layer's scan: ``ssm_ops.ssd_scan`` (token by
    token) against the model's torch path, ``mamba.ssd_chunked`` (chunks of 64)."""
    h, p, n = 32, 64, 128
    dev = {"device": device}
    x, dt = torch.randn(tokens, h, p, **dev), torch.rand(tokens, h, **dev) * 0.1
    a = -torch.rand(h, **dev)
    b, c = torch.randn(tokens, 1, n, **dev), torch.randn(tokens, 1, n, **dev)
    pool, slots = torch.zeros(2, h, p, n, **dev), torch.tensor([1], device=device)

    def scan() -> object:
        return ssm_ops.ssd_scan(pool, x, dt, a, b, c, [0, tokens], slots, backend=kernel)

    def chunked() -> object:
        args = (x[None], dt[None], a, b[None], c[None], pool[1:].clone())
        return ssd_chunked(*args, min(64, tokens))

    t_kernel, t_torch = _time(scan, seconds, device), _time(chunked, seconds, device)
    print(
        f"| ssd_scan ({tokens} tokens) | 1 | {t_kernel * 1e6:.0f} | {t_torch * 1e6:.0f} "
        f"(ssd_chunked) | {t_torch / t_kernel:.1f}x | |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--prefill", type=int, default=256, help="tokens of the scan's row (0: none)")
    args = ap.parse_args()
    device = torch.device(args.device)
    kernel = "native" if device.type == "cpu" else "triton"
    if device.type == "cpu":
        print(f"C++ path: {ssm_ops.native_isa()}, torch threads: {torch.get_num_threads()}")
    print(f"| op | rows | {kernel} us | torch us | speedup | {kernel} GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            for name, (moved, call) in _cases(rows, device).items():
                t_kernel = _time(lambda c=call: c(kernel), args.seconds, device)
                t_torch = _time(lambda c=call: c("torch"), args.seconds, device)
                print(
                    f"| {name} | {rows} | {t_kernel * 1e6:.1f} | {t_torch * 1e6:.1f} | "
                    f"{t_torch / t_kernel:.1f}x | {moved / t_kernel / 1e9:.1f} |"
                )
        if args.prefill:
            _prefill(args.prefill, device, args.seconds, kernel)


if __name__ == "__main__":
    main()

"""``foudre quantize``: quantize a model and write a checkpoint ``foudre`` loads directly.

Wire into ``foudre/cli.py`` with::

    p = sub.add_parser("quantize", help="quantize a model's weights and save it")
    add_quantize_args(p)
    p.set_defaults(func=cmd_quantize)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from foudre.loading.loader import load_model, load_tokenizer
from foudre.loading.quantized import save_quantized
from foudre.quant.api import (
    AWQ,
    GPTQ,
    METHODS,
    Int4WeightOnly,
    Int8WeightOnly,
    MixedBits,
    QuantConfig,
    quantize_,
)


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF directory, hub id or llama2.c .bin")
    parser.add_argument("--tokenizer", default=None)
    # fp8 and mxfp4 are applied at load only (``LLM(quantization="fp8")``): checkpoints hold
    # QuantLinears
    methods = [m for m in METHODS if m not in ("fp8", "mxfp4")]
    parser.add_argument("--method", required=True, choices=methods)
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8), help="gptq / awq bits")
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128, 256))
    parser.add_argument("--average-bits", type=float, default=4.5, help="mixed: bit budget")
    parser.add_argument("--damp", type=float, default=0.01, help="gptq: Hessian dampening")
    parser.add_argument(
        "--calibration",
        default=None,
        help="text file (tokenized with the model's tokenizer) or JSON list of token id lists; "
        "default: random token ids",
    )
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--calibration-seq-len", type=int, default=256)
    parser.add_argument(
        "--skip",
        action="append",
        default=None,
        help="module name pattern to keep in float (repeatable; default: lm_head; "
        "--skip none quantizes everything)",
    )
    parser.add_argument("--dtype", default="float32", help="dtype of the float parts")


def load_calibration(
    path: str, tokenizer_path: str | None, samples: int, seq_len: int
) -> list[list[int]]:
    """Token id sequences from a JSON list of id lists, or from a text file cut into
    ``seq_len``-token windows (at most ``samples``)."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
        return [[int(t) for t in seq] for seq in data][:samples]
    if tokenizer_path is None:
        raise ValueError("a text calibration file needs the model's tokenizer; pass --tokenizer")
    ids = load_tokenizer(tokenizer_path).encode(text)
    seqs = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    seqs = [s for s in seqs if len(s) >= 2]
    return seqs[:samples]


def build_config(args: argparse.Namespace, calibration: list[list[int]] | None) -> QuantConfig:
    if args.method == "int8":
        return Int8WeightOnly()
    if args.method == "int4":
        return Int4WeightOnly(group_size=args.group_size)
    if args.method == "gptq":
        return GPTQ(args.bits, args.group_size, args.damp, calibration=calibration)
    if args.method == "awq":
        return AWQ(args.bits, args.group_size, calibration=calibration)
    return MixedBits(args.average_bits, args.group_size, calibration=calibration)


def cmd_quantize(args: argparse.Namespace) -> int:
    """Load ``--model``, quantize it with ``--method``, write ``--output``; returns 0."""
    loaded = load_model(
        args.model, args.tokenizer, args.dtype, torch.device("cpu"), None, gguf_dequantize=True
    )
    calibration = None
    if args.calibration:
        calibration = load_calibration(
            args.calibration,
            loaded.tokenizer_path,
            args.calibration_samples,
            args.calibration_seq_len,
        )
    skip = args.skip
    if skip is not None and [s.lower() for s in skip] == ["none"]:
        skip = []
    start = time.perf_counter()
    applied = quantize_(loaded.model, build_config(args, calibration), skip=skip)
    elapsed = time.perf_counter() - start
    out = save_quantized(loaded.model, args.output, args.method, loaded.tokenizer_path)
    bits = {int(spec["bits"] or 0) for spec in applied.values()}
    print(
        f"quantized {len(applied)} linears with {args.method} "
        f"(bits {sorted(bits)}) in {elapsed:.1f}s -> {out}"
    )
    return 0

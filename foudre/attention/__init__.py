"""Attention: the interface the models call (``base.AttentionBackend``, ``BatchLayout``), every
backend behind it (``torch_sdpa``, the C++ paged kernels ``cpu_paged``, Triton's
``triton_paged``, over the shared paged cache in ``paged``), KV cache quantization
(``kv_quant``, ``quantized_cache``), and dense causal attention without a cache (``causal``) for
training, evaluation and calibration."""

from __future__ import annotations

import importlib.util
import os

import torch

from foudre.attention import cpu_paged
from foudre.attention.base import AttentionBackend, BatchLayout
from foudre.attention.kv_quant import KV_CACHE_DTYPES
from foudre.attention.torch_sdpa import TorchSDPABackend

__all__ = ["AttentionBackend", "BatchLayout", "TorchSDPABackend", "get_backend", "resolve_backend"]

BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backend(name: str, device: torch.device, kv_cache_dtype: str = "auto") -> str:
    """The concrete backend for ``name`` on ``device``: ``auto`` is ``triton`` on a CUDA device
    where Triton imports, ``cpu`` (the C++ paged kernels) on the CPU where they build, else
    ``torch``. Every backend reads every ``kv_cache_dtype`` (the paged kernels read a quantized
    cache's codes and scales as stored). ``ValueError`` for an unknown name or KV cache dtype,
    or a combination that cannot run."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if name == "sdpa":
        name = "torch"
    if name not in BACKENDS:
        hint = (
            " (the non-paged baseline is kv_allocation='contiguous')"
            if name == "contiguous"
            else ""
        )
        raise ValueError(
            f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)}){hint}"
        )
    triton_ok = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_ok else "torch"
        return "cpu" if device.type == "cpu" and cpu_paged.available() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend 'cpu' runs on the CPU only")
        if not cpu_paged.available():
            raise ValueError("attention_backend 'cpu' needs a C++ compiler to build its kernel")
    if name == "triton":
        if not triton_ok:
            raise ValueError("attention_backend 'triton' needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' runs on CUDA devices only")
    return name


def get_backend(
    name: str, device: torch.device | None = None, kv_cache_dtype: str = "auto"
) -> AttentionBackend:
    """The backend registered under ``name`` (resolved for ``device``, the CPU by default);
    ``ValueError`` for an unknown one."""
    name = resolve_backend(name, device or torch.device("cpu"), kv_cache_dtype)
    if name == "triton":
        from foudre.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    if name == "cpu":
        return cpu_paged.CPUPagedBackend()
    return TorchSDPABackend()

"""Engine options from the outside: one command-line flag per ``EngineConfig`` field, and the
check of the option names that the configuration itself leaves to their owners."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from foudre.config import EngineConfig

if TYPE_CHECKING:
    import torch


# Scenario profiles: engine options chosen for one way of serving. Each is a default that its
# own flag still overrides. realtime: a small token budget with chunked prefill keeps every
# step short (TTFT and TPOT), running requests come first (the scheduler always serves them
# before admitting), and a draft model given with --speculative-model speculates only while one
# request runs (speculative_max_batch_size 1): drafting pays where a step reads the weights for
# one token, not in a batch. The embedded draft is not turned on: with random prompts it
# lowered the embedded model's batch-1 rate and its users within the SLO (the profiles'
# record: docs/performance.md); --speculative-method draft turns it on. 512 tokens a step:
# at 256, arrivals queued for the budget (TTFT); at 1,024 and more, a long prompt's step
# stalls the running requests (TPOT) on the larger models.
# throughput: big batches and budget, prefix caching. edge: int4 weights and an int8 KV cache
# in a small pool, few sequences, small steps (a small machine, memory first).
PROFILES: dict[str, dict[str, Any]] = {
    "realtime": {
        "max_num_batched_tokens": 512,
        "speculative_max_batch_size": 1,
        "max_num_seqs": 32,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
    },
    "throughput": {
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
    },
    "edge": {
        "quantization": "int4",
        "kv_cache_dtype": "int8",
        "kv_cache_memory": float(256 << 20),
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "enable_chunked_prefill": True,
    },
}


def profile_defaults(name: str, model: str | None) -> dict[str, Any]:
    """The engine options of profile ``name`` for ``model`` (None: the embedded model; the
    profiles do not depend on it today); ``ValueError`` for an unknown profile."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
    return dict(PROFILES[name])


def check_config(config: EngineConfig, device: torch.device) -> None:
    """``ValueError`` naming the field if a name in ``config`` is not one its owner knows (or
    cannot run on ``device``); checked before any model is loaded."""
    # imported here: the command line builds its parser from this module without loading torch
    from foudre.attention import resolve_backend
    from foudre.attention.kv_quant import KV_CACHE_DTYPES
    from foudre.engine.policies import POLICIES
    from foudre.loading.loader import parse_dtype
    from foudre.quant.api import METHODS
    from foudre.speculative.registry import PROPOSERS

    named = [
        ("scheduling_policy", config.scheduling_policy, POLICIES),
        ("kv_cache_dtype", config.kv_cache_dtype, KV_CACHE_DTYPES),
        ("quantization", config.quantization, (None, *METHODS)),
        ("speculative_quantization", config.speculative_quantization, (None, *METHODS)),
        ("speculative_method", config.speculative_method, (None, *PROPOSERS)),
    ]
    for field, value, allowed in named:
        if value not in allowed:
            names = ", ".join(str(a) for a in allowed if a is not None)
            raise ValueError(f"{field} must be one of {names}, got {value!r}")
    if config.dtype != "auto":
        try:
            parse_dtype(config.dtype)
        except ValueError as e:
            raise ValueError(f"dtype: {e}") from None
    resolve_backend(config.attention_backend, device, config.kv_cache_dtype)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, with its default."""
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind: Any
        if isinstance(default, bool):
            kind = _bool
        elif f.name in ("kv_cache_memory", "batch_wait_ms", "distributed_timeout_s"):
            kind = float
        elif isinstance(default, int) or f.name in (
            "max_model_len",
            "num_kv_blocks",
            "speculative_max_batch_size",
        ):
            kind = int
        else:
            kind = str
        if isinstance(default, bool):  # "--flag" alone means true; "--flag false" works too
            parser.add_argument(
                flag,
                type=kind,
                nargs="?",
                const=True,
                default=default,
                help=f"(default: {default})",
            )
        else:
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")
        if isinstance(default, bool):
            parser.add_argument(
                "--no-" + f.name.replace("_", "-"),
                dest=f.name,
                action="store_false",
                help=argparse.SUPPRESS,
            )


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})

"""CPU host-side helpers of the runner: the block gather and the malloc settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from foudre.attention.base import gather_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_gather_blocks_matches_advanced_indexing(dtype: torch.dtype) -> None:
    cache = (torch.rand(2, 9, 4, 3, 5) * 100).to(dtype)  # [K/V, blocks, block, heads, dim]
    tables = torch.tensor([[3, 1, 8], [0, 0, 2]])
    assert torch.equal(gather_blocks(cache, tables, dim=1), cache[:, tables])
    assert torch.equal(gather_blocks(cache[1], tables), cache[1][tables])
    scales = torch.rand(2, 9, 4, 3)
    assert torch.equal(gather_blocks(scales, tables, dim=1), scales[:, tables])


def _applied(env: dict[str, str]) -> str:
    code = (
        "from foudre.runner.host_memory import keep_freed_host_memory as k;"
        "print(k(), k())"  # a second call reports the same state
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keep_freed_host_memory_applies_once_and_can_be_turned_off() -> None:
    assert _applied({**os.environ, "FOUDRE_KEEP_HOST_MEMORY": "0"}) == "False False"
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert _applied({**os.environ, "FOUDRE_KEEP_HOST_MEMORY": "1"}) == "True True"


def test_first_engine_freezes_startup_objects_once() -> None:
    """The objects alive as the first engine is built leave the collector's full passes; the
    second engine freezes nothing more; ``FOUDRE_GC_FREEZE=0`` freezes nothing."""
    code = (
        "import gc; from foudre import LLM; a = gc.get_freeze_count();"
        "LLM(skip_tokenizer_init=True, num_kv_blocks=64); b = gc.get_freeze_count();"
        "LLM(skip_tokenizer_init=True, num_kv_blocks=64); print(a, b, gc.get_freeze_count())"
    )

    def counts(flag: str) -> list[int]:
        env = {**os.environ, "FOUDRE_GC_FREEZE": flag}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return [int(x) for x in out.stdout.split()]

    before, first, second = counts("1")
    assert before == 0 and first > 10_000 and second == first
    assert counts("0") == [0, 0, 0]

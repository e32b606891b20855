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

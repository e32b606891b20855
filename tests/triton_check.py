"""Run a Triton check script in a fresh Python process: in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, no GPU visible), or for real (a GPU, or Triton's compiler alone, which
needs its ptxas: skipped where the install has none). The script prints ``ok`` when every check
passed; its stderr explains a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_triton_check(
    script: str,
    *args: str,
    interpret: bool = True,
    timeout: int = 900,
    env: dict[str, str] | None = None,
) -> None:
    """``env``: variables set for the script on top of this process's."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ) | (env or {})
    if interpret:
        env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if not interpret and out.returncode and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip(f"no ptxas for Triton's CUDA backend: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout

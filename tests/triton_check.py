"""Run a Triton check script in a fresh Python process: in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, no GPU visible), or for real where a test asks for a GPU. The script
prints ``ok`` when every check passed; its stderr explains a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_triton_check(script: str, *args: str, interpret: bool = True, timeout: int = 900) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ)
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
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout

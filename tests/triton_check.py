"""Run a Triton check script in a fresh Python process: in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, no GPU visible), or for real (a GPU, or Triton's compiler alone, which
needs its ptxas: skipped where the install has none). The script prints ``ok`` when every check
passed; its stderr explains a failure.

The interpreter runs a kernel's programs one after another in Python, on one core: a module's
checks can start together (``start_triton_checks``), two at a time, so that both cores of a
small host work, and each test waits for its own (``wait_triton_check``)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# started checks: name -> the finished process, to come
Checks = dict[str, Future[subprocess.CompletedProcess[str]]]

# interpreter processes at once (each single-threaded: one per core of a 2-core host)
PARALLEL = max(1, min(2, os.cpu_count() or 1))


def _run(
    script: str, args: tuple[str, ...], interpret: bool, timeout: int, env: dict[str, str] | None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ) | (env or {})
    if interpret:
        env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _verify(out: subprocess.CompletedProcess[str], interpret: bool) -> None:
    if not interpret and out.returncode and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip(f"no ptxas for Triton's CUDA backend: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout


def run_triton_check(
    script: str,
    *args: str,
    interpret: bool = True,
    timeout: int = 900,
    env: dict[str, str] | None = None,
) -> None:
    """``env``: variables set for the script on top of this process's."""
    pytest.importorskip("triton", reason="triton is not installed")
    _verify(_run(script, args, interpret, timeout, env), interpret)


def start_triton_checks(
    checks: dict[str, tuple[str, ...]], interpret: bool = True, timeout: int = 900
) -> Checks:
    """``name -> (script, *args)``: the scripts started (in the interpreter, or for real on a
    GPU), ``PARALLEL`` at a time, in this order; ``name -> future`` of each finished process,
    for ``wait_triton_check``."""
    pytest.importorskip("triton", reason="triton is not installed")
    pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="triton-check")
    one_core = {"OMP_NUM_THREADS": "1"}  # side by side: a core each
    futures = {
        name: pool.submit(_run, script, tuple(args), interpret, timeout, one_core)
        for name, (script, *args) in checks.items()
    }
    pool.shutdown(wait=False)  # its threads end with the last script
    return futures


def wait_triton_check(future: Future[subprocess.CompletedProcess[str]]) -> None:
    """The check started by ``start_triton_checks`` passed."""
    _verify(future.result(), interpret=True)


def selected(request: pytest.FixtureRequest) -> set[str]:
    """The names (with parameters) of the tests of the requesting module that this session
    runs: a module fixture starts the checks of those only."""
    return {
        item.name
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }

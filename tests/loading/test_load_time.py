"""What a process's first load costs beyond reading the weights: building the model on ``meta``
and giving it memory must not import ``torch._dynamo`` (about 2 s), which torch's meta
``normal_`` (an embedding's initialisation) would, nor sympy (about 0.9 s), which
``torch.empty_like`` of a meta tensor (``Module.to_empty``) would. Oracle: the same model
loaded with the initialisation run (its weights, which the load overwrites, equal), and
``sys.modules`` of a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foudre.loading import loader
from foudre.loading.loader import load_model
from tests.conftest import make_hf_model
from tests.quant.test_gguf import write_gguf

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
import torch
from foudre.loading.loader import load_model
loaded = load_model(sys.argv[1], None, "float32", torch.device("cpu"), None)
print(json.dumps({name: name in sys.modules for name in ("torch._dynamo", "sympy")}))
"""


@pytest.mark.parametrize("huge_pages", ["1", "0"])
def test_first_load_imports_neither_dynamo_nor_sympy(tmp_path: Path, huge_pages: str) -> None:
    """A fresh process's ``load_model`` of a Q4_0 GGUF Llama (float tensors and kept quantized
    linears, in huge pages or not) leaves ``torch._dynamo`` and sympy unimported."""
    src = make_hf_model(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256)
    write_gguf(src, tmp_path / "llama.gguf", "Q4_0")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "llama.gguf")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "FOUDRE_HUGE_PAGES": huge_pages},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert imported == {"torch._dynamo": False, "sympy": False}


class _Passing(torch.overrides.TorchFunctionMode):
    """A mode that runs every function as it is (the initialisation included)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_skipped_initialisation_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model loaded with meta ``normal_`` skipped is the one loaded with it run, weight for
    weight; outside the build, ``normal_`` on meta and real tensors is untouched."""
    src = make_hf_model(tmp_path / "llama", "llama")
    skipped = load_model(str(src), None, "float32", torch.device("cpu"), None).model
    with monkeypatch.context() as mp:
        mp.setattr(loader, "_NoMetaInit", _Passing)
        run = load_model(str(src), None, "float32", torch.device("cpu"), None).model
    a, b = skipped.state_dict(), run.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with loader._NoMetaInit():
        real = torch.zeros(64).normal_(generator=torch.Generator().manual_seed(0))
    assert torch.equal(real, torch.zeros(64).normal_(generator=torch.Generator().manual_seed(0)))
    assert bool((real != 0).any())

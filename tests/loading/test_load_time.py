"""What a process's first load costs beyond reading the weights: building the model on ``meta``
must not import ``torch._dynamo`` (about 2 s), which torch's meta ``normal_`` (an embedding's
initialisation) would. Oracle: the same model loaded with the initialisation run (its weights,
which the load overwrites, equal), and ``sys.modules`` of a fresh process."""

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

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
import torch
from foudre.loading.loader import load_model
loaded = load_model(sys.argv[1], None, "float32", torch.device("cpu"), None)
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules}))
"""


def test_first_load_does_not_import_dynamo(tmp_path: Path) -> None:
    """A fresh process's ``load_model`` of a Llama leaves ``torch._dynamo`` unimported."""
    src = make_hf_model(tmp_path / "llama", "llama")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"dynamo": False}


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

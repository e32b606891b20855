"""Quantization through the engine: ``LLM(quantization=...)`` and saved checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from foudre import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate("Once upon a time", PARAMS)[0].outputs[0].token_ids


def test_quantized_engine_matches_float(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    ref = _tokens(LLM(model, tokenizer=tok))
    int8 = LLM(model, tokenizer=tok, quantization="int8")  # K = 172 exercises kernel padding
    got = _tokens(int8)
    assert sum(a == b for a, b in zip(got, ref, strict=True)) >= 36
    int4 = LLM(model, tokenizer=tok, quantization="int4")
    assert len(_tokens(int4)) == 40
    for llm in (int8, int4):
        assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_quantize_cli_checkpoint_loads_without_requantizing(
    stories_paths: tuple[str, str], tmp_path: Path
) -> None:
    model, tok = stories_paths
    out = tmp_path / "q8"
    proc = subprocess.run(
        [sys.executable, "-m", "foudre", "quantize", "--model", model, "--tokenizer", tok,
         "--method", "int8", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    in_memory = _tokens(LLM(model, tokenizer=tok, quantization="int8"))
    assert _tokens(LLM(str(out))) == in_memory

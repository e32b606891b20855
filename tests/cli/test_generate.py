"""``foudre generate``: the prompt then its completion on stdout, errors as one line on
stderr."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from foudre import LLM, SamplingParams
from foudre.cli import add_engine_args, engine_config_from


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "foudre", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_prints_the_prompt_then_its_completion(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    proc = _run(
        "generate",
        "--model",
        model,
        "--tokenizer",
        tok,
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "30",
        "--temperature",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model, tokenizer=tok)
    expected = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30))
    assert proc.stdout == "Once upon a time" + expected[0].outputs[0].text + "\n"


def test_generate_reads_stdin_and_defaults_to_a_builtin_model(
    stories_paths: tuple[str, str],
) -> None:
    proc = _run("generate", "--max-tokens", "12", stdin="Once upon a time")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    assert len(proc.stdout.strip()) > len("Once upon a time")


def test_generate_output_starts_with_the_prompt(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    flags = ["--model", model, "--tokenizer", tok, "--prompt", "Tom had a dog", "--max-tokens"]
    proc = _run("generate", *flags, "8", "--temperature", "0.8", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Tom had a dog") and len(proc.stdout) > len("Tom had a dog\n")
    beams = _run("generate", *flags, "6", "--beam-width", "2")
    assert beams.returncode == 0, beams.stderr
    lines = beams.stdout.splitlines()
    assert len(lines) == 2 and all("): Tom had a dog" in line for line in lines)
    refused = _run("generate", *flags, "4", "--prompt", "once " * 600)
    assert refused.returncode == 2 and refused.stdout == ""  # the engine refused: nothing printed
    assert "max_model_len" in refused.stderr


def test_generate_reports_bad_input_in_one_line(stories_paths: tuple[str, str], tmp_path) -> None:
    model, tok = stories_paths
    bad = _run(
        "generate", "--model", model, "--tokenizer", tok, "--prompt", "x", "--temperature", "-1"
    )
    assert bad.returncode == 2
    assert "temperature" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = _run("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2
    assert "nope" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    corrupt = tmp_path / "model.bin"
    corrupt.write_bytes(b"\x00" * 100)
    proc = _run("generate", "--model", str(corrupt), "--tokenizer", tok, "--prompt", "x")
    assert proc.returncode == 2 and "model.bin" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_boolean_engine_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def config(*argv: str) -> tuple[bool, bool]:
        cfg = engine_config_from(parser.parse_args(list(argv)))
        return cfg.enforce_eager, cfg.enable_prefix_caching

    assert config() == (False, True)
    assert config("--enforce-eager") == (True, True)
    assert config("--enforce-eager", "false", "--no-enable-prefix-caching") == (False, False)
    assert config("--enable-prefix-caching", "off") == (False, False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--enforce-eager", "maybe"])

"""Structured output: the per-step cost of grammar masking against a decode step, and the
grammar compile times.

    .venv/bin/python benchmarks/structured_output.py [--batch-sizes 1 8 32] [--turns 20]
        [--out benchmarks/results/structured-output-DATE.json]

Model: the ~500M random Llama (``common.random_llama("medium", torch.bfloat16)``), whose
32,000-token vocabulary is read with the Llama 2 sentencepiece tokenizer (``../shared``).

- **Masking** at batch B: what the engine adds per step for B constrained rows, with the code it
  runs: ``fill_masks`` (each row's allowed tokens from its grammar state), ``GrammarMasks.apply``
  on the ``[B, 32000]`` float32 logits, and one ``GrammarMatcher.accept`` per row. Each row
  walks its own document of a test schema (the argmax of fresh random logits under the mask; a
  finished document starts over). A **decode step** is ``LLMEngine.step()`` over B free
  requests (64-token random prompts). The two are timed in turns (decode, mask, decode,
  mask, ...) so that both see the same machine (2 shared cores here); the ratio reported is the
  median of the per-turn ratios, and, conservatively, the median masking time over the fastest
  decode step (contention slows the 2-thread forward more than the 1-thread masking).
- **Unconstrained overhead**: ``sampler.grammar_masks`` on B free rows (it returns None).
- **Compile**: the vocabulary read once per engine (``GrammarCompiler``), then each test schema
  compiled on first use and again from the cache (median of repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from common import machine, random_llama

from foudre import LLM, SamplingParams
from foudre.loading.loader import shared_dir
from foudre.loading.tokenizer import SentencePieceTokenizer
from foudre.sample.sampler import grammar_masks
from foudre.sampling_params import StructuredOutput
from foudre.structured.grammar import GrammarCompiler, GrammarMatcher, fill_masks

# the schemas of tests/engine/test_structured.py, a pydantic model's and a tools grammar's
SCHEMAS: dict[str, Any] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 10},
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                },
                "required": ["name", "id"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "bounded_arrays": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 4,
            },
            "labels": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        },
        "required": ["scores"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "count": {"const": 3},
        },
        "required": ["color", "size", "count"],
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "p": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["x", "y", "p"],
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100},
            "nickname": {"type": "string", "maxLength": 8},
            "email": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["id"],
    },
    "pydantic_pet": {
        "additionalProperties": False,
        "properties": {
            "kind": {"enum": ["cat", "dog", "owl"], "title": "Kind", "type": "string"},
            "age": {"maximum": 20, "minimum": 0, "title": "Age", "type": "integer"},
            "name": {"maxLength": 10, "title": "Name", "type": "string"},
        },
        "required": ["kind", "age", "name"],
        "title": "Pet",
        "type": "object",
    },
    "tools_required": {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "get_weather"},
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                            },
                            "required": ["city", "days"],
                        },
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "get_time"},
                        "parameters": {
                            "type": "object",
                            "properties": {"zone": {"enum": ["UTC", "CET"]}},
                            "required": ["zone"],
                        },
                    },
                    "required": ["name", "parameters"],
                },
            ]
        },
    },
}
WALK_SCHEMA = "nested_objects"


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def compile_times(compiler_args: tuple[Any, ...], repeats: int) -> dict[str, Any]:
    """The vocabulary read, then each schema cold (a fresh compiler each repeat) and cached."""
    build, cold, cached = [], {k: [] for k in SCHEMAS}, {k: [] for k in SCHEMAS}
    for _ in range(repeats):
        t = time.perf_counter()
        compiler = GrammarCompiler(*compiler_args)
        build.append(time.perf_counter() - t)
        for name, schema in SCHEMAS.items():
            spec = StructuredOutput(json_schema=schema)
            t = time.perf_counter()
            compiler.compile(spec)
            cold[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.matcher(spec)  # what admission does for a cached spec: lookup + matcher
            cached[name].append(time.perf_counter() - t)
    return {
        "compiler_build_ms": _median_ms(build),
        "schemas": {
            k: {"first_use_ms": _median_ms(cold[k]), "cached_ms": _median_ms(cached[k])}
            for k in SCHEMAS
        },
    }


class Walkers:
    """B matchers, each walking its own document of ``spec`` under random logits."""

    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutput, batch: int, vocab: int):
        self.compiler, self.spec, self.vocab = compiler, spec, vocab
        self.matchers: list[GrammarMatcher] = [compiler.matcher(spec) for _ in range(batch)]
        self.g = torch.Generator().manual_seed(batch)
        for _ in range(7):  # start the rows at different depths of their documents
            self.step()

    def step(self) -> float:
        """One masked step; returns the seconds of the grammar's work (fill, apply, accept),
        not of drawing the logits, picking the token (the sampler's) or restarting."""
        logits = torch.randn(len(self.matchers), self.vocab, generator=self.g)
        for i, m in enumerate(self.matchers):
            if m.is_terminated:
                self.matchers[i] = self.compiler.matcher(self.spec)
        t0 = time.perf_counter()
        masks = fill_masks([(m, ()) for m in self.matchers], self.vocab)
        assert masks is not None
        masks.apply(logits)
        t1 = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()
        t2 = time.perf_counter()
        for m, tok in zip(self.matchers, tokens, strict=True):
            assert m.accept(tok)
        return (t1 - t0) + (time.perf_counter() - t2)


def masking_vs_decode(
    llm: LLM, compiler: GrammarCompiler, batch: int, turns: int, vocab: int
) -> dict[str, Any]:
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (batch, 64), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=turns + 16, ignore_eos=True, seed=1)
    for i, p in enumerate(prompts):
        engine.add_group(f"b{batch}-{i}", [p], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm decode
    walkers = Walkers(compiler, StructuredOutput(json_schema=SCHEMAS[WALK_SCHEMA]), batch, vocab)
    rows = list(engine.scheduler.running)
    assert len(rows) == batch
    decode, mask, free = [], [], []
    for _ in range(turns):
        t = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t)
        mask.append(walkers.step())
        t = time.perf_counter()
        assert grammar_masks(torch.empty(0, vocab), rows, [()] * batch) is None
        free.append(time.perf_counter() - t)
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    ratios = [m / d for m, d in zip(mask, decode, strict=True)]
    return {
        "batch": batch,
        "decode_step_ms": _median_ms(decode),
        "masking_ms": _median_ms(mask),
        "masking_per_row_us": _median_ms(mask) * 1e3 / batch,
        "masking_over_decode": statistics.median(ratios),
        "masking_over_decode_max": max(ratios),
        # conservative: the masking median over the fastest decode step (a shared machine
        # slows the 2-thread forward more than the 1-thread masking)
        "fastest_decode_step_ms": min(decode) * 1e3,
        "masking_over_fastest_decode": statistics.median(mask) / min(decode),
        "unconstrained_overhead_us": _median_ms(free) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--compile-repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    t = time.perf_counter()
    import xgrammar  # noqa: F401  (timed: the import the first constrained request pays)

    import_s = time.perf_counter() - t
    tokenizer = SentencePieceTokenizer(
        shared_dir() / "models" / "llama2-tokenizer" / "tokenizer.model"
    )
    path = random_llama("medium", torch.bfloat16)
    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512)
    vocab = llm.engine.model_config.vocab_size
    assert vocab == tokenizer.vocab_size
    t = time.perf_counter()
    token_bytes = tokenizer.token_bytes()
    vocab_read_s = time.perf_counter() - t
    compiler_args = (token_bytes, [tokenizer.eos_token_id or 2], vocab)
    compiled = compile_times(compiler_args, args.compile_repeats)
    compiler = GrammarCompiler(*compiler_args)
    steps = [masking_vs_decode(llm, compiler, b, args.turns, vocab) for b in args.batch_sizes]
    record = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": f"{path.name} (vocabulary {vocab}, Llama 2 sentencepiece tokenizer)",
        "xgrammar_import_s": import_s,
        "token_bytes_s": vocab_read_s,
        "compile": compiled,
        "steps": steps,
    }
    print(json.dumps(record, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

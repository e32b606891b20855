"""The two grammar engines made for constrained decoding, side by side: xgrammar (foudre's) and
llguidance (not a dependency: ``pip install llguidance`` to include it).

    .venv/bin/python benchmarks/grammar_engines.py [--steps 200]

For the embedded model's byte-level BPE (2,048 tokens) and the Llama 2 sentencepiece vocabulary
(32,000, ``../shared``), and three JSON schemas: the time to read the vocabulary, to compile
each schema (xgrammar precomputes masks; llguidance builds its matcher lazily), and to fill one
token mask, over a random walk of up to ``--steps`` tokens through each schema (mean and worst;
the worst is usually the first mask). Both run with one thread.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from foudre.loading.loader import default_model, load_tokenizer, shared_dir
from foudre.loading.tokenizer import SentencePieceTokenizer, Tokenizer

SCHEMAS: dict[str, Any] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string"},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {
                        "type": "array",
                        "items": {"enum": ["a", "b", "c"]},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["id", "tags"],
            },
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        },
        "required": ["user"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["color", "n"],
    },
}


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask[0].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].nonzero().view(-1)


def _walk(fill: Any, consume: Any, done: Any, vocab: int, steps: int) -> dict[str, float]:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        if done():
            break
        t = time.perf_counter()
        fill(bitmask)
        times.append(time.perf_counter() - t)
        ids = _allowed(bitmask, vocab)
        if not len(ids) or not consume(int(ids[torch.randint(len(ids), (1,), generator=g)])):
            break
    return {
        "tokens": len(times),
        "mask_mean_us": 1e6 * sum(times) / len(times),
        "mask_max_us": 1e6 * max(times),
    }


def run_xgrammar(tok: Tokenizer, eos: int, steps: int) -> dict[str, Any]:
    import xgrammar as xgr

    vocab = tok.vocab_size
    t = time.perf_counter()
    info = xgr.TokenizerInfo(
        tok.token_bytes(), xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[eos]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out: dict[str, Any] = {"vocabulary_ms": 1e3 * (time.perf_counter() - t)}
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(compiled)
        compile_ms = 1e3 * (time.perf_counter() - t)
        walk = _walk(
            lambda b, m=m: m.fill_next_token_bitmask(b, 0),
            m.accept_token,
            m.is_terminated,
            vocab,
            steps,
        )
        out[name] = {"compile_ms": compile_ms, **walk}
    return out


def run_llguidance(tok: Tokenizer, eos: int, steps: int, raw_encode: Any) -> dict[str, Any]:
    import llguidance as llg
    from llguidance.torch import fill_next_token_bitmask

    vocab = tok.vocab_size
    special = sorted(tok.all_special_ids)
    # llguidance marks special tokens with a 0xFF byte and needs a tokenizer without BOS or
    # sentencepiece's dummy space (with one, it fails at the first mask)
    tokens = [b"\xff<special>" if i in special else b for i, b in enumerate(tok.token_bytes())]

    class Wrapper:
        eos_token_id = eos
        bos_token_id = tok.bos_token_id
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, data: bytes) -> list[int]:
            return list(raw_encode(data.decode("utf-8", "replace")))

    t = time.perf_counter()
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(Wrapper()), n_vocab=vocab)
    out: dict[str, Any] = {"vocabulary_ms": 1e3 * (time.perf_counter() - t)}
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        m = llg.LLMatcher(lltok, grammar)
        compile_ms = 1e3 * (time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
        walk = _walk(
            lambda b, m=m: fill_next_token_bitmask(m, b, 0),
            lambda t, m=m: m.consume_token(t) and not m.is_error(),
            m.is_stopped,
            vocab,
            steps,
        )
        out[name] = {"compile_ms": compile_ms, **walk}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    embedded = load_tokenizer(default_model()[0])
    sp = SentencePieceTokenizer(shared_dir() / "models" / "llama2-tokenizer" / "tokenizer.model")

    def sp_raw(text: str) -> list[int]:  # no dummy space: encode after a newline, drop it
        ids = sp.encode("\n" + text, add_special_tokens=False)
        nl = sp.encode("\n", add_special_tokens=False)
        return ids[len(nl) :]

    vocabularies = {
        "embedded-bpe-2048": (embedded, lambda s: embedded.encode(s, add_special_tokens=False)),
        "llama2-sp-32000": (sp, sp_raw),
    }
    results: dict[str, Any] = {}
    for vname, (tok, raw) in vocabularies.items():
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        results[vname] = {"xgrammar": run_xgrammar(tok, eos, args.steps)}
        try:
            results[vname]["llguidance"] = run_llguidance(tok, eos, args.steps, raw)
        except ImportError:
            results[vname]["llguidance"] = "not installed"
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

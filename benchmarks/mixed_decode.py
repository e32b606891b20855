"""Steady-state decode of many requests at mixed context lengths (stories260K, fp32, greedy).

768 requests from BOS with output lengths uniform in 16..500 (EOS ignored), 256 seats: the decode
batch always holds requests at very different positions, which is what the CPU backend's
context-length bands (``torch_sdpa.decode_groups``) are for. Prints output tokens/s and a hash of
all tokens (equal hashes = identical outputs across code versions).

    .venv/bin/python benchmarks/mixed_decode.py [--num-requests 768]
"""

from __future__ import annotations

import argparse
import random
import time

from foudre import LLM, SamplingParams
from foudre.loading.loader import shared_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=768)
    args = ap.parse_args()
    model = shared_dir() / "models" / "stories260K"
    llm = LLM(
        str(model / "stories260K.bin"),
        tokenizer=str(model / "tok512.bin"),
        dtype="float32",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
    rng = random.Random(0)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 500), ignore_eos=True)
        for _ in range(args.num_requests)
    ]
    llm.generate([[1]] * 8, SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([[1]] * args.num_requests, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    digest = hash(tuple(tuple(o.outputs[0].token_ids) for o in outs))
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.0f} tok/s (hash {digest})")


if __name__ == "__main__":
    main()

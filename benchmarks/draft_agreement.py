"""How often a draft model's greedy next token equals the target's, on held-out text.

    .venv/bin/python benchmarks/draft_agreement.py --target DIR --draft DIR --data FILE

Both models must share a tokenizer. Every position of every held-out story (windows of
``--max-length``) counts once; the rate bounds the acceptance of greedy speculative decoding.
"""

from __future__ import annotations

import argparse

import torch

from foudre.compress.data import read_documents
from foudre.compress.model import full_sequence_logits, load_for_eval


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-length", type=int, default=512)
    args = ap.parse_args()
    target, tok = load_for_eval(args.target)
    draft, _ = load_for_eval(args.draft)
    same = total = 0
    with torch.inference_mode():
        for story in read_documents(args.data, "heldout"):
            ids = tok.encode(story)
            for start in range(0, len(ids), args.max_length):
                window = ids[start : start + args.max_length]
                a = full_sequence_logits(target, window).argmax(-1)
                b = full_sequence_logits(draft, window).argmax(-1)
                same += int((a == b).sum())
                total += len(window)
    print(f"greedy agreement {same / total:.3f} over {total} positions")


if __name__ == "__main__":
    main()

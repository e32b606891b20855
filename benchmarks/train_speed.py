"""Training throughput of foudre's model (CausalBackend): fp32 vs bf16 autocast, interleaved.

Steps of the two precisions alternate so that both see the same machine load. Prints the median
tokens/s of each per model shape. Usage::

    python benchmarks/train_speed.py [--threads N] "(hidden, ffn, layers, heads, kv, vocab, B, T)"
"""

from __future__ import annotations

import argparse
import ast
import statistics
import time

import torch

from foudre.compress.model import new_model, num_parameters
from foudre.compress.train import TrainConfig, _optimizer, autocast_context, lm_loss
from foudre.models.config import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("shapes", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for text in args.shapes:
        hidden, ffn, layers, heads, kv, vocab, b, t = ast.literal_eval(text)
        cfg = ModelConfig(
            "llama", vocab, hidden, ffn, layers, heads, kv, hidden // heads,
            max_position_embeddings=t, tie_word_embeddings=True, bos_token_id=0,
        )  # fmt: skip
        runs = {}
        for kind in ("fp32", "bf16"):
            model = new_model(cfg)
            runs[kind] = (model, _optimizer(model, TrainConfig()))
        x, y = torch.randint(0, vocab, (b, t)), torch.randint(0, vocab, (b, t))
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.steps):
            for kind, (model, opt) in runs.items():
                t0 = time.perf_counter()
                with autocast_context(kind):
                    loss = lm_loss(model, x, y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                times[kind].append(time.perf_counter() - t0)
        rates = {k: b * t / statistics.median(v[1:]) for k, v in times.items()}
        params = num_parameters(runs["fp32"][0]) / 1e6
        print(
            f"{params:.2f}M {text}: "
            + ", ".join(f"{k} {r:,.0f} tok/s" for k, r in rates.items())
            + f" (bf16/fp32 {rates['bf16'] / rates['fp32']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Speculative decoding: acceptance, target forwards per token and wall-clock speedup.

    .venv/bin/python benchmarks/spec_decode.py [--model DIR] [--batch-sizes 1 16] [--out FILE]

Proposers (on the embedded target unless ``--model``):
  draft       the embedded draft model (distilled from the target)
  ngram       prompt lookup (n = 1..4), no model
  int4-self   the target itself quantized to int4 (g128) as its own draft
Workloads (held-out TinyStories, greedy):
  story   continue the first 24 tokens of a held-out story
  copy    a held-out story, then its first sentence again: continuing means copying the
          story (the copy-heavy shape of summarising or editing a given text)
Batch 1 runs the requests one after another; batch N submits N at once; with ``--repeat R``
each row keeps the fastest of R runs (this shared 2-core machine's speed drifts by up to 30%).
Every row reports the output tokens per second, the speedup over no speculation in the same run
and workload, the draft acceptance rate, the mean acceptance length (tokens per verification:
accepted + 1) and target forwards per output token of a request (1 without speculation).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from foudre import LLM, SamplingParams
from foudre.compress.data import read_documents
from foudre.loading.loader import default_model, shared_dir

PROPOSERS: dict[str, dict[str, Any]] = {
    "none": {},
    "draft": {"speculative_method": "draft"},
    "ngram": {"speculative_method": "ngram", "ngram_min": 1, "ngram_max": 4},
    "int4-self": {"speculative_quantization": "int4"},  # speculative_model filled in below
}


def workloads(llm: LLM, n: int, random_len: int = 0) -> dict[str, list[list[int]]]:
    if random_len:  # a model without a tokenizer (random weights): random prompt ids
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.model_config.vocab_size
        return {"random": torch.randint(10, vocab, (n, random_len), generator=g).tolist()}
    tok = llm.get_tokenizer()
    stories = read_documents(
        shared_dir() / "data" / "tinystories_v2_train_first2MiB.txt", "heldout"
    )
    stories = [s for s in stories if len(tok.encode(s)) < 300][:n]
    story = [tok.encode(s)[:24] for s in stories]
    copy = []
    for s in stories:
        first = s.split(".")[0] + "."
        copy.append(tok.encode(s + "\n\n" + first))
    return {"story": story, "copy": copy}


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = dict(llm.metrics())
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), batch):
        for o in llm.generate(prompts[i : i + batch], params):
            n_out += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    after = llm.metrics()

    def d(key: str) -> float:
        return float(after[key] - before[key])

    drafts, draft_tokens, accepted = (
        d("spec_num_drafts"),
        d("spec_draft_tokens"),
        d("spec_accepted_tokens"),
    )
    return {
        "output_tokens": n_out,
        "seconds": wall,
        "tok_per_s": n_out / wall,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        # each request's target forward emits its accepted drafts plus one token
        "target_forwards_per_token": (n_out - accepted) / n_out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="draft model (default: the embedded draft)")
    ap.add_argument("--proposers", nargs="+", default=list(PROPOSERS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; the fastest is kept")
    ap.add_argument(
        "--random-prompts", type=int, default=0, metavar="LEN", help="random ids (no tokenizer)"
    )
    ap.add_argument("--out", default=None, help="write JSON and a markdown table (FILE.md)")
    args = ap.parse_args()
    torch.manual_seed(0)
    target = args.model or default_model()[0]
    rows = []
    for name in args.proposers:
        kw = dict(PROPOSERS[name])
        if name == "int4-self":
            kw["speculative_model"] = target
        if name == "draft" and args.draft:
            kw["speculative_model"] = args.draft
        if kw:
            kw["num_speculative_tokens"] = args.num_speculative_tokens
        llm = LLM(
            model=args.model, dtype=args.dtype, skip_tokenizer_init=bool(args.random_prompts), **kw
        )
        loads = workloads(llm, args.num_prompts, args.random_prompts)
        for wl, prompts in loads.items():
            run(llm, prompts[:2], 2, 8)  # warm-up
            for batch in args.batch_sizes:
                r = max(
                    (run(llm, prompts, batch, args.max_tokens) for _ in range(args.repeat)),
                    key=lambda x: x["tok_per_s"],
                )
                rows.append({"proposer": name, "workload": wl, "batch": batch, **r})
                print(json.dumps(rows[-1]), flush=True)
        del llm
    base = {(r["workload"], r["batch"]): r["tok_per_s"] for r in rows if r["proposer"] == "none"}
    for r in rows:
        b = base.get((r["workload"], r["batch"]))
        r["speedup"] = r["tok_per_s"] / b if b else None
    head = (
        "| proposer | workload | batch | tok/s | speedup | acceptance | mean accepted length "
        "| target forwards / token |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(
            f"| {r['proposer']} | {r['workload']} | {r['batch']} | {r['tok_per_s']:.1f} | {sp} "
            f"| {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} "
            f"| {r['target_forwards_per_token']:.3f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        meta = {
            "date": str(date.today()),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "command": "benchmarks/spec_decode.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
            ),
            "k": args.num_speculative_tokens,
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        Path(args.out).with_suffix(".md").write_text(
            f"# Speculative decoding ({meta['date']})\n\n{meta['machine']}; `{meta['command']}`\n\n"
            + table
            + "\n"
        )


if __name__ == "__main__":
    main()

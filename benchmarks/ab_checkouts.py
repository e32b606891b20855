"""Run one benchmark command against two checkouts of foudre in turns (A, B, A, B, ...), so
that the host's drift hits both alike, and print each run's figures side by side.

    .venv/bin/python benchmarks/ab_checkouts.py --base /tmp/base --rounds 2 -- \\
        benchmarks/core_throughput.py --skip-hf --dtypes bfloat16 --rounds 2

``--base`` is a second work tree (``git worktree add /tmp/base <commit>``); the command runs from
each tree's root with that tree's ``foudre`` first on ``PYTHONPATH``. Lines that the command
prints containing ``tok/s`` are collected per run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run(tree: Path, command: list[str]) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, *command], cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return [line for line in proc.stdout.splitlines() if "tok/s" in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True, help="the other work tree (A)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = [c for c in args.command if c != "--"]
    for rnd in range(args.rounds):
        for label, tree in (("A (base)", args.base.resolve()), ("B (this tree)", HERE)):
            print(f"--- round {rnd}, {label}: {tree}", flush=True)
            for line in run(tree, command):
                print("   ", line, flush=True)


if __name__ == "__main__":
    main()

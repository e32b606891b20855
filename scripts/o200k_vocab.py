"""Write ``o200k_base.tiktoken`` (the vocabulary openai-harmony loads) without the network
that openai-harmony would download it from: its ranks are taken from the npm package
``tiktoken`` (``encoders/o200k_base.json``), fetched with ``npm pack``, and the file written
is checked against the SHA-256 that openai-harmony itself checks.

    python scripts/o200k_vocab.py DIR      # then: export TIKTOKEN_ENCODINGS_BASE=DIR

Exits 0 when the file is there (written now or before), 1 when it could not be made.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

NPM_PACKAGE = "tiktoken@1.0.22"
MEMBER = "package/encoders/o200k_base.json"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NAME = "o200k_base.tiktoken"


def tiktoken_text(bpe_ranks: str) -> str:
    """The ``.tiktoken`` text (``base64-token rank`` lines, by rank) of the npm package's
    compact ranks (lines of ``<tag> <first rank> <token> <token> ...``)."""
    ranks: dict[str, int] = {}
    for line in bpe_ranks.split("\n"):
        if not line:
            continue
        _, first, *tokens = line.split(" ")
        for i, token in enumerate(tokens):
            ranks[token] = int(first) + i
    return "".join(f"{t} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def main(folder: Path) -> int:
    target = folder / NAME
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == SHA256:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(
                ["npm", "pack", NPM_PACKAGE, "--silent"],
                cwd=tmp,
                check=True,
                capture_output=True,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as e:
            print(f"o200k_vocab: npm pack {NPM_PACKAGE} failed: {e}", file=sys.stderr)
            return 1
        archive = next(Path(tmp).glob("tiktoken-*.tgz"))
        with tarfile.open(archive) as tar:
            member = tar.extractfile(MEMBER)
            assert member is not None
            ranks = json.load(member)["bpe_ranks"]
    text = tiktoken_text(ranks).encode()
    if hashlib.sha256(text).hexdigest() != SHA256:
        print("o200k_vocab: the rebuilt vocabulary does not match o200k_base", file=sys.stderr)
        return 1
    folder.mkdir(parents=True, exist_ok=True)
    target.write_bytes(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/o200k")))

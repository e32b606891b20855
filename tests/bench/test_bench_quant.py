"""``foudre bench quant`` at a tiny scale on stories260K: files, rows and sane figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from foudre.bench.quant import SCHEMES, add_ratios, check_targets, model_bytes
from foudre.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quant_tiny(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    out = tmp_path / "quant"
    rc = main(["bench", "quant", "--model", model, "--tokenizer", tok,
               "--schemes", "fp32,bf16,int8,int4,int8-kv", "--max-docs", "2", "--kl",
               "--kl-seqs", "1", "--kl-len", "16", "--input-len", "4", "--output-len", "4",
               "--batch-size", "4", "--output", str(out)])  # fmt: skip
    assert rc == 0
    md = (out / "quant.md").read_text()
    data = json.loads((out / "quant.json").read_text())
    assert (out / "quant.png").stat().st_size > 10_000
    assert "machine" in md and "command" in md and "date" in md and "Targets" in md
    rows = {r["scheme"]: r for r in data["rows"]}
    assert list(rows) == ["fp32", "bf16", "int8", "int4", "int8-kv"]
    for name, r in rows.items():
        assert f"| {name} | {SCHEMES[name].label}" in md
        assert r["decode_tps"] > 0 and r["throughput_tps"] > 0 and r["batch_size"] == 4
        assert 0.5 < r["bits_per_byte"] < 3.0 and r["eval_tokens"] > 0
        assert r["kl"] >= 0 and 0 <= r["top1_agree"] <= 1
    size = {k: r["size_bytes"] for k, r in rows.items()}
    assert size["fp32"] > size["bf16"] > size["int8"] > size["int4"]
    assert size["bf16"] * 2 == size["fp32"] and size["int8-kv"] == size["bf16"]
    assert rows["fp32"]["kl"] == 0 and rows["int4"]["kl"] > rows["int8"]["kl"]
    # int8 weights and an int8 KV cache cost little; int4 (group 128 on 64-wide rows) more
    assert rows["int8"]["bpb_excess_vs_bf16"] < 0.01
    assert rows["int8-kv"]["bpb_excess_vs_bf16"] < 0.01
    assert rows["int4"]["bits_per_byte"] > rows["int8"]["bits_per_byte"]
    targets = {t["scheme"]: t for t in data["targets"]}
    assert targets["int8"]["passed"] is True and targets["gptq"]["passed"] is None
    assert targets["int4"]["value"] == pytest.approx(rows["int4"]["decode_tps_vs_bf16"])


def test_quant_skip_switches(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    out = tmp_path / "q"
    rc = main(["bench", "quant", "--model", model, "--tokenizer", tok, "--schemes", "bf16,int8",
               "--skip-speed", "--skip-quality", "--output", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads((out / "quant.json").read_text())["rows"]
    assert [r["scheme"] for r in rows] == ["bf16", "int8"]
    assert all("decode_tps" not in r and "bits_per_byte" not in r for r in rows)
    assert rows[1]["size_bytes"] < rows[0]["size_bytes"]
    bad = ["bench", "quant", "--model", model, "--schemes", "int3", "--output", str(out)]
    assert main(bad) == 2


def test_targets_and_sizes() -> None:
    import torch

    from foudre.quant.qlinear import QuantLinear

    lin = QuantLinear.from_float(torch.randn(64, 256), None, 4, 128)
    # 64 x 256 4-bit codes, plus a scale and a zero point per group of 128 (float32 here)
    assert model_bytes(lin) == 64 * 128 + 2 * 64 * 2 * 4
    rows = [
        {"scheme": "bf16", "size_bytes": 100, "decode_tps": 10.0, "bits_per_byte": 1.0},
        {"scheme": "int8", "size_bytes": 50, "decode_tps": 15.0, "bits_per_byte": 1.005},
        {"scheme": "int4", "size_bytes": 30, "decode_tps": 19.0, "bits_per_byte": 1.1},
        {"scheme": "gptq", "size_bytes": 30, "decode_tps": 19.0, "bits_per_byte": 1.04},
    ]
    add_ratios(rows)
    got = {t["scheme"]: t for t in check_targets(rows)}
    assert got["int8"]["passed"] and math.isclose(got["int8"]["value"], 0.005)
    assert got["gptq"]["passed"] and got["awq"]["passed"] is None
    assert got["int4"]["passed"] is False and got["int4"]["shown"] == "1.90x"


def test_quant_text_calibration(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    out = tmp_path / "q"
    rc = main(["bench", "quant", "--model", model, "--tokenizer", tok, "--schemes",
               "bf16,mixed", "--calibration-docs", "4", "--max-docs", "2", "--skip-speed",
               "--output", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "quant.json").read_text())
    bf16, mixed = data["rows"]
    assert mixed["calibration"] == "4 train documents" and bf16["calibration"] is None
    assert mixed["size_bytes"] < bf16["size_bytes"]
    assert mixed["bpb_excess_vs_bf16"] < 0.2
    assert "first 4 train documents" in (out / "quant.md").read_text()

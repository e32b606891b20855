"""``foudre bench ablate`` and ``foudre bench sweep`` (in process) at a tiny scale on stories260K:
every row and point is written, and the robust effects hold."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from foudre.bench.ablate import DEFAULT_VARIANTS, PLOT_METRICS, Sizes, build_workload
from foudre.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_workloads_have_their_shapes() -> None:
    sizes = Sizes(scale=0.25, num_prompts=16, request_rate=10.0, max_model_len=512)
    chat = build_workload("main", sizes, 512)
    assert len(chat) == 16 and chat[0].arrival == 0 and chat[-1].arrival > 0
    assert all(4 <= w.output_len <= 128 for w in chat)
    assert all(w.arrival == 0 for w in build_workload("main-burst", sizes, 512))
    rag = build_workload("rag", sizes, 512)
    prefix = rag[0].prompt[:250]
    assert len(rag) == 8 and all(w.prompt[:250] == prefix for w in rag)
    inter = build_workload("interference", sizes, 512)
    assert [w.tag for w in inter] == ["short", "short", "long"] and inter[-1].after_tokens > 0
    assert len(inter[-1].prompt) == 500
    assert len(build_workload("interference-idle", sizes, 512)) == 2
    mixed = build_workload("mixed", sizes, 512)
    assert {w.tag for w in mixed} == {"chat", "rag"}
    with pytest.raises(ValueError):
        build_workload("nope", sizes, 512)


def test_chat_output_length_distributions() -> None:
    def lens(dist: str) -> np.ndarray:
        sizes = Sizes(num_prompts=4000, output_dist=dist, max_model_len=2048)
        return np.array([w.output_len for w in build_workload("chat", sizes, 512)])

    uniform, loguniform = lens("uniform"), lens("loguniform")
    for x in (uniform, loguniform):
        assert x.min() >= 16 and x.max() <= 512
    # uniform over 16..512: mean 264; log-uniform: mean 497 / ln(513 / 16) = 143, median 91
    assert abs(uniform.mean() - 264) < 8 and abs(loguniform.mean() - 143) < 6
    assert abs(np.median(loguniform) - 91) < 8
    # every doubling equally likely: 16-32, 32-64, ..., 256-512 hold ~1/5 each
    counts = np.histogram(loguniform, bins=[16, 32, 64, 128, 256, 513])[0]
    assert np.all(np.abs(counts / len(loguniform) - 0.2) < 0.03)
    with pytest.raises(ValueError, match="output_dist"):
        build_workload("chat", Sizes(output_dist="zipf"), 512)


def test_ablate_tiny(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    out = tmp_path / "ablate"
    # the draft row speculates with stories260K itself (quantized to int8) as the draft
    rc = main(["bench", "ablate", "--model", model, "--tokenizer", tok, "--scale", "0.12",
               "--num-prompts", "16", "--request-rate", "400", "--output", str(out),
               "--speculative-model", model, "--speculative-quantization", "int8"])  # fmt: skip
    assert rc == 0
    md = (out / "ablate.md").read_text()
    data = json.loads((out / "ablate.json").read_text())
    assert (out / "ablate.png").stat().st_size > 10_000
    assert "machine" in md and "command" in md and "date" in md
    rows = {(r["experiment"], r["variant"]): r for r in data["rows"]}
    assert len(rows) == len(DEFAULT_VARIANTS)
    for v in DEFAULT_VARIANTS:
        row = rows[(v.experiment, v.name)]
        assert f"| {v.experiment} | {v.name} |" in md
        assert row["failed"] == 0 and row["completed"] > 0
        assert row["output_throughput"] > 0 and row["peak_kv_mib"] > 0
        assert row["max_running"] >= 1
        if not v.experiment.startswith("sharing"):  # those report blocks, not latencies
            assert row["mean_ttft_ms"] > 0
        assert set(PLOT_METRICS) <= set(row["ratio"])
        if v.reference:
            assert row["ratio"]["output_throughput"] == pytest.approx(1.0)
    paged, contiguous = rows[("paging", "paged (full)")], rows[("paging", "contiguous")]
    assert paged["num_kv_blocks"] == contiguous["num_kv_blocks"]
    assert paged["max_running"] > contiguous["max_running"]
    # 4 max_model_len sequences of KV: the contiguous baseline seats at most 4
    assert contiguous["max_running"] <= 4
    on, off = rows[("prefix", "prefix caching on (full)")], rows[("prefix", "prefix caching off")]
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_hits"] == 0
    chunked = rows[("chunked", "chunked prefill on (full)")]
    assert "long" in chunked["mean_ttft_ms_by_tag"]
    assert "long" not in rows[("chunked", "idle (no long prompt)")]["mean_ttft_ms_by_tag"]
    draft, ngram = rows[("speculative", "draft model")], rows[("speculative", "n-gram lookup")]
    assert rows[("speculative", "no speculation (full)")]["spec_draft_tokens"] == 0
    assert draft["spec_draft_tokens"] > 0 and draft["spec_acceptance_rate"] > 0.5
    assert draft["spec_mean_acceptance_length"] > 1.5
    assert ngram["spec_acceptance_rate"] is None or 0 <= ngram["spec_acceptance_rate"] <= 1
    assert "**speculative decoding**" in md
    for name in ("sharing-n8", "sharing-beam4"):
        cow, copies = (r for r in data["rows"] if r["experiment"] == name)
        assert cow["reference"] and cow["peak_kv_blocks"] < copies["peak_kv_blocks"]
        assert cow["num_cow_copies"] > 0 and copies["num_cow_copies"] > cow["num_cow_copies"]
    assert "**n=8 samples**" in md and "**beam search of width 4**" in md
    static = rows[("batching", "static")]
    assert (
        static["total_output_tokens"]
        == rows[("batching", "continuous (full)")]["total_output_tokens"]
    )


def test_ablate_subset_and_bad_experiment(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    out = tmp_path / "sub"
    rc = main(["bench", "ablate", "--model", model, "--tokenizer", tok, "--scale", "0.1",
               "--num-prompts", "4", "--experiments", "prefix", "--request-rate", "400",
               "--output", str(out)])  # fmt: skip
    assert rc == 0
    assert [r["experiment"] for r in json.loads((out / "ablate.json").read_text())["rows"]] == [
        "prefix",
        "prefix",
    ]
    assert main(["bench", "ablate", "--model", model, "--experiments", "nope"]) == 2


def test_sweep_in_process(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    out = tmp_path / "sweep"
    rc = main(["bench", "sweep", "--model", model, "--tokenizer", tok, "--rates", "50", "inf",
               "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
               "--output", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "sweep.json").read_text())
    assert [p["request_rate"] for p in data["points"]] == [50.0, "inf"]
    for p in data["points"]:
        assert p["completed"] == 6 and p["total_output_tokens"] == 48
        assert p["mean_ttft_ms"] > 0 and p["mean_tpot_ms"] > 0
    assert (out / "sweep.png").stat().st_size > 10_000
    assert "| 50.0 |" in (out / "sweep.md").read_text()

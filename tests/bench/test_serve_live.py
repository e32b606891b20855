"""``foudre bench serve`` and ``foudre bench sweep --base-url`` against a live ``foudre serve``
(a subprocess on a free loopback port, always stopped)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from foudre.cli import main
from tests.server.conftest import MODEL, ServerProcess, start_server


@pytest.fixture(scope="module")
def live_server() -> Iterator[ServerProcess]:
    # speculating with an int8 copy of itself, so that the run reports acceptance figures
    srv = start_server(
        "--max-num-seqs", "16", "--speculative-model", str(MODEL),
        "--speculative-quantization", "int8",
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def _served_name(srv: ServerProcess) -> str:
    return srv.ready_line.split("foudre: serving ", 1)[1].split(" at ", 1)[0]


def test_bench_serve_against_live_server(live_server: ServerProcess, tmp_path: Path) -> None:
    result, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(["bench", "serve", "--base-url", live_server.url, "--model",
               _served_name(live_server), "--num-prompts", "30", "--request-rate", "60",
               "--input-len", "24", "--output-len", "12", "--disable-tqdm",
               "--save-result", str(result), "--plot", str(plot)])  # fmt: skip
    assert rc == 0
    data = json.loads(result.read_text())
    assert data["completed"] == 30 and data["failed"] == 0
    assert data["total_output_tokens"] == 30 * 12  # ignore_eos: exactly the asked length
    assert data["mean_ttft_ms"] > 0 and data["mean_tpot_ms"] > 0
    assert plot.stat().st_size > 10_000 and result.with_suffix(".md").exists()
    assert data["spec_draft_tokens"] > 0
    assert 0 < data["spec_acceptance_rate"] <= 1 and data["spec_mean_acceptance_length"] > 1
    assert "Mean acceptance length" in result.with_suffix(".md").read_text()


def test_sweep_against_live_server(live_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    rc = main(["bench", "sweep", "--base-url", live_server.url, "--model",
               _served_name(live_server), "--rates", "20", "80", "--num-prompts", "8",
               "--input-len", "16", "--output-len", "8", "--output", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "sweep.json").read_text())
    assert [p["completed"] for p in data["points"]] == [8, 8]
    assert data["target"] == live_server.url
    assert (out / "sweep.png").exists() and (out / "sweep.md").exists()

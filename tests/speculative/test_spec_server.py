"""``foudre serve --speculative-model``: same greedy text as without speculation, streamed, and
the speculative counters on /metrics."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import GREEDY, MODEL, start_server


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_serve_with_draft_model_streams_the_same_greedy_text() -> None:
    # stories260K speculating with an int8 copy of itself as the draft
    srv = start_server(
        "--speculative-model", str(MODEL), "--speculative-quantization", "int8",
        "--num-speculative-tokens", "3",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"].startswith(GREEDY)
            pieces = []
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
            assert "".join(pieces) == r.json()["choices"][0]["text"]
            sampled = {**body, "temperature": 0.9, "n": 3, "seed": 1}
            assert http.post("/v1/completions", json=sampled).status_code == 200
            text = http.get("/metrics").text
            drafted = _metric(text, "foudre:spec_decode_num_draft_tokens_total")
            accepted = _metric(text, "foudre:spec_decode_num_accepted_tokens_total")
            assert 0 < accepted <= drafted
            assert _metric(text, "foudre:spec_decode_mean_acceptance_length") > 1.0
            assert 'foudre:spec_decode_num_accepted_tokens_per_pos_total{position="1"}' in text
    finally:
        assert srv.stop() == 0

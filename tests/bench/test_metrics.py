"""Serving metric arithmetic on synthetic traces whose answers are known by hand."""

from __future__ import annotations

import pytest

from foudre.bench.metrics import RequestResult, compute_metrics, meets_slos, request_arrays


def ok(ttft: float, latency: float, output_len: int, itls: list[float] | None = None,
       input_len: int = 10) -> RequestResult:  # fmt: skip
    return RequestResult(input_len, output_len, 0.0, ttft, itls or [], latency, True, "")


def failed(error: str = "HTTP 500: boom", input_len: int = 100) -> RequestResult:
    return RequestResult(input_len, 0, 0.0, 0.9, [5.0], 9.0, False, error)


def test_mean_vs_median_and_percentiles_on_skewed_set() -> None:
    results = [ok(0.010, 1.0, 2) for _ in range(4)] + [ok(1.000, 2.0, 2)]
    m = compute_metrics(results, duration=10.0)
    assert m["mean_ttft_ms"] == pytest.approx(208.0)
    assert m["median_ttft_ms"] == pytest.approx(10.0)
    # linear interpolation over sorted [10, 10, 10, 10, 1000]: rank 3.6 and 3.96
    assert m["p90_ttft_ms"] == pytest.approx(604.0)
    assert m["p99_ttft_ms"] == pytest.approx(960.4)
    assert m["std_ttft_ms"] == pytest.approx(396.0)


def test_percentiles_linear_interpolation() -> None:
    results = [ok(i / 1000.0, 1.0, 1) for i in range(1, 101)]  # 1..100 ms
    m = compute_metrics(results, duration=1.0)
    assert m["median_ttft_ms"] == pytest.approx(50.5)
    assert m["p90_ttft_ms"] == pytest.approx(90.1)
    assert m["p99_ttft_ms"] == pytest.approx(99.01)


def test_tpot_excludes_single_token_and_failed_requests() -> None:
    results = [
        ok(0.1, 1.0, 10),  # (1.0 - 0.1) / 9 = 100 ms
        ok(0.1, 0.7, 4),  # (0.7 - 0.1) / 3 = 200 ms
        ok(0.1, 0.1, 1),  # no TPOT
        failed(),
    ]
    m = compute_metrics(results, duration=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["median_tpot_ms"] == pytest.approx(150.0)
    assert results[2].tpot is None and results[3].tpot is None


def test_itl_pools_gaps_of_all_successful_requests() -> None:
    results = [ok(0.1, 0.2, 3, [0.010, 0.020]), ok(0.1, 0.2, 2, [0.030]), failed()]
    m = compute_metrics(results, duration=1.0)
    assert m["mean_itl_ms"] == pytest.approx(20.0)
    assert m["median_itl_ms"] == pytest.approx(20.0)
    assert m["p99_itl_ms"] == pytest.approx(29.8)
    assert request_arrays(results)["itls"] == [[0.010, 0.020], [0.030], []]


def test_goodput_needs_every_slo() -> None:
    slos = {"ttft_ms": 100.0, "tpot_ms": 50.0}
    results = [
        ok(0.05, 0.05 + 9 * 0.040, 10),  # meets both
        ok(0.05, 0.05 + 9 * 0.060, 10),  # meets TTFT, not TPOT: not good
        ok(0.15, 0.15 + 9 * 0.010, 10),  # meets TPOT, not TTFT
        ok(0.05, 0.05, 1),  # one token: no TPOT to violate
        failed(),
    ]
    assert [meets_slos(r, slos) for r in results] == [True, False, False, True, False]
    m = compute_metrics(results, duration=2.0, slos=slos)
    assert m["goodput"] == pytest.approx(1.0)
    assert "goodput" not in compute_metrics(results, duration=2.0)
    assert compute_metrics(results, 2.0, {"e2el_ms": 250.0})["goodput"] == pytest.approx(1.0)


def test_throughputs_and_failed_requests() -> None:
    results = [
        ok(0.1, 1.0, 5, input_len=10),
        ok(0.2, 2.0, 15, input_len=20),
        failed(input_len=1000),
    ]
    m = compute_metrics(results, duration=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["duration"] == 4.0
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 20)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(12.5)
    # the failed request's 0.9 s TTFT and 9 s latency are not in the statistics
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(1500.0)
    arrays = request_arrays(results)
    assert arrays["errors"] == ["", "", "HTTP 500: boom"]
    assert arrays["ttfts"] == [0.1, 0.2, None]
    assert arrays["e2els"] == [1.0, 2.0, None]
    assert arrays["output_lens"] == [5, 15, 0]
    assert arrays["input_lens"] == [10, 20, 1000]


def test_all_keys_and_empty_statistics() -> None:
    m = compute_metrics([failed(), failed()], duration=1.0, slos={"ttft_ms": 1.0})
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert m[f"{stat}_{metric}_ms"] is None
    assert (m["completed"], m["failed"], m["goodput"]) == (0, 2, 0.0)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        compute_metrics([ok(0.1, 1.0, 2)], duration=0.0)
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_metrics([ok(0.1, 1.0, 2)], duration=1.0, slos={"latency": 1.0})

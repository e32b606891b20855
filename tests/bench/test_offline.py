"""The replay driver's timing arithmetic and ``foudre bench throughput`` / ``latency`` end to end,
on stories260K."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from foudre.bench.metrics import compute_metrics
from foudre.bench.offline import WorkItem, replay, replay_summary
from foudre.cli import main
from foudre.config import EngineConfig
from foudre.engine.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(stories_paths: tuple[str, str], **kw: object) -> LLMEngine:
    model, tok = stories_paths
    return LLMEngine(EngineConfig(model=model, tokenizer=tok, **kw))  # type: ignore[arg-type]


def _prompt(k: int, n: int = 12) -> list[int]:
    return [10 + (7 * k + 3 * j) % 400 for j in range(n)]


def test_replay_respects_arrivals_and_times_tokens(stories_paths: tuple[str, str]) -> None:
    engine = _engine(stories_paths)
    work = [WorkItem(_prompt(0), 6, arrival=0.0), WorkItem(_prompt(1), 5, arrival=0.25)]
    t0 = time.monotonic()
    rep = replay(engine, work)
    wall = time.monotonic() - t0
    assert [r.success for r in rep.results] == [True, True]
    first, second = rep.results
    assert first.start == pytest.approx(0.0, abs=0.05)
    assert second.start >= 0.25 - 1e-6  # never added before its time
    assert second.start < 0.25 + 0.1
    for r, item in zip(rep.results, work, strict=True):
        assert r.output_len == item.output_len
        assert r.input_len == len(item.prompt)
        assert len(r.itls) == item.output_len - 1
        assert r.ttft > 0 and all(g >= 0 for g in r.itls)
        assert r.latency == pytest.approx(r.ttft + sum(r.itls), abs=1e-9)
    assert rep.duration <= wall + 1e-6
    assert rep.duration >= second.start + second.latency - 1e-6
    assert rep.max_running >= 1 and rep.num_steps >= 10
    assert 0 < rep.peak_kv_usage <= 1 and rep.peak_rss_bytes > 0
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    summary = replay_summary(rep)
    assert summary["completed"] == 2 and summary["total_output_tokens"] == 11


def test_replay_ttft_counts_queueing(stories_paths: tuple[str, str]) -> None:
    """One seat: each request waits for the previous one, and that wait is in its TTFT."""
    engine = _engine(stories_paths, max_num_seqs=1)
    work = [WorkItem(_prompt(k), 8) for k in range(3)]
    rep = replay(engine, work)
    r = rep.results
    assert rep.max_running == 1
    for prev, nxt in itertools.pairwise(r):
        assert nxt.start == pytest.approx(0.0, abs=0.05)
        # all arrive at once, so the later one's first token comes after the earlier one's last
        assert nxt.ttft + nxt.start >= prev.latency + prev.start
    m = compute_metrics(r, rep.duration)
    assert m["completed"] == 3 and m["mean_ttft_ms"] > r[0].ttft * 1e3


def test_replay_after_tokens_and_static_flush(stories_paths: tuple[str, str]) -> None:
    """A token-triggered request arrives after the run produced that many tokens; a static
    batch that can never fill still runs once everything has been added."""
    engine = _engine(stories_paths, scheduling_policy="static", max_num_seqs=8)
    work = [WorkItem(_prompt(k), 10, tag="short") for k in range(2)]
    work.append(WorkItem(_prompt(9, 40), 3, after_tokens=6, tag="long"))
    rep = replay(engine, work)
    assert all(r.success for r in rep.results)
    long = rep.select("long")[0]
    shorts = rep.select("short")
    assert long.start > min(s.ttft for s in shorts)
    assert engine.scheduler.policy.flush is False  # set_draining(False) after the replay


def test_replay_rejects_busy_engine(stories_paths: tuple[str, str]) -> None:
    from foudre.sampling_params import SamplingParams

    engine = _engine(stories_paths)
    engine.add_request(_prompt(0), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        replay(engine, [WorkItem(_prompt(1), 2)])


def test_bench_throughput_cli(
    stories_paths: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, tok = stories_paths
    out = tmp_path / "tput.json"
    rc = main(["bench", "throughput", "--model", model, "--tokenizer", tok, "--num-prompts", "6",
               "--input-len", "16", "--output-len", "12", "--range-ratio", "0.5",
               "--save-result", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    for key in ("requests/s", "output tokens/s", "total tokens/s", "peak KV usage", "preemptions"):
        assert key in text
    res = json.loads(out.read_text())
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "peak_kv_cache_usage", "num_preemptions", "machine", "date"):  # fmt: skip
        assert key in res
    assert res["num_prompts"] == 6 and res["output_tokens_per_s"] > 0
    assert 6 * 6 <= res["total_output_tokens"] <= 6 * 18


def test_bench_latency_cli(
    stories_paths: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, tok = stories_paths
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", model, "--tokenizer", tok, "--batch-size", "3",
               "--input-len", "16", "--output-len", "10", "--num-iters", "2",
               "--bandwidth", "20", "--save-result", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "TPOT" in text and "roofline" in text
    res = json.loads(out.read_text())
    assert res["num_decode_steps"] == 2 * 9
    assert res["median_tpot_ms"] > 0 and res["mean_ttft_ms"] > 0
    assert res["bandwidth_gb_s"] == 20
    assert res["roofline_fraction"] == pytest.approx(
        res["weight_bytes"] / (res["median_tpot_ms"] / 1e3) / 20e9
    )


def test_weight_bytes_counts_tied_head_once() -> None:
    import torch

    from foudre.bench.roofline import weight_bytes

    class Toy(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(100, 8)
            self.proj = torch.nn.Linear(8, 8, bias=False)
            self.lm_head = torch.nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    assert weight_bytes(Toy(tied=False)) == (64 + 800) * 4
    assert weight_bytes(Toy(tied=True)) == (64 + 800) * 4


def test_timed_batch_pairs_each_decode_step_with_a_probe(stories_paths: tuple[str, str]) -> None:
    """The paired roofline: one probe call after each pure decode step, none after prefill."""
    from foudre.bench.offline import timed_batch
    from foudre.bench.roofline import matvec_probe

    engine = _engine(stories_paths)
    probe = matvec_probe(mib=4)
    samples: list[float] = []
    ttfts, decode = timed_batch(
        engine, [_prompt(0), _prompt(1, 20)], 7, lambda: samples.append(probe())
    )
    assert len(ttfts) == 2 and len(decode) == 6  # 7 tokens: the first from prefill
    assert len(samples) == len(decode) and all(s > 0 for s in samples)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_probe_reads_past_the_last_level_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bandwidth probe's matrix is four times the CPU's largest cache (sysfs: the highest
    level whose size reads), 512 MiB at least, and 512 MiB on a GPU; ``measure_bandwidth`` and
    ``matvec_probe`` read that much unless told otherwise."""
    from foudre.bench import roofline

    assert roofline.probe_mib() >= 512
    assert roofline.probe_mib() << 20 >= 4 * roofline.last_level_cache_bytes()
    assert roofline.probe_mib("cuda") == 512
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 480 << 20)
    assert roofline.probe_mib() == 1920
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: (32 << 20) + 1)
    assert roofline.probe_mib() == 512
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: (300 << 20) + 1)
    assert roofline.probe_mib() == 1201  # (rounded up)
    sizes: list[int] = []
    real_samplers = roofline._matvec_samplers
    monkeypatch.setattr(roofline, "probe_mib", lambda device=None: 4)
    monkeypatch.setattr(
        roofline, "_matvec_samplers", lambda mib, dev: sizes.append(mib) or real_samplers(mib, dev)
    )
    assert roofline.measure_bandwidth(repeats=1) > 0 and roofline.matvec_probe()() > 0
    assert roofline.measure_bandwidth(2, repeats=1) > 0
    assert sizes == [4, 4, 2]
    monkeypatch.undo()

    def caches(*entries: tuple[int, int, str]) -> int:
        fake = tmp_path / f"cache{len(list(tmp_path.iterdir()))}"
        for index, level, text in entries:
            (fake / f"index{index}").mkdir(parents=True)
            (fake / f"index{index}" / "level").write_text(f"{level}\n")
            (fake / f"index{index}" / "size").write_text(f"{text}\n")
        real = roofline.Path
        sysfs = "/sys/devices/system/cpu/cpu0/cache"
        with monkeypatch.context() as m:
            m.setattr(roofline, "Path", lambda p: fake if p == sysfs else real(p))
            return roofline.last_level_cache_bytes()

    # cpu0's caches as sysfs lists them, in any order: the highest level counts
    assert caches((0, 1, "48K"), (2, 2, "2048K"), (3, 3, "491520K"), (4, 2, "1M")) == 480 << 20
    assert caches((3, 3, "32M"), (0, 1, "32K"), (2, 2, "1M")) == 32 << 20
    assert caches((1, 2, "2M"), (3, 4, "1G")) == 1 << 30
    assert caches((0, 2, "2M"), (1, 3, "unknown")) == 2 << 20  # (an L3 whose size does not read)
    assert caches() == 0


def test_the_peak_resident_memory_can_be_reset() -> None:
    """A buffer held and freed (a bandwidth probe's matrix, a map of its own) leaves the peak
    once it is reset."""
    from foudre.bench.offline import peak_rss_bytes, reset_peak_rss
    from foudre.native import huge_pages

    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs")
    before = peak_rss_bytes()
    buffer = huge_pages.empty(256 << 20).fill_(1)  # 256 MiB, every page touched
    assert peak_rss_bytes() >= before + (200 << 20)
    del buffer
    assert reset_peak_rss()
    assert peak_rss_bytes() < before + (100 << 20)

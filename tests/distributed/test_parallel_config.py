"""Parallel configurations that cannot run fail at start, typed, before any worker starts; and
the pieces of the layout (ranks, stages, micro-batches) hold their promises."""

from __future__ import annotations

import itertools
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.config import EngineConfig
from foudre.distributed.errors import ParallelConfigError
from foudre.distributed.groups import check_devices
from foudre.distributed.plan import ParallelPlan
from foudre.distributed.runner import micro_batches
from tests.conftest import make_hf_model

BAD: dict[str, tuple[str, dict[str, Any], int, int, str, str]] = {
    "heads": ("llama", {}, 3, 1, "tensor_parallel_size", "does not divide the 4 attention heads"),
    "kv-heads": (
        "llama",
        {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6},
        4,
        1,
        "tensor_parallel_size",
        "6 KV heads",
    ),
    "experts": (
        "mixtral",
        {"num_local_experts": 3, "num_experts_per_tok": 2},
        2,
        1,
        "tensor_parallel_size",
        "num_experts 3",
    ),
    "stages": ("llama", {}, 1, 3, "pipeline_parallel_size", "exceeds the model's 2 layers"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sizes_fail_before_any_worker(tmp_path: Path, case: str) -> None:
    arch, overrides, t, p, param, words = BAD[case]
    path = make_hf_model(tmp_path / case, arch, **overrides)
    with pytest.raises(ParallelConfigError, match=words) as info:
        LLM(str(path), tensor_parallel_size=t, pipeline_parallel_size=p, skip_tokenizer_init=True)
    assert info.value.param == param
    assert multiprocessing.active_children() == []


def test_calibrated_quantization_is_refused(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")
    with pytest.raises(ParallelConfigError, match="gptq") as info:
        LLM(str(path), tensor_parallel_size=2, quantization="gptq", skip_tokenizer_init=True)
    assert info.value.param == "quantization"


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ParallelConfigError, match="2 ranks need 2 CUDA devices"):
        check_devices(torch.device("cuda"), 2)
    check_devices(torch.device("cpu"), 8)  # the CPU runs any number of ranks


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_sizes_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: 0})


def test_layout_puts_the_engine_on_the_last_stage() -> None:
    t, p = 2, 3
    plans = [ParallelPlan(r, t, p) for r in range(t * p)]
    assert [(x.stage, x.tp_rank) for x in plans] == [(2, 0), (2, 1), (0, 0), (0, 1), (1, 0), (1, 1)]
    for x in plans:
        assert x.rank_of(x.stage, x.tp_rank) == x.rank
        assert x.rank in x.tp_ranks(x.stage)
    # 7 layers over 3 stages: consecutive, every layer once, the spare one to stage 0
    ranges = sorted((x.layers(7) for x in plans[::t]), key=lambda r: r.start)
    assert [list(r) for r in ranges] == [[0, 1, 2], [3, 4], [5, 6]]


def test_kv_heads_are_replicated_when_ranks_outnumber_them(tmp_path: Path) -> None:
    from foudre.loading.hf import load_hf_config

    cfg = load_hf_config(make_hf_model(tmp_path / "m", "llama"))  # 4 heads, 2 KV heads, dim 16
    rows = []
    for r in range(4):
        chosen = ParallelPlan(r, 4, 1).select(
            cfg, "model.layers.0.self_attn.k_proj.weight", (32, 64)
        )
        assert chosen is not None and chosen[1] is not None
        rows.append(chosen[1][0])
    assert rows == [slice(0, 16), slice(0, 16), slice(16, 32), slice(16, 32)]
    local = ParallelPlan(3, 4, 1).local_config(cfg)
    assert (local.num_attention_heads, local.num_key_value_heads) == (1, 1)


@pytest.mark.parametrize(
    ("sizes", "count"),
    [([5], 2), ([1, 1, 1, 1], 2), ([30, 1, 1, 1], 2), ([1, 1, 1, 30], 3), ([4, 4, 4, 4, 4], 4)],
)
def test_micro_batches_are_consecutive_and_balanced(sizes: list[int], count: int) -> None:
    cuts = micro_batches(sizes, count)
    assert cuts[0][0] == 0 and cuts[-1][1] == len(sizes)
    assert all(a < b for a, b in cuts)
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(cuts))
    assert len(cuts) == min(count, len(sizes))
    if sizes == [4, 4, 4, 4, 4]:
        assert [b - a for a, b in cuts] == [2, 1, 1, 1]


def test_one_device_keeps_its_runner(tmp_path: Path) -> None:
    """At T = P = 1 the engine steps its ModelRunner itself: no executor, no process group."""
    from foudre.runner.model_runner import ModelRunner

    llm = LLM(str(make_hf_model(tmp_path / "m", "llama")), skip_tokenizer_init=True)
    assert type(llm.engine.runner) is ModelRunner
    assert not torch.distributed.is_initialized()
    assert llm.engine.fatal_error is None and llm.engine.healthy


def test_flags_reach_the_config() -> None:
    from foudre.cli import build_parser
    from foudre.engine.options import engine_config_from

    flags = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]
    flags += ["--distributed-timeout-s", "7.5"]
    for command in (["generate", "--prompt", "x"], ["serve"]):
        args = build_parser().parse_args([*command, *flags])
        config = engine_config_from(args)
        assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 3)
        assert config.distributed_timeout_s == 7.5


def test_a_dropped_engine_frees_its_workers_and_groups(tmp_path: Path) -> None:
    """An ``LLM`` dropped without ``shutdown()`` stops its workers and leaves the process
    groups (the watcher thread holds the workers, not the executor), so a second parallel
    engine can start in the same process; two at once are refused with a clear error."""
    import gc

    import torch.distributed as dist

    path = make_hf_model(tmp_path / "m", "llama", num_hidden_layers=2)
    options: dict[str, Any] = dict(skip_tokenizer_init=True, num_kv_blocks=40)
    llm = LLM(str(path), tensor_parallel_size=2, **options)
    workers = list(llm.engine._parallel._workers.processes)  # type: ignore[union-attr]
    with pytest.raises(ParallelConfigError, match="already holds a parallel engine"):
        LLM(str(path), tensor_parallel_size=2, **options)
    del llm
    gc.collect()
    assert not dist.is_initialized()
    assert all(not w.is_alive() for w in workers)
    again = LLM(str(path), tensor_parallel_size=2, **options)
    try:
        out = again.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        again.shutdown()
    assert not dist.is_initialized()

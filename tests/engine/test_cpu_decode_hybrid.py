"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``) on state-space and
hybrid stacks: Mamba-2 (recurrent layers only), Bamba (Mamba-2 and attention layers, partial
RoPE) and Granite 4.0's hybrids (multipliers on the embedding, each sublayer and the attention
scores; RoPE or none; a dense MLP, or experts with a shared MLP beside them) against the
model's Python path: the same logits, KV pages, recurrent states (conv windows and SSM states,
in every slot of the pools) and routers' counts, bit for bit, padding rows and prefix-cache
snapshots of decode rows included; and greedy generation through ``LLM`` the same with and
without the native step (bfloat16 and int8)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention import cpu_paged
from foudre.attention.cache_spec import RecurrentCache, pages_of
from foudre.layers import fused, ssm_ops
from foudre.layers.mamba import GatedRMSNorm
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.model_runner import ModelRunner
from foudre.runner.step import ForwardStep
from tests.oracles.ssm_models import prompt, save_random
from tests.oracles.test_bamba import BASE as BAMBA
from tests.oracles.test_granite_moe_hybrid import BASE as GRANITE
from tests.oracles.test_mamba2 import BASE as MAMBA2
from tests.oracles.test_mamba2 import CASES as MAMBA2_CASES

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None
    or not cpu_paged.available()
    or ssm_ops.library() is None,
    reason="neither AVX-512 nor AVX2, or no C++ compiler",
)

DENSE_GRANITE = {**GRANITE, "num_local_experts": 0}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2": ("Mamba2", MAMBA2),
    # one group, a tied head, no conv bias, projections with biases
    "mamba2-tied-bias": ("Mamba2", {**MAMBA2, **MAMBA2_CASES["tied-onegroup"]}),
    "bamba": ("Bamba", BAMBA),  # RoPE over half of each head
    "granite-rope": ("GraniteMoeHybrid", {**DENSE_GRANITE, "position_embedding_type": "rope"}),
    "granite-nope": ("GraniteMoeHybrid", DENSE_GRANITE),
    # experts (top-2 of 4) with the shared MLP beside them, no RoPE
    "granite-moe": ("GraniteMoeHybrid", GRANITE),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, config = MODELS[request.param]
    return save_random(
        family, {**config, "max_position_embeddings": 512}, tmp_path_factory.mktemp(request.param)
    )


def _llm(path: Path, dtype: str, **kwargs: Any) -> LLM:
    return LLM(
        str(path),
        dtype=dtype,
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        max_model_len=256,
        **kwargs,
    )


def _pools(runner: ModelRunner) -> list[torch.Tensor]:
    """Every tensor of the runner's caches: KV pages (``pages_of``: a latent cache's once), conv
    windows, SSM states."""
    held: list[torch.Tensor] = []
    for c in runner.kv_caches:
        held += list(c) if isinstance(c, RecurrentCache) else pages_of(c)
    return held


def _written(runner: ModelRunner) -> list[torch.Tensor]:
    """What the real rows of a step write, copied: every page and state slot but the padding
    rows' (their block and state slot, which padding rows share: with more than two threads
    their order, and so what is left there, varies from run to run in either path)."""
    kept: list[torch.Tensor] = []
    for c in runner.kv_caches:
        if isinstance(c, RecurrentCache):
            pad = runner.padding_state_slot
            kept += [torch.cat([t[:pad], t[pad + 1 :]]) for t in c]
        else:
            pad = runner.padding_block
            kept += [torch.cat([p[:pad], p[pad + 1 :]]) for p in pages_of(c)]
    return kept


def _counted(native: NativeDecode) -> list[int]:
    """The steps the native layers run from now on (one entry each)."""
    calls: list[int] = []
    call = native._call  # what run and run_logits call
    native._call = lambda step, logits: calls.append(1) or call(step, logits)  # type: ignore[method-assign]
    return calls


def _added(runner: ModelRunner, before: dict[int, list[int]]) -> dict[int, list[int]]:
    """What the routers counted (tokens per expert, by layer) since ``before``."""
    now = runner.model.moe_expert_tokens()
    return {i: [b - a for a, b in zip(before[i], c, strict=True)] for i, c in now.items()}


def _both_paths(
    runner: ModelRunner, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's logits by the native path and by Python from the same caches; each path's
    caches after it equal, every slot and page (a stray write anywhere shows)."""
    before = [t.clone() for t in _pools(runner)]
    counts = runner.model.moe_expert_tokens()
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    calls = _counted(native)
    try:
        got = runner.forward(*args, **kwargs)
    finally:
        del native._call
    assert calls == [1]  # it ran natively
    after = _written(runner)
    native_counts, counts = _added(runner, counts), runner.model.moe_expert_tokens()
    for t, b in zip(_pools(runner), before, strict=True):
        t.copy_(b)
    runner.decode_path = None
    try:
        want = runner.forward(*args, **kwargs)
    finally:
        runner.decode_path = native
    for a, b in zip(after, _written(runner), strict=True):
        assert torch.equal(a, b)
    assert native_counts == _added(runner, counts)  # the routers counted the same tokens
    assert got is not None and want is not None
    return got, want


def check_decode_steps(runner: ModelRunner) -> None:
    """Prefill three prompts (state slots out of order, blocks out of order) in Python, then
    decode steps of 1, 3 and 3 + 2 padding rows natively, two of them leaving a snapshot of a
    row's state: logits, KV pages and every state slot equal the Python path's, bit for bit
    (the native-step tests of every recurrent family)."""
    assert isinstance(runner.decode_path, NativeDecode)
    lens = [5, 17, 33]
    tables = [[7, 3, 9], [1, 12, 4], [20, 2, 30]]
    slots = [4, 0, 2]
    prompts = [prompt(n, 7 + n) for n in lens]
    with torch.inference_mode():
        logits = runner.forward(tables, [0] * 3, prompts, [1] * 3, state_slots=slots)
        assert logits is not None
        for rows, pad, snapshots in ((1, 0, []), (3, 0, [(1, 0, 6)]), (3, 2, [(2, 0, 5)])):
            new = [[int(t)] for t in logits.argmax(-1)[:rows]] + [[0]] * pad
            step_tables = tables[:rows] + [[runner.padding_block]] * pad
            args = (step_tables, lens[:rows] + [0] * pad, new, [1] * (rows + pad), pad)
            got, want = _both_paths(
                runner, *args, state_slots=slots[:rows], state_snapshots=snapshots
            )
            got, want = got[:rows], want[:rows]  # (the padding rows share a slot: see _written)
            assert torch.equal(got, want), (rows, (got - want).abs().max())
            lens[:rows] = [n + 1 for n in lens[:rows]]
            logits = torch.cat([got[:rows], logits[rows:]])
            runner.forward(*args, state_slots=slots[:rows], state_snapshots=snapshots)


def check_generate_both_ways(
    make: Callable[[], LLM],
    prompts: list[list[int]],
    params: SamplingParams,
    check: Callable[[NativeDecode], object] = lambda path: None,
) -> None:
    """Greedy generation through two ``LLM``s that ``make`` builds, one with the native step
    (which ran: ``check`` also looks at it) and one without: the same tokens."""
    outs = []
    for native in (True, False):
        llm = make()
        runner = llm.engine.runner
        path = runner.decode_path
        assert isinstance(path, NativeDecode)
        check(path)
        calls = _counted(path)
        if not native:
            runner.decode_path = None
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert bool(calls) == native
    assert outs[0] == outs[1]


def check_generate_with_snapshots(
    model_path: Path,
    quantization: str | None,
    check: Callable[[NativeDecode], object] = lambda path: None,
) -> None:
    """``check_generate_both_ways`` in bfloat16 with prefix caching on (decode rows leave
    snapshots) and ``quantization``'s projections (the native step holding quantized ones
    exactly then; ``check`` looks at it too); a model whose experts ``quantization`` replaces
    has no native step (those layers run in Python)."""

    def make() -> LLM:
        return _llm(
            model_path,
            "bfloat16",
            enable_prefix_caching=True,
            state_snapshot_interval=32,
            quantization=quantization,
        )

    built = [make()]  # (the first run's, looked at here)
    runner = built[0].engine.runner
    if quantization and runner.model.moe_blocks():
        assert runner.decode_path is None  # quantized experts: the Python path's
        return
    prompts = [prompt(n, 3 + n) for n in (5, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def checked(path: NativeDecode) -> None:
        assert bool(path.checks.quantized) == bool(quantization)
        check(path)

    check_generate_both_ways(lambda: built.pop() if built else make(), prompts, params, checked)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_equals_the_python_path(model_path: Path, dtype: str) -> None:
    """``check_decode_steps`` on each hybrid and Mamba-2 model, float32 and bfloat16."""
    check_decode_steps(_llm(model_path, dtype).engine.runner)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_generate_is_the_same_with_and_without_native_decode(
    model_path: Path, quantization: str | None
) -> None:
    """Greedy generation through ``LLM`` (batched prompts, prefix caching on, so that decode
    rows leave snapshots; bfloat16, or int8 projections) gives the same tokens with the native
    step as without, and the native step ran (not where the experts are quantized: those
    layers run in Python)."""
    check_generate_with_snapshots(model_path, quantization)


def test_native_decode_steps_aside_when_a_mixer_changes(tmp_path: Path) -> None:
    """The call reads float32 copies of a Mamba-2 mixer's small parameters and its pools'
    addresses: an in-place write to one of those parameters, a hook on a mixer, a replaced
    norm, or a snapshot at an offset a decode row does not have sends the step to Python;
    undone (or rebuilt), it runs natively again."""
    path = save_random("Mamba2", {**MAMBA2, "max_position_embeddings": 512}, tmp_path / "m")
    runner = _llm(path, "float32").engine.runner
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    step = ForwardStep([[3]], [4], [[5]], [1], state_slots=[0])
    assert native.can_run(step)
    mixer = runner.model.model.layers[1].mixer
    with torch.inference_mode():
        mixer.A_log.add_(0.0)  # (the same values: the version alone says it was written)
    assert not native.can_run(step)
    runner.model_changed()
    native = runner.decode_path
    assert isinstance(native, NativeDecode) and native.can_run(step)
    handle = mixer.register_forward_hook(lambda *_: None)
    assert not native.can_run(step)
    handle.remove()
    assert native.can_run(step)
    norm = mixer.norm
    mixer.norm = GatedRMSNorm(norm.weight.numel(), norm.groups, norm.eps)
    assert not native.can_run(step)
    mixer.norm = norm
    assert native.can_run(step)
    assert not native.can_run(
        ForwardStep([[3]], [4], [[5]], [1], state_slots=[0], state_snapshots=[(0, 1, 7)])
    )


def test_native_decode_refuses_slots_outside_the_pools(tmp_path: Path) -> None:
    path = save_random("Mamba2", {**MAMBA2, "max_position_embeddings": 512}, tmp_path / "m")
    check_refuses_slots_outside_the_pools(_llm(path, "float32").engine.runner)


def check_refuses_slots_outside_the_pools(runner: ModelRunner) -> None:
    """A row's state slot, or a snapshot's, outside the pools: a typed error naming them,
    before any layer runs (every state slot and page left as it was)."""
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    before = [t.clone() for t in _pools(runner)]
    pools = native.num_state_slots
    bad = [
        ForwardStep([[3]], [4], [[5]], [1], state_slots=[pools]),
        ForwardStep([[3]], [4], [[5]], [1], state_slots=[-1]),
        ForwardStep([[3]], [4], [[5]], [1], state_slots=[0], state_snapshots=[(0, 0, pools)]),
    ]
    with torch.inference_mode():
        for step in bad:
            with pytest.raises(IndexError, match="recurrent state slot"):
                native.run(step)
    for t, b in zip(_pools(runner), before, strict=True):
        assert torch.equal(t, b)

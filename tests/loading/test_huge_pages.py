"""Weights moved into 2 MiB pages at load (``foudre.native.huge_pages``): the same tensors, values
and strides in one advised map; what else holds a storage keeps it where it is."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from foudre import LLM, SamplingParams
from foudre.compress.model import causal_logits
from foudre.loading.loader import load_model
from foudre.native import huge_pages
from foudre.quant import Int4WeightOnly, cpu_qmatmul, quantize_
from foudre.quant.qlinear import QuantLinear, prepare_for_cpu
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.model_runner import ModelRunner
from foudre.runner.step import ForwardStep
from tests.conftest import make_hf_model

needs_thp = pytest.mark.skipif(
    not huge_pages.enabled(), reason="no transparent huge pages (or FOUDRE_HUGE_PAGES=0)"
)


def _region(address: int) -> tuple[int, int, str]:
    """(start, end, VmFlags) of the mapping of this process that holds ``address``."""
    start = end = -1
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
        elif head == "VmFlags:" and start <= address < end:
            return start, end, line
    raise AssertionError(f"no mapping holds {address:#x}")


def _in_advised_map(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor lies in one mapping advised MADV_HUGEPAGE (flag ``hg``), once the
    weight maps waiting to move into 2 MiB pages have moved (``settle``)."""
    huge_pages.settle()
    regions = {_region(t.data_ptr()) for t in tensors}
    return len(regions) == 1 and " hg" in next(iter(regions))[2]


def _smaps(address: int) -> dict[str, int]:
    """The kB fields (Rss, AnonHugePages, ...) of the mapping that holds ``address``."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.endswith(" kB"):
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def _collapses() -> bool:
    """Whether this kernel moves written 4 KiB pages into 2 MiB ones on ``MADV_COLLAPSE`` (Linux
    6.1) and has one to give now (asked where a figure depends on it: memory may be short)."""
    buf = mmap.mmap(-1, 4 * huge_pages.HUGE_PAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    start = -address % huge_pages.HUGE_PAGE
    buf[start : start + 4096] = b"x" * 4096
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address + start, huge_pages.HUGE_PAGE, 25) == 0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(96, 80)
        self.b = nn.Linear(96, 80, bias=False)
        self.b.weight = self.a.weight  # tied: one tensor in two modules
        self.c = nn.Linear(40, 24)
        self.register_buffer("table", torch.empty_strided((5, 7), (1, 5)).normal_())  # strided
        self.register_buffer("gone", None)


@needs_thp
def test_moves_storages_keeping_tensors_and_values() -> None:
    torch.manual_seed(0)
    net = _Net()
    held = net.c.weight[3:]  # a view that another holder keeps: its storage must stay
    tensors = [net.a.weight, net.a.bias, net.c.bias, net.table]
    before = {id(t): (t.clone(), t.stride(), t.data_ptr()) for t in [*tensors, net.c.weight]}
    moved = huge_pages.place_in_huge_pages(net)
    assert moved == sum(-(-t.nbytes // 64) * 64 for t in tensors)
    assert net.b.weight is net.a.weight
    for t in tensors:
        value, stride, address = before[id(t)]
        assert t.stride() == stride and torch.equal(t, value)
        assert t.data_ptr() != address and t.data_ptr() % 64 == 0
    assert _in_advised_map(tensors)
    assert net.c.weight.data_ptr() == before[id(net.c.weight)][2]  # left in place
    assert held.data_ptr() == net.c.weight.data_ptr() + 3 * 40 * 4
    # the module still trains and computes as before
    x = torch.randn(3, 96)
    assert torch.equal(net.a(x), x @ before[id(net.a.weight)][0].t() + before[id(net.a.bias)][0])
    net.a(x).sum().backward()
    assert net.a.weight.grad is not None


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOUDRE_HUGE_PAGES", "0")
    net = _Net()
    address = net.a.weight.data_ptr()
    assert not huge_pages.enabled()
    assert huge_pages.place_in_huge_pages(net) == 0
    assert net.a.weight.data_ptr() == address
    assert huge_pages.empty(100).numel() == 100
    pool = huge_pages.zeros((3, 5), torch.float16)
    assert pool.shape == (3, 5) and pool.dtype == torch.float16 and not pool.any()


@needs_thp
def test_empty_is_aligned_and_advised() -> None:
    buf = huge_pages.empty(3 * huge_pages.HUGE_PAGE + 5)
    assert buf.numel() == 3 * huge_pages.HUGE_PAGE + 5 and buf.dtype == torch.uint8
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _in_advised_map([buf])
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()


def test_paired_scales_are_not_views() -> None:
    """``pair_scales`` gives two tensors on one storage, neither a view (whose base would hold
    the storage too and keep it out of huge pages), with the values given."""
    scales, zeros = torch.rand(6, 4, dtype=torch.bfloat16), torch.rand(6, 4, dtype=torch.bfloat16)
    s, z = cpu_qmatmul.pair_scales(scales, zeros)
    assert s._base is None and z._base is None
    assert s.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()
    assert torch.equal(s, scales) and torch.equal(z, zeros)
    assert cpu_qmatmul.pair_scales(s, z) == (s, z)  # already paired: as they are
    # on one storage but not paired (weights in huge pages all share one): paired
    one = torch.cat([scales.flatten(), zeros.flatten()])
    s2, z2 = cpu_qmatmul.pair_scales(one[:24].view(6, 4), one[24:].view(6, 4))
    assert s2.untyped_storage().data_ptr() != one.untyped_storage().data_ptr()
    assert torch.equal(s2, scales) and torch.equal(z2, zeros)
    assert z2.data_ptr() == s2.data_ptr() + 4 * s2.element_size()


def _maps() -> set[str]:
    return {line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines()}


@needs_thp
def test_storage_held_elsewhere_stays_and_placing_again_compacts() -> None:
    """A storage whose storage object someone holds stays; placing twice moves everything into
    a new map and unmaps the first (what held only a replaced weight is freed with it)."""
    net = _Net()
    held = net.c.bias.untyped_storage()
    address = net.c.bias.data_ptr()
    huge_pages.place_in_huge_pages(net)
    assert net.c.bias.data_ptr() == address and held.data_ptr() == address
    first = _region(net.a.weight.data_ptr())
    address = net.a.weight.data_ptr()
    assert huge_pages.place_in_huge_pages(net) == 0  # nothing changed: nothing moves
    assert net.a.weight.data_ptr() == address
    net.c.weight = nn.Parameter(torch.zeros(24, 40))  # replaced: its old copy stays in the map
    before = net.a.weight.clone()
    huge_pages.place_in_huge_pages(net)
    assert _region(net.a.weight.data_ptr()) != first
    assert f"{first[0]:x}-{first[1]:x}" not in _maps()  # the first map is gone
    assert torch.equal(net.a.weight, before)


@needs_thp
def test_moves_inference_tensors_in_inference_mode() -> None:
    with torch.inference_mode():
        net = _Net()
        assert net.a.weight.is_inference()
        assert huge_pages.place_in_huge_pages(net) > 0
        assert _in_advised_map([net.a.weight, net.c.bias])
    net = _Net()
    with torch.inference_mode():
        net.c.register_buffer("made", torch.ones(3))  # an inference tensor, outside: left
    address = net.c.made.data_ptr()
    huge_pages.place_in_huge_pages(net)
    assert net.c.made.data_ptr() == address and _in_advised_map([net.a.weight])


@needs_thp
def test_interleaved_q8_0_blocks_move() -> None:
    """GGUF's Q8_0 form, repacked in blocks of 16 rows when its layout is built
    (``cpu_qmatmul.interleave``: a tensor of its own, no view), moves into the map and the
    kernels' layout reads it there."""
    if cpu_qmatmul.path() != "vnni":
        pytest.skip("blocks of 16 rows are built on the VNNI path only")
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    net = nn.Sequential(QuantLinear.from_float(w, None, 8, 32).to(torch.float16))
    mod = net[0]
    x = torch.randn(3, 256)
    mod._native_layout()  # (as prepare_for_cpu builds it)
    assert mod.interleaved
    before = mod(x)
    assert huge_pages.place_in_huge_pages(net) > 0
    assert _in_advised_map([mod.qweight])
    assert mod._native_layout().w is mod.qweight and torch.equal(mod(x), before)


@needs_thp
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_kv_pools_in_huge_pages(kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine on the CPU keeps each layer's KV pool (the codes of a quantized cache) zeroed
    in an advised map of its own: decode attention reads blocks from anywhere in a pool. A
    pool under ``HUGE_POOL_BYTES`` stays in torch's memory."""
    maps: list[tuple[int, ...]] = []
    zeros = huge_pages.zeros

    def spy(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        maps.append(shape)
        return zeros(shape, dtype)

    monkeypatch.setattr(huge_pages, "zeros", spy)
    LLM(skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
    assert maps == []
    # 6000 blocks of 16 tokens, 2 KV heads of 32: 12 MB a layer of int8 codes, 49 of float32
    llm = LLM(skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=6000)
    caches = llm.engine.runner.kv_caches
    pools = [c if isinstance(c, torch.Tensor) else c.codes for c in caches]
    assert len(pools) == llm.engine.model_config.num_hidden_layers
    assert len(maps) == len(pools)
    for pool in pools:
        assert pool.data_ptr() % huge_pages.HUGE_PAGE == 0 and _in_advised_map([pool])
        assert not pool.any()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert any(bool(pool.any()) for pool in pools)


@needs_thp
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_engine_weights_in_huge_pages_same_logits(
    quantization: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine on the CPU holds every weight of its model (the quantized linears' codes,
    paired scales and zero points too) in one advised map, and computes the same logits, bit for
    bit, as the same model loaded without (``FOUDRE_HUGE_PAGES=0``)."""
    path = make_hf_model(tmp_path / "m", hidden_size=256, intermediate_size=512, vocab_size=384)
    llm = LLM(str(path), dtype="bfloat16", quantization=quantization, skip_tokenizer_init=True)
    model = llm.engine.model
    monkeypatch.setenv("FOUDRE_HUGE_PAGES", "0")
    cpu = torch.device("cpu")
    plain = load_model(str(path), None, "bfloat16", cpu, None, quantization=quantization).model
    # (blocks of 16 rows leave their linears' scales and zeros empty: cpu_qmatmul.interleave)
    buffers = (b for n, b in model.named_buffers() if "rotary" not in n and b.numel())
    weights = [*model.parameters(), *buffers]
    assert _in_advised_map(weights)
    # not gathered into a map of its own nor the engine's (a lone tensor may still land in a
    # region of the heap that another test of this process advised)
    engine_map = _region(weights[0].data_ptr())
    assert not _in_advised_map(list(plain.parameters()))
    assert all(_region(w.data_ptr()) != engine_map for w in plain.parameters())
    if quantization is not None:
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        # int4's zero points: paired with the scales, or inside the blocks of 16 rows
        assert any(m.zeros is not None for m in linears)
        vnni = cpu_qmatmul.path() == "vnni"  # (the head: 6 bits, rows)
        assert all(m.interleaved == (vnni and m.bits == 4) for m in linears)
        for m in linears:
            # (in blocks of 16 rows, scales and zeros are empty: cpu_qmatmul.interleave)
            held = [t for t in (m.qweight, m.scales, m.zeros) if t is not None and t.numel()]
            assert _in_advised_map(held)
    ids = torch.tensor([[1, 7, 42, 300, 5, 9]])
    with torch.inference_mode():
        assert torch.equal(causal_logits(model, ids), causal_logits(plain, ids))


@needs_thp
def test_model_changed_after_quantizing_in_place(tmp_path: Path) -> None:
    """Quantized in place after the engine was built, the model's steps fall back to Python;
    ``ModelRunner.model_changed`` moves the weights into a new map (the float ones freed with the
    old) and rebuilds the native decode step on the quantized projections."""
    if cpu_qmatmul.path() not in cpu_qmatmul.NATIVE_PATHS:
        pytest.skip("quantized projections run natively with AVX-512 or AVX2 only")
    path = make_hf_model(tmp_path / "m", hidden_size=256, intermediate_size=512, vocab_size=384)
    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True)
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner)
    model = runner.model
    first = _region(model.model.norm.weight.data_ptr())
    quantize_(model, Int4WeightOnly(group_size=64), skip=("lm_head",))
    prepare_for_cpu(model)
    step = ForwardStep([[0]], [3], [[5]], [1])
    assert runner.decode_path is not None and not runner.decode_path.can_run(step)
    runner.model_changed()
    native = runner.decode_path
    assert isinstance(native, NativeDecode) and native.can_run(step)
    assert len(native.checks.quantized) == 4 * len(model.model.layers)
    assert f"{first[0]:x}-{first[1]:x}" not in _maps()
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert _in_advised_map([model.model.norm.weight, *(m.qweight for m in linears)])


@needs_thp
def test_float_weights_load_straight_into_huge_pages(tmp_path: Path) -> None:
    """A float checkpoint loads on the CPU straight into one advised map (``allocate``: no copy
    made at load then moved), which ``place_in_huge_pages`` leaves where it is; the logits are
    those of the same model loaded without (``FOUDRE_HUGE_PAGES=0``), bit for bit."""
    path = make_hf_model(tmp_path / "m", hidden_size=256, intermediate_size=512, vocab_size=384)
    cpu = torch.device("cpu")
    model = load_model(str(path), None, "bfloat16", cpu, None).model
    params = list(model.parameters())
    assert _in_advised_map(params)
    addresses = [p.data_ptr() for p in params]
    moved = huge_pages.place_in_huge_pages(model)  # the rotary tables only, made after
    assert moved < sum(p.nbytes for p in params) // 10
    assert [p.data_ptr() for p in params] == addresses
    assert huge_pages.place_in_huge_pages(model) == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOUDRE_HUGE_PAGES", "0")
        plain = load_model(str(path), None, "bfloat16", cpu, None).model
    # not gathered into a map (a lone tensor may still land in a region of the heap that another
    # test of this process advised), nor in the first model's
    assert not _in_advised_map(list(plain.parameters()))
    assert all(_region(p.data_ptr()) != _region(addresses[0]) for p in plain.parameters())
    ids = torch.tensor([[1, 7, 42, 300, 5, 9]])
    with torch.inference_mode():
        assert torch.equal(causal_logits(model, ids), causal_logits(plain, ids))


@needs_thp
def test_gguf_float_tensors_load_into_huge_pages_kept_linears_apart(tmp_path: Path) -> None:
    """A GGUF file's float tensors (the embedding, the norms) load straight into one advised
    map; its kept quantized linears get memory of their own (their layouts, built of them,
    replace them), which ``place_in_huge_pages`` then moves into another."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import load_memory

    path = load_memory.build_models(tmp_path, "tiny", ("Q8_0",))["Q8_0"]
    model = load_model(str(path), None, "bfloat16", torch.device("cpu"), None).model
    floats = [model.model.embed_tokens.weight, model.model.norm.weight]
    assert _in_advised_map(floats)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and not any(_in_advised_map([floats[0], m.qweight]) for m in linears)
    addresses = [t.data_ptr() for t in floats]
    assert huge_pages.place_in_huge_pages(model) > 0
    assert [t.data_ptr() for t in floats] == addresses
    assert _in_advised_map([m.qweight for m in linears if m.qweight.numel()])


def test_kv_cache_larger_than_available_memory_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Pools fault in as they are used, so a KV cache larger than the memory available is told
    at start (a warning naming what to lower), not found when it fills; the runner passes the
    bytes of its caches' storages."""
    with caplog.at_level("WARNING", logger="foudre"):
        assert huge_pages.warn_if_short(1 << 60, "the KV cache")
        assert not huge_pages.warn_if_short(1, "the KV cache")
    assert "kv_cache_memory" in caplog.text and "the KV cache" in caplog.text
    seen: list[int] = []
    monkeypatch.setattr(huge_pages, "warn_if_short", lambda n, what: seen.append(n) or False)
    llm = LLM(skip_tokenizer_init=True, num_kv_blocks=64)
    cfg = llm.engine.model_config
    per_block = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    assert seen == [cfg.num_hidden_layers * 65 * per_block]  # (one block more: the padding's)


@needs_thp
def test_weights_move_into_huge_pages_after_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's weights are written at load into 4 KiB pages (their map advised
    ``MADV_NOHUGEPAGE`` meanwhile: the time to a first token does not wait for fresh 2 MiB
    pages) and moved into 2 MiB pages once its first step is done, by a thread of their own that
    the step starts; the tokens are those of the same model run with the maps advised before
    their first touch (``FOUDRE_HUGE_PAGES=eager``) and without huge pages."""
    if not huge_pages._collapse_works():
        pytest.skip("no MADV_COLLAPSE (Linux < 6.1): weights are advised before their first touch")
    huge_pages.settle()  # (maps of this process's earlier tests: moved before this one starts)
    path = make_hf_model(tmp_path / "m", hidden_size=256, intermediate_size=512, vocab_size=384)
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [[1, 7, 42, 300, 5, 9], [3, 3, 8]]
    calls: list[bool] = []
    promote = huge_pages.promote_later
    monkeypatch.setattr(
        huge_pages, "promote_later", lambda: (calls.append(bool(huge_pages._pending)), promote())
    )
    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True)
    weight = llm.engine.model.model.layers[0].mlp.down_proj.weight
    start, end, flags = _region(weight.data_ptr())
    assert " hg" not in flags and " nh" in flags and not calls
    assert _smaps(weight.data_ptr())["AnonHugePages"] == 0
    with huge_pages._lock:  # written in full (sealed), waiting for a step
        assert any(start <= address < end for _, address, _ in huge_pages._pending)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    assert calls and calls[0]  # the first step's end found the maps waiting
    thread = huge_pages._promoter
    if thread is not None:
        thread.join()
    assert " hg" in _region(weight.data_ptr())[2]
    if _collapses():
        assert _smaps(weight.data_ptr())["AnonHugePages"] >= 2048
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)]]
    for mode in ("eager", "0"):
        monkeypatch.setenv("FOUDRE_HUGE_PAGES", mode)
        other = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True)
        outs.append([o.outputs[0].token_ids for o in other.generate(prompts, params)])
        if mode == "eager":
            eager_weight = other.engine.model.model.layers[0].mlp.down_proj.weight
            assert " hg" in _region(eager_weight.data_ptr())[2]
    assert outs[0][0] == first[0] and outs[0] == outs[1] == outs[2]


@needs_thp
def test_a_map_moves_once_written_and_only_what_was_touched() -> None:
    """A weight map moves into 2 MiB pages only once its writer says it is written in full
    (``_ready``: ``seal``, ``place_in_huge_pages``), not while it may still be written; then only
    its 2 MiB ranges of which something was touched (the room of a tied head or of a replaced
    table stays unbacked), values kept."""
    if not huge_pages._collapse_works():
        pytest.skip("no MADV_COLLAPSE (Linux < 6.1): weights are advised before their first touch")
    buf = huge_pages.arena(16 * huge_pages.HUGE_PAGE)
    assert buf is not None
    buf[: 2 * huge_pages.HUGE_PAGE].fill_(3)
    buf[9 * huge_pages.HUGE_PAGE + 5] = 7
    huge_pages.settle()  # not written in full yet: left alone
    before = _smaps(buf.data_ptr())
    assert " hg" not in _region(buf.data_ptr())[2] and before["AnonHugePages"] == 0
    huge_pages._ready(buf.untyped_storage().data_ptr())
    huge_pages.settle()
    after = _smaps(buf.data_ptr())
    assert " hg" in _region(buf.data_ptr())[2]
    # three 2 MiB ranges touched at all: at most those are backed, in full
    assert before["Rss"] <= after["Rss"] <= 3 * 2048 + 64
    if _collapses():
        assert after["AnonHugePages"] == 3 * 2048
    assert int(buf[: 2 * huge_pages.HUGE_PAGE].sum()) == 3 * 2 * huge_pages.HUGE_PAGE
    assert int(buf[9 * huge_pages.HUGE_PAGE + 5]) == 7
    assert int(buf.sum()) == 3 * 2 * huge_pages.HUGE_PAGE + 7


def test_promote_later_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no thread can be started (a process limit, shutdown), the maps waiting are advised
    and left to ``khugepaged``; the engine's step goes on."""
    buf = huge_pages.arena(2 * huge_pages.HUGE_PAGE)
    if buf is None or not huge_pages._collapse_works():
        pytest.skip("no weight maps to move here")
    huge_pages.settle()
    buf.fill_(1)
    huge_pages._ready(buf.untyped_storage().data_ptr())

    def refuse(self: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(huge_pages.threading.Thread, "start", refuse)
    huge_pages.promote_later()
    assert not huge_pages._pending and huge_pages._promoter is None
    assert " hg" in _region(buf.data_ptr())[2]

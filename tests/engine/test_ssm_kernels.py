"""The recurrent layers' decode kernels (``layers/ssm_ops.py``: the C++ of ``cpu_ssm.cpp``, the
Triton of ``layers/ssm_triton.py``) against their torch references: Mamba-2's selective-state
update, the causal conv1d update and the gated delta rule, on random shapes (n_groups > 1, odd
head counts, state sizes that are not a multiple of a vector, inputs that are views of a wider
projection), the rows' slots scattered in a larger pool in random order. Each kernel must
update its rows' slots as the reference does and leave every other slot as it was, bit for bit.

The C++ is checked on this CPU's own build and, in fresh processes, built for haswell (AVX2)
and x86-64 (the portable loops); its AVX-512 and AVX2 code also compiles for CPUs this host is
not, and the source for aarch64. The Triton kernels run the same checks in Triton's
interpreter on CPU tensors (on a GPU where there is one)."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.layers import ssm_ops
from foudre.layers.mamba import ssd_chunked
from foudre.native import build as native
from tests.engine.march import native_paths, run_built_for
from tests.triton_check import run_triton_check

needs_native = pytest.mark.skipif(ssm_ops.library() is None, reason="no C++ compiler")

# (rows, pool slots, heads, head_dim, d_state, groups)
SSM_SHAPES = [(1, 3, 1, 4, 16, 1), (3, 9, 6, 8, 20, 2), (4, 7, 5, 3, 7, 5), (2, 5, 3, 16, 64, 1)]
# (rows, pool slots, channels, window)
CONV_SHAPES = [(1, 2, 5, 3), (3, 8, 40, 3), (4, 6, 37, 1), (2, 9, 130, 4)]
# (rows, pool slots, k_heads, v_heads, dk, dv)
DELTA_SHAPES = [(1, 3, 1, 1, 8, 16), (3, 8, 2, 6, 16, 20), (2, 5, 3, 3, 5, 37)]


def _slots(rows: int, pool: int, g: torch.Generator) -> torch.Tensor:
    return torch.randperm(pool, generator=g)[:rows].to(torch.int64)


def _view(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``t``'s values as a view into a wider tensor (rows at a larger stride)."""
    wide = torch.randn(t.shape[0], t[0].numel() + 5, generator=g).to(t.dtype)
    wide[:, 3 : 3 + t[0].numel()] = t.reshape(t.shape[0], -1)
    return wide[:, 3 : 3 + t[0].numel()].view(t.shape)


def _assert_pools(got: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, slots: torch.Tensor,
                  atol: float, rtol: float = 0.0) -> None:  # fmt: skip
    untouched = torch.ones(got.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got[untouched], before[untouched]), "wrote a slot it was not given"
    torch.testing.assert_close(got[slots].float(), ref[slots].float(), atol=atol, rtol=rtol)


def _on(device: str, *tensors: torch.Tensor | None) -> list[Any]:
    return [None if t is None else t.to(device) for t in tensors]


def check_selective_state_update(backend: str = "native", device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(0)
    for rows, pool, heads, p, n, groups in SSM_SHAPES:
        for with_d, as_view in ((True, False), (False, True)):
            state = torch.randn(pool, heads, p, n, generator=g)
            x = torch.randn(rows, heads, p, generator=g)
            dt = torch.rand(rows, heads, generator=g) * 0.5
            a = -torch.rand(heads, generator=g) * 4
            b, c = (torch.randn(rows, groups, n, generator=g) for _ in range(2))
            d = torch.randn(heads, generator=g) if with_d else None
            if as_view:
                x, b, c = _view(x, g), _view(b, g), _view(c, g)
            slots = _slots(rows, pool, g)
            ref_state = state.clone()
            ref = ssm_ops.selective_state_update_reference(ref_state, x, dt, a, b, c, slots, d)
            got_state, *args = _on(device, state.clone(), x, dt, a, b, c, slots, d)
            got = ssm_ops.selective_state_update(got_state, *args, backend=backend).cpu()
            got_state = got_state.cpu()
            assert got.dtype == torch.float32 and got.shape == ref.shape
            _assert_pools(got_state, ref_state, state, slots, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# (row lengths, heads, head_dim, d_state, groups)
SCAN_SHAPES = [([1, 5, 17, 3], 6, 4, 20, 2), ([40], 3, 5, 7, 3), ([2, 9], 1, 8, 16, 1)]


def check_ssd_scan(backend: str = "native", device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(3)
    for lengths, heads, p, n, groups in SCAN_SHAPES:
        rows, t = len(lengths), sum(lengths)
        cu = [7]  # (a step's tokens need not start at 0)
        for length in lengths:
            cu.append(cu[-1] + length)
        pool = 2 * rows + 4
        perm = torch.randperm(pool, generator=g)
        slots, spare = perm[:rows].clone(), perm[rows:].tolist()
        # the state after a middle token, after a row's last, after a row's first
        snapshots = [(rows - 1, lengths[-1] // 2, spare[0]), (0, lengths[0] - 1, spare[1])]
        snapshots.append((rows // 2, 0, spare[2]))
        touched = torch.cat([slots, torch.tensor([s for _, _, s in snapshots])])
        state = torch.randn(pool, heads, p, n, generator=g)
        x = _view(torch.randn(t, heads, p, generator=g), g)
        dt = torch.rand(t, heads, generator=g) * 0.5
        a = -torch.rand(heads, generator=g) * 4
        b, c = (torch.randn(t, groups, n, generator=g) for _ in range(2))
        d = torch.randn(heads, generator=g) if rows > 1 else None
        ref_state = state.clone()
        ref = ssm_ops.ssd_scan_reference(ref_state, x, dt, a, b, c, cu, slots, d, snapshots)
        got_state, *args = _on(device, state.clone(), x, dt, a, b, c)
        slots_on, d_on = _on(device, slots, d)
        got = ssm_ops.ssd_scan(
            got_state, *args, cu, slots_on, d_on, snapshots, backend=backend
        ).cpu()
        _assert_pools(got_state.cpu(), ref_state, state, touched, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def check_causal_conv1d_update(backend: str = "native", device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(1)
    for rows, pool, channels, window in CONV_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for silu, with_bias in ((False, True), (True, False)):
                state = torch.randn(pool, window, channels, generator=g).to(dtype)
                x = _view(torch.randn(rows, channels, generator=g).to(dtype), g)
                weight = torch.randn(channels, 1, window + 1, generator=g).to(dtype)
                bias = torch.randn(channels, generator=g).to(dtype) if with_bias else None
                slots = _slots(rows, pool, g)
                ref_state = state.clone()
                ref = ssm_ops.causal_conv1d_update_reference(
                    ref_state, x, weight, bias, slots, silu
                )
                got_state, *on = _on(device, state.clone(), x, weight, bias, slots)
                got = ssm_ops.causal_conv1d_update(got_state, *on, silu, backend).cpu()
                got_state = got_state.cpu()
                assert got.dtype == dtype and got.shape == ref.shape
                # the window shifts: exactly the inputs it held and x
                _assert_pools(got_state, ref_state, state, slots, atol=0.0)
                # float32: a sum in another order; bfloat16: one rounding of the float32 sum
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def check_gated_delta_rule_update(backend: str = "native", device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(2)
    for rows, pool, k_heads, v_heads, dk, dv in DELTA_SHAPES:
        for l2norm, scale, as_view in ((True, None, True), (False, 0.3, False)):
            state = torch.randn(pool, v_heads, dk, dv, generator=g) * 0.3
            q, k = (torch.randn(rows, k_heads, dk, generator=g) for _ in range(2))
            if not l2norm:
                k = k / dk**0.5
            v = torch.randn(rows, v_heads, dv, generator=g)
            gate = -torch.rand(rows, v_heads, generator=g) * 2
            beta = torch.rand(rows, v_heads, generator=g)
            if as_view:
                q, k, v = _view(q, g), _view(k, g), _view(v, g)
            slots = _slots(rows, pool, g)
            ref_state = state.clone()
            ref = ssm_ops.gated_delta_rule_update_reference(
                ref_state, q, k, v, gate, beta, slots, scale, l2norm
            )
            got_state, *args = _on(device, state.clone(), q, k, v, gate, beta, slots)
            got = ssm_ops.gated_delta_rule_update(
                got_state, *args, scale=scale, l2norm=l2norm, backend=backend
            ).cpu()
            got_state = got_state.cpu()
            assert got.dtype == torch.float32 and got.shape == ref.shape
            _assert_pools(got_state, ref_state, state, slots, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# (row lengths, k_heads, v_heads, dk, dv)
DELTA_SCAN_SHAPES = [([1, 6, 11], 2, 4, 8, 12), ([20], 1, 1, 5, 37), ([3, 3], 3, 3, 16, 16)]


def check_gated_delta_rule_scan(backend: str = "native", device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(5)
    for lengths, k_heads, v_heads, dk, dv in DELTA_SCAN_SHAPES:
        rows, t = len(lengths), sum(lengths)
        cu = [3]
        for length in lengths:
            cu.append(cu[-1] + length)
        pool = 2 * rows + 3
        perm = torch.randperm(pool, generator=g)
        slots, spare = perm[:rows].clone(), perm[rows:].tolist()
        snapshots = [(rows - 1, lengths[-1] // 2, spare[0]), (0, lengths[0] - 1, spare[1])]
        touched = torch.cat([slots, torch.tensor([s for _, _, s in snapshots])])
        l2norm = len(lengths) != 2
        state = torch.randn(pool, v_heads, dk, dv, generator=g) * 0.3
        q, k = (_view(torch.randn(t, k_heads, dk, generator=g), g) for _ in range(2))
        if not l2norm:
            k = k / dk**0.5
        v = torch.randn(t, v_heads, dv, generator=g)
        gate = -torch.rand(t, v_heads, generator=g) * 2
        beta = torch.rand(t, v_heads, generator=g)
        ref_state = state.clone()
        ref = ssm_ops.gated_delta_rule_scan_reference(
            ref_state, q, k, v, gate, beta, cu, slots, None, l2norm, snapshots
        )
        got_state, *args = _on(device, state.clone(), q, k, v, gate, beta, slots)
        got = ssm_ops.gated_delta_rule_scan(
            got_state, *args[:5], cu, args[5], None, l2norm, snapshots, backend=backend
        ).cpu()
        _assert_pools(got_state.cpu(), ref_state, state, touched, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def check_mamba_decode() -> None:
    """A Mamba-2 mixer's decode step in one C++ call (``ssm_ops.mamba_decode``) against the
    mixer's op-by-op path: each output norm, two groups, a clamped dt, slots scattered in the
    pool; float32 (a few ulps) and bfloat16 (the op-by-op path rounds each op to bfloat16)."""
    from foudre.layers import mamba
    from foudre.layers.mamba import Mamba2Mixer, Mamba2Shape, RecurrentBatch

    g = torch.Generator().manual_seed(5)
    for dtype, gate_norm in itertools.product(
        (torch.float32, torch.bfloat16), ("after_gate", "before_gate", "none")
    ):
        shape = Mamba2Shape(64, 6, 16, 24, 2, 4, 8, gate_norm=gate_norm)
        shape = dataclasses.replace(shape, time_step_limit=(0.05, 2.0))
        mixer = Mamba2Mixer(shape)
        with torch.no_grad():
            for p in mixer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            mixer.A_log.copy_(torch.rand(6, generator=g).log())
        mixer = mixer.to(dtype)
        spec = shape.state_spec()
        cache = spec.allocate(9, dtype, torch.device("cpu"))
        cache.conv.copy_(torch.randn(cache.conv.shape, generator=g))
        cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=g))
        slots = [7, 2, 4]
        x = torch.randn(3, 64, generator=g).to(dtype)
        batch = RecurrentBatch.of_lengths([1, 1, 1], slots, torch.device("cpu"))
        ref_cache = type(cache)(cache.conv.clone(), cache.ssm.clone())
        fused = mamba.mamba_decode
        try:
            mamba.mamba_decode = lambda *a: None  # type: ignore[assignment]
            with torch.no_grad():
                want = mixer(x, ref_cache, batch)
        finally:
            mamba.mamba_decode = fused
        ran: list[bool] = []

        def counted(*a: Any, ran: list[bool] = ran, fused: Any = fused) -> torch.Tensor | None:
            out = fused(*a)
            ran.append(out is not None)
            return out

        try:
            mamba.mamba_decode = counted  # type: ignore[assignment]
            with torch.no_grad():
                got = mixer(x, cache, batch)
        finally:
            mamba.mamba_decode = fused
        assert ran == [True], "the C++ decode step did not run"
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
        torch.testing.assert_close(got.float(), want.float(), **tol)  # type: ignore[arg-type]
        torch.testing.assert_close(cache.conv, ref_cache.conv)
        torch.testing.assert_close(cache.ssm, ref_cache.ssm, **tol)  # type: ignore[arg-type]


def check_native() -> None:
    """Every kernel's checks through the C++, on the path that this process's build takes."""
    paths = native_paths()
    if paths is not None:
        want = "avx512" if "avx512" in paths else "avx2" if "avx2" in paths else "portable"
        assert ssm_ops.native_isa() == want, (ssm_ops.native_isa(), want)
    check_selective_state_update()
    check_ssd_scan()
    check_causal_conv1d_update()
    check_gated_delta_rule_update()
    check_gated_delta_rule_scan()
    check_mamba_decode()


@needs_native
def test_selective_state_update_native() -> None:
    check_selective_state_update()


@needs_native
def test_mamba_decode_native() -> None:
    check_mamba_decode()


@needs_native
def test_ssd_scan_native() -> None:
    check_ssd_scan()


def test_scan_reference_is_the_models_chunked_scan() -> None:
    """``ssd_scan_reference`` (token by token) equals ``mamba.ssd_chunked`` (the model's
    chunked form) on two rows padded to a common length: outputs, final states and the states
    after chosen tokens."""
    g = torch.Generator().manual_seed(4)
    heads, p, n, groups, chunk = 4, 3, 8, 2, 4  # rows of 13 and 16 tokens
    x = torch.randn(2, 16, heads, p, generator=g)
    dt = torch.rand(2, 16, heads, generator=g) * 0.5
    dt[0, 13:] = 0.0  # padding leaves the state as it is
    a = -torch.rand(heads, generator=g) * 2
    b, c = (torch.randn(2, 16, groups, n, generator=g) for _ in range(2))
    state = torch.randn(2, heads, p, n, generator=g)
    at = (torch.tensor([0, 1, 1]), torch.tensor([5, 0, 11]))
    y, final, states_at = ssd_chunked(x, dt, a, b, c, state.clone(), chunk, at)
    assert states_at is not None
    pool = torch.cat([state, torch.zeros(3, heads, p, n)])
    flat = torch.cat([torch.arange(13), 16 + torch.arange(16)])
    snapshots = [(0, 5, 2), (1, 0, 3), (1, 11, 4)]
    ref = ssm_ops.ssd_scan_reference(
        pool, *(v.flatten(0, 1)[flat] for v in (x, dt)), a,
        *(v.flatten(0, 1)[flat] for v in (b, c)), [0, 13, 29], torch.tensor([0, 1]), None,
        snapshots,
    )  # fmt: skip
    torch.testing.assert_close(ref, y.flatten(0, 1)[flat], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[:2], final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2:], states_at, atol=1e-5, rtol=1e-5)


@needs_native
def test_causal_conv1d_update_native() -> None:
    check_causal_conv1d_update()


@needs_native
def test_gated_delta_rule_update_native() -> None:
    check_gated_delta_rule_update()


@needs_native
def test_gated_delta_rule_scan_native() -> None:
    check_gated_delta_rule_scan()


def test_delta_references_are_transformers_recurrence() -> None:
    """The gated delta rule's references (one step, and the scan) equal transformers'
    ``torch_recurrent_gated_delta_rule`` (Qwen3-Next's spec: q and k L2-normalized in the
    kernel, q scaled by dk^-0.5, value heads sharing key heads) from the same initial state."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(6)
    rows, length, k_heads, v_heads, dk, dv = 2, 7, 2, 4, 8, 6
    q, k = (torch.randn(rows, length, k_heads, dk, generator=g) for _ in range(2))
    v = torch.randn(rows, length, v_heads, dv, generator=g)
    gate = -torch.rand(rows, length, v_heads, generator=g)
    beta = torch.rand(rows, length, v_heads, generator=g)
    initial = torch.randn(rows, v_heads, dk, dv, generator=g) * 0.3
    want, final = qwen3_next.torch_recurrent_gated_delta_rule(
        q, k, v, gate, beta, initial_state=initial.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    flat = [x.flatten(0, 1) for x in (q, k, v, gate, beta)]
    pool, slots = initial.clone(), torch.tensor([0, 1])
    got = ssm_ops.gated_delta_rule_scan_reference(pool, *flat, [0, 7, 14], slots, l2norm=True)
    torch.testing.assert_close(got.view(rows, length, v_heads, dv), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, final, atol=1e-5, rtol=1e-5)
    pool = initial.clone()
    one = ssm_ops.gated_delta_rule_update_reference(
        pool, *(x[:, 0] for x in (q, k, v, gate, beta)), slots, l2norm=True
    )
    want, _ = qwen3_next.torch_recurrent_gated_delta_rule(
        *(x[:, :1] for x in (q, k, v, gate, beta)), initial_state=initial.clone(),
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(one, want[:, 0], atol=1e-5, rtol=1e-5)


@needs_native
def test_native_takes_this_cpus_path() -> None:
    paths = native_paths()
    assert paths is not None
    want = "avx512" if "avx512" in paths else "avx2" if "avx2" in paths else "portable"
    assert ssm_ops.native_isa() == want


@needs_native
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_native_built_for(march: str, march_cache: Callable[[str], Path]) -> None:
    """The AVX2 build and the portable loops (x86-64's baseline), each in a process whose
    kernels were built for that ``-march``."""
    run_built_for(march, "tests.engine.test_ssm_kernels:check_native", "cpu_ssm", march_cache)


@needs_native
@pytest.mark.parametrize("march", ["sapphirerapids", "znver3"])
def test_avx512_and_avx2_code_compiles(march: str) -> None:
    cxx = native.compiler()
    assert cxx is not None
    flags = [f for f in native.flags() if not f.startswith("-march=") and f != "-shared"]
    command = [cxx, *flags, f"-march={march}", "-fsyntax-only", str(ssm_ops.SOURCE)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if out.returncode and march in out.stderr:
        pytest.skip(f"{cxx} does not know -march={march}")
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None, reason="no aarch64 g++")
def test_source_compiles_for_aarch64() -> None:
    flags = [f for f in native.flags() if not f.startswith("-march=") and f != "-shared"]
    command = ["aarch64-linux-gnu-g++", *flags, "-fsyntax-only", str(ssm_ops.SOURCE)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_torch_backend_is_the_reference() -> None:
    """``backend="torch"`` (and autograd) run the references: the dispatch itself."""
    state = torch.randn(4, 2, 3, 5)
    ref_state = state.clone()
    args = (torch.randn(1, 2, 3), torch.rand(1, 2), -torch.rand(2), torch.randn(1, 1, 5))
    slots = torch.tensor([2])
    got = ssm_ops.selective_state_update(state, *args, args[3], slots, backend="torch")
    ref = ssm_ops.selective_state_update_reference(ref_state, *args, args[3], slots)
    assert torch.equal(got, ref) and torch.equal(state, ref_state)
    with pytest.raises(ValueError, match="slots"):
        ssm_ops.selective_state_update(state, *args, args[3], torch.tensor([2], dtype=torch.int32))


_TRITON = """
import sys
from tests.engine import test_ssm_kernels as t
device = sys.argv[1]
t.check_selective_state_update("triton", device)
t.check_ssd_scan("triton", device)
t.check_causal_conv1d_update("triton", device)
t.check_gated_delta_rule_update("triton", device)
t.check_gated_delta_rule_scan("triton", device)
print("ok")
"""


def test_triton_kernels_interpreted() -> None:
    """The Triton kernels pass the same checks (in Triton's interpreter without a GPU)."""
    cuda = torch.cuda.is_available()
    run_triton_check(_TRITON, "cuda" if cuda else "cpu", interpret=not cuda, timeout=600)


_COMPILE_CHECK = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from foudre.layers import ssm_triton as st

def compile_for(fn, types, consts):
    names = inspect.signature(fn.fn).parameters
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32))

f32, i64 = "*fp32", "*i64"
ssm = dict(state_ptr=f32, slots_ptr=i64, cu_ptr=i64, snap_ptr=i64, x_ptr=f32, dt_ptr=f32,
           a_ptr=f32, b_ptr=f32, c_ptr=f32, d_ptr=f32, y_ptr=f32, slot_stride="i64")
shape = dict(HEAD_DIM=64, D_STATE=128, BLOCK_P=32, N_P2=128)
for has_d in (True, False):
    compile_for(st._ssm_update, ssm, dict(shape, HAS_D=has_d))
    compile_for(st._ssm_scan, ssm, dict(shape, HAS_D=has_d, SNAPS=not has_d))
for dt in ("*fp32", "*bf16"):
    conv = dict(state_ptr=dt, slots_ptr=i64, x_ptr=dt, w_ptr=dt, bias_ptr=dt, out_ptr=dt)
    compile_for(st._conv_update, conv, dict(WINDOW=3, BLOCK_C=256, HAS_BIAS=True, SILU=False))
delta = dict(state_ptr=f32, slots_ptr=i64, cu_ptr=i64, snap_ptr=i64, q_ptr=f32, k_ptr=f32,
             v_ptr=f32, g_ptr=f32, beta_ptr=f32, o_ptr=f32, scale="fp32", slot_stride="i64")
shape = dict(DK=128, DV=128, DK_P2=128, BLOCK_V=64, L2NORM=True)
compile_for(st._delta_update, delta, shape)
compile_for(st._delta_scan, delta, dict(shape, SNAPS=True))
print("ok")
"""


@pytest.mark.slow
def test_triton_kernels_compile_for_the_gpu() -> None:
    """The interpreter does not type-check like the compiler: every kernel compiled to sm_90
    code (Triton's own ptxas, no GPU needed) for the shapes of a ~0.5B model, float32 and
    bfloat16 conv windows."""
    run_triton_check(
        _COMPILE_CHECK, interpret=False, timeout=600, env={"TRITON_DEFAULT_FP_FUSION": "1"}
    )

"""The recurrent layers' kernels (``cpu_ssm.cpp``) built for aarch64 (Armv8.0: the portable
loops, which the compiler vectorizes with NEON) and run under ``qemu-aarch64`` through
``ssm_harness.cpp``: each kernel's output and state pool against the host's torch references
(``layers/ssm_ops.py``), the rows' slots scattered in a larger pool. Skipped where the cross
compiler or qemu is missing (test_cross.py says how to install them)."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import torch

from foudre.layers import ssm_ops
from tests.native.test_cross import CROSS, FLAGS, QEMU, call, needs_cross

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The command that runs the aarch64 harness (Armv8.0)."""
    out = tmp_path_factory.mktemp("ssm-arm") / "ssm_harness"
    command = [CROSS, *FLAGS, "-march=armv8-a", "-static", str(HERE / "ssm_harness.cpp")]
    done = subprocess.run(
        [*command, str(ssm_ops.SOURCE), "-o", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [QEMU, "-cpu", "max", str(out)]


def _split(out: bytes, first: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The harness's output (an array shaped and typed as ``first``, then the state pool)."""
    n = first.numel() * first.element_size()
    got = torch.frombuffer(bytearray(out[:n]), dtype=first.dtype).view(first.shape)
    pool = torch.frombuffer(bytearray(out[n:]), dtype=state.dtype).view(state.shape)
    return got, pool


@needs_cross
def test_aarch64_build_takes_the_portable_path(arm: list[str]) -> None:
    assert ssm_ops.ISA[struct.unpack("<i", call(arm, "isa", [], []))[0]] == "portable"


@needs_cross
def test_state_updates_on_aarch64(arm: list[str]) -> None:
    """The selective-state update (n_groups 2, D) and its scan over rows of 1, 5 and 9 tokens
    with snapshots, and the gated delta rule (two key heads for six value heads, L2-normalized
    q and k): outputs and pools within float32 rounding of the references."""
    g = torch.Generator().manual_seed(0)
    pool, heads, p, n, groups = 9, 6, 8, 20, 2
    state = torch.randn(pool, heads, p, n, generator=g)
    slots = torch.tensor([4, 0, 7])
    for name, lengths in (("ssm_update", [1, 1, 1]), ("ssm_scan", [1, 5, 9])):
        t = sum(lengths)
        x, dt = torch.randn(t, heads, p, generator=g), torch.rand(t, heads, generator=g) * 0.5
        a, d = -torch.rand(heads, generator=g) * 3, torch.randn(heads, generator=g)
        b, c = (torch.randn(t, groups, n, generator=g) for _ in range(2))
        ref_state = state.clone()
        cu = [0, 1, 1 + lengths[1], t]
        snapshots = [(1, 2, 3), (2, 8, 5)] if name == "ssm_scan" else []
        ref = ssm_ops.ssd_scan_reference(ref_state, x, dt, a, b, c, cu, slots, d, snapshots)
        snap = torch.full((t,), -1, dtype=torch.int64)
        for row, offset, slot in snapshots:
            snap[cu[row] + offset] = slot
        params = [heads * p * n, t, heads, p, n, groups, len(lengths)]
        arrays = [state, slots, x, dt, a, b, c, d, torch.tensor(cu), snap]
        got, got_state = _split(call(arm, name, params, arrays), ref, state)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got_state, ref_state, atol=1e-5, rtol=1e-5)
    k_heads, v_heads, dk, dv = 2, 6, 16, 12
    state = torch.randn(pool, v_heads, dk, dv, generator=g) * 0.3
    q, k = (torch.randn(3, k_heads, dk, generator=g) for _ in range(2))
    v = torch.randn(3, v_heads, dv, generator=g)
    gate, beta = -torch.rand(3, v_heads, generator=g), torch.rand(3, v_heads, generator=g)
    ref_state = state.clone()
    ref = ssm_ops.gated_delta_rule_update_reference(
        ref_state, q, k, v, gate, beta, slots, 0.3, True
    )
    params = [v_heads * dk * dv, 3, k_heads, v_heads, dk, dv, 0.3, 1]
    out = call(arm, "gated_delta", params, [state, slots, q, k, v, gate, beta])
    got, got_state = _split(out, ref, state)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, ref_state, atol=1e-5, rtol=1e-5)


@needs_cross
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_conv_update_on_aarch64(arm: list[str], dtype: torch.dtype) -> None:
    """The conv1d window update (window 3, 37 channels, bias, SiLU): the window shifted exactly,
    the output within one rounding of the float32 reference."""
    g = torch.Generator().manual_seed(1)
    pool, rows, channels, window = 6, 3, 37, 3
    state = torch.randn(pool, window, channels, generator=g).to(dtype)
    slots = torch.tensor([5, 1, 2])
    x = torch.randn(rows, channels, generator=g).to(dtype)
    weight = torch.randn(channels, window + 1, generator=g).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype)
    ref_state = state.clone()
    ref = ssm_ops.causal_conv1d_update_reference(ref_state, x, weight, bias, slots, True)
    name = "conv_f32" if dtype == torch.float32 else "conv_bf16"
    params = [window * channels, rows, channels, window, 1]
    got, got_state = _split(call(arm, name, params, [state, slots, x, weight, bias]), ref, state)
    assert torch.equal(got_state, ref_state)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)

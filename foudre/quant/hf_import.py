"""Import of Hugging Face GPTQ (AutoGPTQ / GPTQModel) and AutoAWQ (GEMM) 4-bit tensors.

GPTQ (``quant_method: "gptq"``), per linear: ``qweight`` int32 ``[K / 8, N]`` (8 input rows per
word, row ``8i + j`` in bits ``4j``), ``qzeros`` int32 ``[K / G, N / 8]`` (8 output columns per
word, same order), ``scales`` ``[K / G, N]``, ``g_idx`` int32 ``[K]`` (the group of each input
column; not monotonic with act-order). ``w[n, k] = scale[g, n] * (q[k, n] - zero[g, n])`` with
``g = g_idx[k]``; the classic format ("gptq", v1) stores ``zero - 1``, "gptq_v2" stores ``zero``.

AWQ GEMM (``quant_method: "awq"``, ``version: "gemm"``): ``qweight`` int32 ``[K, N / 8]`` and
``qzeros`` ``[K / G, N / 8]`` pack 8 output columns per word in the interleaved order
``0 2 4 6 1 3 5 7`` (column ``8j + order[i]`` in bits ``4i``); ``scales`` ``[K / G, N]``;
``w[n, k] = (q[k, n] - zero[k // G, n]) * scale[k // G, n]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(slots=True)
class Int4Codes:
    """A 4-bit weight in our orientation: codes ``[N, K]`` (0..15, uint8), scales and integer
    zero points ``[N, K / G]``, and the act-order permutation (None when groups are in order):
    the weight is ``dequantize(codes)`` over columns ``perm``, i.e. it multiplies ``x[..., perm]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` in the original column order."""
        n, k = self.codes.shape
        g = self.codes.float().view(n, k // self.group_size, self.group_size)
        w = ((g - self.zeros[..., None]) * self.scales.float()[..., None]).view(n, k)
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm, w)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` to ``[R, C, 8]`` nibbles in bit order."""
    return (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """``[K / 8, N]`` int32 to codes ``[K, N]``."""
    q = _unpack_rows(qweight)  # [K/8, N, 8]
    return q.permute(0, 2, 1).reshape(-1, qweight.shape[1])


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C / 8]`` int32 packed along columns to ``[R, C]``; ``order`` is the AWQ reverse
    order (None: plain bit order)."""
    q = _unpack_rows(packed)  # [R, C/8, 8] in bit order
    if order is not None:
        q = q[..., list(order)]
    return q.reshape(packed.shape[0], -1)


def gptq_codes(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int = 1,
) -> Int4Codes:
    """A GPTQ 4-bit linear's tensors as ``Int4Codes``; act-order ``g_idx`` becomes ``perm``.

    ``zero_offset`` is 1 for the classic (v1) checkpoint format, 0 for ``gptq_v2``. Raises
    ``ValueError`` when the groups of ``g_idx`` are not all of ``group_size`` columns.
    """
    q = unpack_gptq_qweight(qweight)  # [K, N]
    k, n = q.shape
    z = unpack_cols(qzeros)[:, :n].float() + zero_offset  # [G, N]
    s = scales.float()
    if group_size <= 0:
        group_size = k
    _check_groups(k, group_size, s.shape[0])
    default = torch.arange(k) // group_size
    if g_idx is None or torch.equal(g_idx.long(), default):
        return Int4Codes(
            q.t().to(torch.uint8).contiguous(), s.t().contiguous(), z.t().contiguous(), group_size
        )
    g_idx = g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    counts = torch.bincount(g_idx, minlength=s.shape[0])
    if not bool((counts == group_size).all()):
        raise ValueError("g_idx groups are not all of group_size columns")
    codes = q.t()[:, perm].to(torch.uint8).contiguous()
    return Int4Codes(codes, s.t().contiguous(), z.t().contiguous(), group_size, perm)


def _check_groups(k: int, group_size: int, groups: int) -> None:
    """``ValueError`` unless ``group_size`` divides the ``k`` input features into ``groups``."""
    if group_size <= 0 or k % group_size or k // group_size != groups:
        raise ValueError(
            f"group_size {group_size} does not divide its {k} input features into the "
            f"{groups} groups of its scales"
        )


def awq_codes(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Codes:
    """An AutoAWQ GEMM 4-bit linear's tensors as ``Int4Codes``."""
    q = unpack_cols(qweight, AWQ_REVERSE_ORDER)  # [K, N]
    n = scales.shape[1]
    _check_groups(q.shape[0], group_size, scales.shape[0])
    z = unpack_cols(qzeros, AWQ_REVERSE_ORDER)[:, :n].float()
    return Int4Codes(
        q[:, :n].t().to(torch.uint8).contiguous(),
        scales.float().t().contiguous(),
        z.t().contiguous(),
        group_size,
    )

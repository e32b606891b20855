"""GGUF's Q4_0, Q4_1, Q4_K, Q5_0 and Q8_0 blocks repacked at load straight into the 16-row
blocks of ``cpu_qmatmul.interleave`` (``gguf_repack.cpp``, one pass over the file's bytes a row
at a time): the bytes ``interleave`` builds from the codes that ``loading.gguf_quant`` decodes,
with none of the unpacked codes, rows and temporaries in between.

``blocks_kind`` says which layout a module takes this way (None: the general path); ``repack``
writes a tensor's rows into it, ``pad`` the rows past the weight's last, and
``QuantLinear.adopt_blocks`` takes the result as the module's buffers. ``dequantize`` expands
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K tensors (an embedding table) to float32 or bfloat16, as
the gguf package's dequantizers and a copy into a tensor of that dtype do.
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache

import torch

from foudre.native import build as native
from foudre.quant import cpu_qmatmul

SOURCE = native.SOURCES / "gguf_repack.cpp"
_P, _I64 = ctypes.c_void_p, ctypes.c_int64

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 8, 12, 13, 14  # ggml's type numbers
BLOCK_BYTES = {Q4_0: 18, Q5_0: 22, Q8_0: 34}  # a block of 32 values' bytes
# the 4-bit types with mins, as int4x16 with float32 scales and zero points stored
# ("int4x16z"): bytes per 32 values
MIN_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q4_K: 18}
_ZC = {"int4x16": 8.0, "int8x16": 0.0}  # the one zero point of each layout's blocks


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    dll = native.load(SOURCE)
    if dll is not None:
        fn = dll.foudre_gguf_x16
        fn.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I64, _P, _I64, _I64, _P, _I64]
        fn.restype = _I64
        fn = dll.foudre_gguf_x16_zeros
        fn.argtypes = [ctypes.c_int, _P, _I64, _P, _I64, _I64, _P, _I64, _P, _P]
        fn.restype = _I64
        fn = dll.foudre_gguf_int6
        fn.argtypes = [_P, _P, _I64, _I64, _P, _P, _I64]
        fn.restype = _I64
        fn = dll.foudre_gguf_dequantize
        fn.argtypes = [ctypes.c_int, _P, _I64, _P, ctypes.c_int]
        fn.restype = _I64
    return dll


def blocks_kind(types: list[int], bits: int, group: int, zero_point: bool, k: int) -> str | None:
    """The 16-row layout that ``cpu_qmatmul`` would repack a module to (``interleaves``) and that
    ``repack`` builds from tensors of ggml ``types`` held in ``bits`` and ``group`` (the module's
    layout): ``"int4x16"`` for Q4_0 parts only held in 4 bits (K a multiple of 128),
    ``"int4x16z"`` (``"int4x16"`` with float32 scales and zero points stored) for Q4_1 and Q4_K
    parts, and Q4_0 beside them, held in 4 bits (K a multiple of 256),
    ``"int8x16"`` for Q4_0, Q5_0 and Q8_0 parts held in 8 bits without zero points (K a multiple
    of 64); None otherwise, or where the kernels do not repack (``cpu_qmatmul.repacks``), or
    where the library did not build."""
    if group != 32 or not cpu_qmatmul.repacks() or _library() is None:
        return None
    if bits == 4 and all(t == Q4_0 for t in types) and k % 128 == 0:
        return "int4x16"
    if bits == 4 and all(t in MIN_BLOCK_BYTES for t in types) and k % 256 == 0:
        return "int4x16z"
    if bits == 8 and not zero_point and all(t in BLOCK_BYTES for t in types) and k % 64 == 0:
        return "int8x16"
    return None


def held_as(kind: str) -> tuple[str, float, bool]:
    """How a module holds blocks of ``kind``: ``Packed``'s kind, ``zc`` (the zero point every
    group has where none are stored) and whether zero points are stored."""
    return ("int4x16", 0.0, True) if kind == "int4x16z" else (kind, _ZC[kind], False)


def shape(kind: str, n: int, k: int) -> tuple[int, int]:
    """The shape of an ``[n, k]`` weight in ``kind``'s blocks (uint8 ``[ceil(n / 16), bytes]``;
    float16 scales, float32 ones and zero points for ``"int4x16z"``)."""
    per_group = {"int4x16": 288, "int4x16z": 384, "int8x16": cpu_qmatmul.X16_CODES + 32}[kind]
    return -(-n // 16), k // 32 * per_group


def _check_room(kind: str, dst: torch.Tensor, rows: int, k: int) -> None:
    """``dst`` must be contiguous uint8 blocks of ``kind`` over ``k`` columns, at least
    ``rows`` rows of them (the native code writes there unchecked)."""
    blocks, width = shape(kind, rows, k)
    if (
        dst.dtype != torch.uint8
        or not dst.is_contiguous()
        or dst.dim() != 2
        or dst.shape[1] != width
        or dst.shape[0] < blocks
    ):
        raise ValueError(
            f"dst must be contiguous uint8 [>= {blocks}, {width}] ({kind}, {rows} rows, k={k}), "
            f"got {dst.dtype} {tuple(dst.shape)}"
        )


class ZeroPoints:
    """A module's zero points as ``repack`` builds its parts' ``"int4x16z"`` blocks: the first,
    and how many groups' differ from it. All alike, the general path holds none (one
    ``Packed.zc`` instead): the caller takes that path then."""

    def __init__(self) -> None:
        self.first = ctypes.c_float(math.nan)
        self.differ = ctypes.c_int64(0)

    def alike(self) -> bool:
        """Whether every zero point seen is the first's."""
        return self.differ.value == 0


def repack(
    kind: str,
    qtype: int,
    address: int,
    order: torch.Tensor | None,
    n: int,
    k: int,
    dst: torch.Tensor,
    first: int,
    zeros: ZeroPoints | None = None,
) -> bool:
    """Rows ``first .. first + n - 1`` of ``dst`` (uint8 of ``shape``) from the ``n`` rows of
    ``k`` columns of a tensor of ggml type ``qtype`` at ``address`` (its bytes, which must stay
    mapped: row ``order[i]`` the i-th where ``order`` is given); ``"int4x16z"`` counts its zero
    points in ``zeros`` (one for all of a module's parts). False where a group's values are
    ones that the general path holds otherwise (int4 from Q4_0: a ``d`` of 0, infinite or NaN,
    whose zero point is not 8; int8: a NaN ``d``; ``"int4x16z"``: a scale, min or zero point
    not finite): the caller then loads the module by that path."""
    dll = _library()
    assert dll is not None
    _check_room(kind, dst, first + n, k)
    index = None if order is None else order.to(torch.int64).contiguous()
    if index is not None and (index.shape != (n,) or bool(((index < 0) | (index >= n)).any())):
        raise ValueError(f"order must be {n} row indices below {n}, got {tuple(index.shape)}")
    rows = None if index is None else index.data_ptr()
    if kind == "int4x16z":
        if qtype not in MIN_BLOCK_BYTES or zeros is None:
            raise ValueError(f"int4x16z blocks take Q4_0, Q4_1 or Q4_K and zeros, not {qtype}")
        row_bytes = k // 32 * MIN_BLOCK_BYTES[qtype]
        special = dll.foudre_gguf_x16_zeros(
            qtype, address, row_bytes, rows, n, k, dst.data_ptr(), first,
            ctypes.byref(zeros.first), ctypes.byref(zeros.differ),
        )  # fmt: skip
    else:
        row_bytes = k // 32 * BLOCK_BYTES.get(qtype, 0)
        special = dll.foudre_gguf_x16(
            cpu_qmatmul.KINDS[kind], qtype, address, row_bytes, rows, n, k, dst.data_ptr(), first
        )
    if special < 0:
        raise ValueError(f"no {kind} blocks from ggml type {qtype}")
    return special == 0


def pad(kind: str, dst: torch.Tensor, k: int, rows: int) -> None:
    """The rows of ``dst``'s last block past a weight's ``rows`` as ``interleave`` leaves them
    (codes 0, scales and zero points 0)."""
    dll = _library()
    assert dll is not None
    _check_room(kind, dst, rows, k)
    extra = -rows % 16
    if not extra:
        return
    if kind == "int4x16z":
        first, differ = ctypes.c_float(math.nan), ctypes.c_int64(0)
        dll.foudre_gguf_x16_zeros(
            Q4_0, None, 0, None, extra, k, dst.data_ptr(), rows, ctypes.byref(first),
            ctypes.byref(differ),
        )  # fmt: skip
        return
    qtype = Q4_0 if kind == "int4x16" else Q8_0
    dll.foudre_gguf_x16(
        cpu_qmatmul.KINDS[kind], qtype, None, 0, None, extra, k, dst.data_ptr(), rows
    )


def int6_rows(
    address: int,
    order: torch.Tensor | None,
    n: int,
    k: int,
    q: torch.Tensor,
    d: torch.Tensor,
    first: int,
) -> bool:
    """Rows ``first .. first + n - 1`` of a 6-bit ``QuantLinear``'s ``q`` (``qweight``:
    ``packing.pack_int6``'s rows) and ``d`` (``scales``, float16) from the ``n`` rows of ``k``
    columns (a multiple of 256) of a Q6_K tensor at ``address`` (row ``order[i]`` the i-th
    where given): the codes and sub-scales ``pack_int6`` packs of ``decode_codes``'s, and the
    file's d. False where a d is a NaN (the caller then takes the general path)."""
    dll = _library()
    assert dll is not None
    rows = first + n
    if (
        k % 256
        or q.dtype != torch.uint8
        or q.shape[0] < rows
        or q.shape[1] != k // 16 * 13
        or d.dtype != torch.float16
        or d.shape[0] < rows
        or d.shape[1] != k // 256
        or not (q.is_contiguous() and d.is_contiguous())
    ):
        raise ValueError(
            f"int6 rows of k={k} need contiguous uint8 q [>= {rows}, {k // 16 * 13}] and float16 "
            f"d [>= {rows}, {k // 256}], got {q.dtype} {tuple(q.shape)}, {d.dtype} {tuple(d.shape)}"
        )
    index = None if order is None else order.to(torch.int64).contiguous()
    if index is not None and (index.shape != (n,) or bool(((index < 0) | (index >= n)).any())):
        raise ValueError(f"order must be {n} row indices below {n}, got {tuple(index.shape)}")
    rows_ptr = None if index is None else index.data_ptr()
    special = dll.foudre_gguf_int6(address, rows_ptr, n, k, q.data_ptr(), d.data_ptr(), first)
    return bool(special == 0)


_OUT_TYPES = {torch.float32: 0, torch.bfloat16: 2}
DEQUANTIZED = (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)  # the types ``dequantize`` takes


def dequantize(qtype: int, address: int, out: torch.Tensor) -> bool:
    """``out`` (float32 or bfloat16, contiguous) filled with the values of the tensor of ggml
    type ``qtype`` (``DEQUANTIZED``) at ``address`` (its bytes, which must stay mapped; as many
    values as ``out`` has): in float32 as the gguf package computes them, then rounded to
    ``out``'s dtype. False, ``out`` untouched, where
    the type or dtype is not one it takes, where a ``d`` is infinite or a NaN (NaN values,
    whose bfloat16 bits torch's vector code chooses), or where the library did not build."""
    dll = _library()
    if dll is None or qtype not in DEQUANTIZED or out.dtype not in _OUT_TYPES:
        return False
    assert out.is_contiguous() and out.device.type == "cpu"
    code = dll.foudre_gguf_dequantize(
        qtype, address, out.numel(), out.data_ptr(), _OUT_TYPES[out.dtype]
    )
    return bool(code == 0)

"""Our native CPU kernels for weight-only quantized linears (``cpu_qmatmul.cpp``):
``y [M, N] = x [M, K] @ dequant(W)^T`` for the weights of ``foudre.quant.packing``: int8 per
channel, int8 group-wise with a scale and an optional zero point per group of 16 columns or more
(GGUF's Q8_0, Q5_0, Q5_1 and Q5_K as QuantLinear holds them), int4 group-wise and int6
(GGUF's Q6_K, ``packing.pack_int6``); x float32 or bfloat16, y in x's dtype.

Each task streams its weight rows once for every row of x (for one row of x, 16 rows on the
VNNI path and 8 on the AVX2 one, one after another, 8 at once on the float paths). With
AVX512-VNNI, and on AVX2 CPUs without AVX-512 (``vpmaddubsw``, ``vpmaddwd``), the activations
are quantized to int8 per block (``activation_block``: 32 columns for group-wise int8, as
llama.cpp's Q8_0, 64 or 128 for int4 and per-channel int8, 128 for int6) and multiplied by
vpdpbusd (AVX2: vpmaddubsw), so results differ from dequantize-then-matmul by that rounding
(each x within half its block's ``max|x| / 127``); the AVX-512 path without VNNI and the
portable one multiply in float32. ``layout`` is the kernels' view of ``QuantLinear``'s buffers
(the buffers themselves, no copy, for the usual shapes); ``matmul`` runs it. ``path()`` names
the path the library was built with, None where it did not build. On the VNNI path GGUF's Q8_0
and Q5_0 (int8 in groups of 32, one zero point) and int4 (ours, GPTQ, AWQ, GGUF's Q4_x) are
repacked in blocks of 16 rows (``interleave``): the same codes and scales, read faster.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache, lru_cache

import torch
import torch.nn.functional as F

from foudre.layers.linear import gemm_dtype
from foudre.native import build as native

SOURCE = native.SOURCES / "cpu_qmatmul.cpp"
PATHS = ("portable", "avx512", "vnni", "avx2", "neon", "dotprod", "i8mm")
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    dll = native.load(SOURCE)
    if dll is None:
        return None
    grouping = [ctypes.c_int, _I64, _I64, _I64]  # scale type, groups, group, scales' row stride
    for suffix in DTYPES.values():
        # kind, x, q, s, z, zc, ..., y, m, n, k
        qmm = [ctypes.c_int, _P, _P, _P, _P, ctypes.c_float, *grouping, _P, _I64, _I64, _I64]
        getattr(dll, f"foudre_qmm_{suffix}").argtypes = qmm
        # kind, q, s, z, zc, ..., out, n0, n1, k
        dequantize = [ctypes.c_int, _P, _P, _P, ctypes.c_float, *grouping, _P, _I64, _I64, _I64]
        getattr(dll, f"foudre_dequantize_{suffix}").argtypes = dequantize
    dll.foudre_qmm_amx_rows.argtypes = [ctypes.c_int, _I64]  # kind, group
    return dll


def function(dtype: torch.dtype) -> int | None:
    """The address of the kernels' entry point for activations in ``dtype`` (``foudre_qmm_f32``
    or ``_bf16``, which the native decode step calls), None where it did not build."""
    dll = _library()
    if dll is None or dtype not in DTYPES:
        return None
    return ctypes.cast(getattr(dll, f"foudre_qmm_{DTYPES[dtype]}"), ctypes.c_void_p).value


@cache
def amx_rows(bits: int = 8, group_size: int | None = None, blocks: bool = False) -> int:
    """The fewest rows from which a layout runs on AMX's int8 tiles (where the CPU has them and
    Linux grants this process their state; ``FOUDRE_AMX=0`` declines them), rounding differently
    from the VNNI kernel below them: int8 per channel, int4 in groups of 128 or more, and
    int8 and int4 in groups of 32 (GGUF's Q8_0, Q5_x; Q4_0, Q4_1, Q4_K); 0 where it never
    does. ``blocks``: the layout in blocks of 16 rows (``interleave``: group-wise int8 and int4),
    which take the tiles from the same rows, and int4 in groups of 64 too (from 12)."""
    dll = _library()
    if dll is None:
        return 0
    kind = {8: "int8" if group_size is None else "int8g", 4: "int4", 6: "int6"}.get(bits)
    if blocks and kind in ("int8g", "int4"):
        kind = "int8x16" if kind == "int8g" else "int4x16"
    return 0 if kind is None else int(dll.foudre_qmm_amx_rows(KINDS[kind], group_size or 0))


@lru_cache(maxsize=1)
def path() -> str | None:
    """``"vnni"``, ``"avx2"``, ``"avx512"``, ``"neon"``, ``"dotprod"``, ``"i8mm"`` (Arm with SDOT,
    and with SMMLA too) or ``"portable"``: the path the library was built for; None where it did
    not build (asked every decode step: one library, one answer)."""
    dll = _library()
    return None if dll is None else PATHS[dll.foudre_qmm_path()]


ROUNDING_PATHS = ("vnni", "avx2", "dotprod", "i8mm")  # the paths that round x to int8 per block
# the paths that serve models (not the portable one)
NATIVE_PATHS = ("vnni", "avx2", "avx512", "neon", "dotprod", "i8mm")


def rounds_activations() -> bool:
    """Whether this build's path rounds x to int8 per block (``activation_block``) before its
    integer products: VNNI (AVX-512), AVX2 and Arm's dotprod and i8mm, the same rounding; the
    float paths do not."""
    return path() in ROUNDING_PATHS


KINDS = {"int8": 0, "int8g": 1, "int4": 2, "int6": 3, "int8x16": 4, "int4x16": 5}
SCALE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class Packed:
    """A weight as the kernels read it (``layout``): ``kind`` ``"int8"`` (per channel, ``s``
    ``[N]``), ``"int8g"`` (group-wise int8), ``"int4"`` or ``"int6"`` (``s`` the ``d`` per 256
    columns, ``zc`` 32), with ``s`` and ``z`` ``[N, groups]``
    in one dtype (float32, float16 or bfloat16), ``z`` None where every zero point is ``zc``
    (0 for symmetric int8, 8 for GGUF's Q4_0: the kernels then read no zero points); ``k`` the
    input features (padded). ``s`` and ``z`` rows may be further apart than their length, by
    one stride (``pair_scales``). ``"int8x16"`` and ``"int4x16"``: group-wise int8 in groups of
    32, or int4, repacked in blocks of 16 rows (``interleave``), ``w`` the blocks ``[ceil(N /
    16), bytes]`` with the scales (and zero points) inside, ``s`` an empty tensor of their dtype,
    ``z`` None or (int4, its zero points stored in the blocks) an empty one, ``n`` the rows N."""

    kind: str
    w: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor | None
    group: int | None
    k: int
    zc: float = 0.0
    n: int | None = None  # the weight's rows (None: w's)

    @property
    def rows(self) -> int:
        """The weight's rows N (the product's output features)."""
        return self.w.shape[0] if self.n is None else self.n

    def arguments(self) -> tuple[int, float, int, int, int, int]:
        """The kernels' arguments from the zero points to the scales' row stride: ``z``'s
        address (0: none), ``zc``, the scale type, groups, group, the stride."""
        if self.kind in BLOCKS:  # (the stride's place: 1 where the blocks hold zero points)
            group, stored = self.group or 0, int(self.z is not None)
            return 0, self.zc, SCALE_TYPES[self.s.dtype], self.k // group, group, stored
        grouped = self.kind != "int8"
        return (
            0 if self.z is None else self.z.data_ptr(), self.zc, SCALE_TYPES[self.s.dtype],
            self.s.shape[1] if grouped else 0, self.group or 0, self.s.stride(0) if grouped else 1,
        )  # fmt: skip


def layout(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    bits: int | None = None,
) -> Packed:
    """The kernels' view of ``QuantLinear``'s buffers for a ``bits``-bit weight (default: 4 for
    uint8 codes, else 8): the buffers themselves where K is a multiple of 64 (int8) or 128
    (int4, ``pack_int4``'s nibbles) and the scales float32, float16 or bfloat16 (one dtype for
    both), else copies padded with zero columns (zero scales). 6 bits (``pack_int6``'s rows, K
    a multiple of 256 already; ``bits=6`` must be given: the rows are uint8 as int4's): the
    buffers themselves."""
    bits = bits or (4 if qweight.dtype == torch.uint8 else 8)
    if bits == 6:
        k = qweight.shape[1] * 16 // 13
        s = scales if scales.dtype in SCALE_TYPES else scales.float()
        return Packed("int6", qweight.contiguous(), s.contiguous(), None, 256, k, 32.0)
    per_channel = scales.dim() == 1
    kind = "int8" if per_channel else ("int8g" if bits == 8 else "int4")
    codes_per_byte = 2 if bits == 4 else 1
    k = qweight.shape[1] * codes_per_byte
    multiple = 128 if bits == 4 else 64
    zc, zeros = _zero_point(zeros)
    if scales.dtype not in SCALE_TYPES or (zeros is not None and zeros.dtype != scales.dtype):
        scales = scales.float()
        zeros = None if zeros is None else zeros.float()
    if not _rows_alike(scales, zeros):  # one row stride for both, each row's elements adjacent
        scales = scales.contiguous()
        zeros = None if zeros is None else zeros.contiguous()
    if k % multiple:
        pad = -k % multiple
        qweight = F.pad(qweight, (0, pad // codes_per_byte))
        if not per_channel:
            assert group_size is not None
            more = -(-(k + pad) // group_size) - scales.shape[1]
            scales = F.pad(scales, (0, more))
            zeros = None if zeros is None else F.pad(zeros, (0, more))
        k += pad
    group = None if per_channel else group_size
    return Packed(kind, qweight.contiguous(), scales, zeros, group, k, zc)


X16_CODES = 512  # a block's code bytes per group of 32 columns (16 rows x 32)
INTERLEAVE_BYTES = 1 << 20  # bytes of codes ``interleave`` repacks at a time (its temporaries: ~5x)


BLOCKS = ("int8x16", "int4x16")  # the layouts in blocks of 16 rows (interleave)


def interleaves(packed: Packed) -> bool:
    """Whether ``interleave`` repacks ``packed`` (where the kernels read its blocks faster than
    its rows): group-wise int8 in groups of 32 whose zero points are one integer (GGUF's Q8_0
    and Q5_0), and int4 (ours: ``int4``, GPTQ, AWQ; GGUF's Q4_0, Q4_1, Q4_K), on the VNNI path
    (the other paths have no kernel of their own for the blocks), unless ``FOUDRE_REPACK=0``."""
    return repacks() and _has_blocks(packed)


def repacks() -> bool:
    """Whether layouts that have a form in blocks of 16 rows are repacked to it (``interleaves``):
    on the VNNI path, unless ``FOUDRE_REPACK=0``."""
    return path() == "vnni" and os.environ.get("FOUDRE_REPACK", "1") != "0"


def _has_blocks(packed: Packed) -> bool:
    """Whether ``packed`` has a form in blocks of 16 rows: int4 whose groups divide K (layout
    pads K to 128: groups of 256 may not), int8 in groups of 32 whose zero points are one
    integer."""
    if packed.kind == "int4":
        return packed.k % max(packed.group or 0, 128) == 0
    return (
        packed.kind == "int8g"
        and packed.group == 32
        and packed.z is None
        and packed.k % 64 == 0
        and float(packed.zc).is_integer()
        and -128 <= packed.zc <= 127
    )


def interleave(packed: Packed) -> Packed:
    """``packed`` repacked in blocks of 16 rows: int4 as ``_interleave_int4`` lays it out;
    group-wise int8 in groups of 32 with one zero point as ``"int8x16"`` (cpu_qmatmul.cpp's
    ``x16_codes``): per block and group the 16 rows' 32 codes plus 128 as unsigned bytes, four
    columns of each row in turn (line j, 64 bytes: columns 4 j .. 4 j + 3 of rows 0 .. 15), two
    groups' codes then their scales (16 rows each, group by group), rows past N zero. The same
    codes and scales, in one stream a block, each group's codes whole cache lines: at batch 1
    the kernel broadcasts x's 4 codes against 16 rows (no lane pairing or reduction), and AMX's
    tiles read a group's codes as they lie. ``deinterleave`` gives the rows back."""
    if not _has_blocks(packed):
        raise ValueError(
            f"interleave takes int8 in groups of 32 with one integer zero point, or int4 whose "
            f"groups divide K: {packed}"
        )
    q, s, k = packed.w, packed.s, packed.k
    n = q.shape[0]
    int4 = packed.kind == "int4"
    if int4:
        groups, size, kept = k // (packed.group or 1), s.element_size(), 1 + (packed.z is not None)
        width = groups * (8 * (packed.group or 0) + 16 * size * kept)
    else:
        width = k // 64 * 2 * (X16_CODES + 16 * s.element_size())
    # (a tensor of its own, not a view: huge_pages.place_in_huge_pages moves only storages
    # that their tensors alone hold)
    w = torch.empty(-(-n // 16), width, dtype=torch.uint8)
    # a few megabytes of rows at a time (whole blocks of 16): each block is its rows' alone, so
    # the temporaries of one piece are all that is held besides the result
    step = 16 * max(1, INTERLEAVE_BYTES // (16 * max(1, q.shape[1])))
    for r in range(0, n, step):
        z = None if packed.z is None else packed.z[r : r + step]
        part = Packed(packed.kind, q[r : r + step], s[r : r + step], z, packed.group, k, packed.zc)
        (_interleave_int4 if int4 else _interleave_int8)(part, w[r // 16 : (r + step) // 16])
    if int4:
        stored = None if packed.z is None else s.new_empty(0)
        return Packed("int4x16", w, s.new_empty(0), stored, packed.group, k, packed.zc, n)
    return Packed("int8x16", w, s.new_empty(0), None, 32, k, packed.zc, n)


def _interleave_int8(packed: Packed, w: torch.Tensor) -> None:
    """Group-wise int8 ``packed`` in ``"int8x16"`` blocks, written into ``w`` (its blocks)."""
    q, s, k = packed.w, packed.s, packed.k
    n, pairs = q.shape[0], k // 64
    blocks = -(-n // 16)
    codes = (F.pad(q, (0, 0, 0, blocks * 16 - n)).view(torch.uint8) ^ 128).view(
        blocks, 16, pairs, 2, 8, 4
    )
    scales = F.pad(s[:, : 2 * pairs].contiguous(), (0, 0, 0, blocks * 16 - n))
    scales = scales.view(blocks, 16, pairs, 2).permute(0, 2, 3, 1).contiguous()
    parts = w.view(blocks, pairs, -1)
    parts[..., : 2 * X16_CODES].view(blocks, pairs, 2, 8, 16, 4).copy_(
        codes.permute(0, 2, 3, 4, 1, 5)
    )
    parts[..., 2 * X16_CODES :].copy_(scales.view(torch.uint8).view(blocks, pairs, -1))


def _interleave_int4(packed: Packed, w: torch.Tensor) -> None:
    """int4 in blocks of 16 rows (``"int4x16"``, cpu_qmatmul.cpp's ``x4_group``): per block and
    group, per 8 columns a line of 64 bytes, 4 bytes of each row (row r's at 4 r: low nibbles its
    columns 8 j .. 8 j + 3, high nibbles 8 j + 4 .. 8 j + 7), then the group's 16 scales and,
    where they are not all ``zc`` (Q4_0's 8), 16 zero points (the Packed's ``z`` then an empty
    tensor: stored)."""
    q, s, k, group = packed.w, packed.s, packed.k, packed.group or 0
    n, groups, size = q.shape[0], k // group, s.element_size()
    blocks, pad = -(-n // 16), -n % 16
    # pack_int4's 4 bytes of 8 columns c0..c7 (byte j: c_2j low, c_2j+1 high) as one word, to
    # the line's 4 bytes (byte i: c_i low, c_i+4 high), on words: the even columns' nibbles
    # (lo: c0 c2 c4 c6) and the odd ones' (hi: c1 c3 c5 c7), each folded (byte 0: c0 | c4 << 4,
    # byte 1: c2 | c6 << 4), then interleaved byte by byte
    x = F.pad(q, (0, 0, 0, pad)).view(torch.int32)  # [n + pad, k / 8]
    lo, hi = x & 0x0F0F0F0F, (x >> 4) & 0x0F0F0F0F
    a, b = lo | (lo >> 12), hi | (hi >> 12)
    words = (a & 0xFF) | ((b & 0xFF) << 8) | ((a & 0xFF00) << 8) | ((b & 0xFF00) << 16)
    nibbles = words.view(blocks, 16, groups, group // 8)
    kept = [s[:, :groups]] + ([] if packed.z is None else [packed.z[:, :groups]])
    params = F.pad(torch.stack(kept, dim=-1), (0, 0, 0, 0, 0, pad))  # [n + pad, groups, 1 or 2]
    params = params.view(blocks, 16, groups, len(kept)).permute(0, 2, 3, 1).contiguous()
    per_group = 8 * group + 16 * size * len(kept)
    parts = w.view(blocks, groups, per_group)
    parts[..., : 8 * group].view(torch.int32).view(blocks, groups, group // 8, 16).copy_(
        nibbles.permute(0, 2, 3, 1)
    )
    parts[..., 8 * group :].copy_(params.view(torch.uint8).view(blocks, groups, -1))


def deinterleave(
    packed: Packed,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of an ``interleave``d weight: int8 codes ``[N, K]`` and scales ``[N, K / 32]``;
    int4: ``pack_int4``'s bytes ``[N, K / 2]``, scales and zero points ``[N, K / group]``."""
    if packed.kind == "int4x16":
        return _deinterleave_int4(packed)
    n, pairs, size = packed.rows, packed.k // 64, packed.s.element_size()
    blocks = packed.w.shape[0]
    parts = packed.w.view(blocks, pairs, 2 * (X16_CODES + 16 * size))
    codes = parts[..., : 2 * X16_CODES].reshape(blocks, pairs, 2, 8, 16, 4)
    codes = codes.permute(0, 4, 1, 2, 3, 5).reshape(blocks * 16, packed.k)
    q = (codes[:n] ^ 128).view(torch.int8).clone()
    scales = parts[..., 2 * X16_CODES :].contiguous().view(packed.s.dtype)
    scales = scales.view(blocks, pairs, 2, 16).permute(0, 3, 1, 2).reshape(blocks * 16, -1)
    return q, scales[:n].clone()


def _deinterleave_int4(packed: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k, group, size = packed.rows, packed.k, packed.group or 0, packed.s.element_size()
    blocks, groups, kept = packed.w.shape[0], k // group, 1 + (packed.z is not None)
    parts = packed.w.view(blocks, groups, 8 * group + 16 * size * kept)
    nibbles = parts[..., : 8 * group].reshape(blocks, groups, group // 8, 16, 4)
    nibbles = nibbles.permute(0, 3, 1, 2, 4)  # [blocks, 16, groups, lines, 4]
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-2).reshape(blocks * 16, k)[:n]
    q = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # pack_int4's bytes
    params = parts[..., 8 * group :].contiguous().view(packed.s.dtype)
    params = params.view(blocks, groups, kept, 16).permute(0, 3, 1, 2).reshape(-1, groups, kept)
    scales = params[:n, :, 0].contiguous()
    zeros = params[:n, :, 1].contiguous() if kept == 2 else torch.full_like(scales, packed.zc)
    return q, scales, zeros


def _zero_point(zeros: torch.Tensor | None) -> tuple[float, torch.Tensor | None]:
    """(zc, None) where every zero point is zc (0 without any: nothing for the kernels to read),
    else (0, zeros)."""
    if zeros is not None and zeros.numel() and bool((zeros == zeros.flatten()[0]).all()):
        return float(zeros.flatten()[0]), None
    return 0.0, zeros


def _rows_alike(scales: torch.Tensor, zeros: torch.Tensor | None) -> bool:
    """Whether the kernels can read ``scales`` (and ``zeros``) as they are: contiguous, or 2-D
    rows of adjacent elements with one row stride for both."""
    if zeros is None:
        return scales.is_contiguous() or (scales.dim() == 2 and scales.stride(1) == 1)
    if scales.dim() != 2 or zeros.shape != scales.shape:
        return False
    return scales.stride() == zeros.stride() and scales.stride(1) == 1


def _paired(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether ``zeros`` follow ``scales`` row by row in one buffer, as ``pair_scales`` leaves
    them (not just on one storage: weights in huge pages all share one)."""
    groups = scales.shape[1]
    return (
        scales.stride() == zeros.stride() == (2 * groups, 1)
        and zeros.untyped_storage().data_ptr() == scales.untyped_storage().data_ptr()
        and zeros.data_ptr() == scales.data_ptr() + groups * scales.element_size()
    )


def pair_scales(
    scales: torch.Tensor, zeros: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Group-wise scales and zero points (where the kernels read them: not all one value) as
    views of one buffer whose rows hold a row's scales, then its zero points: the kernels read
    them as one stream beside the codes', not two (a separate stream of int4 g128's zero
    points, 1.5% of the bytes, cost 18% of a batch-1 8192 x 1536 product). The same values, no
    more memory; the tensors as they are otherwise."""
    read = _zero_point(zeros)[1]
    if (
        read is None
        or scales.dim() != 2
        or read.shape != scales.shape
        or read.dtype != scales.dtype
        or scales.dtype not in SCALE_TYPES
        or scales.device.type != "cpu"
        or _paired(scales, read)
    ):
        return scales, zeros
    both = torch.stack([scales, read], dim=1)  # [N, 2, groups]
    # tensors on its storage, not views of it: a view holds ``both`` too (its ``_base``), which
    # keeps ``huge_pages.place_in_huge_pages`` from moving the storage
    storage, stride = both.untyped_storage(), (both.stride(0), both.stride(2))
    return tuple(  # type: ignore[return-value]
        scales.new_empty(0).set_(storage, i * both.stride(1), scales.shape, stride) for i in (0, 1)
    )


def activation_block(bits: int, group_size: int | None) -> int:
    """The columns of x that share one int8 scale on the VNNI path: 32 for group-wise 8-bit
    weights (llama.cpp's Q8_0 activations: the weight's scale changes every 32 columns or sooner
    anyway), 128 for per-channel int8 and 64 for int4 (the kernels sum two 64-column halves in
    int32 before one float conversion: a quarter of the float work of blocks of 32), 128 for
    int4 in groups of 128 or more (one d and one weight scale a step: their product a scalar).
    Per channel, where K = 64 mod 128, the last 64 columns are a block of their own."""
    if bits == 4:
        return 64 if group_size is not None and group_size < 128 else 128
    return 128 if group_size is None or bits == 6 else 32


def error_bound(
    x: torch.Tensor,
    w: torch.Tensor,
    bits: int = 8,
    group_size: int | None = None,
    rounds: bool | None = None,
) -> torch.Tensor:
    """A bound ``[M, N]`` on ``|matmul(x, layout(W)) - x @ w.T|`` for float32 ``x [M, K]`` and
    the dequantized ``bits``-bit weight ``w [N, K]`` (bits 4, 6 or 8), float32 outputs: the
    float32 sums' order (``1e-5 sum |x| |w|``) and, on the paths that round x
    (``ROUNDING_PATHS``), its rounding to int8 (each x within ``d / 2``, ``d = max|x| / 127``
    over its block, ``activation_block(bits, group_size)``: the default group, None, gives the
    loosest bound for either width). ``rounds``: whether the path rounds x (another build's, as
    tests/native's); None: this build's path."""
    x, aw = x.float(), w.float().abs()
    bound = 1e-5 * (x.abs() @ aw.t()) + 1e-6
    if rounds is None:
        rounds = rounds_activations()
    if rounds:
        k, span = x.shape[1], activation_block(bits, group_size)
        d = F.pad(x, (0, -k % span)).abs().reshape(x.shape[0], -1, span).amax(-1) / 127
        bound = bound + (d.repeat_interleave(span, dim=1)[:, :k] / 2) @ aw.t()
    return bound


def _check_layout(packed: Packed) -> None:
    """``ValueError`` unless ``packed`` is what the kernels read: K a multiple of 64 (128 for
    int4, 256 for int6) that the codes hold, and a group-wise layout's groups a power of two,
    at least 16 columns (32 for int4), covering the padded columns (int6: one d per 256)."""
    if packed.kind in BLOCKS:
        k, w, size = packed.k, packed.w, packed.s.element_size()
        group = packed.group or 0
        stored = 1 + (packed.z is not None)
        per_group = (
            X16_CODES + 16 * size if packed.kind == "int8x16" else 8 * group + 16 * size * stored
        )
        shape = (-(-packed.rows // 16), k // max(group, 1) * per_group)
        if (
            k % 64
            or (packed.kind == "int4x16" and k % max(group, 128))
            or tuple(w.shape) != shape
            or w.dtype != torch.uint8
            or not w.is_contiguous()
            or packed.group != (32 if packed.kind == "int8x16" else max(group, 32))
            or group & (group - 1)
            or (packed.z is not None and (packed.kind == "int8x16" or packed.z.numel()))
        ):
            raise ValueError(
                f"{packed.kind} blocks {tuple(w.shape)} for {packed.rows} x {k}: the kernels take "
                f"{shape} contiguous uint8, K a multiple of 64 (of 128 for int4), groups of "
                "32 (int4: a power of two from 32), z None (int4: or an empty tensor, zero "
                "points stored) (interleave)"
            )
        return
    if packed.kind == "int6":
        s, k, w = packed.s, packed.k, packed.w
        n = w.shape[0] if w.dim() == 2 else -1
        checks = {
            f"K = {k} a multiple of 256": k % 256 == 0,
            "rows of 13 K / 16 bytes": w.dim() == 2 and w.shape[1] * 16 == k * 13,
            "a contiguous d [N, K / 256]": s.shape == (n, k // 256) and s.is_contiguous(),
            "group 256, zc 32, no zero points": (packed.group, packed.zc, packed.z)
            == (256, 32, None),
        }
        wrong = [what for what, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(
                f"int6 rows {tuple(w.shape)}, d {tuple(s.shape)}: the kernels take "
                + "; ".join(wrong)
            )
        return
    per_byte = 2 if packed.kind == "int4" else 1
    multiple = 128 if packed.kind == "int4" else 64
    if packed.k % multiple or packed.w.dim() != 2 or packed.w.shape[1] * per_byte != packed.k:
        raise ValueError(
            f"{packed.kind} codes {tuple(packed.w.shape)} for {packed.k} columns: the kernels "
            f"take K a multiple of {multiple} (cpu_qmatmul.layout pads)"
        )
    if packed.kind == "int8":
        return
    s, z = packed.s, packed.z
    if s.dim() != 2 or not _rows_alike(s, z):
        raise ValueError(
            "group-wise scales and zero points must be 2-D rows of adjacent elements with one "
            f"shape and row stride, got {tuple(s.shape)} {s.stride()} and "
            f"{None if z is None else (tuple(z.shape), z.stride())}"
        )
    group, least = packed.group or 0, 32 if packed.kind == "int4" else 16
    if group < least or group & (group - 1) or packed.s.shape[1] * group < packed.k:
        raise ValueError(
            f"group-wise scales {tuple(packed.s.shape)} do not cover {packed.k} columns in "
            f"groups of {group} (a power of two, {least} or more)"
        )


def round_like_kernel(x: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """``x`` ``[..., K]`` as the VNNI and AVX2 paths round it (the oracle of their tests): codes
    ``round(x * 127 / a)`` (ties to even, as ``vcvtps2dq``) times ``a / 127``, ``a`` the largest
    ``|x|`` of the block, ``activation_block(bits, group_size)`` columns (for int4 weights the
    even and the odd columns of 64 share their scale, so the two halves of a byte's products add
    up in int32)."""
    k = x.shape[-1]
    span = activation_block(bits, group_size)
    xb = F.pad(x.float().reshape(-1, k), (0, -k % span)).reshape(-1, -(-k // span), span)
    amax = xb.abs().amax(-1, keepdim=True)
    # one division, as the kernel (127 / a, not 127 * (1 / a): a scalar over a tensor rounds
    # twice in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv)
    return (codes * (amax / 127.0)).reshape(xb.shape[0], -1)[:, :k].reshape(x.shape).to(x.dtype)


def _prepared(x: torch.Tensor, packed: Packed) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The library, and ``x`` checked and padded with zero columns to the weight's (padded)
    input features; the layout's groups checked."""
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build: use the aten kernels (quant.kernels)")
    if x.dtype not in DTYPES or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 or bfloat16 CPU tensor, got {x.dtype} {x.shape}")
    k = packed.k
    if x.shape[1] > k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k} (padded)")
    _check_layout(packed)
    return dll, (F.pad(x, (0, k - x.shape[1])) if x.shape[1] != k else x).contiguous()


def matmul(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """``x [M, K] @ W^T`` (no bias) for a ``layout``; ``x`` float32 or bfloat16 on the CPU.
    ``[M, N]`` in x's dtype."""
    dll, x = _prepared(x, packed)
    k, m, n = packed.k, x.shape[0], packed.rows
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return y
    fn = getattr(dll, f"foudre_qmm_{DTYPES[x.dtype]}")
    fn(
        KINDS[packed.kind], x.data_ptr(), packed.w.data_ptr(), packed.s.data_ptr(),
        *packed.arguments(), y.data_ptr(), m, n, k,
    )  # fmt: skip
    return y


DEQUANTIZED_CHUNK_BYTES = 4 << 20  # the weight rows dequantized at a time (L2/L3-sized)


def dequantize_rows(packed: Packed, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``n0:n1`` of the weight, ``(q - z) s`` in float32 (``QuantLinear.dequantize``'s
    values) then in ``dtype`` (float32 or bfloat16), ``[n1 - n0, k]``."""
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build")
    out = torch.empty(n1 - n0, packed.k, dtype=dtype)
    _dequantize_into(dll, packed, n0, n1, out)
    return out


def _dequantize_into(dll: ctypes.CDLL, packed: Packed, n0: int, n1: int, out: torch.Tensor) -> None:
    getattr(dll, f"foudre_dequantize_{DTYPES[out.dtype]}")(
        KINDS[packed.kind], packed.w.data_ptr(), packed.s.data_ptr(), *packed.arguments(),
        out.data_ptr(), n0, n1, packed.k,
    )  # fmt: skip


def matmul_dequantized(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """``matmul``'s product for large batches: the weight dequantized to x's dtype a few rows
    at a time (``foudre_dequantize_*``: ``(q - z) s`` in float32, as ``QuantLinear.dequantize``,
    then rounded to x's dtype; bfloat16 x where torch's bfloat16 GEMM is slow: kept in float32,
    ``layers.linear.gemm_dtype``, the result rounded) and multiplied by torch's GEMM, which
    outruns the integer kernel when the batch makes the step compute-bound (prefill chunks). As
    ``forward_reference`` computes, up to the GEMM's summation order."""
    dll, x = _prepared(x, packed)
    k, n = packed.k, packed.rows
    if n == 0 or x.shape[0] == 0:
        return torch.zeros(x.shape[0], n, dtype=x.dtype)
    # (bfloat16 in float32 where torch's bfloat16 GEMM is slow: layers.linear.gemm_dtype)
    dtype = gemm_dtype(x.dtype)
    xg = x.to(dtype)
    rows = max(16, DEQUANTIZED_CHUNK_BYTES // (k * xg.element_size()) // 16 * 16)
    w = torch.empty(min(rows, n), k, dtype=dtype)
    parts = []
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        _dequantize_into(dll, packed, n0, n1, w[: n1 - n0])
        parts.append(F.linear(xg, w[: n1 - n0]).to(x.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

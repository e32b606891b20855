// Weight-only quantized linears on the CPU: y [M, N] = x [M, K] @ W^T for
//   int8 per output channel   w = q * s               (s [N])
//   int8 group-wise            w = (q - z[g]) * s[g]   (z optional: GGUF's Q8_0, Q5_0, Q6_K without,
//                                                       Q5_1, Q5_K with; groups of 16 columns or more)
//   int4 group-wise            w = (q - z[g]) * s[g]   (codes 0..15, groups of 32 or more)
//   int6 (GGUF's Q6_K)         w = (q - 32) * d[b] * sc[j]  (codes 0..63, an int8 sc per 16
//                                                       columns, a d per block b of 256)
//   int8 in blocks of 16 rows  w = (q - zc) * s[g]      (group-wise int8 in groups of 32 with
//                                                       one integer zero point, Q8_0 and Q5_0,
//                                                       repacked at load: x16_codes, -- Int8x16 --)
//   int4 in blocks of 16 rows  w = (q - z[g]) * s[g]    (int4 in groups of 128 or more, repacked
//                                                       at load: x4_group, -- Int4x16 --)
// x and y float32 or bfloat16. Bound by reading the weight: each task takes R weight rows (for
// one x row on the VNNI path 16 and on the AVX2 path 8, one after another, so that a thread
// reads one sequential stream: Vnni::strip, Avx2's Tile<1, 8>::strip; 4 for more, 2 on the
// AVX2 path) and multiplies them with every x row (four at a time, the weight rows coming from
// memory once and then from L1), the tasks split over torch's OpenMP threads by output-row
// ranges.
//
// The kernels read QuantLinear's own buffers, no copy: int8 codes [N, K] (K a multiple of 64),
// int4 codes [N, K / 2] as packing.pack_int4 lays them (column 2j in the low nibble of byte j,
// 2j + 1 in the high one; K a multiple of 128), int6 rows [N, 13 K / 16] as packing.pack_int6
// lays them (K a multiple of 256; per 128 columns 104 bytes: the low nibbles as int4's, the top
// two bits, the int8 sub-scales: a row one sequential stream), scales and zero points [N, groups]
// in float32, float16 or bfloat16 (st: 0, 1, 2), their rows s_stride elements apart
// (QuantLinear pairs a row's scales and zero points in one buffer: cpu_qmatmul.pair_scales, one
// stream where a separate one of zero points cost 18% at batch 1). The loops over tasks prefetch
// the scales and zero points of a task ahead (prefetch_scale_rows): a row's are a few lines,
// too short a stream for the hardware prefetcher, and waiting on them halved the speed of groups
// of 32, and of int4 g128 rows of 4096 codes with zero points at batch 1. The weight rows are
// prefetched kAhead bytes (8 KiB) ahead of the line each step reads: at batch 1 a core's stream
// is bound by the misses it keeps in flight, not by the DRAM (one thread read a cold Q8_0
// 8192 x 1536 weight at 22-23 GB/s however fast its loop, two at 33-35), and these prefetches add
// to them: 27 GB/s and 40-43 (Zen 4, 4 KiB ahead then; a 64-projection int4 decode step's
// products 1.10x, int8's 1.04-1.13x, in interleaved pairs).
//
// Five paths, by what the compiler targets (built with -march=native), and AMX's tiles beside
// the first:
//   VNNI      (AVX512-VNNI): x quantized to int8 per block (d = max|x| / 127; 32 columns for
//             group-wise int8, as llama.cpp's Q8_0; 128 per channel, for int6 and for int4 in
//             groups of 128 or more, 64 for smaller int4 groups: their steps sum two 64-code
//             halves in int32 before one conversion), the weight codes as the unsigned operand
//             of vpdpbusd (int8 codes + 128, int4 and int6 codes as they are):
//             sum_k u_k q_k per 4 columns in int32 lanes (group-wise int8: two such lanes
//             summed, 8 columns), scaled per lane by d
//             and the group's scale into float32 accumulators; the offsets (128, z) are taken off
//             in each lane's int32 sum where they are one integer in groups under 128 (Q4_0's 8,
//             Q8_0's 128: vpdpbusd starts from -(z [+ 128]) times the lane's sum of x codes;
//             int6's 32 always), else at the end through the sums of x's codes per group: y =
//             sum_g s_g (sum d u q - (z_g [+ 128]) sum_{k in g} d q_k). For int4 and int6, x's
//             codes are stored in the order of the nibbles (per 128 columns: the even columns,
//             then the odd ones), so one AND (low) or shift and AND (high) of 64 code bytes lines
//             them up with 64 of x's. The loops of groups under 128 are compiled for their
//             scales' type.
//   AMX       (beside VNNI, where the CPU has AMX's int8 tiles and Linux grants them): int8 per
//             channel from 4 x rows, int4 in groups of 128 or more from 8, int8 in groups of
//             32 from 6 (in 16-row blocks too: amx_x16), int4 in groups of 32 from 12 (int4 in
//             16-row blocks from 8: amx_x4), on tile
//             products of 16 weight rows by 16 x rows (see "-- AMX --" below); x rounded as for
//             VNNI.
//   (the 16-row blocks, repacked where VNNI serves them: their own kernels, "-- Int8x16 --" and
//   "-- Int4x16 --"; without VNNI the float paths' arithmetic over their dequantized rows, x not
//   rounded)
//   AVX-512   the codes widened to float32, dequantized, multiplied with x in float32: no
//             activation rounding.
//   AVX2      (without AVX-512; with FMA and F16C): the VNNI path's arithmetic on 8 lanes (see
//             "-- AVX2 --" below); x rounded as there.
//   NEON      (Arm, aarch64): with dotprod (SDOT) the AVX2 path's rounding of x and integer
//             products, with i8mm (SMMLA) too for pairs of x rows (see "-- NEON dotprod / i8mm
//             --" below); without them the AVX-512 float path's arithmetic on 4 lanes (int6:
//             portable either way).
//   portable  the same in plain loops.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FOUDRE_AVX512 1
#if defined(__AVX512VNNI__)
#define FOUDRE_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#define FOUDRE_AMX 1
#endif
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FOUDRE_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define FOUDRE_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define FOUDRE_DOTPROD 1
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define FOUDRE_I8MM 1
#endif
#endif
#endif

namespace {

enum class Kind { Int8, Int8Grouped, Int4, Int6, Int8x16, Int4x16 };
enum ScaleType { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16: the high half of a float32
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float half_to_float(uint16_t h) {
#if defined(FOUDRE_AVX512)  // one instruction (the scalar below: a branch and a few shifts)
  return _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h))));
#elif defined(FOUDRE_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 31, man = h & 1023;
  float f;
  if (exp == 0) {  // zero or subnormal
    f = std::ldexp(static_cast<float>(man), -24);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= sign;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const uint32_t u = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
// element i of a scale array of type st
inline float scale_at(const void* p, int64_t i, int st) {
  if (st == kF32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return st == kF16 ? half_to_float(h) : to_float(h);
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) {  // round to nearest even, NaN to a quiet NaN
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *p = std::isnan(v) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <typename T>
struct Args {
  const T* x;        // [m, k]
  const uint8_t* w;  // codes, rows of row_bytes
  int64_t row_bytes;
  const void* s;  // [n] (int8) or [n, groups] with rows s_stride elements apart, of type st
  const void* z;  // as s (the same row stride), or null: every zero point is zc
  float zc;
  int st;
  int64_t groups, group, s_stride;
  int gshift;  // log2(group): groups are powers of two
  T* y;        // [m, n]
  int64_t m, n, k;
  // VNNI, AVX2: x quantized ([m, k] int8, int4 and int6: in nibble order), d per 4 codes
  // ([m, k / 4]; group-wise int8: VNNI per 8, [m, k / 8], AVX2 per 32, [m, k / 32]), the sums
  // d q per row (int8) or per group ([m] or [m, groups])
  const int8_t* xq;
  const float* dl;
  const float* corr;
  // where a lane's dot starts (int6; groups under 128 whose zero points are all one integer
  // zc, the offset within 384): minus the codes' offset (int6 32, int4 zc, int8 zc + 128) times
  // the sum of x's codes over the lane's columns, per step and lane ([m, k / 8] int6 and int4,
  // [m, k / 4] int8); else null
  const int32_t* xs;
  // VNNI, group-wise int8 in groups of 32: x's d per 32 columns ([m, k / 32]; in 16-row blocks
  // with xs as -(zc + 128) times the sums of x's codes per 32 columns, both [m, k / 32], their
  // rows padded to 16 where the tiles run); else null
  const float* d32;
  // AVX2, int6: 32 times the sums of x's codes per pair of positions and the pair 64 on ([m, k / 4])
  const int16_t* xo;
};

// The weight rows of the task at n0 (past the end: row n - 1 again, its results not stored).
template <int R, typename T>
void row_ptrs(const Args<T>& a, int64_t n0, const uint8_t** wr, int64_t* nr) {
  for (int r = 0; r < R; ++r) {
    nr[r] = std::min<int64_t>(n0 + r, a.n - 1);
    wr[r] = a.w + nr[r] * a.row_bytes;
  }
}

// prefetch the line at address p (an integer: it may lie past a buffer) into L2
[[gnu::always_inline]] inline void prefetch_l2(uintptr_t p) {
#if defined(__GNUC__)
  __builtin_prefetch(reinterpret_cast<const void*>(p), 0, 2);
#else
  (void)p;
#endif
}

// prefetch the line `ahead` bytes past p, which may lie past the buffer (a prefetch never
// faults; the address is formed as an integer, not as a pointer past the object). Stream: the
// rows of a batch-1 task (one at a time), each line read once, into L2 (prefetcht1). It had been
// non-temporal (prefetchnta: on Zen 4 1.00-1.025x T0), which on an Intel Xeon (AMX, 480 MB L3)
// read cold 4096 x 1536 weights at batch 1 at half the speed: two threads, int8 10.5 GB/s
// against 24-25 with T1 (T0 23-24, none 21; a plain read 31), Q8_0 10.8 / 20-22, int4 g128
// 11.4 / 18-21, Q4_0 9.2 / 14. Else (tasks of several rows, whose tiles read their rows again
// from the caches, and the float path's 8 rows a task, more lines in flight than an L1 holds)
// into every level (T0)
template <bool Stream>
[[gnu::always_inline]] inline void prefetch_ahead(const void* p, int64_t ahead) {
#if defined(__GNUC__)
  const auto* line = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + ahead);
  __builtin_prefetch(line, 0, Stream ? 2 : 3);
#else
  (void)p;
  (void)ahead;
#endif
}

// how far ahead of its reads a task prefetches its weight rows (one thread on a cold Q8_0
// weight: 512 bytes 0.85x of none, 1024 1.05x, 2048 1.12x, 4096 1.24x, 8192 and 16384 1.19-1.23x;
// a whole int4 decode step's products: 2048 0.94x and 8192 0.99x of 4096, in an hour when a
// plain read of the memory ran at ~45 GB/s. Where it ran at ~70 (the host's bandwidth drifts),
// two threads on chains of cold 4096 x 1536 weights: int8 53-55 GB/s at 4096, 57-59 at 8192
// (non-temporal; 12288-24576 no better), int4 g128 50-51 and 53, Q4_0 44 and 47, Q8_0 52 and
// 54, int6 51 and 54; at ~45 the same or 1.02-1.05x; 16 rows of int8 1.27x, 4 rows and int4's
// tiles unchanged)
constexpr int64_t kAhead = 8192;

// Guided tasks: the parallel loops of the products over weight rows (not dequantize's, for the
// prefill GEMMs) hand out their tasks guided: each chunk a thread takes is its share of the
// tasks left (libgomp: the tasks left over the threads; libomp half that), down to one task. The
// first chunks are long sequential streams, and a thread that finishes early takes the next
// chunk, which with two threads mostly starts where its last one ended, instead of waiting. In
// equal static shares one of two threads finished its share of a projection 5 us before the
// other on average (0.32 ms of the products' 4.9 ms in a batch-1 int4 decode step, summed), the
// other's tail reading alone at one thread's speed. Guided, interleaved, a 494.7M Llama's decode
// layers: 0.97-0.99x the time at batch 1 (int4), 0.95-0.98x (int8), 0.97x at 16 rows (int4);
// dynamic chunks of 64 rows (a stream restarting at each) 1.18x, of 16 rows 1.39x. A row's
// result is the same bits whichever thread computes it.

// The scales and zero points of the rows [first, first + count) (none past the last row), every
// cache line of them, into L2: what a task some rows on will read (kTaskScalesAhead tasks; at
// batch 1 the next strip), prefetched by the loops over tasks as each task begins. Before, each
// task prefetched its own rows' scales as its steps began, in a function of its own, which GCC
// left out of most of the object code (every batch-1 strip, the bfloat16 tiles: no prefetcht0
// there), and which came late where it ran: at batch 1 a row of 4096 int4 codes waited on its
// group scales and zero points (one thread, chains of cold 1536 x 4096 int4 g128 weights:
// 24.6-25.3 GB/s, 36.1 prefetched a strip ahead; 4096 x 1536 33.4 -> 34.1; a 494.7M Llama's int4
// decode layers 0.963x the time, interleaved, on two threads; at 16 rows 0.986x). It, its
// lambda and prefetch_l2 always inlined, so that nothing decides it does nothing (with the
// lambda left to the compiler, no prefetcht1 was left in any loop's object code); into L2 (T1),
// as a strip's scales in small groups of wide rows run to tens of KiB.
template <typename T>
[[gnu::always_inline]] inline void prefetch_scale_rows(const Args<T>& a, int64_t first,
                                                       int64_t count) {
  count = std::min(count, a.n - first);
  if (count <= 0) return;
  const auto s = reinterpret_cast<uintptr_t>(a.s), z = reinterpret_cast<uintptr_t>(a.z);
  const int64_t size = a.st == kF32 ? 4 : 2, stride = a.s_stride * size;
  const int64_t span = std::max<int64_t>(a.groups, 1) * size;  // a row's scales (or zero points)
  // zero points paired with the scales (cpu_qmatmul.pair_scales): inside each scale row's stride
  const bool paired = z != 0 && z >= s && z < s + static_cast<uintptr_t>(stride);
  const auto lines = [&](uintptr_t base, int64_t row_bytes) __attribute__((always_inline)) {
    const uintptr_t from = (base + first * stride) & ~uintptr_t{63};
    const uintptr_t to = base + (first + count - 1) * stride + row_bytes;
    for (uintptr_t p = from; p < to; p += 64) prefetch_l2(p);
  };
  lines(s, paired ? static_cast<int64_t>(z - s) + span : span);
  if (z != 0 && !paired) lines(z, span);
}

// how many tasks ahead for_tiles prefetches the scales (tasks of RM rows, or at batch 1 of R1)
constexpr int64_t kTaskScalesAhead = 2;

// x's rows a pass over the weights takes on the AVX2 path (the others, whose engine batches stay
// under 64 rows, take x whole): each task's tiles read every row of its panel, which must stay
// in the core's L2 (at 512 rows x 1536 columns, 768 KiB of int8 codes read again from
// L3 by every task, the AVX2 kernel fell from 181 GFLOP/s at 64 rows to 146): 128 KiB of codes,
// 32 to 64 rows (with 32 rows or more the products are compute-bound, and reading the weights
// once a panel costs little beside them; fewer would multiply a batch's weight reads)
constexpr int64_t kPanelBytes = 128 << 10;

// the threads a parallel loop runs on (torch's OpenMP setting; 1 without OpenMP)
inline int64_t threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// The parallel loop: tasks of R weight rows, x's rows in tiles of four (then the one to three
// left); Tile<MT, R>::run(a, m0, n0) computes y[m0 : m0 + MT, n0 : n0 + R]. One x row: tasks of
// R1 rows (the VNNI kernels 1, where their strips of 16 would leave threads idle: one
// sequential stream a thread, where 8 rows interleaved, each a short stream of its own, ran
// 0.8x as fast; the AVX2 kernels 8, summed one row after another, or 1 where their strips
// would leave threads idle; the float paths 8, which share each x load among them); more:
// tasks of RM rows (4; the AVX2 kernels 2, whose 16 registers hold 4 x 2 accumulators).
// The tasks are handed out guided (see guided tasks above).
template <template <int, int> class Tile, int R1, int RM = 4, typename A>
void for_tiles(const A& a) {
  if (a.m == 1) {
#pragma omp parallel for schedule(guided)
    for (int64_t n0 = 0; n0 < a.n; n0 += R1) {
      prefetch_scale_rows(a, n0 + kTaskScalesAhead * R1, R1);
      Tile<1, R1>::run(a, 0, n0);
    }
    return;
  }
#if defined(FOUDRE_AVX2)
  const int64_t panel = std::max<int64_t>(32, std::min<int64_t>(64, kPanelBytes / a.k / 4 * 4));
#else
  const int64_t panel = a.m;  // (measured on AVX2 only, whose batches reach 2047 rows)
#endif
  for (int64_t p0 = 0; p0 < a.m; p0 += panel) {  // (one pass over the weights a panel)
    const int64_t p1 = std::min(a.m, p0 + panel);
#pragma omp parallel for schedule(guided)
    for (int64_t n0 = 0; n0 < a.n; n0 += RM) {
      prefetch_scale_rows(a, n0 + kTaskScalesAhead * RM, RM);
      for (int64_t m0 = p0; m0 < p1; m0 += 4) {
        switch (std::min<int64_t>(p1 - m0, 4)) {
          case 1: Tile<1, RM>::run(a, m0, n0); break;
          case 2: Tile<2, RM>::run(a, m0, n0); break;
          case 3: Tile<3, RM>::run(a, m0, n0); break;
          default: Tile<4, RM>::run(a, m0, n0); break;
        }
      }
    }
  }
}

// An int6 row (packing.pack_int6) is blocks of 104 bytes, one per 128 columns: the low nibbles
// (64 bytes, as int4's), the top two bits (32 bytes, byte i holding those of the block's columns
// 2i in bits 0-1, 2i + 64 in 2-3, 2i + 1 in 4-5, 2i + 65 in 6-7), the int8 sub-scales (8 bytes).
constexpr int64_t kInt6Block = 104, kInt6Tops = 64, kInt6Subs = 96;
inline const uint8_t* int6_block(const uint8_t* row, int64_t c) {
  return row + c / 128 * kInt6Block;
}
inline int int6_top_shift(int64_t c) { return 2 * ((c % 128) / 64) + 4 * (c & 1); }

// Group-wise int8 in 16-row blocks (Kind::Int8x16; GGUF's Q8_0 and Q5_0 as cpu_qmatmul.interleave
// repacks them at load: groups of 32 columns, every zero point one integer zc): per block of 16
// weight rows (rows past n zero) and group, kX16Codes bytes of codes, line j (64 bytes) holding
// columns 4 j .. 4 j + 3 of the 16 rows (row r's four at 4 r), each code + 128 (unsigned); two
// groups' codes, then their 16 rows' scales (type st, group by group): a block one sequential
// stream, each group's codes whole cache lines (a pair of groups 17 lines with 16-bit scales),
// a vpdpbusd operand or an AMX B tile as they lie, x's 4 codes broadcast against 16 rows at once.
// row_bytes: a block's.
constexpr int64_t kX16Codes = 512;
constexpr int64_t x16_scale_bytes(int st) { return 16 * (st == kF32 ? 4 : 2); }
// group g's codes and scales in the block at p
inline const uint8_t* x16_codes(const uint8_t* p, int64_t g, int64_t scale_bytes) {
  return p + g / 2 * 2 * (kX16Codes + scale_bytes) + g % 2 * kX16Codes;
}
inline const uint8_t* x16_scales(const uint8_t* p, int64_t g, int64_t scale_bytes) {
  return p + g / 2 * 2 * (kX16Codes + scale_bytes) + 2 * kX16Codes + g % 2 * scale_bytes;
}
// the code (q, before the zero point) of row nr, column c, and the scale of its group
template <typename A>
inline int x16_code(const A& a, int64_t nr, int64_t c) {
  const uint8_t* codes = x16_codes(a.w + nr / 16 * a.row_bytes, c / 32, x16_scale_bytes(a.st));
  return codes[64 * (c % 32 / 4) + 4 * (nr % 16) + c % 4] - 128;
}
template <typename A>
inline float x16_scale(const A& a, int64_t nr, int64_t g) {
  return scale_at(x16_scales(a.w + nr / 16 * a.row_bytes, g, x16_scale_bytes(a.st)), nr % 16,
                  a.st);
}

// Int4 in blocks of 16 rows (Kind::Int4x16; int4 in any group, as cpu_qmatmul.interleave repacks
// it): per block and group, per 8 columns a line of 64 bytes, line j holding 4 bytes of each of
// the 16 rows (row r's at 4 r), their low nibbles columns 8 j .. 8 j + 3 and their high ones
// 8 j + 4 .. 8 j + 7; after the group's lines the 16 rows' scales, then (where they are stored:
// s_stride 1; else every zero point is zc, as Q4_0's 8) their zero points (type st): 8 group +
// 16 size (+ 16 size) bytes a group (a group of 128 with 16-bit scales and zero points 17 cache
// lines; Q4_0's 32 columns 4.5, 18 bytes a row as in its file).
constexpr int64_t x4_group_bytes(int64_t group, int st, bool zeros) {
  return 8 * group + (zeros ? 32 : 16) * (st == kF32 ? 4 : 2);
}
template <typename A>
inline const uint8_t* x4_group(const A& a, int64_t nr, int64_t g) {
  return a.w + nr / 16 * a.row_bytes + g * x4_group_bytes(a.group, a.st, a.s_stride != 0);
}
template <typename A>
inline int x4_code(const A& a, int64_t nr, int64_t c) {
  const int64_t cg = c & (a.group - 1);  // the column within its group
  const uint8_t byte = x4_group(a, nr, c >> a.gshift)[64 * (cg / 8) + 4 * (nr % 16) + cg % 4];
  return cg % 8 < 4 ? byte & 15 : byte >> 4;
}
// the scale (which: 0) or zero point (1) of row nr's group g
template <typename A>
inline float x4_param(const A& a, int64_t nr, int64_t g, int which) {
  if (which == 1 && a.s_stride == 0) return a.zc;
  const uint8_t* p = x4_group(a, nr, g) + 8 * a.group + which * 16 * (a.st == kF32 ? 4 : 2);
  return scale_at(p, nr % 16, a.st);
}

// the code of column c of a weight row
template <Kind K>
inline int code(const uint8_t* row, int64_t c) {
  if constexpr (K == Kind::Int4) return (row[c / 2] >> (4 * (c & 1))) & 15;
  if constexpr (K == Kind::Int6) {
    const uint8_t* b = int6_block(row, c);
    const int low = (b[(c % 128) / 2] >> (4 * (c & 1))) & 15;
    return low | (((b[kInt6Tops + (c % 64) / 2] >> int6_top_shift(c)) & 3) << 4);
  }
  return static_cast<int8_t>(row[c]);
}

// the scale of the group of column c of row nr (int6: d times the sub-scale of c's 16 columns)
template <Kind K, typename A>
inline float group_scale(const A& a, int64_t nr, const uint8_t* row, int64_t c) {
  const float s = scale_at(a.s, nr * a.s_stride + (c >> a.gshift), a.st);
  if constexpr (K == Kind::Int6)
    return s * static_cast<int8_t>(int6_block(row, c)[kInt6Subs + (c % 128) / 16]);
  return s;
}

// The first column of x's 16 codes from code position p (int4: in nibble order; the first of
// each 16 positions: the rest follow it two columns apart)
template <Kind K>
inline int64_t column_of(int64_t p) {
  if constexpr (K == Kind::Int4) return (p / 128) * 128 + 2 * (p % 64) + (p % 128) / 64;
  return p;
}

// x's block of codes (one d): per channel int8 128 (the last one 64 where K = 64 mod 128), its
// steps' two halves summed in int32 as int4's; group-wise int8 32 (llama.cpp's Q8_0); int4 64,
// 128 in groups of 128 or more (one d and one scale a step)
template <Kind K>
int64_t activation_block(int64_t group) {
  if constexpr (K == Kind::Int6) return 128;
  if constexpr (K == Kind::Int4) return group >= 128 ? 128 : 64;
  return K == Kind::Int8 ? 128 : 32;
}

// -- portable --------------------------------------------------------------------------------

template <typename T, Kind K>
struct Portable {
  template <int MT, int R>
  struct Tile {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      for (int r = 0; r < R && n0 + r < a.n; ++r) {
        const int64_t nr = n0 + r;
        const uint8_t* row = a.w + nr * a.row_bytes;
        for (int mi = 0; mi < MT; ++mi) {
          const T* x = a.x + (m0 + mi) * a.k;
          float acc[16] = {};
          for (int64_t c = 0; c < a.k; c += 16) {
            float s = 1.0f, sz = 0.0f;
            if constexpr (K != Kind::Int8) {
              s = group_scale<K>(a, nr, row, c);
              sz = s * (a.z ? scale_at(a.z, nr * a.s_stride + (c >> a.gshift), a.st) : a.zc);
            }
            for (int j = 0; j < 16; ++j)
              acc[j] +=
                  (static_cast<float>(code<K>(row, c + j)) * s - sz) * to_float(x[c + j]);
          }
          float sum = 0;
          for (float v : acc) sum += v;
          if constexpr (K == Kind::Int8) sum *= scale_at(a.s, nr, a.st);
          store1(a.y + (m0 + mi) * a.n + nr, sum);
        }
      }
    }
  };
};

#if defined(FOUDRE_AVX512)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// the scales from p + i of the lanes `mask` sets (up to 16), as float32 lanes (the others zero)
inline __m512 load_scales(const void* p, int64_t i, int st, __mmask16 mask) {
  if (st == kF32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
  if (st == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the 16 scales of type ST from p + i as float32 lanes
template <int ST>
inline __m512 load_scales16(const void* p, int64_t i) {
  if constexpr (ST == kF32) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  const auto* h = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i);
  if constexpr (ST == kF16) return _mm512_cvtph_ps(_mm256_loadu_si256(h));
  return load16(static_cast<const uint16_t*>(p) + i);  // bfloat16
}

// the `span` scales of type ST from p + i as float32 lanes 0..span - 1 (the others undefined),
// reading those bytes only (a step spans 128 columns: 1 to 8 groups of 16 or more; any other
// count through the masked load of 16 lanes). Through a masked 16-lane load
// (load_scales) GGUF's layouts ran at 0.75-0.82x at batch 1 (8192 x 1536 on Zen 4:
// Q4_0 0.35 -> 0.27 ms; int8 g32 with float32 scales 0.54 -> 0.44 ms; Q6_K's int8 g16 0.57 ->
// 0.43 ms); the cause was not isolated. One switch per type: a case of 32 bytes in a switch
// shared by all three made Q8_0 and Q4_0 1.08x slower (one thread, from the caches).
template <int ST>
[[gnu::always_inline]] inline __m512 load_few(const void* p, int64_t i, int64_t span) {
  static_assert(ST >= 0, "the scales' type compiled in");
  if constexpr (ST == kF32) {
    const float* f = static_cast<const float*>(p) + i;
    switch (span) {
      case 1: return _mm512_castps128_ps512(_mm_load_ss(f));
      case 2: return _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64(
                  reinterpret_cast<const __m128i*>(f))));
      case 4: return _mm512_castps128_ps512(_mm_loadu_ps(f));
      case 8: return _mm512_castps256_ps512(_mm256_loadu_ps(f));
      default: return load_scales(p, i, ST, static_cast<__mmask16>((1u << span) - 1));
    }
  }
  const uint8_t* b = static_cast<const uint8_t*>(p) + i * 2;
  __m128i v;
  switch (span) {
    case 1: { uint16_t u; std::memcpy(&u, b, 2); v = _mm_cvtsi32_si128(u); break; }
    case 2: { int32_t u; std::memcpy(&u, b, 4); v = _mm_cvtsi32_si128(u); break; }
    case 4: { int64_t u; std::memcpy(&u, b, 8); v = _mm_cvtsi64_si128(u); break; }
    case 8: v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)); break;
    default: return load_scales(p, i, ST, static_cast<__mmask16>((1u << span) - 1));
  }
  if constexpr (ST == kF16) return _mm512_castps256_ps512(_mm256_cvtph_ps(v));
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16);  // bfloat16
  return _mm512_castps256_ps512(_mm256_castsi256_ps(wide));
}

// y[m0 + mi, n0 + r] = finish(m0 + mi, n0 + r, acc[mi][r]), for the rows that exist
template <typename T, int MT, int R, typename F>
void store_tile(const Args<T>& a, int64_t m0, int64_t n0, __m512 (&acc)[MT][R], F&& finish) {
  for (int mi = 0; mi < MT; ++mi)
    for (int r = 0; r < R && n0 + r < a.n; ++r)
      store1(a.y + (m0 + mi) * a.n + n0 + r, finish(m0 + mi, n0 + r, acc[mi][r]));
}

// The sum of v's lanes, in one written-out order (GCC's _mm512_reduce_add_ps's: the halves,
// then the quarters, then within one): reduce16 sums 16 vectors in the same order, so that a
// row comes out bit for bit the same whichever of them sums it
inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));  // q0 + q2, q1 + q3
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// lane i: hsum16(v[i]), the 16 sums at once (about 3 instructions a row where hsum16 takes 7
// and a row's result was stored alone)
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 h[8], q[4];
  for (int i = 0; i < 8; ++i)  // two rows' halves summed: [a's 8 | b's 8]
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // four rows' quarters summed: 128-bit lane j, row 4 i + j
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // within the 128-bit lanes: (q0 + q2) and (q1 + q3) of two quads' rows side by side, then
  // their sum: 128-bit lane j, element e, row 4 e + j
  const __m512 z01 = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
  const __m512 z23 = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
  const __m512 f = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z01), _mm512_castps_pd(z23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z01), _mm512_castps_pd(z23))));
  const __m512i rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(rows, f);
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // to bfloat16 as torch rounds (subnormals kept)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// the codes of columns c .. c + 15 of a row as float32
template <Kind K>
inline __m512 codes16(const uint8_t* row, int64_t c) {
  if constexpr (K == Kind::Int4 || K == Kind::Int6) {
    const uint8_t* nibbles = K == Kind::Int4 ? row + c / 2 : int6_block(row, c) + (c % 128) / 2;
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(nibbles));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    if constexpr (K == Kind::Int6) {  // the 16 columns' top bits: 8 bytes, one shift for all
      const uint8_t* tops = int6_block(row, c) + kInt6Tops + (c % 64) / 2;
      const __m128i t = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tops));
      const __m128i three = _mm_set1_epi8(3);
      const __m128i shift = _mm_cvtsi32_si128(int6_top_shift(c));  // column c is even
      const __m128i shift_odd = _mm_cvtsi32_si128(int6_top_shift(c) + 4);
      lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(t, shift), three), 4));
      hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(t, shift_odd), three), 4));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  } else {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
  }
}

template <typename T, Kind K>
struct Float512 {
  template <int MT, int R>
  struct Tile {  // 16 columns at a time, all in one group (groups are multiples of 16)
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      int64_t nr[R];
      row_ptrs<R>(a, n0, wr, nr);
      __m512 acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t c = 0; c < a.k; c += 16) {
        __m512 xv[MT];
        for (int mi = 0; mi < MT; ++mi) xv[mi] = load16(a.x + (m0 + mi) * a.k + c);
        // the bytes read before this step (int6: 104 per 128 columns, 52 per 64: a line every 64)
        const int64_t line = K == Kind::Int4 ? c / 2 : (K == Kind::Int6 ? c / 16 * 13 : c);
        for (int r = 0; r < R; ++r) {
          if (K == Kind::Int6 ? c % 64 == 0 : line % 64 == 0)
            prefetch_ahead<false>(wr[r] + line, kAhead);
          __m512 wv = codes16<K>(wr[r], c);
          if constexpr (K != Kind::Int8) {
            const float s = group_scale<K>(a, nr[r], wr[r], c);
            const float sz =
                s * (a.z ? scale_at(a.z, nr[r] * a.s_stride + (c >> a.gshift), a.st) : a.zc);
            wv = _mm512_fmsub_ps(wv, _mm512_set1_ps(s), _mm512_set1_ps(sz));
          }
          for (int mi = 0; mi < MT; ++mi) acc[mi][r] = _mm512_fmadd_ps(xv[mi], wv, acc[mi][r]);
        }
      }
      store_tile<T, MT, R>(a, m0, n0, acc, [&](int64_t, int64_t n, __m512 v) {
        const float sum = _mm512_reduce_add_ps(v);
        return K == Kind::Int8 ? sum * scale_at(a.s, n, a.st) : sum;
      });
    }
  };
};

#endif  // FOUDRE_AVX512

#if defined(FOUDRE_VNNI)

// x [m, k] to int8 per block of `block` columns (32 or 128; nibbles 64 or 128): xq, d per 4 codes
// (dl), and d * sum(q) per 16 codes (hsum [m, k / 16]). Nibbles (int4, int6): per 128 columns,
// the even columns then the odd ones, and one d per 64 columns or 128 (the same d for codes j and
// 64 + j, whose products a kernel adds up in int32).
template <typename T, bool Nibbles>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t block, int8_t* xq, float* dl,
                   float* hsum) {
  const auto put = [&](int64_t i, int64_t p, __m512 lo, __m512 hi, float amax) {
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    int8_t* q = xq + i * k + p;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
    _mm256_storeu_ps(dl + i * (k / 4) + p / 4, _mm256_set1_ps(d));
    hsum[i * (k / 16) + p / 16] = d * static_cast<float>(_mm512_reduce_add_epi32(qlo));
    hsum[i * (k / 16) + p / 16 + 1] = d * static_cast<float>(_mm512_reduce_add_epi32(qhi));
  };
  const auto amax = [](__m512 a, __m512 b) {
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  };
#pragma omp parallel for schedule(static) if (m * k >= 65536)
  for (int64_t i = 0; i < m; ++i) {
    if constexpr (Nibbles) {
      const __m512i even =
          _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      for (int64_t c = 0; c < k; c += 128) {
        __m512 ev[4], od[4];  // ev[h]: the even columns of c + 32 h .. c + 32 h + 31
        float span[2];        // max |x| over each 64 columns
        for (int h = 0; h < 4; ++h) {
          const __m512 u = load16(x + i * k + c + 32 * h), v = load16(x + i * k + c + 32 * h + 16);
          ev[h] = _mm512_permutex2var_ps(u, even, v);
          od[h] = _mm512_permutex2var_ps(u, odd, v);
        }
        for (int half = 0; half < 2; ++half)
          span[half] = std::max(amax(ev[2 * half], ev[2 * half + 1]),
                                amax(od[2 * half], od[2 * half + 1]));
        if (block == 128) span[0] = span[1] = std::max(span[0], span[1]);
        for (int half = 0; half < 2; ++half) {
          put(i, c + 32 * half, ev[2 * half], ev[2 * half + 1], span[half]);
          put(i, c + 64 + 32 * half, od[2 * half], od[2 * half + 1], span[half]);
        }
      }
    } else {
      for (int64_t p = 0; p < k; p += block) {  // the last block may be short (K = 64 mod 128)
        const int64_t end = std::min(block, k - p);
        float span = 0.0f;
        for (int64_t j = 0; j < end; j += 32)
          span = std::max(span, amax(load16(x + i * k + p + j), load16(x + i * k + p + j + 16)));
        for (int64_t j = 0; j < end; j += 32)
          put(i, p + j, load16(x + i * k + p + j), load16(x + i * k + p + j + 16), span);
      }
    }
  }
}

// a batch-1 strip's 16 sums (lane r: row(r)'s lanes summed; zero past `rows`): row(r) returns
// row n0 + r's lanes, its steps inlined into this loop (called, strips ran 1.1-1.3x as long as
// tasks of one row; unrolled 16 times, per-channel int8's 1.13x)
template <typename F>
[[gnu::always_inline]] inline __m512 strip_sums(int64_t rows, F&& row) {
  __m512 lanes[16];
#pragma GCC unroll 1
  for (int64_t r = 0; r < rows; ++r) lanes[r] = row(r);
  for (int64_t r = rows; r < 16; ++r) lanes[r] = _mm512_setzero_ps();
  return reduce16(lanes);
}

// y[0, n0 .. n0 + rows) = lanes 0 .. rows - 1 of v (a strip's results, batch 1)
template <typename T>
void store_strip(const Args<T>& a, int64_t n0, int64_t rows, __m512 v) {
  if (rows == 16) {
    store16(a.y + n0, v);
  } else {
    T part[16];
    store16(part, v);
    std::copy(part, part + rows, a.y + n0);
  }
}

template <typename T, Kind K>
struct Vnni {
  static constexpr bool kGrouped = K != Kind::Int8;
  // a step: 128 codes in two halves of 64 whose products sum in int32 before one conversion
  // to float: int8 two 64-byte loads, int4 the low nibbles of 64 bytes then the high ones.
  // Group-wise int8 (kPairs) sums the halves' lanes in pairs: lanes 2j and 2j + 1 of the first
  // half (its columns 8 j .. 8 j + 7) make lane j, those of the second lane 8 + j, so that a
  // lane spans 8 adjacent columns, inside one group (16 or more) and one block of x (32), and
  // a step converts, scales and accumulates 128 codes where it did 64 (batch-1 4096 x 1536
  // products from the caches on Zen 4, one thread: Q8_0 1.3x as fast, int8 g16 with float32
  // scales 1.25x; from memory where the host's bandwidth was low the same, bound by the bytes)
  static constexpr int64_t kStepCodes = 128;
  static constexpr bool kPairs = K == Kind::Int8Grouped;
  static constexpr int64_t kLaneColumns = K == Kind::Int8 ? 4 : 8;  // columns a lane spans
  static constexpr int64_t kXsColumns = K == Kind::Int4 ? 8 : 4;  // columns of an xs entry
  static constexpr int64_t kDColumns = kPairs ? 8 : 4;  // columns of a d entry

  template <int MT, int R>
  struct Tile {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      __m512 acc[MT][R];
      sums<MT, R>(a, m0, n0, acc);
      if constexpr (kGrouped) {
        store_tile<T, MT, R>(a, m0, n0, acc,
                             [](int64_t, int64_t, __m512 v) { return hsum16(v); });
      } else {  // the offset 128: y = s (acc - 128 sum d q)
        store_tile<T, MT, R>(a, m0, n0, acc, [&](int64_t mr, int64_t n, __m512 v) {
          return (hsum16(v) - 128.0f * a.corr[mr]) * scale_at(a.s, n, a.st);
        });
      }
    }
  };

  // batch 1: tasks of 16 weight rows, one after another (one sequential stream, as tasks of
  // one row), their lanes summed 16 rows at a time (reduce16) and stored as one vector, where
  // each row's sum and store took up to 15% of a 1536-column row's time from the caches
  // (4096 x 1536, one thread, interleaved: int4 g128 72 -> 66 us, Q4_0 81 -> 76, int8 69 -> 65,
  // Q8_0 98 -> 95; from memory, where the host's bandwidth was low, the same)
  static void strip(const Args<T>& a, int64_t n0) {
    const int64_t rows = std::min<int64_t>(16, a.n - n0);
    __m512 y = strip_sums(rows, [&](int64_t r) __attribute__((always_inline)) {
      __m512 acc[1][1];
      sums<1, 1>(a, 0, n0 + r, acc);
      return acc[0][0];
    });
    if constexpr (!kGrouped) {  // as Tile::run's: y = s (acc - 128 sum d q)
      const __mmask16 mask = static_cast<__mmask16>(rows == 16 ? 0xFFFF : (1u << rows) - 1);
      y = _mm512_mul_ps(_mm512_sub_ps(y, _mm512_set1_ps(128.0f * a.corr[0])),
                        load_scales(a.s, n0, a.st, mask));
    }
    store_strip(a, n0, rows, y);
  }

  // acc[mi][r]: the lanes of y[m0 + mi, n0 + r]'s sum (the zero points' offsets taken off; per
  // channel: before the 128 and the scale). It and the steps are inlined into strip's loop
  // (strip_sums)
  template <int MT, int R>
  [[gnu::always_inline]] static void sums(const Args<T>& a, int64_t m0, int64_t n0,
                                          __m512 (&acc)[MT][R]) {
    const uint8_t* wr[R];
    int64_t nr[R];
    row_ptrs<R>(a, n0, wr, nr);
    for (auto& row : acc)
      for (auto& v : row) v = _mm512_setzero_ps();
    // lane l (the columns c + kLaneColumns l and on, of a step at c; per-channel int8: of
    // its first half) is in group (its first column) / group: the step's first group plus
    // lane_group[l]; a step spans `span` groups
    const int64_t step_columns = 16 * kLaneColumns;
    const int64_t span = a.group > 0 ? std::max<int64_t>(1, step_columns / a.group) : 1;
    __m512i lane_group = _mm512_setzero_si512();
    if (span > 1)
      lane_group = _mm512_srli_epi32(
          _mm512_mullo_epi32(
              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
              _mm512_set1_epi32(static_cast<int>(kLaneColumns))),
          a.gshift);
    // int4 in groups of 128 or more: one d (x's block of 128) and one scale per step, their
    // product a scalar broadcast (no vector loads, conversions and products of scales)
    // One loop compiled per case: per channel, and int4 in groups of 128 or more, one (their
    // scales read at the end, or one a step); smaller groups with their scales' type and
    // their lane offsets compiled in (read through a runtime type, the steps of int4 g32 ran
    // 1.4-1.8x as long). (More cases than these, each compiled in, made the four-row tiles
    // 1.3-1.4x slower.)
    // (offsets takes off what the steps did not: with xs they took them all)
    if constexpr (K == Kind::Int4) {
      if (a.group >= kStepCodes) {
        steps<MT, R, true, false, -1>(a, m0, wr, nr, acc, lane_group, span);
        offsets<MT, R>(a, m0, nr, acc);
        return;
      }
    }
    if constexpr (!kGrouped) {
      steps<MT, R, false, false, -1>(a, m0, wr, nr, acc, lane_group, span);
    } else if (a.xs) {
      typed_steps<MT, R, true>(a, m0, wr, nr, acc, lane_group, span);
    } else {
      typed_steps<MT, R, false>(a, m0, wr, nr, acc, lane_group, span);
      offsets<MT, R>(a, m0, nr, acc);
    }
  }

  template <int MT, int R, bool Offsets>
  [[gnu::always_inline]] static void typed_steps(const Args<T>& a, int64_t m0,
                                                 const uint8_t* const* wr,
                          const int64_t* nr, __m512 (&acc)[MT][R], __m512i lane_group,
                          int64_t span) {
    if (a.st == kF16)
      steps<MT, R, false, Offsets, kF16>(a, m0, wr, nr, acc, lane_group, span);
    else if (a.st == kBF16)
      steps<MT, R, false, Offsets, kBF16>(a, m0, wr, nr, acc, lane_group, span);
    else
      steps<MT, R, false, Offsets, kF32>(a, m0, wr, nr, acc, lane_group, span);
  }

  // (everything a step reads kept in locals: __m512 may alias anything, so through `a` each
  // step would reload its fields after every store of an accumulator.) ST:
  // the scales' type, -1 read at run time.
  template <int MT, int R, bool Uniform, bool Offsets, int ST>
  [[gnu::always_inline]] static void steps(const Args<T>& a, int64_t m0,
                                           const uint8_t* const* wr, const int64_t* nr,
                    __m512 (&acc)[MT][R], __m512i lane_group, int64_t span) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t k = a.k;
    const int gshift = a.gshift;
    const int8_t* xq = a.xq + m0 * k;
    const float* dl = a.dl + m0 * (k / kDColumns);
    const int64_t lanes = k / kXsColumns;  // xs per x row
    const int32_t* xs = Offsets ? a.xs + m0 * lanes : nullptr;
    // kPairs: the lanes that make lane j, of the first half (j < 8) or the second (16 + ...)
    const __m512i first =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
    const uint8_t* w[R];
    const void* srow[R];  // the row's scales
    const int st = ST < 0 ? a.st : ST;
    const int64_t size = st == kF32 ? 4 : 2;
    for (int r = 0; r < R; ++r) {
      w[r] = wr[r];
      srow[r] = static_cast<const uint8_t*>(a.s) + nr[r] * a.s_stride * size;
    }
    // a step at column c; a tail (int8 where K = 64 mod 128) has its first half only
    // (chunk: nullptr, or a step of a chunk of four, below: its lanes' scales given)
    const auto step = [&](int64_t c, auto tail_c,
                          const auto& chunk) __attribute__((always_inline)) {
      constexpr bool kBoth = !decltype(tail_c)::value;
      constexpr bool kChunk = !std::is_same_v<std::decay_t<decltype(chunk)>, std::nullptr_t>;
      const int64_t bytes = K == Kind::Int4 ? c / 2 : c;
      const int64_t g0 = c >> gshift;  // the step's first group
      __m512i xv[MT], xh[MT], start[MT], start_h[MT];
      __m512 d[MT];
      float d1[MT];
      for (int mi = 0; mi < MT; ++mi) {
        start[mi] = Offsets ? _mm512_loadu_si512(xs + mi * lanes + c / kXsColumns)
                            : _mm512_setzero_si512();
        if constexpr (kPairs)
          start_h[mi] = Offsets && kBoth
                            ? _mm512_loadu_si512(xs + mi * lanes + c / kXsColumns + 16)
                            : _mm512_setzero_si512();
        xv[mi] = _mm512_loadu_si512(xq + mi * k + c);
        if constexpr (kBoth) xh[mi] = _mm512_loadu_si512(xq + mi * k + c + 64);
        if constexpr (Uniform)
          d1[mi] = dl[mi * (k / 4) + c / 4];
        else if constexpr (kChunk)
          ;  // (the chunk's products)
        else if constexpr (kPairs && !kBoth)  // (a tail: the d of its 8 lanes)
          d[mi] = _mm512_maskz_loadu_ps(0x00FF, dl + mi * (k / kDColumns) + c / kDColumns);
        else
          d[mi] = _mm512_loadu_ps(dl + mi * (k / kDColumns) + c / kDColumns);
      }
      for (int r = 0; r < R; ++r) {
        // (past a row's end: the rows after it, which this task or the thread's next one reads,
        // and past the last row of the weight: nothing there, no fault)
        constexpr bool kStream = MT == 1 && R == 1;  // (a batch-1 row, of a strip or alone)
        prefetch_ahead<kStream>(w[r] + bytes, kAhead);
        if constexpr (kBoth && K != Kind::Int4) prefetch_ahead<kStream>(w[r] + bytes, kAhead + 64);
        const __m512i v = _mm512_loadu_si512(w[r] + bytes);
        __m512i wv, wh = v;
        if constexpr (K == Kind::Int4) {
          wv = _mm512_and_si512(v, low);
          wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
          wv = _mm512_xor_si512(v, flip);
          if constexpr (kBoth)
            wh = _mm512_xor_si512(_mm512_loadu_si512(w[r] + bytes + 64), flip);
        }
        __m512 sv = _mm512_setzero_ps();
        float s1 = 0.0f;
        if constexpr (Uniform) {
          s1 = scale_at(srow[r], g0, st);
        } else if constexpr (kGrouped && !kChunk) {
          // (a tail: the groups of its 64 columns)
          const int64_t count = kBoth ? span : std::max<int64_t>(1, span / 2);
          const __m512 gs = load_few<ST>(srow[r], g0, count);
          sv = span > 1 ? _mm512_permutexvar_ps(lane_group, gs)
                        : _mm512_broadcastss_ps(_mm512_castps512_ps128(gs));
        }
        for (int mi = 0; mi < MT; ++mi) {
          __m512i dot = _mm512_dpbusd_epi32(start[mi], wv, xv[mi]);
          if constexpr (kPairs) {  // (a tail: lanes 8-15 zero, their scales too)
            __m512i dh = _mm512_setzero_si512();
            if constexpr (kBoth) dh = _mm512_dpbusd_epi32(start_h[mi], wh, xh[mi]);
            dot = _mm512_add_epi32(_mm512_permutex2var_epi32(dot, first, dh),
                                   _mm512_permutex2var_epi32(dot, second, dh));
          } else if constexpr (kBoth) {
            dot = _mm512_dpbusd_epi32(dot, wh, xh[mi]);
          }
          __m512 scale;
          if constexpr (Uniform)
            scale = _mm512_set1_ps(d1[mi] * s1);
          else if constexpr (kChunk)
            scale = _mm512_permutexvar_ps(chunk.index, chunk.ds[mi][r]);
          else if constexpr (kPairs && !kBoth)  // (lanes 8-15 of sv: undefined)
            scale = _mm512_maskz_mul_ps(0x00FF, d[mi], sv);
          else
            scale = kGrouped ? _mm512_mul_ps(d[mi], sv) : d[mi];
          acc[mi][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[mi][r]);
        }
      }
    };
    int64_t c = 0;
    if constexpr (kPairs && ST >= 0) {
      // groups of 32 (Q8_0, Q5_x): four steps' scales (512 columns, 16 groups) read and
      // converted at once and multiplied by x's d of each group (a.d32: x's blocks are 32
      // columns too), then each step's lanes one permutation of those products (lane j of
      // step t: group 4 t + j / 4): the products the steps form one by one, so the same bits
      // (batch 1 from the caches, 1024 x 1536 on the AMX Xeon: 1.11x as fast; from memory
      // 1.00-1.02x; 4096 x 1536 at 3 and 7 rows 1.08-1.11x, at 2 and 4 0.98-1.0x)
      if (a.d32 && a.group == 32) {
        struct {
          __m512 ds[MT][R];
          __m512i index;
        } chunk;
        const float* d32 = a.d32 + m0 * (k / 32);
        for (; c + 512 <= k; c += 512) {
          for (int mi = 0; mi < MT; ++mi) {
            const __m512 dv = _mm512_loadu_ps(d32 + mi * (k / 32) + c / 32);
            for (int r = 0; r < R; ++r)
              chunk.ds[mi][r] = _mm512_mul_ps(dv, load_scales16<ST>(srow[r], c / 32));
          }
          for (int t = 0; t < 4; ++t) {
            chunk.index = _mm512_add_epi32(lane_group, _mm512_set1_epi32(4 * t));
            step(c + 128 * t, std::false_type{}, chunk);
          }
        }
      }
    }
    const int64_t whole = k / kStepCodes * kStepCodes;
    for (; c < whole; c += kStepCodes) step(c, std::false_type{}, nullptr);
    if constexpr (K != Kind::Int4)  // (int4's K: a multiple of 128)
      if (whole < k) step(whole, std::true_type{}, nullptr);  // K = 64 mod 128: a half
  }

  // grouped: acc -= the offsets, where the steps did not take them off in the lanes' dots
  template <int MT, int R>
  [[gnu::always_inline]] static void offsets(const Args<T>& a, int64_t m0, const int64_t* nr,
                                             __m512 (&acc)[MT][R]) {
    if constexpr (kGrouped) {
      // acc -= s (z [+ 128]) * (the group's sum of d q), 16 groups a step
      for (int64_t g = 0; g < a.groups; g += 16) {
        const __mmask16 mask =
            a.groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (a.groups - g)) - 1);
        __m512 off[R];
        for (int r = 0; r < R; ++r) {
          const __m512 s = load_scales(a.s, nr[r] * a.s_stride + g, a.st, mask);
          __m512 z = a.z ? load_scales(a.z, nr[r] * a.s_stride + g, a.st, mask)
                         : _mm512_set1_ps(a.zc);  // one zero point (Q4_0's 8): no loads
          if constexpr (K != Kind::Int4) z = _mm512_add_ps(z, _mm512_set1_ps(128.0f));
          off[r] = _mm512_mul_ps(s, z);
        }
        for (int mi = 0; mi < MT; ++mi) {
          const __m512 cv = _mm512_maskz_loadu_ps(mask, a.corr + (m0 + mi) * a.groups + g);
          for (int r = 0; r < R; ++r) acc[mi][r] = _mm512_fnmadd_ps(off[r], cv, acc[mi][r]);
        }
      }
    }
  }
};

// int6 (Q6_K): a step of 128 columns makes 128 codes 0..63 of a row's 64 bytes of low nibbles
// (x's nibble order, as int4) and 32 of top bits; vpdpbusd sums lane l's 8 columns (c + 8 l ..
// c + 8 l + 7, inside one sub-block of 16) on top of -32 times the sum of their x codes (xs: the
// codes' offset), the lane's sub-scale multiplies that in int32 (|sum| <= 8 * 32 * 128, |sc| <=
// 128: far inside int32), then one float product by x's d (one per 128 columns) times the
// weight's (one per 256). No offsets left for the end.
template <typename T>
struct VnniInt6 {
  template <int MT, int R>
  struct Tile {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      if (a.st == kF16)
        go<kF16>(a, m0, n0);
      else if (a.st == kBF16)
        go<kBF16>(a, m0, n0);
      else
        go<kF32>(a, m0, n0);
    }
    template <int ST>
    static void go(const Args<T>& a, int64_t m0, int64_t n0) {
      __m512 sum[MT][R];
      sums<ST>(a, m0, n0, sum);
      store_tile<T, MT, R>(a, m0, n0, sum, [](int64_t, int64_t, __m512 v) { return hsum16(v); });
    }
    // sum[mi][r]: the lanes of y[m0 + mi, n0 + r] (inlined into strip's loop, as Vnni::sums)
    template <int ST>  // the type of d, compiled in (as Vnni::steps)
    [[gnu::always_inline]] static void sums(const Args<T>& a, int64_t m0, int64_t n0,
                                            __m512 (&sum)[MT][R]) {
      const uint8_t* wr[R];
      int64_t nr[R];
      row_ptrs<R>(a, n0, wr, nr);
      const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
      // the top bits as bits 4-5: of the even columns bits 0-1 of the 32 bytes (for the first 64
      // code bytes) and 2-3 (the copy, for the last 64); of the odd ones bits 4-5 and 6-7
      const __m512i even_left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
      const __m512i odd_right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      // (in locals, as Vnni::steps)
      const int64_t k = a.k;
      const int gshift = a.gshift;
      const int8_t* xq = a.xq + m0 * k;
      const int32_t* xs = a.xs + m0 * (k / 8);
      const float* dl = a.dl + m0 * (k / 4);
      const void* srow[R];
      for (int r = 0; r < R; ++r)
        srow[r] = static_cast<const uint8_t*>(a.s) + nr[r] * a.s_stride * (ST == kF32 ? 4 : 2);
      for (auto& row : sum)
        for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t c = 0; c < k; c += 128) {
        __m512i xv[MT], xh[MT], off[MT];
        float d1[MT];
        for (int mi = 0; mi < MT; ++mi) {
          xv[mi] = _mm512_loadu_si512(xq + mi * k + c);
          xh[mi] = _mm512_loadu_si512(xq + mi * k + c + 64);
          off[mi] = _mm512_loadu_si512(xs + mi * (k / 8) + c / 8);
          d1[mi] = dl[mi * (k / 4) + c / 4];
        }
        for (int r = 0; r < R; ++r) {
          const uint8_t* block = int6_block(wr[r], c);  // a step reads one block of 104 bytes
          constexpr bool kStream = MT == 1 && R == 1;  // (as Vnni::steps)
          prefetch_ahead<kStream>(block, kAhead);
          prefetch_ahead<kStream>(block, kAhead + 64);
          const __m512i v = _mm512_loadu_si512(block);
          const __m512i t = _mm512_broadcast_i64x4(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kInt6Tops)));
          const __m512i wv =
              _mm512_or_si512(_mm512_and_si512(v, low),
                              _mm512_and_si512(_mm512_sllv_epi16(t, even_left), top));
          const __m512i wh =
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                              _mm512_and_si512(_mm512_srlv_epi16(t, odd_right), top));
          const __m128i sc8 =
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kInt6Subs));
          // lane l: sc[l / 2]
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_unpacklo_epi8(sc8, sc8));
          const float dw = scale_at(srow[r], c >> gshift, ST);
          for (int mi = 0; mi < MT; ++mi) {
            __m512i dot = _mm512_dpbusd_epi32(off[mi], wv, xv[mi]);
            dot = _mm512_mullo_epi32(_mm512_dpbusd_epi32(dot, wh, xh[mi]), sc);
            sum[mi][r] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d1[mi] * dw), sum[mi][r]);
          }
        }
      }
    }
  };

  // batch 1: as Vnni::strip
  static void strip(const Args<T>& a, int64_t n0) {
    if (a.st == kF16)
      strip_typed<kF16>(a, n0);
    else if (a.st == kBF16)
      strip_typed<kBF16>(a, n0);
    else
      strip_typed<kF32>(a, n0);
  }
  template <int ST>
  static void strip_typed(const Args<T>& a, int64_t n0) {
    const int64_t rows = std::min<int64_t>(16, a.n - n0);
    store_strip(a, n0, rows, strip_sums(rows, [&](int64_t r) __attribute__((always_inline)) {
      __m512 sum[1][1];
      Tile<1, 1>::template sums<ST>(a, 0, n0 + r, sum);
      return sum[0][0];
    }));
  }
};

// Minus `offset` times the sum of x's codes over each lane's columns, per step: 128 columns
// of nibble order (int4, int6: lane l the codes at c + 4 l .. c + 4 l + 3 and 64 further) or
// 64 columns of 4 a lane (int8)
template <bool Nibbles>
std::vector<int32_t> lane_offsets(const int8_t* xq, int64_t m, int64_t k, int32_t offset) {
  const int64_t columns = Nibbles ? 8 : 4, step = Nibbles ? 128 : 64;
  std::vector<int32_t> xs(m * k / columns);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < k; c += step)
      for (int l = 0; l < 16; ++l) {
        int32_t sum = 0;
        for (int b = 0; b < 4; ++b) {
          sum += xq[i * k + c + 4 * l + b];
          if (Nibbles) sum += xq[i * k + c + 64 + 4 * l + b];
        }
        xs[i * (k / columns) + c / columns + l] = -offset * sum;
      }
  return xs;
}

// a VNNI kernel's tasks: at batch 1 strips of 16 rows (Kernel::strip) where there are at least
// as many strips as threads (a strip's results are the same bits as one-row tasks'; on a
// many-core host a narrow output in strips would leave threads idle), else for_tiles (one-row
// tasks at batch 1)
template <typename Kernel, typename T>
void vnni_tiles(const Args<T>& a) {
  const bool strips = a.m == 1 && a.n >= 16 * threads();
  if (!strips) {
    for_tiles<Kernel::template Tile, 1>(a);
    return;
  }
#pragma omp parallel for schedule(guided)
  for (int64_t n0 = 0; n0 < a.n; n0 += 16) {
    prefetch_scale_rows(a, n0 + 16, 16);  // the next strip's
    Kernel::strip(a, n0);
  }
}

#if defined(FOUDRE_AMX)

// -- AMX: int8 per channel, int4 in groups of 128 or more, int8 and int4 in groups of 32 --------
//
// Where the CPU has AMX's int8 tiles and Linux lets this process use them (arch_prctl: the tiles' 8
// KiB of state is granted on request; FOUDRE_AMX=0 declines it), int8 per channel runs on them from
// kAmxRows x rows, int4 in groups of 128 or more from kAmxRowsInt4 (amx_int4, below), int8 and int4
// in groups of 32 from kAmxRowsGroups32 and kAmxRowsInt4Groups32 (amx_groups32, below). A row's
// result there depends on no other row, but differs from the VNNI kernel's in its float rounding
// (the sums' order is not the same). x is quantized as on the VNNI path (per 128 columns, signed
// codes; per 32 for group-wise int8, per 64 in the columns' order for int4 g32); for int8 a tile
// product (tdpbssd: signed by signed, no offset) takes 16 weight rows x 64 columns straight from
// the row-major codes (A, rows row_bytes apart) and 16 x rows packed 4 bytes a column group (B),
// summing each (weight row, x row) pair's 64 products in int32; two such products make a block of
// 128 columns, whose int32 sums are converted once and multiplied by x's d of the block into
// float32 accumulators (one vector per weight row, its lanes the x rows); at the end y = s times
// that. Each task takes 16 weight rows (one tile of A) for every 16 x rows.

// the fewest x rows that run on the tiles (fewer, the VNNI kernel is faster; 4096 x 1536 and
// 1536 x 4096 weights from memory, two threads, in turns: int8 1 row 0.89x, 2 0.95x, 4 1.05x,
// 32 2.28x; int4 g128 4 rows 0.67x, 8 1.19x, 16 2.1x, 32 2.8x; Q8_0 4 rows 0.75x, 5 0.93-1.04x,
// 6 1.11-1.12x, 7 1.21-1.28x, 8 1.25-1.40x, 16 2.5x, 31 2.65x; Q4_0 8 rows 0.73-0.86x, 10
// 0.88-1.02x, 12 1.02-1.17x, 16 1.7x)
constexpr int64_t kAmxRows = 4, kAmxRowsInt4 = 8, kAmxRowsGroups32 = 6, kAmxRowsInt4Groups32 = 12;
constexpr int64_t kAmxRowsInt4x16 = 8;
constexpr int64_t kAmxRowsX16 = 6;  // (blocks of 16 rows: 4 rows 0.9x, 5 0.84-1.01x, 6 0.95-1.02x,
                                    // 7 1.09-1.10x, 8 1.03-1.11x, 12 1.3-1.4x)

// whether this process may use AMX's tiles (asked once)
inline bool amx_ready() {
  static const bool ok = [] {
    const char* env = std::getenv("FOUDRE_AMX");
    if (env && env[0] == '0') return false;
    constexpr long kReqPerm = 0x1023, kXTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXTileData) == 0;
  }();
  return ok;
}

// the fewest x rows from which a layout runs on the tiles; 0: never
inline int64_t amx_rows(Kind kind, int64_t group) {
  if (!amx_ready()) return 0;
  if (kind == Kind::Int8) return kAmxRows;
  if (kind == Kind::Int8Grouped) return group == 32 ? kAmxRowsGroups32 : 0;
  if (kind == Kind::Int8x16) return kAmxRowsX16;
  if (kind == Kind::Int4x16) return group >= 128 ? kAmxRowsInt4x16 : kAmxRowsInt4Groups32;
  if (kind == Kind::Int4 && group == 32) return kAmxRowsInt4Groups32;
  return kind == Kind::Int4 && group >= 128 ? kAmxRowsInt4 : 0;
}

// GCC's tile loads declare no memory operand: before one reads a buffer just written, the
// compiler must have stored it
[[gnu::always_inline]] inline void tile_reads_memory() { asm volatile("" ::: "memory"); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-5 as 16 rows of 64 bytes (C: 0 and 5, A: 1 and 2, B: 3 and 4), for this thread;
// with `columns` 32 (a product over 32 columns) A's rows of 32 bytes and B's 8 rows
inline void configure_tiles(int columns = 64) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    const bool a = t == 1 || t == 2, b = t == 3 || t == 4;
    cfg.rows[t] = static_cast<uint8_t>(b ? columns / 4 : 16);
    cfg.colsb[t] = static_cast<uint16_t>(a ? columns : 64);
  }
  _tile_loadconfig(&cfg);
}

// x's codes as the tiles take them: B per x tile (16 rows; those past m zero) and 64 columns,
// 16 lines of 64 bytes, line j holding columns 4 j .. 4 j + 3 of the tile's rows (a product
// over 32 columns: 8 of those lines, half_tile); per x tile and block of `block` columns (x's
// blocks: 128; 32 for the groups of 32, int4's d then the same for two) the 16 rows' d, and
// (given hsum) their sums d q
struct AmxX {
  int64_t chunks, block, blocks, xtiles;
  std::vector<int32_t> codes;
  std::vector<float> d, h;
  template <typename T>
  AmxX(const Args<T>& a, const float* hsum, int64_t block_ = 128)
      : chunks(a.k / 64), block(block_), blocks((a.k + block - 1) / block), xtiles((a.m + 15) / 16),
        codes(xtiles * chunks * 256, 0), d(xtiles * blocks * 16, 0.0f),
        h(hsum ? xtiles * blocks * 16 : 0, 0.0f) {
    const int64_t k = a.k;
    for (int64_t i = 0; i < a.m; ++i) {
      const int64_t jt = i / 16, ii = i % 16;
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t j = 0; j < 16; ++j)
          std::memcpy(&codes[(jt * chunks + c) * 256 + j * 16 + ii],
                      a.xq + i * k + c * 64 + 4 * j, 4);
      for (int64_t b = 0; b < blocks; ++b) {
        d[(jt * blocks + b) * 16 + ii] = a.dl[i * (k / 4) + b * (block / 4)];
        if (!hsum) continue;
        float sum = 0.0f;
        for (int64_t q = 0; q < std::min(block, k - b * block) / 16; ++q)
          sum += hsum[i * (k / 16) + b * (block / 16) + q];
        h[(jt * blocks + b) * 16 + ii] = sum;
      }
    }
  }
  const int32_t* tile(int64_t jt, int64_t chunk) const {
    return &codes[(jt * chunks + chunk) * 256];
  }
  const int32_t* half_tile(int64_t jt, int64_t c32) const {  // columns 32 c32 .. 32 c32 + 31
    return tile(jt, c32 / 2) + (c32 % 2) * 128;
  }
  __m512 dv(int64_t jt, int64_t b) const { return _mm512_loadu_ps(&d[(jt * blocks + b) * 16]); }
  __m512 hv(int64_t jt, int64_t b) const { return _mm512_loadu_ps(&h[(jt * blocks + b) * 16]); }
};

// y [16 jt + i, n0 + r] = out[r][i] for x tile jt's rows and a task's `rows` weight rows
template <typename T>
void store_amx_tile(const Args<T>& a, int64_t jt, int64_t n0, int64_t rows,
                    const float (&out)[16][16]) {
  for (int64_t i = 0; i < std::min<int64_t>(16, a.m - jt * 16); ++i)
    for (int64_t r = 0; r < rows; ++r) store1(a.y + (jt * 16 + i) * a.n + n0 + r, out[r][i]);
}

// a task's 16 weight rows of int8 codes as an A tile reads them (stride: their distance): the
// rows themselves, or where fewer than 16 are left (the last task) a copy in `pad`, zero past them
template <typename T>
const int8_t* task_rows(const Args<T>& a, int64_t n0, int64_t rows, std::vector<int8_t>& pad,
                        int64_t& stride) {
  const int8_t* w = reinterpret_cast<const int8_t*>(a.w) + n0 * a.row_bytes;
  stride = a.row_bytes;
  if (rows == 16) return w;
  pad.assign(16 * a.k, 0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&pad[r * a.k], w + r * a.row_bytes, a.k);
  stride = a.k;
  tile_reads_memory();
  return pad.data();
}

template <typename T>
void amx_int8(const Args<T>& a) {
  const int64_t n = a.n, k = a.k;
  const AmxX xt(a, nullptr);
  const int64_t blocks = xt.blocks, xtiles = xt.xtiles;
  const int64_t tasks = (n + 15) / 16;
#pragma omp parallel
  {
    configure_tiles();
    std::vector<int8_t> pad;  // the last task's rows past n: zero
    alignas(64) int32_t sums[16][16];
    alignas(64) float out[16][16];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t n0 = task * 16, rows = std::min<int64_t>(16, n - n0);
      int64_t stride;
      const int8_t* w = task_rows(a, n0, rows, pad, stride);
      for (int64_t jt = 0; jt < xtiles; ++jt) {
        __m512 acc[16];
        for (auto& v : acc) v = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t c0 = b * 128;
          if (jt == 0 && rows == 16)  // the same columns of the next task's rows, into L2
            for (int r = 0; r < 16; ++r) {
              const uintptr_t next = reinterpret_cast<uintptr_t>(w) + (16 + r) * stride + c0;
              prefetch_l2(next);
              prefetch_l2(next + 64);
            }
          _tile_zero(0);
          _tile_loadd(1, w + c0, stride);
          _tile_loadd(3, xt.tile(jt, c0 / 64), 64);
          _tile_dpbssd(0, 1, 3);
          if (c0 + 64 < k) {
            _tile_loadd(2, w + c0 + 64, stride);
            _tile_loadd(4, xt.tile(jt, c0 / 64 + 1), 64);
            _tile_dpbssd(0, 2, 4);
          }
          _tile_stored(0, sums, 64);
          const __m512 d = xt.dv(jt, b);
          for (int r = 0; r < 16; ++r)
            acc[r] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_load_si512(sums[r])), d, acc[r]);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 s = _mm512_set1_ps(scale_at(a.s, n0 + r, a.st));
          _mm512_store_ps(out[r], _mm512_mul_ps(acc[r], s));
        }
        store_amx_tile(a, jt, n0, rows, out);
      }
    }
    _tile_release();
  }
}

// int4 in groups of 128 or more: x in the VNNI path's nibble order (per 128 columns the even
// ones, then the odd ones), so that a block's 64 code bytes of a weight row, their low nibbles
// then their high ones, unpacked to bytes (two A tiles, through a buffer), meet x's two halves
// as packed for int8 (the same B); tdpbusd (the codes unsigned) sums q x per pair and block,
// and each block adds s (d sum - z sum(d q over the block)) of its group. A task unpacks its 16
// rows' block once, for all the x tiles (blocks outside, x tiles inside).
template <typename T>
void amx_int4(const Args<T>& a, const float* hsum) {
  const int64_t n = a.n;
  const AmxX xt(a, hsum);
  const int64_t blocks = xt.blocks, xtiles = xt.xtiles;
  const int64_t tasks = (n + 15) / 16, per_group = a.group / 128;
#pragma omp parallel
  {
    configure_tiles();
    alignas(64) uint8_t lo[16][64], hi[16][64];
    alignas(64) int32_t sums[16][16];
    alignas(64) float out[16][16];
    std::vector<__m512> acc(xtiles * 16);
    const __m512i low = _mm512_set1_epi8(15);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t n0 = task * 16, rows = std::min<int64_t>(16, n - n0);
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        __m512 s[16], sz[16];  // the rows' scale, and scale times zero point, of b's group
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t nr = std::min(n0 + r, n - 1);
          const uint8_t* row = a.w + nr * a.row_bytes + b * 64;
          if (rows == 16) prefetch_l2(reinterpret_cast<uintptr_t>(row) + 16 * a.row_bytes);
          const __m512i v = r < rows ? _mm512_loadu_si512(row) : _mm512_setzero_si512();
          _mm512_store_si512(lo[r], _mm512_and_si512(v, low));
          _mm512_store_si512(hi[r], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
          const int64_t g = nr * a.s_stride + b / per_group;
          const float sc = scale_at(a.s, g, a.st);
          const float z = a.z ? scale_at(a.z, g, a.st) : a.zc;
          s[r] = _mm512_set1_ps(sc);
          sz[r] = _mm512_set1_ps(sc * z);
        }
        tile_reads_memory();
        _tile_loadd(1, lo, 64);
        _tile_loadd(2, hi, 64);
        for (int64_t jt = 0; jt < xtiles; ++jt) {
          _tile_zero(0);
          _tile_loadd(3, xt.tile(jt, 2 * b), 64);
          _tile_dpbusd(0, 1, 3);
          _tile_loadd(4, xt.tile(jt, 2 * b + 1), 64);
          _tile_dpbusd(0, 2, 4);
          _tile_stored(0, sums, 64);
          const __m512 d = xt.dv(jt, b), h = xt.hv(jt, b);
          __m512* av = &acc[jt * 16];
          for (int r = 0; r < 16; ++r) {
            const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r])), d);
            av[r] = _mm512_fnmadd_ps(sz[r], h, _mm512_fmadd_ps(p, s[r], av[r]));
          }
        }
      }
      for (int64_t jt = 0; jt < xtiles; ++jt) {
        for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(out[r], acc[jt * 16 + r]);
        store_amx_tile(a, jt, n0, rows, out);
      }
    }
    _tile_release();
  }
}

// group-wise int8 in groups of 32 (GGUF's Q8_0, Q5_0, Q5_1 and Q5_K as QuantLinear holds them),
// x quantized per 32 columns as on the VNNI path: a tile product (tdpbssd) a group, 16 weight
// rows x 32 columns (A, rows of 32 bytes: the row-major codes themselves) by 16 x rows (B, 8 lines
// of AmxX's), whose int32 sums are converted, multiplied by x's d of the group and by each
// weight row's scale into float32 accumulators (with zero points: minus s z times x's sums d q
// over the group). A task converts its 16 rows' scales (and s z) once, for all the x tiles.
// Int4 in groups of 32 (GGUF's Q4_0, Q4_1, Q4_K; Nibbles): the same, x quantized as on the
// VNNI path (one d per 64 columns, so one a group) but in the columns' order, not the nibbles',
// each task's 16 rows unpacked once to one code byte a column (a row's 16 bytes a group: low
// nibbles the even columns, high the odd), tdpbusd for the unsigned codes.
template <typename T, bool Nibbles>
void amx_groups32(const Args<T>& a, const float* hsum) {
  const int64_t n = a.n, k = a.k, groups = k / 32;
  const bool offsets = a.z != nullptr || a.zc != 0.0f;
  const AmxX xt(a, offsets ? hsum : nullptr, 32);
  const int64_t xtiles = xt.xtiles, tasks = (n + 15) / 16;
#pragma omp parallel
  {
    configure_tiles(32);
    // the last task's rows, zero past n (int4: every task's rows, unpacked)
    std::vector<int8_t> pad;
    std::vector<float> sf(16 * groups), szf(offsets ? 16 * groups : 0);  // [row][group]
    alignas(64) int32_t sums[2][16][16];
    alignas(64) float out[16][16];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t n0 = task * 16, rows = std::min<int64_t>(16, n - n0);
      prefetch_scale_rows(a, n0 + 16, 16);
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t g = 0; g < groups; g += 16) {
          // (rows past n: zero scales)
          const auto valid =
              static_cast<__mmask16>(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
          const auto mask = static_cast<__mmask16>(r < rows ? valid : 0);
          const int64_t at = (n0 + std::min(r, rows - 1)) * a.s_stride + g;
          const __m512 sv = load_scales(a.s, at, a.st, mask);
          _mm512_mask_storeu_ps(&sf[r * groups + g], valid, sv);
          if (!offsets) continue;
          const __m512 z = a.z ? load_scales(a.z, at, a.st, mask) : _mm512_set1_ps(a.zc);
          _mm512_mask_storeu_ps(&szf[r * groups + g], valid, _mm512_mul_ps(sv, z));
        }
      int64_t stride;
      const int8_t* w;
      if constexpr (Nibbles) {
        // 128 columns at a time: the bytes' low and high nibbles interleaved within each 16-byte
        // lane (32 columns: its first 16 in unpacklo's lane, the rest in unpackhi's), the lanes
        // then put in order
        pad.resize(16 * k);
        const __m512i low = _mm512_set1_epi8(15);
        const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        for (int64_t r = 0; r < 16; ++r) {
          const uint8_t* row = a.w + std::min(n0 + r, n - 1) * a.row_bytes;
          int8_t* bytes = &pad[r * k];
          for (int64_t c = 0; c < k; c += 128) {
            const uintptr_t next = reinterpret_cast<uintptr_t>(row + c / 2) + 16 * a.row_bytes;
            if (rows == 16) prefetch_l2(next);  // the next task's rows
            const __m512i v = r < rows ? _mm512_loadu_si512(row + c / 2) : _mm512_setzero_si512();
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            const __m512i a0 = _mm512_unpacklo_epi8(lo, hi), a1 = _mm512_unpackhi_epi8(lo, hi);
            _mm512_storeu_si512(bytes + c, _mm512_permutex2var_epi64(a0, first, a1));
            _mm512_storeu_si512(bytes + c + 64, _mm512_permutex2var_epi64(a0, second, a1));
          }
        }
        w = pad.data();
        stride = k;
        tile_reads_memory();
      } else {
        w = task_rows(a, n0, rows, pad, stride);
      }
      for (int64_t jt = 0; jt < xtiles; ++jt) {
        __m512 acc[16];
        for (auto& v : acc) v = _mm512_setzero_ps();
        // group g's product into C tile 0 or 5 and sums[g % 2], group g - 1's sums scaled
        // meanwhile (its tile store long done by the time they are read)
        const auto scale = [&](int64_t g) __attribute__((always_inline)) {
          const __m512 d = xt.dv(jt, g);
          const float* s = &sf[g];
          for (int r = 0; r < 16; ++r) {
            const __m512 p =
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[g % 2][r])), d);
            acc[r] = _mm512_fmadd_ps(p, _mm512_set1_ps(s[r * groups]), acc[r]);
          }
          if (offsets) {
            const __m512 h = xt.hv(jt, g);
            for (int r = 0; r < 16; ++r)
              acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(szf[r * groups + g]), h, acc[r]);
          }
        };
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t c0 = g * 32;
          if (!Nibbles && jt == 0 && rows == 16 && c0 % 128 == 0)  // the next task's rows
            for (int r = 0; r < 16; ++r) {
              const uintptr_t next = reinterpret_cast<uintptr_t>(w) + (16 + r) * stride + c0;
              prefetch_l2(next);
              prefetch_l2(next + 64);
            }
          if (g % 2 == 0) {
            _tile_zero(0);
            _tile_loadd(1, w + c0, stride);
            _tile_loadd(3, xt.half_tile(jt, g), 64);
            if constexpr (Nibbles)
              _tile_dpbusd(0, 1, 3);
            else
              _tile_dpbssd(0, 1, 3);
            _tile_stored(0, sums[0], 64);
          } else {
            _tile_zero(5);
            _tile_loadd(2, w + c0, stride);
            _tile_loadd(4, xt.half_tile(jt, g), 64);
            if constexpr (Nibbles)
              _tile_dpbusd(5, 2, 4);
            else
              _tile_dpbssd(5, 2, 4);
            _tile_stored(5, sums[1], 64);
          }
          if (g > 0) scale(g - 1);
        }
        scale(groups - 1);
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) _mm512_store_ps(out[r], acc[r]);  // (rows of them stored)
        store_amx_tile(a, jt, n0, rows, out);
      }
    }
    _tile_release();
  }
}

#endif  // FOUDRE_AMX

// quantize x, then the tiles (AMX's, where they take the layout and the rows); the codes'
// offsets taken off in the lanes' dots (xs) where they are one integer (int6's 32; groups under
// 128 whose zero points are all zc), else at the end through corr = the sums of a row's 16-code
// sums: per row (int8), per group (grouped)
template <typename T, Kind K>
void vnni_matmul(Args<T> a) {
  constexpr bool grouped = K != Kind::Int8;
  constexpr bool nibbles = K == Kind::Int4 || K == Kind::Int6;
  const int64_t halves = a.k / 16;
  std::vector<int8_t> xq(a.m * a.k);
  std::vector<float> dl(a.m * a.k / 4), hsum(a.m * halves);
  a.xq = xq.data();
  a.dl = dl.data();
  bool tiles = false;  // AMX's
#if defined(FOUDRE_AMX)
  if constexpr (K != Kind::Int6) {
    const int64_t from = amx_rows(K, a.group);
    tiles = from && a.m >= from;
  }
#endif
  // int4 in groups of 32 on the tiles: x in its columns' order (the same blocks, the same d)
  if (K == Kind::Int4 && tiles && a.group < 128)
    quantize_rows<T, false>(a.x, a.m, a.k, activation_block<K>(a.group), xq.data(), dl.data(),
                            hsum.data());
  else
    quantize_rows<T, nibbles>(a.x, a.m, a.k, activation_block<K>(a.group), xq.data(), dl.data(),
                              hsum.data());
#if defined(FOUDRE_AMX)
  if constexpr (K != Kind::Int6) {
    if (tiles) {
      if constexpr (K == Kind::Int8) {
        amx_int8(a);
      } else if constexpr (K == Kind::Int4) {
        if (a.group >= 128)
          amx_int4(a, hsum.data());
        else
          amx_groups32<T, true>(a, hsum.data());
      } else {
        amx_groups32<T, false>(a, hsum.data());
      }
      return;
    }
  }
#endif
  std::vector<float> dl8;
  if constexpr (K == Kind::Int8Grouped) {  // one d per 8 columns (a lane after the pair sums)
    dl8.resize(a.m * a.k / 8);
    for (int64_t i = 0; i < a.m * a.k / 8; ++i) dl8[i] = dl[2 * i];
    a.dl = dl8.data();
  }
  std::vector<float> d32;
  if (K == Kind::Int8Grouped && a.group == 32) {  // one d per 32 columns (Vnni::steps' chunks)
    d32.resize(a.m * a.k / 32);
    for (int64_t i = 0; i < a.m * a.k / 32; ++i) d32[i] = dl[8 * i];
    a.d32 = d32.data();
  }
  std::vector<int32_t> xs;
  const float offset = K == Kind::Int6 ? 32.0f : a.zc + (K == Kind::Int4 ? 0.0f : 128.0f);
  const bool small_groups = K != Kind::Int4 || a.group < 128;  // (int4 g128+: one loop only)
  const bool one_integer = !a.z && offset == std::floor(offset) && std::fabs(offset) <= 384.0f;
  if (K == Kind::Int6 || (grouped && small_groups && one_integer)) {
    xs = lane_offsets<nibbles>(xq.data(), a.m, a.k, static_cast<int32_t>(offset));
    a.xs = xs.data();
  }
  if constexpr (K == Kind::Int6) {
    vnni_tiles<VnniInt6<T>>(a);
  } else {
    const int64_t per_row = grouped ? a.groups : 1;
    std::vector<float> corr(a.xs ? 0 : a.m * per_row, 0.0f);  // (unread with xs)
    for (int64_t i = 0; i < (a.xs ? 0 : a.m); ++i)
      for (int64_t h = 0; h < halves; ++h)
        corr[i * per_row + (grouped ? column_of<K>(h * 16) >> a.gshift : 0)] +=
            hsum[i * halves + h];
    a.corr = corr.data();
    vnni_tiles<Vnni<T, K>>(a);
  }
}

// whether the rows of x run on AMX's tiles for this layout (amx_rows)
template <typename T>
bool on_tiles(const Args<T>& a, Kind kind) {
#if defined(FOUDRE_AMX)
  const int64_t from = amx_rows(kind, a.group);
  return from && a.m >= from;
#else
  (void)a;
  (void)kind;
  return false;
#endif
}

// f(std::integral_constant<int, ST>{}) for the scales' type st
template <typename F>
void by_scale_type(int st, F&& f) {
  if (st == kF16)
    f(std::integral_constant<int, kF16>{});
  else if (st == kBF16)
    f(std::integral_constant<int, kBF16>{});
  else
    f(std::integral_constant<int, kF32>{});
}

// a blocks layout's tasks (16 weight rows), x's rows four at a time: Kernel::tile<MT>
template <typename Kernel, typename T>
void blocks_by_four(const Args<T>& a) {
  const int64_t blocks = (a.n + 15) / 16;
#pragma omp parallel for schedule(guided)
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t m0 = 0; m0 < a.m; m0 += 4) switch (std::min<int64_t>(a.m - m0, 4)) {
        case 1: Kernel::template tile<1>(a, m0, b); break;
        case 2: Kernel::template tile<2>(a, m0, b); break;
        case 3: Kernel::template tile<3>(a, m0, b); break;
        default: Kernel::template tile<4>(a, m0, b); break;
      }
}

// -- Int8x16 (group-wise int8 in 16-row blocks, see x16_codes) --------------------------------
//
// x quantized per 32 columns as for group-wise int8 (the same codes and d); a group's 16 rows at
// once: vpdpbusd of each of its 8 code lines (16 rows x 4 columns, unsigned) with x's 4 codes of
// those columns broadcast, on top of -(zc + 128) times the group's sum of x's codes (xs), so the
// int32 lanes hold the 16 rows' sums of q x; converted, times the rows' scales times x's d into
// float32 lanes, one per weight row: no pairing, permutes or reduction of lanes. One x row's
// result is the same bits at any batch, on AMX's tiles too (amx_x16: the same int32 sums, the
// same float products in the same order).

template <typename T, int ST>
struct X16 {
  // y [m0 .. m0 + MT, block b's rows]
  template <int MT>
  static void tile(const Args<T>& a, int64_t m0, int64_t b) {
    constexpr int64_t kScales = x16_scale_bytes(ST);
    const int64_t k = a.k, groups = k / 32;
    const uint8_t* block = a.w + b * a.row_bytes;
    const int32_t* xw = reinterpret_cast<const int32_t*>(a.xq + m0 * k);  // 4 codes a dword
    const float* d = a.d32 + m0 * groups;
    const int32_t* xs = a.xs + m0 * groups;
    __m512 acc[MT];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = x16_codes(block, g, kScales);
      constexpr bool kStream = MT == 1;  // (else the block is read again for the next x rows)
      for (int line = 0; line < 8; ++line) prefetch_ahead<kStream>(p + 64 * line, kAhead);
      prefetch_ahead<kStream>(x16_scales(block, g, kScales), kAhead);  // (16-bit: g's pair's)
      __m512i dot[MT];
      for (int mi = 0; mi < MT; ++mi) dot[mi] = _mm512_set1_epi32(xs[mi * groups + g]);
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(p + 64 * j);
        for (int mi = 0; mi < MT; ++mi)
          dot[mi] = _mm512_dpbusd_epi32(dot[mi], w, _mm512_set1_epi32(xw[mi * (k / 4) + 8 * g + j]));
      }
      const __m512 s = load_scales16<ST>(x16_scales(block, g, kScales), 0);
      for (int mi = 0; mi < MT; ++mi)
        acc[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[mi]),
                                  _mm512_mul_ps(s, _mm512_set1_ps(d[mi * groups + g])), acc[mi]);
    }
    const int64_t rows = std::min<int64_t>(16, a.n - 16 * b);
    for (int mi = 0; mi < MT; ++mi) store_strip(a, (m0 + mi) * a.n + 16 * b, rows, acc[mi]);
  }
};

#if defined(FOUDRE_AMX)
// on the tiles: a tile product a group (tdpbsud: x's 16 rows x 32 columns, signed, A, the rows of
// xq themselves; the group's 512 code bytes, unsigned, B as they lie), its int32 sums (C: x rows
// by weight rows) plus xs, then scaled as X16's; the next group's product in a second C tile
// meanwhile (as amx_groups32)
template <typename T, int ST>
void amx_x16(const Args<T>& a) {
  const int64_t n = a.n, k = a.k, groups = k / 32, xtiles = (a.m + 15) / 16;
  constexpr int64_t kScales = x16_scale_bytes(ST);
  const int64_t tasks = (n + 15) / 16;
#pragma omp parallel
  {
    configure_tiles(32);
    alignas(64) int32_t sums[2][16][16];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < tasks; ++b) {
      const uint8_t* p = a.w + b * a.row_bytes;
      const int64_t rows = std::min<int64_t>(16, n - 16 * b);
      for (int64_t jt = 0; jt < xtiles; ++jt) {
        const int8_t* x = a.xq + 16 * jt * k;
        const float* d = a.d32 + 16 * jt * groups;
        const int32_t* xs = a.xs + 16 * jt * groups;
        __m512 acc[16];
        for (auto& v : acc) v = _mm512_setzero_ps();
        const auto scale = [&](int64_t g) __attribute__((always_inline)) {
          const __m512 s = load_scales16<ST>(x16_scales(p, g, kScales), 0);
          for (int i = 0; i < 16; ++i) {
            const __m512i dot = _mm512_add_epi32(_mm512_load_si512(sums[g % 2][i]),
                                                 _mm512_set1_epi32(xs[i * groups + g]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(s, _mm512_set1_ps(d[i * groups + g])), acc[i]);
          }
        };
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* w = x16_codes(p, g, kScales);
          if (jt == 0) {  // the next block's group, into L2
            for (int line = 0; line < 8; ++line)
              prefetch_l2(reinterpret_cast<uintptr_t>(w) + a.row_bytes + 64 * line);
            prefetch_l2(reinterpret_cast<uintptr_t>(x16_scales(p, g, kScales)) + a.row_bytes);
          }
          if (g % 2 == 0) {
            _tile_zero(0);
            _tile_loadd(1, x + 32 * g, k);
            _tile_loadd(3, w, 64);
            _tile_dpbsud(0, 1, 3);
            _tile_stored(0, sums[0], 64);
          } else {
            _tile_zero(5);
            _tile_loadd(2, x + 32 * g, k);
            _tile_loadd(4, w, 64);
            _tile_dpbsud(5, 2, 4);
            _tile_stored(5, sums[1], 64);
          }
          if (g > 0) scale(g - 1);
        }
        scale(groups - 1);
        for (int64_t i = 0; i < std::min<int64_t>(16, a.m - 16 * jt); ++i)
          store_strip(a, (16 * jt + i) * n + 16 * b, rows, acc[i]);
      }
    }
    _tile_release();
  }
}
#endif  // FOUDRE_AMX

// x quantized (its rows padded to a multiple of 16 for the tiles: zero), then X16's tiles (or
// AMX's, from amx_rows) over blocks
template <typename T>
void x16_matmul(Args<T> a) {
  const bool tiles = on_tiles(a, Kind::Int8x16);
  const int64_t padded = tiles ? (a.m + 15) / 16 * 16 : a.m;  // (the tiles: 16 x rows at a time)
  const int64_t k = a.k, groups = k / 32;
  std::vector<int8_t> xq(padded * k, 0);
  std::vector<float> dl(a.m * k / 4), hsum(a.m * k / 16), d32(padded * groups, 0.0f);
  std::vector<int32_t> xs(padded * groups, 0);
  quantize_rows<T, false>(a.x, a.m, k, 32, xq.data(), dl.data(), hsum.data());
  const int32_t offset = static_cast<int32_t>(a.zc) + 128;
  for (int64_t i = 0; i < a.m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t c = 32 * g; c < 32 * g + 32; ++c) sum += xq[i * k + c];
      xs[i * groups + g] = -offset * sum;
      d32[i * groups + g] = dl[i * (k / 4) + 8 * g];
    }
  a.xq = xq.data();
  a.d32 = d32.data();
  a.xs = xs.data();
  by_scale_type(a.st, [&](auto st) {
#if defined(FOUDRE_AMX)
    if (tiles) return amx_x16<T, decltype(st)::value>(a);
#endif
    blocks_by_four<X16<T, decltype(st)::value>>(a);
  });
}

// -- Int4x16 (int4 in 16-row blocks, see x4_group) -------------------------------------------
//
// x quantized as for int4 on rows (the same codes and d: per 128 columns, per 64 in groups under
// 128), in the columns' order; per 128 columns of a block (a group, under 128), each of its lines:
// the low nibbles (columns
// 8 j .. 8 j + 3 of the 16 rows) and the high ones (8 j + 4 ..) each a vpdpbusd with x's 4 codes
// of those columns broadcast, summed in int32 (two chains, added), converted and scaled by the
// rows' scales times x's d into float lanes, one per weight row; per group minus the rows' s z
// times x's sum d q over the group (corr). As Int8x16, a row's result is the same bits at any
// batch and on AMX's tiles (amx_x4: the same int32 sums, the same float steps in one order).

template <typename T, int ST>
struct X4 {
  template <int MT>
  static void tile(const Args<T>& a, int64_t m0, int64_t b) {
    constexpr int64_t kScales = 16 * (ST == kF32 ? 4 : 2);
    const int64_t k = a.k, group = a.group, groups = k / group;
    const int64_t chunk = std::min<int64_t>(group, 128), xblock = group >= 128 ? 128 : 64;
    const int64_t xblocks = k / xblock;
    const bool zeros = a.s_stride != 0;
    const int64_t step = 8 * group + (zeros ? 2 : 1) * kScales;
    const uint8_t* p = a.w + b * a.row_bytes;
    const int32_t* xw = reinterpret_cast<const int32_t*>(a.xq + m0 * k);  // 4 codes a dword
    const float* d = a.d32 + m0 * xblocks;
    const float* corr = a.corr + m0 * groups;
    const __m512i low = _mm512_set1_epi8(15);
    const __m512 zc = _mm512_set1_ps(a.zc);
    constexpr bool kStream = MT == 1;  // (else the block is read again for the next x rows)
    __m512 acc[MT];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, p += step) {
      const __m512 s = load_scales16<ST>(p + 8 * group, 0);
      for (int64_t c = 0; c < group; c += chunk) {
        const uint8_t* lines = p + 8 * c;
        const int64_t col = g * group + c;
        __m512i lo_dot[MT], hi_dot[MT];
        for (int mi = 0; mi < MT; ++mi) lo_dot[mi] = hi_dot[mi] = _mm512_setzero_si512();
        for (int64_t j = 0; j < chunk / 8; ++j) {
          prefetch_ahead<kStream>(lines + 64 * j, kAhead);
          const __m512i v = _mm512_loadu_si512(lines + 64 * j);
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int mi = 0; mi < MT; ++mi) {
            const int32_t* x4 = xw + mi * (k / 4) + col / 4 + 2 * j;
            lo_dot[mi] = _mm512_dpbusd_epi32(lo_dot[mi], lo, _mm512_set1_epi32(x4[0]));
            hi_dot[mi] = _mm512_dpbusd_epi32(hi_dot[mi], hi, _mm512_set1_epi32(x4[1]));
          }
        }
        for (int mi = 0; mi < MT; ++mi) {
          const __m512i dot = _mm512_add_epi32(lo_dot[mi], hi_dot[mi]);
          acc[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                    _mm512_mul_ps(s, _mm512_set1_ps(d[mi * xblocks + col / xblock])),
                                    acc[mi]);
        }
      }
      for (int64_t line = 8 * group; line < step; line += 64)
        prefetch_ahead<kStream>(p + line, kAhead);
      const __m512 z = zeros ? load_scales16<ST>(p + 8 * group + kScales, 0) : zc;
      const __m512 sz = _mm512_mul_ps(s, z);
      for (int mi = 0; mi < MT; ++mi)
        acc[mi] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(corr[mi * groups + g]), acc[mi]);
    }
    const int64_t rows = std::min<int64_t>(16, a.n - 16 * b);
    for (int mi = 0; mi < MT; ++mi) store_strip(a, (m0 + mi) * a.n + 16 * b, rows, acc[mi]);
  }
};

#if defined(FOUDRE_AMX)
// on the tiles: per 128 columns of a block (a group, under 128) its lines unpacked once (each
// line's low nibbles then its high ones: lines of 64 bytes, B tiles of 64 columns each, or one of
// 32 for groups of 32; unsigned), for every 16 x rows (A, their quantized rows themselves)
// tdpbsud into one C (x rows by weight rows), then each x row scaled as X4's
template <typename T, int ST>
void amx_x4(const Args<T>& a) {
  constexpr int64_t kScales = 16 * (ST == kF32 ? 4 : 2);
  const int64_t n = a.n, k = a.k, group = a.group, groups = k / group;
  const int64_t chunk = std::min<int64_t>(group, 128), xblock = group >= 128 ? 128 : 64;
  const int64_t unit = std::min<int64_t>(group, 64), xblocks = k / xblock;
  const bool zeros = a.s_stride != 0;
  const int64_t step = 8 * group + (zeros ? 2 : 1) * kScales;
  const int64_t xtiles = (a.m + 15) / 16, tasks = (n + 15) / 16;
#pragma omp parallel
  {
    configure_tiles(static_cast<int>(unit));
    alignas(64) uint8_t unpacked[32][64];
    alignas(64) int32_t sums[2][16][16];
    std::vector<__m512> acc(xtiles * 16);
    const __m512i low = _mm512_set1_epi8(15);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < tasks; ++b) {
      const uint8_t* p = a.w + b * a.row_bytes;
      const int64_t rows = std::min<int64_t>(16, n - 16 * b);
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g, p += step) {
        const __m512 s = load_scales16<ST>(p + 8 * group, 0);
        const __m512 z =
            zeros ? load_scales16<ST>(p + 8 * group + kScales, 0) : _mm512_set1_ps(a.zc);
        const __m512 sz = _mm512_mul_ps(s, z);
        for (int64_t c = 0; c < group; c += chunk) {
          const uint8_t* lines = p + 8 * c;
          const int64_t col = g * group + c;
          for (int64_t j = 0; j < chunk / 8; ++j) {
            prefetch_l2(reinterpret_cast<uintptr_t>(lines) + 64 * j + a.row_bytes);  // next block
            const __m512i v = _mm512_loadu_si512(lines + 64 * j);
            _mm512_store_si512(unpacked[2 * j], _mm512_and_si512(v, low));
            _mm512_store_si512(unpacked[2 * j + 1],
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
          }
          tile_reads_memory();
          _tile_loadd(3, unpacked[0], 64);
          if (chunk > unit) _tile_loadd(4, unpacked[unit / 4], 64);
          const bool last = c + chunk == group;  // (then the group's zero points too)
          // x tile jt's sums scaled (the group's zero points taken off after its last chunk)
          const auto scale = [&](int64_t jt) __attribute__((always_inline)) {
            const float* d = a.d32 + 16 * jt * xblocks + col / xblock;
            const float* h = a.corr + 16 * jt * groups + g;
            __m512* av = &acc[jt * 16];
            for (int i = 0; i < 16; ++i) {
              av[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[jt % 2][i])),
                                      _mm512_mul_ps(s, _mm512_set1_ps(d[i * xblocks])), av[i]);
              if (last) av[i] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(h[i * groups]), av[i]);
            }
          };
          // x tile jt's product into C tile 0 or 5 (sums[jt % 2]), tile jt - 1's scaled meanwhile
          for (int64_t jt = 0; jt < xtiles; ++jt) {
            const int8_t* x = a.xq + 16 * jt * k + col;
            if (jt % 2 == 0) {
              _tile_zero(0);
              _tile_loadd(1, x, k);
              _tile_dpbsud(0, 1, 3);
              if (chunk > unit) {
                _tile_loadd(2, x + unit, k);
                _tile_dpbsud(0, 2, 4);
              }
              _tile_stored(0, sums[0], 64);
            } else {
              _tile_zero(5);
              _tile_loadd(1, x, k);
              _tile_dpbsud(5, 1, 3);
              if (chunk > unit) {
                _tile_loadd(2, x + unit, k);
                _tile_dpbsud(5, 2, 4);
              }
              _tile_stored(5, sums[1], 64);
            }
            if (jt > 0) scale(jt - 1);
          }
          scale(xtiles - 1);
        }
        for (int64_t line = 8 * group; line < step; line += 64)
          prefetch_l2(reinterpret_cast<uintptr_t>(p) + line + a.row_bytes);
      }
      for (int64_t jt = 0; jt < xtiles; ++jt)
        for (int64_t i = 0; i < std::min<int64_t>(16, a.m - 16 * jt); ++i)
          store_strip(a, (16 * jt + i) * n + 16 * b, rows, acc[jt * 16 + i]);
    }
    _tile_release();
  }
}
#endif  // FOUDRE_AMX

// x quantized per block (activation_block: 128 columns, 64 for groups under 128) in the columns'
// order (rows padded to 16 for the tiles), x's d per block (d32's place) and its sums d q per
// group (corr's)
template <typename T>
void x4_matmul(Args<T> a) {
  const bool tiles = on_tiles(a, Kind::Int4x16);
  const int64_t padded = tiles ? (a.m + 15) / 16 * 16 : a.m;
  const int64_t k = a.k, groups = k / a.group, xblock = a.group >= 128 ? 128 : 64;
  const int64_t xblocks = k / xblock;
  std::vector<int8_t> xq(padded * k, 0);
  std::vector<float> dl(a.m * k / 4), hsum(a.m * k / 16), d(padded * xblocks, 0.0f);
  std::vector<float> corr(padded * groups, 0.0f);
  quantize_rows<T, false>(a.x, a.m, k, xblock, xq.data(), dl.data(), hsum.data());
  for (int64_t i = 0; i < a.m; ++i) {
    for (int64_t c = 0; c < xblocks; ++c) d[i * xblocks + c] = dl[i * (k / 4) + c * (xblock / 4)];
    for (int64_t h = 0; h < k / 16; ++h)
      corr[i * groups + (h * 16 >> a.gshift)] += hsum[i * (k / 16) + h];
  }
  a.xq = xq.data();
  a.d32 = d.data();
  a.corr = corr.data();
  by_scale_type(a.st, [&](auto st) {
#if defined(FOUDRE_AMX)
    if (tiles) return amx_x4<T, decltype(st)::value>(a);
#endif
    blocks_by_four<X4<T, decltype(st)::value>>(a);
  });
}

#endif  // FOUDRE_VNNI

#if defined(FOUDRE_AVX2)

// -- AVX2 ------------------------------------------------------------------------------------
//
// Without AVX-512 (AMD Zen 2 and 3, Intel's client cores): the VNNI path's arithmetic, x
// rounded to int8 per block as there (the same codes, the same d: quantize_rows8), its
// products by vpmaddubsw (unsigned by signed bytes, pairs summed in int16) and vpmaddwd (pairs
// of those in int32), as llama.cpp's AVX2 kernels do, on 8 float32 lanes. The unsigned operand:
// int4 and int6 codes as they are (|pair| <= 63 * 127 * 2 fits int16), int8 codes' magnitudes
// with their signs moved onto x (vpsignb: |q| <= 128, |pair| <= 128 * 127 * 2), so signed codes
// need no offset. A step's int32 lanes are converted once and scaled by x's d times the
// weight's scale; zero points come off at the end, through the sums of x's codes per group
// (corr, as the VNNI path's), int6's 32 through x's pair sums in int16 before its sub-scales
// (vpmaddwd by them). At batch 1 tasks of 8 weight rows, summed one after another (one
// sequential stream a thread, its lines prefetched kAhead ahead) and reduced and stored
// together (Tile<1, 8>::strip); tasks of two rows for more (16 registers).

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bfloat16: the high halves of float32s
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// x [m, k] rounded as the VNNI path's quantize_rows rounds it, on 8 lanes (the same products
// x * (127 / amax), rounded to nearest even, saturated to int8: the same codes): xq, d per 4
// codes (dl [m, k / 4]), d * sum(q) per 16 codes (hsum [m, k / 16]); nibbles: per 128 columns
// the even columns then the odd ones, the codes j and 64 + j sharing one d. (In scalar loops
// it took 7 us for 1536 columns, 14 for 4096: 0.6 ms of a 494.7M Llama's int8 decode step.)
template <typename T, bool Nibbles>
void quantize_rows8(const T* x, int64_t m, int64_t k, int64_t block, int8_t* xq, float* dl,
                    float* hsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // 16 positions from column c0: consecutive columns, or (nibbles) every other one, from the
  // 32 columns of c0's pair on
  const auto sixteen = [](const T* xr, int64_t c0, __m256& lo, __m256& hi) {
    if constexpr (Nibbles) {
      const T* from = xr + (c0 & ~int64_t{1});
      const auto take = [odd = c0 & 1](__m256 u, __m256 v) {  // 8 of 16 columns, in order
        const __m256 e = odd ? _mm256_shuffle_ps(u, v, _MM_SHUFFLE(3, 1, 3, 1))
                             : _mm256_shuffle_ps(u, v, _MM_SHUFFLE(2, 0, 2, 0));
        return _mm256_castpd_ps(
            _mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
      };
      lo = take(load8(from), load8(from + 8));
      hi = take(load8(from + 16), load8(from + 24));
    } else {
      lo = load8(xr + c0);
      hi = load8(xr + c0 + 8);
    }
  };
#pragma omp parallel for schedule(static) if (m * k >= 65536)
  for (int64_t i = 0; i < m; ++i) {
    const T* xr = x + i * k;
    std::vector<float> amax((k + block - 1) / block);  // max |x| over each block of columns
    for (int64_t b = 0; b < static_cast<int64_t>(amax.size()); ++b) {
      __m256 v = _mm256_setzero_ps();
      for (int64_t c = b * block; c < std::min(k, (b + 1) * block); c += 8)
        v = _mm256_max_ps(v, _mm256_andnot_ps(sign, load8(xr + c)));
      __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      q = _mm_max_ps(q, _mm_movehl_ps(q, q));
      amax[b] = _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
    }
    for (int64_t p0 = 0; p0 < k; p0 += 16) {  // 16 positions: one block, one d
      const int64_t c0 = Nibbles ? column_of<Kind::Int4>(p0) : p0;
      const float a = amax[c0 / block];
      const float d = a / 127.0f, id = a > 0 ? 127.0f / a : 0.0f;
      __m256 lo, hi;
      sixteen(xr, c0, lo, hi);
      const __m256i qlo = _mm256_cvtps_epi32(_mm256_mul_ps(lo, _mm256_set1_ps(id)));
      const __m256i qhi = _mm256_cvtps_epi32(_mm256_mul_ps(hi, _mm256_set1_ps(id)));
      // int32 -> int16 -> int8, saturating (per 128-bit lane: put back in order)
      const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qlo, qhi),
                                                   _MM_SHUFFLE(3, 1, 2, 0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * k + p0),
                       _mm_packs_epi16(_mm256_castsi256_si128(q16),
                                       _mm256_extracti128_si256(q16, 1)));
      _mm_storeu_ps(dl + i * (k / 4) + p0 / 4, _mm_set1_ps(d));
      const __m256i s8 = _mm256_add_epi32(qlo, qhi);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      hsum[i * (k / 16) + p0 / 16] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  }
}

inline float hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {  // to bfloat16 as torch rounds (as store16)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// lane r: hsum8(v[r]), the same additions in the same order (a row's sum is the same bits
// whichever way its tile is reduced), the 8 sums at once
inline __m256 reduce8(const __m256 (&v)[8]) {
  __m256 f[4];  // f[i]: the low half plus the high half of v[2 i], then of v[2 i + 1]
  for (int i = 0; i < 4; ++i)
    f[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  __m256 h[2];  // h[i] lanes 0, 1: rows 4 i, 4 i + 2; lanes 4, 5: rows 4 i + 1, 4 i + 3
  for (int i = 0; i < 2; ++i) {
    const __m256 g = _mm256_add_ps(_mm256_unpacklo_ps(f[2 * i], f[2 * i + 1]),
                                   _mm256_unpackhi_ps(f[2 * i], f[2 * i + 1]));
    h[i] = _mm256_add_ps(g, _mm256_permute_ps(g, _MM_SHUFFLE(1, 0, 3, 2)));
  }
  const __m256 s = _mm256_shuffle_ps(h[0], h[1], _MM_SHUFFLE(1, 0, 1, 0));  // rows 0 2 4 6 1 3 5 7
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename T, Kind K>
struct Avx2 {
  template <int MT, int R>
  struct Tile {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      if constexpr (MT == 1 && R == 8) {
        strip(a, n0);
      } else {
        __m256 acc[MT][R];
        float rest[MT][R] = {};
        int64_t nr[R];
        sums(a, m0, n0, nr, acc, rest);
        for (int mi = 0; mi < MT; ++mi)
          for (int r = 0; r < R && n0 + r < a.n; ++r) {
            float sum = hsum8(acc[mi][r]) - rest[mi][r];
            if constexpr (K == Kind::Int8) sum *= scale_at(a.s, nr[r], a.st);
            store1(a.y + (m0 + mi) * a.n + n0 + r, sum);
          }
      }
    }

    // One x row (batch 1): 8 weight rows one after another (one stream), their sums reduced
    // and stored 8 at once, where each row had been a task of its own, set up apart (a
    // for_tiles iteration, a call, its pointers, a reduction, a scalar store and rounding:
    // about a fifth of a row of 1536 int8 codes' instructions). In turns in one process,
    // weights in the caches (2048 x 1536, two threads): int8 1.16-1.19x the speed, Q4_0
    // 1.12x, int4 g128 1.00-1.04x; chains of cold weights in hours of low bandwidth (25-31
    // GB/s) int8 1.00-1.04x, int4 1.00-1.03x
    static void strip(const Args<T>& a, int64_t n0) {
      if (a.n - n0 < 8) {
        for (int64_t r = n0; r < a.n; ++r) Tile<1, 1>::run(a, 0, r);
        return;
      }
      __m256 acc[8];
      alignas(32) float rest[8];
      for (int r = 0; r < 8; ++r) {
        __m256 one[1][1];
        float rest1[1][1] = {};
        int64_t nr[1];
        Tile<1, 1>::sums(a, 0, n0 + r, nr, one, rest1);
        acc[r] = one[0][0];
        rest[r] = rest1[0][0];
      }
      __m256 sum = _mm256_sub_ps(reduce8(acc), _mm256_load_ps(rest));
      if constexpr (K == Kind::Int8) sum = _mm256_mul_ps(sum, scales8(a.s, n0, a.st));
      store8(a.y + n0, sum);
    }

    // The sums of x rows m0 .. m0 + MT - 1 with weight rows n0 .. n0 + R - 1 (row pointers
    // clamped to the last row: nr): y at (m0 + mi, nr[r]) is acc[mi][r] summed across lanes,
    // minus rest[mi][r] (zero points past a multiple of 8 groups), for int8 times the row's
    // scale
    [[gnu::always_inline]] static void sums(const Args<T>& a, int64_t m0, int64_t n0,
                                            int64_t* nr, __m256 (&acc)[MT][R],
                                            float (&rest)[MT][R]) {
      const uint8_t* wr[R];
      row_ptrs<R>(a, n0, wr, nr);
      for (auto& row : acc)
        for (auto& v : row) v = _mm256_setzero_ps();
      // (steps of one group or two, int4 under 128 and group-wise int8, compiled for their
      // scales' type, as the VNNI path's: read through a runtime type, Q4_0's ran 1.2x as long)
      // (int4 in groups of 128 or more: Wide; its steps, and int6's, read a scale each, compiled
      // for its type too: read through scale_at's runtime type, one thread on int4 g128 rows of
      // 1536 columns with bfloat16 scales ran 0.9x its speed with float32 ones; int8 per
      // channel reads its row's scale after the steps)
      const auto typed = [&](auto wide) __attribute__((always_inline)) {
        constexpr bool kWide = decltype(wide)::value;
        if (a.st == kF16)
          steps<MT, R, kWide, kF16>(a, m0, wr, nr, acc);
        else if (a.st == kBF16)
          steps<MT, R, kWide, kBF16>(a, m0, wr, nr, acc);
        else
          steps<MT, R, kWide, kF32>(a, m0, wr, nr, acc);
      };
      if constexpr (K == Kind::Int8)
        steps<MT, R, false, -1>(a, m0, wr, nr, acc);
      else if (K == Kind::Int4 && a.group >= 128)
        typed(std::bool_constant<K == Kind::Int4>{});
      else
        typed(std::false_type{});
      if (K != Kind::Int8 && K != Kind::Int6 && (a.z || a.zc != 0.0f))
        take_offsets<MT, R>(a, m0, nr, acc, rest);
    }
  };

  // The zero points' part of row nr[r]'s dot with x row m0 + mi, the sum over groups g of
  // s_g z_g corr_g: taken off acc[mi][r] lane-wise (8 groups a step, each row's s_g z_g read
  // once for the tile's x rows, summed apart from acc, whose chain of FMAs bounds a short row)
  // and, for the groups past a multiple of 8, added to rest[mi][r] (zeros before; scalars:
  // gathered into a vector through memory, they cost more than the lanes saved). (Summed per
  // pair of an x row and a weight row, the zero points took a fifth of a 4 x 2 int4 g128 tile
  // at 1536 columns.)
  template <int MT, int R>
  static void take_offsets(const Args<T>& a, int64_t m0, const int64_t* nr,
                           __m256 (&acc)[MT][R], float (&rest)[MT][R]) {
    const int64_t whole = a.groups / 8 * 8;
    const float* corr = a.corr + m0 * a.groups;
    __m256 off[MT][R];
    for (auto& row : off)
      for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t g = 0; g < whole; g += 8) {
      __m256 sz[R];
      for (int r = 0; r < R; ++r) {
        const int64_t at = nr[r] * a.s_stride + g;
        sz[r] = _mm256_mul_ps(scales8(a.s, at, a.st),
                              a.z ? scales8(a.z, at, a.st) : _mm256_set1_ps(a.zc));
      }
      for (int mi = 0; mi < MT; ++mi) {
        const __m256 c = _mm256_loadu_ps(corr + mi * a.groups + g);
        for (int r = 0; r < R; ++r) off[mi][r] = _mm256_fmadd_ps(sz[r], c, off[mi][r]);
      }
    }
    for (int mi = 0; mi < MT; ++mi)
      for (int r = 0; r < R; ++r) acc[mi][r] = _mm256_sub_ps(acc[mi][r], off[mi][r]);
    for (int64_t g = whole; g < a.groups; ++g)
      for (int r = 0; r < R; ++r) {
        const int64_t at = nr[r] * a.s_stride + g;
        const float sz = scale_at(a.s, at, a.st) * (a.z ? scale_at(a.z, at, a.st) : a.zc);
        for (int mi = 0; mi < MT; ++mi) rest[mi][r] += sz * corr[mi * a.groups + g];
      }
  }

  // the 8 scales from p + i as float32
  static __m256 scales8(const void* p, int64_t i, int st) {
    if (st == kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    const auto* h16 = static_cast<const uint16_t*>(p) + i;
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h16));
    if (st == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }

  // the scale of lanes 0-3 (group g) and 4-7 (group g + 1 where Two, else g again): the two read
  // in one load and spread (reading each through scale_at took 8 instructions where this takes
  // 3), or one broadcast. Two is a constant of the loop that calls it: where it was a flag read
  // in the loop, the group-wise int8 and small-group int4 loops held the spread's index vector
  // and more of their accumulators on the stack (2048 x 1536 and 1536 x 4096, two threads, in
  // turns: Q8_0's 4 x 2 tiles 1.10-1.17x the speed at 4-256 rows, Q4_0's 1.06-1.14x at 16-128,
  // batch 1 unchanged)
  template <int ST, bool Two>
  static __m256 two_scales(const void* srow, int64_t g) {
    constexpr int st = ST;
    __m128 pair;
    if (st == kF32) {  // (the second unread where one group spans the step)
      const float* f = static_cast<const float*>(srow) + g;
      if (!Two) return _mm256_broadcast_ss(f);
      pair = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f)));
    } else {
      int32_t u = 0;  // (two 16-bit scales, or one; each size a constant: no call)
      const auto* h16 = static_cast<const uint16_t*>(srow) + g;
      if (Two)
        std::memcpy(&u, h16, 4);
      else
        std::memcpy(&u, h16, 2);
      const __m128i h = _mm_cvtsi32_si128(u);
      pair = st == kF16 ? _mm_cvtph_ps(h)
                        : _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
    }
    if (!Two) return _mm256_broadcastss_ps(pair);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }

  template <int MT, int R, bool Wide, int ST>
  [[gnu::always_inline]] static void steps(const Args<T>& a, int64_t m0,
                                           const uint8_t* const* wr, const int64_t* nr,
                                           __m256 (&acc)[MT][R]) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int64_t k = a.k;
    const int gshift = a.gshift, st = ST >= 0 ? ST : a.st;  // (ST: the scales' type, compiled)
    const int8_t* xq = a.xq + m0 * k;
    // x's d per 4 codes (group-wise int8: per 32, d32 below)
    const float* dl = K == Kind::Int8Grouped ? nullptr : a.dl + m0 * (k / 4);
    const void* srow[R];
    const int64_t size = st == kF32 ? 4 : 2;
    for (int r = 0; r < R; ++r)
      srow[r] = static_cast<const uint8_t*>(a.s) + nr[r] * a.s_stride * size;
    constexpr bool kStream = MT == 1 && R == 1;
    if constexpr (K == Kind::Int8) {
      // steps of x's blocks (128 columns; a last one of 64 where K = 64 mod 128): 4 (2)
      // vectors of 32 codes summed in int32, one conversion and one d
      const auto block = [&](int64_t c, auto parts_c) __attribute__((always_inline)) {
        constexpr int parts = decltype(parts_c)::value;
        for (int r = 0; r < R; ++r) {
          prefetch_ahead<kStream>(wr[r] + c, kAhead);
          prefetch_ahead<kStream>(wr[r] + c, kAhead + 64);
          __m256i w[parts], mag[parts];
          for (int j = 0; j < parts; ++j) {
            w[j] = load32(wr[r] + c + 32 * j);
            mag[j] = _mm256_abs_epi8(w[j]);
          }
          for (int mi = 0; mi < MT; ++mi) {
            __m256i dot = _mm256_setzero_si256();
            for (int j = 0; j < parts; ++j) {
              const __m256i xs = _mm256_sign_epi8(load32(xq + mi * k + c + 32 * j), w[j]);
              dot = _mm256_add_epi32(dot,
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(mag[j], xs), ones));
            }
            acc[mi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                         _mm256_set1_ps(dl[mi * (k / 4) + c / 4]), acc[mi][r]);
          }
        }
      };
      const int64_t whole = k / 128 * 128;
      for (int64_t c = 0; c < whole; c += 128) block(c, std::integral_constant<int, 4>{});
      if (whole < k) block(whole, std::integral_constant<int, 2>{});
    } else if constexpr (K == Kind::Int8Grouped) {
      // steps of 32 columns (x's block, one d: d32 [m, k / 32]): one group, or two of 16 (two:
      // a loop of its own). In groups of 32 (GGUF's Q8_0 and Q5 types) the products d * s of 8
      // steps are formed at once (x's 8 d's times the row's 8 scales, stored) and each step
      // broadcasts its own, where each step had read its scale (16-bit scales: a load, a
      // conversion, a broadcast), broadcast x's d and multiplied them (the same products, the
      // same bits; 4096 x 1536 and 1536 x 4096, two threads, in turns: batch 1 with the weights
      // in L3 1.14-1.32x the speed, 4-128 rows 1.05-1.13x)
      const float* d32 = a.dl + m0 * (k / 32);
      const auto run = [&](auto two) __attribute__((always_inline)) {
        constexpr bool kTwo = decltype(two)::value;
        const auto step = [&](int64_t c, int r, int mi, __m256i w, __m256i mag, __m256 f)
                              __attribute__((always_inline)) {
          const __m256i xs = _mm256_sign_epi8(load32(xq + mi * k + c), w);
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones);
          acc[mi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[mi][r]);
        };
        int64_t c = 0;
        if (!kTwo && a.group == 32) {
          alignas(32) float f[MT][R][8];
          for (; c + 256 <= k; c += 256) {
            for (int r = 0; r < R; ++r) {
              const __m256 s8 = scales8(srow[r], c >> gshift, ST);
              for (int mi = 0; mi < MT; ++mi)
                _mm256_store_ps(f[mi][r],
                                _mm256_mul_ps(_mm256_loadu_ps(d32 + mi * (k / 32) + c / 32), s8));
            }
            for (int j = 0; j < 8; ++j) {
              for (int r = 0; r < R; ++r) {
                if (j % 2 == 0) prefetch_ahead<kStream>(wr[r] + c + 32 * j, kAhead);
                const __m256i w = load32(wr[r] + c + 32 * j), mag = _mm256_abs_epi8(w);
                for (int mi = 0; mi < MT; ++mi)
                  step(c + 32 * j, r, mi, w, mag, _mm256_broadcast_ss(&f[mi][r][j]));
              }
            }
          }
        }
        for (; c < k; c += 32) {
          for (int r = 0; r < R; ++r) {
            if (c % 64 == 0) prefetch_ahead<kStream>(wr[r] + c, kAhead);
            const __m256i w = load32(wr[r] + c), mag = _mm256_abs_epi8(w);
            const __m256 s = two_scales<ST, kTwo>(srow[r], c >> gshift);
            for (int mi = 0; mi < MT; ++mi)
              step(c, r, mi, w, mag, _mm256_mul_ps(_mm256_set1_ps(d32[mi * (k / 32) + c / 32]), s));
          }
        }
      };
      if (a.group < 32)
        run(std::true_type{});
      else
        run(std::false_type{});
    } else if constexpr (K == Kind::Int4) {
      // 32 code bytes: 64 columns, the low nibbles (even columns) against x's codes at p, the
      // high ones (odd) at p + 64 (p: the step's positions in x's nibble order); lane l the
      // columns 8 l .. 8 l + 7. Wide (groups of 128 or more): both halves of 128 columns,
      // summed in int16 (|sum| <= 4 * 15 * 127 * 2), one group, one d
      const auto half = [&](const uint8_t* w, const int8_t* x) __attribute__((always_inline)) {
        const __m256i v = load32(w);
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        return _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(x)),
                                _mm256_maddubs_epi16(hi, load32(x + 64)));
      };
      if constexpr (Wide) {
        for (int64_t c = 0; c < k; c += 128) {
          for (int r = 0; r < R; ++r) {
            prefetch_ahead<kStream>(wr[r] + c / 2, kAhead);
            const float s = scale_at(srow[r], c >> gshift, st);
            for (int mi = 0; mi < MT; ++mi) {
              const int8_t* x = xq + mi * k + c;
              const __m256i p =
                  _mm256_add_epi16(half(wr[r] + c / 2, x), half(wr[r] + c / 2 + 32, x + 32));
              const __m256i dot = _mm256_madd_epi16(p, ones);
              acc[mi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                           _mm256_set1_ps(dl[mi * (k / 4) + c / 4] * s),
                                           acc[mi][r]);
            }
          }
        }
      } else {
        // 128 columns a step, in two halves of 64 (the low nibbles' positions c and c + 32),
        // each with its groups' scales and its x block's d, summed before the accumulator: one
        // dependent add a step, where an FMA a half held a batch-1 row to one half per FMA
        // latency (Q4_0's decode 0.8x int4 g128's)
        const auto run = [&](auto two) __attribute__((always_inline)) {
          for (int64_t c = 0; c < k; c += 128) {
            for (int r = 0; r < R; ++r) {
              const uint8_t* w = wr[r] + c / 2;
              prefetch_ahead<kStream>(w, kAhead);
              constexpr bool two_c = decltype(two)::value;
              const __m256 s0 = two_scales<ST, two_c>(srow[r], c >> gshift);
              const __m256 s1 = two_scales<ST, two_c>(srow[r], (c + 64) >> gshift);
              for (int mi = 0; mi < MT; ++mi) {
                const int8_t* x = xq + mi * k + c;
                const float* d = dl + mi * (k / 4) + c / 4;
                const __m256 t0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(half(w, x), ones));
                const __m256 t1 =
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(half(w + 32, x + 32), ones));
                const __m256 u = _mm256_mul_ps(t1, _mm256_mul_ps(_mm256_set1_ps(d[8]), s1));
                acc[mi][r] = _mm256_add_ps(
                    acc[mi][r], _mm256_fmadd_ps(t0, _mm256_mul_ps(_mm256_set1_ps(d[0]), s0), u));
              }
            }
          }
        };
        if (a.group < 64)
          run(std::true_type{});
        else
          run(std::false_type{});
      }
    } else {  // int6: a block of 104 bytes per 128 columns (int6_block)
      const __m256i top = _mm256_set1_epi8(0x30);
      // int16 lane j of a half's pair sums covers columns 4 j .. 4 j + 3: sub-scale j / 4
      const __m128i spread0 = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      const __m128i spread1 = _mm_add_epi8(spread0, _mm_set1_epi8(4));
      const int16_t* xo = a.xo + m0 * (k / 4);
      for (int64_t c = 0; c < k; c += 128) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* b = int6_block(wr[r], c);
          prefetch_ahead<kStream>(b, kAhead);
          prefetch_ahead<kStream>(b, kAhead + 64);
          const __m256i v0 = load32(b), v1 = load32(b + 32), t = load32(b + kInt6Tops);
          // the codes against x's positions 0-31 (even columns 0-62), 32-63 (64-126), 64-95
          // (odd 1-63), 96-127 (65-127): the top bits of byte i at bits 0-1, 2-3, 4-5, 6-7
          const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v0, low),
                                             _mm256_and_si256(_mm256_slli_epi16(t, 4), top));
          const __m256i q1 = _mm256_or_si256(_mm256_and_si256(v1, low),
                                             _mm256_and_si256(_mm256_slli_epi16(t, 2), top));
          const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                                             _mm256_and_si256(t, top));
          const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                                             _mm256_and_si256(_mm256_srli_epi16(t, 2), top));
          const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kInt6Subs));
          const __m256i sc0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, spread0));
          const __m256i sc1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, spread1));
          const float dw = scale_at(srow[r], c >> gshift, st);
          for (int mi = 0; mi < MT; ++mi) {
            const int8_t* x = xq + mi * k + c;
            const int16_t* o = xo + mi * (k / 4) + c / 4;  // 32 (the codes' offset) x pair sums
            const __m256i p0 = _mm256_sub_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(q0, load32(x)),
                                 _mm256_maddubs_epi16(q2, load32(x + 64))),
                load32(o));
            const __m256i p1 = _mm256_sub_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(q1, load32(x + 32)),
                                 _mm256_maddubs_epi16(q3, load32(x + 96))),
                load32(o + 16));
            const __m256i dot =
                _mm256_add_epi32(_mm256_madd_epi16(p0, sc0), _mm256_madd_epi16(p1, sc1));
            acc[mi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                         _mm256_set1_ps(dl[mi * (k / 4) + c / 4] * dw),
                                         acc[mi][r]);
          }
        }
      }
    }
  }
};

// quantize x, the sums of its codes per group (corr: the zero points' part, taken off at the
// end) or int6's offsets (xo), then the tiles
template <typename T, Kind K>
void avx2_matmul(Args<T> a) {
  constexpr bool nibbles = K == Kind::Int4 || K == Kind::Int6;
  const int64_t halves = a.k / 16;
  std::vector<int8_t> xq(a.m * a.k);
  std::vector<float> dl(a.m * a.k / 4), hsum(a.m * halves);
  quantize_rows8<T, nibbles>(a.x, a.m, a.k, activation_block<K>(a.group), xq.data(),
                             dl.data(), hsum.data());
  a.xq = xq.data();
  a.dl = dl.data();
  std::vector<float> d32;
  if constexpr (K == Kind::Int8Grouped) {  // one d per 32 columns (x's block), [m, k / 32]
    d32.resize(a.m * a.k / 32);
    for (int64_t i = 0; i < a.m * a.k / 32; ++i) d32[i] = dl[8 * i];
    a.dl = d32.data();
  }
  std::vector<float> corr;
  std::vector<int16_t> xo;
  if constexpr (K == Kind::Int6) {
    // per 64 columns (positions p .. p + 31 and p + 64 .. p + 95), int16 lane j: 32 times the
    // sum of the codes at p + 2 j, p + 2 j + 1 and the same 64 on
    xo.resize(a.m * a.k / 4);
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t c = 0; c < a.k; c += 128)
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 16; ++j) {
            const int8_t* q = xq.data() + i * a.k + c + 32 * h + 2 * j;
            xo[i * (a.k / 4) + c / 4 + 16 * h + j] =
                static_cast<int16_t>(32 * (q[0] + q[1] + q[64] + q[65]));
          }
    a.xo = xo.data();
  } else if constexpr (K != Kind::Int8) {
    corr.assign(a.m * a.groups, 0.0f);
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t h = 0; h < halves; ++h)
        corr[i * a.groups + (column_of<K>(h * 16) >> a.gshift)] += hsum[i * halves + h];
    a.corr = corr.data();
  }
  // batch 1: strips of 8 rows where there are as many as threads, else a row a task (as
  // vnni_tiles decides)
  if (a.m == 1 && a.n < 8 * threads())
    for_tiles<Avx2<T, K>::template Tile, 1, 2>(a);
  else
    for_tiles<Avx2<T, K>::template Tile, 8, 2>(a);
}

// the codes of columns c .. c + 7 of a row as float32 (c a multiple of 8): dequantize's
inline __m128i nibbles8(const uint8_t* p) {  // 4 bytes: the low and high nibbles in column order
  int32_t u;
  std::memcpy(&u, p, 4);
  const __m128i b = _mm_cvtsi32_si128(u), low = _mm_set1_epi8(15);
  return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}
template <Kind K>
inline __m256 codes8(const uint8_t* row, int64_t c) {
  if constexpr (K == Kind::Int4) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles8(row + c / 2)));
  } else if constexpr (K == Kind::Int6) {  // as codes16: the 8 columns' top bits in 4 bytes
    const uint8_t* b = int6_block(row, c);
    __m128i lo, hi;
    {
      int32_t u;
      std::memcpy(&u, b + (c % 128) / 2, 4);
      const __m128i v = _mm_cvtsi32_si128(u), low = _mm_set1_epi8(15);
      lo = _mm_and_si128(v, low);
      hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    }
    int32_t tu;
    std::memcpy(&tu, b + kInt6Tops + (c % 64) / 2, 4);
    const __m128i t = _mm_cvtsi32_si128(tu), three = _mm_set1_epi8(3);
    const __m128i shift = _mm_cvtsi32_si128(int6_top_shift(c));  // column c is even
    const __m128i shift_odd = _mm_cvtsi32_si128(int6_top_shift(c) + 4);
    lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(t, shift), three), 4));
    hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(t, shift_odd), three), 4));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  } else {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c))));
  }
}
#endif  // FOUDRE_AVX2

// -- NEON (Arm) --------------------------------------------------------------------------------
// The AVX-512 float path's arithmetic on 4 lanes: 16 codes a step widened to float32 and
// dequantized ((q s - z s) per group), multiplied with x in float32 (no activation rounding),
// per (x row, weight row) one accumulator of 4 lanes summed at the end. Int6 takes the portable
// loops.
#if defined(FOUDRE_NEON)

struct F32x16 {
  float32x4_t v[4];
};

inline F32x16 load16(const float* p) {
  return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}};
}
inline F32x16 load16(const uint16_t* p) {  // bfloat16: the high halves of float32s
  const uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8);
  return {{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16)),
           vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(a), 16)),
           vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16)),
           vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(b), 16))}};
}

inline F32x16 widen16(int16x8_t lo, int16x8_t hi) {
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}

// the codes of columns c .. c + 15 of a row as float32 (int8, or int4 in column order)
template <Kind K>
inline F32x16 neon_codes16(const uint8_t* row, int64_t c) {
  if constexpr (K == Kind::Int4) {
    const uint8x8_t b = vld1_u8(row + c / 2);
    const uint8x8_t lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
    const uint8x16_t q = vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi));
    return widen16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(q))),
                   vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(q))));
  } else {
    const int8x16_t q = vld1q_s8(reinterpret_cast<const int8_t*>(row + c));
    return widen16(vmovl_s8(vget_low_s8(q)), vmovl_s8(vget_high_s8(q)));
  }
}

template <typename T, Kind K>
struct Neon {
  template <int MT, int R>
  struct Tile {  // 16 columns at a time, all in one group (groups are multiples of 16)
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      int64_t nr[R];
      row_ptrs<R>(a, n0, wr, nr);
      float32x4_t acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = vdupq_n_f32(0.0f);
      for (int64_t c = 0; c < a.k; c += 16) {
        F32x16 xv[MT];
        for (int mi = 0; mi < MT; ++mi) xv[mi] = load16(a.x + (m0 + mi) * a.k + c);
        const int64_t line = K == Kind::Int4 ? c / 2 : c;  // the bytes read before this step
        for (int r = 0; r < R; ++r) {
          if (line % 64 == 0) prefetch_ahead<false>(wr[r] + line, kAhead);
          F32x16 wv = neon_codes16<K>(wr[r], c);
          if constexpr (K != Kind::Int8) {
            const float sc = group_scale<K>(a, nr[r], wr[r], c);
            const float sz =
                sc * (a.z ? scale_at(a.z, nr[r] * a.s_stride + (c >> a.gshift), a.st) : a.zc);
            const float32x4_t vs = vdupq_n_f32(sc), vz = vdupq_n_f32(sz);
            for (auto& v : wv.v) v = vsubq_f32(vmulq_f32(v, vs), vz);
          }
          for (int mi = 0; mi < MT; ++mi)
            for (int j = 0; j < 4; ++j) acc[mi][r] = vfmaq_f32(acc[mi][r], xv[mi].v[j], wv.v[j]);
        }
      }
      for (int mi = 0; mi < MT; ++mi)
        for (int r = 0; r < R && n0 + r < a.n; ++r) {
          const float sum = vaddvq_f32(acc[mi][r]);
          store1(a.y + (m0 + mi) * a.n + n0 + r,
                 K == Kind::Int8 ? sum * scale_at(a.s, n0 + r, a.st) : sum);
        }
    }
  };
};

// -- NEON dotprod / i8mm (Arm) ------------------------------------------------------------------
// Where the target has the dot product instructions (__ARM_FEATURE_DOTPROD: SDOT, vdotq_s32),
// the VNNI and AVX2 paths' arithmetic: x rounded to int8 per block as they round it (the same
// block, the same d = max|x| / 127, the products x * (127 / max|x|) rounded to nearest even and
// saturated: the same codes, activation_block), the weight codes as signed bytes (int8 as they
// are, int4's 0..15), their products summed in int32 lanes over a unit of columns that share x's
// d and the weight's scale (per channel x's block of 128, else the smaller of the group and x's
// block), one conversion and one FMA by d * s a unit; the zero points come off through the sums
// of x's codes per unit (corr: d sum q), each unit's s z times them summed apart in float32 and
// taken off at the end (a unit lies in one group). For int4, x's codes are
// stored per 32 columns in the order of the nibbles of 16 bytes (the even columns, then the odd
// ones), so one AND (low) or shift (high) of 16 code bytes lines them up with 16 of x's. Where
// the target has the int8 matrix products too (__ARM_FEATURE_MATMUL_INT8: SMMLA, vmmlaq_s32), a
// pair of x rows against a pair of weight rows takes one SMMLA per 8 columns (the 2 x 2 int32
// sums in one register) instead of four SDOTs' worth of lanes; an odd x row left takes SDOT.
// Int6 takes the portable loops. Tasks: at batch 1 one weight row a task (the guided chunks one
// sequential stream a thread, prefetched kAhead ahead), else 2 rows (SDOT: 4 x 2 tiles) or 4
// (SMMLA: pairs of rows).
#if defined(FOUDRE_DOTPROD)

// x [m, k] rounded per block of `block` columns: codes xq [m, k] (Nibbles: per 32 columns the
// even ones, then the odd ones), d per 16 columns dl [m, k / 16], and the sums d * sum(q) per
// unit of `unit` columns (a multiple of 16 that divides K), corr [m, k / unit] (where unit > 0)
template <typename T, bool Nibbles>
void neon_quantize_rows(const T* x, int64_t m, int64_t k, int64_t block, int64_t unit,
                        int8_t* xq, float* dl, float* corr) {
  const int64_t groups = unit > 0 ? k / unit : 0;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
  for (int64_t i = 0; i < m; ++i) {
    const T* xr = x + i * k;
    int8_t* q = xq + i * k;
    float* cr = corr + i * groups;
    for (int64_t g = 0; g < groups; ++g) cr[g] = 0.0f;
    for (int64_t b0 = 0; b0 < k; b0 += block) {
      const int64_t b1 = std::min(k, b0 + block);
      float32x4_t mx = vdupq_n_f32(0.0f);
      for (int64_t c = b0; c < b1; c += 16) {
        const F32x16 v = load16(xr + c);
        for (const auto& u : v.v) mx = vmaxq_f32(mx, vabsq_f32(u));
      }
      const float amax = vmaxvq_f32(mx);
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      for (int64_t c = b0; c < b1; c += 16) {
        const F32x16 v = load16(xr + c);
        int32x4_t n[4];
        for (int j = 0; j < 4; ++j) n[j] = vcvtnq_s32_f32(vmulq_f32(v.v[j], vdupq_n_f32(id)));
        const int16x8_t lo = vcombine_s16(vqmovn_s32(n[0]), vqmovn_s32(n[1]));
        const int16x8_t hi = vcombine_s16(vqmovn_s32(n[2]), vqmovn_s32(n[3]));
        const int8x16_t codes = vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi));
        if constexpr (Nibbles) {  // columns c .. c + 15 of 32: 8 even, 8 odd
          const int64_t c32 = c & ~int64_t{31}, half = (c & 16) / 2;
          const int8x16_t ev = vuzp1q_s8(codes, codes), od = vuzp2q_s8(codes, codes);
          vst1_s8(q + c32 + half, vget_low_s8(ev));
          vst1_s8(q + c32 + 16 + half, vget_low_s8(od));
        } else {
          vst1q_s8(q + c, codes);
        }
        dl[i * (k / 16) + c / 16] = d;
        if (groups) cr[c / unit] += d * static_cast<float>(vaddlvq_s8(codes));
      }
    }
  }
}

template <typename T, Kind K>
struct NeonDot {
  // the columns whose int32 sums share one d and one scale; the columns of one SDOT step
  static int64_t unit(const Args<T>& a) {
    return K == Kind::Int8 ? 128 : std::min<int64_t>(a.group, activation_block<K>(a.group));
  }
  static constexpr int64_t kStep = K == Kind::Int4 ? 32 : 16;
  static constexpr int64_t kStepBytes = 16;

  // the int32 sums of x row xr's codes with weight row w over columns c .. c + n (lanes)
  [[gnu::always_inline]] static int32x4_t dot(int32x4_t acc, const uint8_t* w, const int8_t* x,
                                              int64_t c) {
    if constexpr (K == Kind::Int4) {
      const uint8x16_t b = vld1q_u8(w + c / 2);
      acc = vdotq_s32(acc, vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), vld1q_s8(x + c));
      return vdotq_s32(acc, vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), vld1q_s8(x + c + 16));
    } else {
      return vdotq_s32(acc, vld1q_s8(reinterpret_cast<const int8_t*>(w + c)), vld1q_s8(x + c));
    }
  }

  template <int MT, int R>
  struct Tile {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      int64_t nr[R];
      row_ptrs<R>(a, n0, wr, nr);
      constexpr bool kStream = MT == 1 && R == 1;
      float32x4_t acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = vdupq_n_f32(0.0f);
      const int64_t k = a.k, u = unit(a);
      float off[MT][R] = {};  // the zero points' part: sum over units of s z corr
      for (int64_t c0 = 0; c0 < k; c0 += u) {
        const int64_t c1 = std::min(k, c0 + u);
        float s[R];
        for (int r = 0; r < R; ++r)
          s[r] = K == Kind::Int8 ? 1.0f
                                 : scale_at(a.s, nr[r] * a.s_stride + (c0 >> a.gshift), a.st);
        if (a.corr) offsets<MT, R>(a, m0, nr, c0, u, s, off);
        int32x4_t dots[MT][R];
        for (auto& row : dots)
          for (auto& v : row) v = vdupq_n_s32(0);
        for (int64_t c = c0; c < c1; c += kStep) {
          const int64_t line = K == Kind::Int4 ? c / 2 : c;  // the bytes read before this step
          for (int r = 0; r < R; ++r) {
            if (line % 64 == 0) prefetch_ahead<kStream>(wr[r] + line, kAhead);
            for (int mi = 0; mi < MT; ++mi)
              dots[mi][r] = dot(dots[mi][r], wr[r], a.xq + (m0 + mi) * k, c);
          }
        }
        for (int mi = 0; mi < MT; ++mi) {
          const float d = a.dl[(m0 + mi) * (k / 16) + c0 / 16];
          for (int r = 0; r < R; ++r)
            acc[mi][r] = vfmaq_f32(acc[mi][r], vcvtq_f32_s32(dots[mi][r]), vdupq_n_f32(d * s[r]));
        }
      }
      for (int mi = 0; mi < MT; ++mi)
        for (int r = 0; r < R && n0 + r < a.n; ++r)
          finish(a, m0 + mi, nr[r], vaddvq_f32(acc[mi][r]) - off[mi][r]);
    }
  };

  // the unit at c0's part of the zero points: off[mi][r] += s z corr (s: the rows' scales)
  template <int MT, int R>
  [[gnu::always_inline]] static void offsets(const Args<T>& a, int64_t m0, const int64_t* nr,
                                             int64_t c0, int64_t u, const float* s,
                                             float (&off)[MT][R]) {
    const int64_t units = a.k / u;
    for (int r = 0; r < R; ++r) {
      const float sz =
          s[r] * (a.z ? scale_at(a.z, nr[r] * a.s_stride + (c0 >> a.gshift), a.st) : a.zc);
      for (int mi = 0; mi < MT; ++mi) off[mi][r] += sz * a.corr[(m0 + mi) * units + c0 / u];
    }
  }

  // y[i, n] from the scaled sums (the zero points' part taken off): times the row's scale
  // (int8 per channel)
  static void finish(const Args<T>& a, int64_t i, int64_t n, float sum) {
    if constexpr (K == Kind::Int8) sum *= scale_at(a.s, n, a.st);
    store1(a.y + i * a.n + n, sum);
  }
};

#if defined(FOUDRE_I8MM)
// SMMLA tiles: x rows in pairs against weight rows in pairs (R even), 8 columns of each pair a
// matrix product into lanes (x0 w0, x0 w1, x1 w0, x1 w1); an odd x row left: NeonDot's SDOT
template <typename T, Kind K>
struct NeonMatmul {
  using Dot = NeonDot<T, K>;
  static constexpr int64_t kStep = Dot::kStep;

  // the 16 codes of a step of row w at c: two halves of 8 (int4: the low and high nibbles, the
  // columns x's codes at c and c + 16 line up with)
  [[gnu::always_inline]] static int8x16_t codes(const uint8_t* w, int64_t c, int half) {
    if constexpr (K == Kind::Int4) {
      const uint8x16_t b = vld1q_u8(w + c / 2);
      return vreinterpretq_s8_u8(half ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(15)));
    } else {
      return vld1q_s8(reinterpret_cast<const int8_t*>(w + c + 16 * half));
    }
  }
  // rows u and v's 8 bytes from byte j (0 or 8) of each: one SMMLA operand
  [[gnu::always_inline]] static int8x16_t pair(int8x16_t u, int8x16_t v, int j) {
    const int64x2_t a = vreinterpretq_s64_s8(u), b = vreinterpretq_s64_s8(v);
    return vreinterpretq_s8_s64(j ? vzip2q_s64(a, b) : vzip1q_s64(a, b));
  }

  template <int MT, int R>
  struct Tile {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      if constexpr (MT == 1) {
        Dot::template Tile<1, R>::run(a, m0, n0);
      } else {
        constexpr int P = MT / 2, Q = R / 2;  // pairs of x rows, of weight rows
        const uint8_t* wr[R];
        int64_t nr[R];
        row_ptrs<R>(a, n0, wr, nr);
        float32x4_t acc[P][Q];
        for (auto& row : acc)
          for (auto& v : row) v = vdupq_n_f32(0.0f);
        const int64_t k = a.k, u = Dot::unit(a);
        float off[2 * P][R] = {};  // the zero points' part (NeonDot::offsets)
        for (int64_t c0 = 0; c0 < k; c0 += u) {
          const int64_t c1 = std::min(k, c0 + u);
          if (a.corr) {
            float s[R];
            for (int r = 0; r < R; ++r)
              s[r] = scale_at(a.s, nr[r] * a.s_stride + (c0 >> a.gshift), a.st);
            Dot::template offsets<2 * P, R>(a, m0, nr, c0, u, s, off);
          }
          int32x4_t dots[P][Q];
          for (auto& row : dots)
            for (auto& v : row) v = vdupq_n_s32(0);
          for (int64_t c = c0; c < c1; c += kStep) {
            const int64_t line = K == Kind::Int4 ? c / 2 : c;
            for (int h = 0; h < 2; ++h) {  // int8: columns c + 16 h .. (a step of 16: h 0)
              if (K != Kind::Int4 && h == 1) break;
              int8x16_t xb[P][2];
              for (int p = 0; p < P; ++p) {
                const int64_t at = K == Kind::Int4 ? c + 16 * h : c;
                const int8x16_t x0 = vld1q_s8(a.xq + (m0 + 2 * p) * k + at);
                const int8x16_t x1 = vld1q_s8(a.xq + (m0 + 2 * p + 1) * k + at);
                xb[p][0] = pair(x0, x1, 0);
                xb[p][1] = pair(x0, x1, 1);
              }
              for (int q = 0; q < Q; ++q) {
                if (h == 0 && line % 64 == 0) {
                  prefetch_ahead<false>(wr[2 * q] + line, kAhead);
                  prefetch_ahead<false>(wr[2 * q + 1] + line, kAhead);
                }
                const int8x16_t w0 = codes(wr[2 * q], c, h), w1 = codes(wr[2 * q + 1], c, h);
                const int8x16_t wb0 = pair(w0, w1, 0), wb1 = pair(w0, w1, 1);
                for (int p = 0; p < P; ++p) {
                  dots[p][q] = vmmlaq_s32(dots[p][q], xb[p][0], wb0);
                  dots[p][q] = vmmlaq_s32(dots[p][q], xb[p][1], wb1);
                }
              }
            }
          }
          for (int p = 0; p < P; ++p) {
            const float d0 = a.dl[(m0 + 2 * p) * (k / 16) + c0 / 16];
            const float d1 = a.dl[(m0 + 2 * p + 1) * (k / 16) + c0 / 16];
            for (int q = 0; q < Q; ++q) {
              float s0 = 1.0f, s1 = 1.0f;
              if constexpr (K != Kind::Int8) {
                s0 = scale_at(a.s, nr[2 * q] * a.s_stride + (c0 >> a.gshift), a.st);
                s1 = scale_at(a.s, nr[2 * q + 1] * a.s_stride + (c0 >> a.gshift), a.st);
              }
              const float f[4] = {d0 * s0, d0 * s1, d1 * s0, d1 * s1};
              acc[p][q] = vfmaq_f32(acc[p][q], vcvtq_f32_s32(dots[p][q]), vld1q_f32(f));
            }
          }
        }
        for (int p = 0; p < P; ++p)
          for (int q = 0; q < Q; ++q) {
            float out[4];
            vst1q_f32(out, acc[p][q]);
            for (int e = 0; e < 4; ++e)
              if (n0 + 2 * q + e % 2 < a.n)
                Dot::finish(a, m0 + 2 * p + e / 2, nr[2 * q + e % 2],
                            out[e] - off[2 * p + e / 2][2 * q + e % 2]);
          }
        if constexpr (MT % 2) Dot::template Tile<1, R>::run(a, m0 + MT - 1, n0);
      }
    }
  };
};
#endif  // FOUDRE_I8MM

// quantize x and the sums of its codes per group (corr), then the tiles
template <typename T, Kind K>
void neon_dot_matmul(Args<T> a) {
  constexpr bool nibbles = K == Kind::Int4;
  const bool offsets = K != Kind::Int8 && (a.z || a.zc != 0.0f);
  std::vector<int8_t> xq(a.m * a.k);
  const int64_t unit = NeonDot<T, K>::unit(a);
  std::vector<float> dl(a.m * a.k / 16), corr(offsets ? a.m * a.k / unit : 0);
  neon_quantize_rows<T, nibbles>(a.x, a.m, a.k, activation_block<K>(a.group),
                                 offsets ? unit : 0, xq.data(), dl.data(), corr.data());
  a.xq = xq.data();
  a.dl = dl.data();
  a.corr = offsets ? corr.data() : nullptr;
#if defined(FOUDRE_I8MM)
  for_tiles<NeonMatmul<T, K>::template Tile, 1, 4>(a);
#else
  for_tiles<NeonDot<T, K>::template Tile, 1, 2>(a);
#endif
}

#endif  // FOUDRE_DOTPROD

#endif  // FOUDRE_NEON

template <typename T, Kind K>
void matmul(const Args<T>& a) {
#if defined(FOUDRE_VNNI)
  vnni_matmul<T, K>(a);
#elif defined(FOUDRE_AVX512)
  for_tiles<Float512<T, K>::template Tile, 8>(a);
#elif defined(FOUDRE_AVX2)
  avx2_matmul<T, K>(a);
#elif defined(FOUDRE_NEON)
  if constexpr (K == Kind::Int6)
    for_tiles<Portable<T, K>::template Tile, 8>(a);
  else
#if defined(FOUDRE_DOTPROD)
    neon_dot_matmul<T, K>(a);
#else
    for_tiles<Neon<T, K>::template Tile, 8, 2>(a);
#endif
#else
  for_tiles<Portable<T, K>::template Tile, 8>(a);
#endif
}

// Rows n0 .. n1 of the dequantized weight into out [n1 - n0, k] (T): w = (q - z) s in float32
// (QuantLinear.dequantize's values), then rounded to T; for the large batches that run a float
// GEMM over them instead. A scale and zero point read once for the columns that share them
// (they were read per 16 columns: 8192 x 1536 dequantized 1360 rows at a time on 2 threads,
// int4 g128 1.15-1.28 -> 0.8 ms, int8 0.68-0.79 -> 0.46-0.56, Q8_0 1.06 -> 0.92, Q4_0 1.23-1.29 ->
// 1.10-1.20; int6 the same, its sub-scales per 16)
template <typename T, Kind K>
void dequantize(const Args<T>& a, int64_t n0, int64_t n1, T* out) {
  // the columns that share a scale and zero point: a row (per channel), a group, 16 (int6's
  // sub-scales)
  const int64_t span = K == Kind::Int8 ? a.k : (K == Kind::Int6 ? 16 : a.group);
  // (int6: one step of 16, known to the compiler: through the loop bound its rows took 1.17x)
#pragma omp parallel for schedule(static)
  for (int64_t nr = n0; nr < n1; ++nr) {
    const uint8_t* row = a.w + nr * a.row_bytes;
    T* o = out + (nr - n0) * a.k;
    for (int64_t c0 = 0; c0 < a.k; c0 += span) {
      float s, z = 0.0f;
      if constexpr (K == Kind::Int8) {
        s = scale_at(a.s, nr, a.st);
      } else {
        s = group_scale<K>(a, nr, row, c0);
        z = a.z ? scale_at(a.z, nr * a.s_stride + (c0 >> a.gshift), a.st) : a.zc;
      }
      const int64_t end = K == Kind::Int6 ? c0 + 16 : std::min(a.k, c0 + span);
#if defined(FOUDRE_AVX512)
      const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
      for (int64_t c = c0; c < end; c += 16)
        store16(o + c, _mm512_mul_ps(_mm512_sub_ps(codes16<K>(row, c), vz), vs));
#elif defined(FOUDRE_AVX2)  // (spans of 16 columns or more, multiples of 8)
      const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
      for (int64_t c = c0; c < end; c += 8)
        store8(o + c, _mm256_mul_ps(_mm256_sub_ps(codes8<K>(row, c), vz), vs));
#else
      for (int64_t c = c0; c < end; ++c)
        store1(o + c, (static_cast<float>(code<K>(row, c)) - z) * s);
#endif
    }
  }
}

// The blocks' rows n0 .. n1 dequantized, (q - z) s in float32 as dequantize's, one code at a
// time (without AVX-512; with it dequantize_blocks, below); and without VNNI the product of those
// floats with x (the float paths' arithmetic: the blocks are built where VNNI serves them,
// cpu_qmatmul.interleaves, but run anywhere)
template <typename T>
void dequantize_x16(const Args<T>& a, int64_t n0, int64_t n1, T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t nr = n0; nr < n1; ++nr)
    for (int64_t c = 0; c < a.k; ++c)
      store1(out + (nr - n0) * a.k + c,
             (static_cast<float>(x16_code(a, nr, c)) - a.zc) * x16_scale(a, nr, c / 32));
}

template <typename T>
void dequantize_x4(const Args<T>& a, int64_t n0, int64_t n1, T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t nr = n0; nr < n1; ++nr)
    for (int64_t c = 0; c < a.k; ++c) {
      const int64_t g = c >> a.gshift;
      const float s = x4_param(a, nr, g, 0), z = x4_param(a, nr, g, 1);
      store1(out + (nr - n0) * a.k + c, (static_cast<float>(x4_code(a, nr, c)) - z) * s);
    }
}

#if defined(FOUDRE_AVX512)
// the blocks' rows n0 .. n1 dequantized a block at a time (a row's 4 bytes gathered from each
// line had taken 1.6-2.6x as long): per 8 columns of the 16 rows (an
// int4 line's low and high nibbles, or two int8 lines) their dwords interleaved (unpacklo /
// unpackhi: per 128-bit lane two rows' 8 columns each), widened, (q - z) s by each row's pair of
// parameters, stored row by row
template <typename T, bool Int4>
void dequantize_blocks(const Args<T>& a, int64_t n0, int64_t n1, T* out) {
  const int64_t group = a.group, groups = a.k / group, k = a.k;
  const int64_t size = a.st == kF32 ? 4 : 2;
  const bool zeros = Int4 && a.s_stride != 0;
  const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma omp parallel for schedule(static)
  for (int64_t b = n0 / 16; b < (n1 + 15) / 16; ++b) {
    const uint8_t* block = a.w + b * a.row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* codes = Int4 ? block + g * x4_group_bytes(group, a.st, zeros)
                                  : x16_codes(block, g, 16 * size);
      const uint8_t* params = Int4 ? codes + 8 * group : x16_scales(block, g, 16 * size);
      const __m512 sv = load_scales(params, 0, a.st, 0xFFFF);
      const __m512 zv = zeros ? load_scales(params + 16 * size, 0, a.st, 0xFFFF)
                              : _mm512_set1_ps(a.zc);
      __m512 sp[8], zp[8];  // rows 2 pr (lanes 0-7) and 2 pr + 1 (8-15)
      for (int pr = 0; pr < 8; ++pr) {
        const __m512i idx =
            _mm512_inserti64x4(_mm512_set1_epi32(2 * pr), _mm256_set1_epi32(2 * pr + 1), 1);
        sp[pr] = _mm512_permutexvar_ps(idx, sv);
        zp[pr] = _mm512_permutexvar_ps(idx, zv);
      }
      for (int64_t c = 0; c < group; c += 8) {  // 8 columns: an int4 line, two int8 lines
        __m512i first, second;
        if constexpr (Int4) {
          const __m512i v = _mm512_loadu_si512(codes + 8 * c);
          first = _mm512_and_si512(v, low);
          second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
          first = _mm512_xor_si512(_mm512_loadu_si512(codes + 16 * c), flip);  // (line c / 4)
          second = _mm512_xor_si512(_mm512_loadu_si512(codes + 16 * c + 64), flip);
        }
        alignas(64) uint8_t bytes[2][64];
        _mm512_store_si512(bytes[0], _mm512_unpacklo_epi32(first, second));
        _mm512_store_si512(bytes[1], _mm512_unpackhi_epi32(first, second));
        for (int h = 0; h < 2; ++h)
          for (int lane = 0; lane < 4; ++lane) {
            const int r = 4 * lane + 2 * h;  // rows r and r + 1
            const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes[h] + 16 * lane));
            const __m512i wide = Int4 ? _mm512_cvtepu8_epi32(q) : _mm512_cvtepi8_epi32(q);
            const __m512 w = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(wide), zp[r / 2]),
                                           sp[r / 2]);
            T part[16];
            store16(part, w);
            for (int e = 0; e < 2; ++e) {
              const int64_t nr = 16 * b + r + e;
              if (nr >= n0 && nr < n1)
                std::memcpy(out + (nr - n0) * k + g * group + c, part + 8 * e, 8 * sizeof(T));
            }
          }
      }
    }
  }
}
#endif

// kind 4 (int8) or 5 (int4) blocks' rows n0 .. n1 into out
template <typename T>
void dequantize_rows_of_blocks(const Args<T>& a, bool int4, int64_t n0, int64_t n1, T* out) {
#if defined(FOUDRE_AVX512)
  int4 ? dequantize_blocks<T, true>(a, n0, n1, out) : dequantize_blocks<T, false>(a, n0, n1, out);
#else
  int4 ? dequantize_x4(a, n0, n1, out) : dequantize_x16(a, n0, n1, out);
#endif
}

inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) { return to_float(v); }

template <typename T>
void x16_float_matmul(const Args<T>& a, bool int4) {
  const Args<float> f{nullptr, a.w,       a.row_bytes, a.s,      a.z,    a.zc, a.st, a.groups,
                      a.group, a.s_stride, a.gshift,    nullptr, 0,      a.n,  a.k};
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < a.n; n0 += 16) {  // a block's rows at a time
    const int64_t n1 = std::min(a.n, n0 + 16);
    std::vector<float> w((n1 - n0) * a.k);
    dequantize_rows_of_blocks(f, int4, n0, n1, w.data());
    for (int64_t nr = n0; nr < n1; ++nr)
      for (int64_t i = 0; i < a.m; ++i) {
        float sum = 0.0f;
        for (int64_t c = 0; c < a.k; ++c)
          sum += as_float(a.x[i * a.k + c]) * w[(nr - n0) * a.k + c];
        store1(a.y + i * a.n + nr, sum);
      }
  }
}

template <typename T>
Args<T> args(int kind, const void* x, const void* q, const void* s, const void* z, float zc,
             int st, int64_t groups, int64_t group, int64_t s_stride, void* y, int64_t m,
             int64_t n, int64_t k) {
  const int gshift = group > 0 ? __builtin_ctzll(static_cast<uint64_t>(group)) : 0;
  const int64_t row_bytes = kind == 2   ? k / 2
                            : kind == 3 ? k / 16 * 13
                            : kind == 4 ? k / 32 * (kX16Codes + x16_scale_bytes(st))
                            : kind == 5 ? k / group * x4_group_bytes(group, st, s_stride != 0)
                                        : k;
  return {static_cast<const T*>(x), static_cast<const uint8_t*>(q), row_bytes, s, z, zc, st,
          groups, group, s_stride, gshift, static_cast<T*>(y), m, n, k, nullptr, nullptr,
          nullptr, nullptr, nullptr, nullptr};
}

template <typename T>
void run(int kind, const void* x, const void* q, const void* s, const void* z, float zc, int st,
         int64_t groups, int64_t group, int64_t s_stride, void* y, int64_t m, int64_t n,
         int64_t k) {
  const Args<T> a = args<T>(kind, x, q, s, z, zc, st, groups, group, s_stride, y, m, n, k);
  if (kind == 4 || kind == 5)
#if defined(FOUDRE_VNNI)
    kind == 4 ? x16_matmul(a) : x4_matmul(a);
#else
    x16_float_matmul(a, kind == 5);
#endif
  else if (kind == 0)
    matmul<T, Kind::Int8>(a);
  else if (kind == 1)
    matmul<T, Kind::Int8Grouped>(a);
  else if (kind == 2)
    matmul<T, Kind::Int4>(a);
  else
    matmul<T, Kind::Int6>(a);
}

template <typename T>
void run_dequantize(int kind, const void* q, const void* s, const void* z, float zc, int st,
                    int64_t groups, int64_t group, int64_t s_stride, void* out, int64_t n0,
                    int64_t n1, int64_t k) {
  const Args<T> a =
      args<T>(kind, nullptr, q, s, z, zc, st, groups, group, s_stride, nullptr, 0, n1, k);
  T* o = static_cast<T*>(out);
  if (kind == 4 || kind == 5)
    dequantize_rows_of_blocks(a, kind == 5, n0, n1, o);
  else if (kind == 0)
    dequantize<T, Kind::Int8>(a, n0, n1, o);
  else if (kind == 1)
    dequantize<T, Kind::Int8Grouped>(a, n0, n1, o);
  else if (kind == 2)
    dequantize<T, Kind::Int4>(a, n0, n1, o);
  else
    dequantize<T, Kind::Int6>(a, n0, n1, o);
}

}  // namespace

extern "C" {

// 2: VNNI (int8 activations), 1: AVX-512 float, 3: AVX2 (int8 activations), 4: NEON float,
// 5: NEON dotprod (int8 activations), 6: NEON dotprod + i8mm (int8 activations), 0: portable
int foudre_qmm_path() {
#if defined(FOUDRE_VNNI)
  return 2;
#elif defined(FOUDRE_AVX512)
  return 1;
#elif defined(FOUDRE_AVX2)
  return 3;
#elif defined(FOUDRE_I8MM)
  return 6;
#elif defined(FOUDRE_DOTPROD)
  return 5;
#elif defined(FOUDRE_NEON)
  return 4;
#else
  return 0;
#endif
}

// the fewest x rows from which a layout (kind as foudre_qmm's, its group) runs on AMX's tiles;
// 0 where it never does
int foudre_qmm_amx_rows(int kind, int64_t group) {
#if defined(FOUDRE_AMX)
  return static_cast<int>(amx_rows(static_cast<Kind>(kind), group));
#else
  (void)kind;
  (void)group;
  return 0;
#endif
}

// y [m, n] = x [m, k] @ W^T, x and y float32 (f32) or bfloat16 (bf16). kind 0: int8 per channel,
// q [n, k] (k a multiple of 64), s [n]; 1: int8 group-wise, q [n, k] (k a multiple of 64), s
// and z [n, groups] for groups of `group` columns (a power of two, 16 or more); 2: int4,
// q [n, k / 2] (k a multiple of 128), s and z [n, groups] (groups of 32 or more); 3: int6, q
// [n, 13 k / 16] (k a multiple of 256), s the d [n, k / 256] (group 256), z null and zc 32. z
// null: every zero point is zc. st: the type of s and z (0 float32, 1 float16, 2 bfloat16);
// s_stride: the elements between two rows of s (and of z), groups or more
// (cpu_qmatmul.pair_scales: a row's scales then its zero points, one stream). 4: int8 in blocks of
// 16 rows (x16_codes; groups of 32, z null, zc, s_stride 0), 5: int4 in blocks of 16 rows
// (x4_group; s_stride 1 where the blocks hold zero points, else 0 and zc): q the blocks, s null.
#define FOUDRE_QMM(SUFFIX, T)                                                                   \
  void foudre_qmm_##SUFFIX(int kind, const void* x, const void* q, const void* s, const void* z, \
                           float zc, int st, int64_t groups, int64_t group, int64_t s_stride,    \
                           void* y, int64_t m, int64_t n, int64_t k) {                           \
    run<T>(kind, x, q, s, z, zc, st, groups, group, s_stride, y, m, n, k);                       \
  }                                                                                              \
  /* rows n0 .. n1 of the same weights dequantized into out [n1 - n0, k] */                      \
  void foudre_dequantize_##SUFFIX(int kind, const void* q, const void* s, const void* z,         \
                                  float zc, int st, int64_t groups, int64_t group,               \
                                  int64_t s_stride, void* out, int64_t n0, int64_t n1,           \
                                  int64_t k) {                                                   \
    run_dequantize<T>(kind, q, s, z, zc, st, groups, group, s_stride, out, n0, n1, k);           \
  }

FOUDRE_QMM(f32, float)
FOUDRE_QMM(bf16, uint16_t)

}  // extern "C"

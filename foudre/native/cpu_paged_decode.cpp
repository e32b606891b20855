// Paged decode attention on the CPU: the C++ twin of the Triton kernel in triton_paged.py.
//
// Each decode row walks its block table with an online softmax (running max m, running sum l,
// rescaled accumulator), reading K/V straight from the paged pool: nothing is gathered, padded
// or masked. Work is spread over torch's OpenMP threads (the library resolves to the libgomp
// torch loaded). Products and sums are float32 whatever the storage type (float32, bfloat16 or
// float16); the bfloat16 path rounds the softmax weights to bfloat16 for the P·V products, as
// FlashAttention does on GPUs.
//
// Five paths, by what the compiler targets (cpu_paged.py builds with -march=native):
//   paged_decode            portable: one task per (row, KV head), loops for the vectorizer
//   paged_decode_avx512     AVX-512: a row's keys in two parts (below), head_dim in 16-lane
//                           float32 chunks
//   paged_decode_bf16_dot   AVX512-BF16, bfloat16 caches: the same parts, vdpbf16ps (below)
//   paged_decode_avx2       AVX2 + FMA + F16C (no AVX-512): the same parts, tiles of 16 tokens,
//                           K and V read into registers 16 values at a time (below)
//   paged_decode_neon       NEON (aarch64): the AVX2 path on 4 lanes (below)
//
// A quantized cache (kv_cache_dtype int8 / fp8: 8-bit codes with one float32 scale per token and
// KV head, attention/kv_quant.py) is read as it lies: codes are converted to float32 as they are
// used and the scales never touch a code, since q · (c s) = (q · c) s and p (c s) = (p s) c: a
// key's scale multiplies its score, a value's scale its softmax weight (after the weight joined
// the running sum). The AVX-512 path converts a tile's codes once per KV head into an L1 scratch
// tile (int8: vpmovsxbd + vcvtdq2ps; e4m3: its bits moved into a float16's, vcvtph2ps, the
// factor 2^8 that leaves folded into the scales), which the products then read for every query
// head of the group: float32 FMAs (FmaOps), or for bfloat16 queries with AVX512-BF16 the
// vdpbf16ps path (Bf16DotOps) on the codes' values rounded to bfloat16, which is exact (8
// significant bits hold every int8 and e4m3 value).

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_paged_common.h"

namespace {

// The keys [lo, hi) of part `part` of `parts` of a row of `len` keys in blocks of BS: its share
// of the blocks from the first key it sees (a sliding window's, else 0) to the last, whole
// blocks each (the first part the smaller; empty for a row of one block). They depend on the
// row's length alone: a row's result is the same bits in any batch and on any threads.
inline void part_keys(int64_t len, int64_t window, int64_t BS, int64_t part, int64_t parts,
                      int64_t& lo, int64_t& hi) {
  const int64_t start = window > 0 && len > window ? len - window : 0;
  const int64_t first_block = start / BS, blocks = (len - 1) / BS - first_block + 1;
  lo = std::max(start, (first_block + blocks * part / parts) * BS);
  hi = std::min(len, (first_block + blocks * (part + 1) / parts) * BS);
}

// The block holding the first key that part `part` of `parts` of row r reads (its rows in
// tables, table_width apart; its length in lens), -1 where the part is empty: what a thread
// prefetches while it finishes the part before
inline int64_t first_block_of(const int32_t* tables, const int32_t* lens, int64_t table_width,
                              int64_t window, int64_t BS, int64_t r, int64_t part, int64_t parts) {
  int64_t lo, hi;
  part_keys(lens[r], window, BS, part, parts, lo, hi);
  return lo < hi ? tables[r * table_width + lo / BS] : -1;
}

// An attention sink's term of head hg's softmax denominator, exp(sinks[hg] - m), for a running
// max m of the same (scaled) scores: a key whose value is zero (0 without sinks). std::exp, as
// the sink may exceed every score.
inline float sink_weight(const float* sinks, int64_t hg, float m) {
  return sinks == nullptr ? 0.0f : std::exp(sinks[hg] - m);
}

// T: the queries' and outputs' type; C: the cache's (T, or int8_t / Fp8 codes whose scales are
// k_scale / v_scale, laid out as the codes without head_dim: the code offset / head_dim)
template <typename T, typename C>
void paged_decode(const T* q, const C* k_cache, const C* v_cache, const float* k_scale,
                  const float* v_scale, T* out, const int32_t* tokens,
                  const int32_t* block_tables, const int32_t* seq_lens, int64_t rows,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t table_width, int64_t q_stride, int64_t o_stride, int64_t block_stride,
                  int64_t token_stride, float scale, int64_t window, const float* sinks) {
  constexpr bool quantized = !std::is_same_v<T, C>;
  const int64_t G = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t BS = block_size;
  const int64_t scale_token_stride = token_stride / D;
#pragma omp parallel
  {
    std::vector<float> qf(G * D), acc(G * D), s(G * BS), m(G), l(G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows * num_kv_heads; ++task) {
      const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t tok = tokens[r], len = seq_lens[r];
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = q + tok * q_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qr[d]) * scale;
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t num_blocks = (len + BS - 1) / BS;
      const int64_t start = window > 0 && len > window ? len - window : 0;  // first key seen
      for (int64_t b = start / BS; b < num_blocks; ++b) {
        const int64_t blk = block_tables[r * table_width + b];
        const int64_t j0 = b == start / BS ? start % BS : 0;
        const int64_t nt = ((len - b * BS) < BS ? (len - b * BS) : BS) - j0;
        const int64_t off = blk * block_stride + j0 * token_stride + h * D;
        const C* kb = k_cache + off;
        const C* vb = v_cache + off;
        for (int64_t j = 0; j < nt; ++j) {
          const C* kr = kb + j * token_stride;
          const float ks = quantized ? k_scale[off / D + j * scale_token_stride] : 1.0f;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(kr[d]);
            s[g * BS + j] = quantized ? dot * ks : dot;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * BS;
          float mx = m[g];
          for (int64_t j = 0; j < nt; ++j) mx = sg[j] > mx ? sg[j] : mx;
          const float corr = exp_nonpositive(m[g] - mx);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < nt; ++j) {
            sg[j] = exp_nonpositive(sg[j] - mx);
            sum += sg[j];
          }
          l[g] = l[g] * corr + sum;
          m[g] = mx;
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
        }
        for (int64_t j = 0; j < nt; ++j) {
          const C* vr = vb + j * token_stride;
          const float vs = quantized ? v_scale[off / D + j * scale_token_stride] : 1.0f;
          for (int64_t g = 0; g < G; ++g) {
            const float p = quantized ? s[g * BS + j] * vs : s[g * BS + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vr[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = out + tok * o_stride + (h * G + g) * D;
        const float inv = 1.0f / (l[g] + sink_weight(sinks, h * G + g, m[g]));
        for (int64_t d = 0; d < D; ++d) store(orow + d, acc[g * D + d] * inv);
      }
    }
  }
}

#if defined(FOUDRE_AVX512)
// The AVX-512 paths: each decode row's keys in two parts of its blocks, merged after (one task a
// part below as many rows as threads, else one a row: paged_decode_rows), each part walking its
// blocks in order in tiles of <= 16 tokens, each tile for every KV head in turn, so that a
// block's K and V rows (all heads: one contiguous run in the [blocks, block_size, heads, dim]
// pool) are read front to back, once, while the next block is prefetched. Per tile and query
// head: 16 scores in one vector, the online-softmax update, then P·V into float32 accumulators.
// How scores and P·V are computed is the Ops policy: FmaOps (float32 FMAs, any storage type) or
// Bf16DotOps (AVX512-BF16).

// codes: int8 exactly; e4m3 as 2^-8 times its value (kUnit), its bits placed in a float16's:
// sign to bit 15, exponent and mantissa to bits 7-13, which vcvtph2ps reads as e4m3's value with
// an exponent bias of 15 instead of 7, subnormals included
inline __m512 load16(const Fp8* p, __mmask16 m) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000));
  const __m256i rest = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80));
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

// A row of head_dim codes converted into a scratch row of floats, or of bfloat16 (exact, see
// the top), `width` long (zeros past head_dim)
template <typename C>
inline void convert_row(float* dst, const C* src, int64_t D, int64_t width) {
  for (int64_t d = 0; d < width; d += 16) _mm512_storeu_ps(dst + d, load16(src + d, lanes(D - d)));
}
#if defined(__AVX512BF16__)
inline void convert_row(uint16_t* dst, const int8_t* src, int64_t D, int64_t width) {
  for (int64_t d = 0; d < width; d += 16) {
    const __m512 v = load16(src + d, lanes(D - d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}
// e4m3 straight to bfloat16 bits, 32 codes at a time, as 2^-8 times their values (kUnit): a
// normal code's exponent and mantissa moved into a bfloat16's, the bias raised from 7 to
// 127 - 8; a subnormal one (exponent field 0: m 2^-9) from a table of m 2^-17
inline void convert_row(uint16_t* dst, const Fp8* src, int64_t D, int64_t width) {
  static const uint16_t subnormal[8] = {0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860};
  const __m512i table = _mm512_maskz_loadu_epi16(0xFF, subnormal);  // vpermw's lanes 0-7
  for (int64_t d = 0; d < width; d += 32) {
    const int64_t left = D - d;
    const __mmask32 m = left >= 32 ? ~__mmask32{0} : left > 0 ? (__mmask32{1} << left) - 1 : 0;
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, src + d));
    const __m512i em = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
    const __m512i normal =
        _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(static_cast<short>(112 << 7)));
    const __m512i mag =
        _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)), normal,
                                _mm512_permutexvar_epi16(em, table));
    const __m512i sign = _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(-0x8000));
    _mm512_storeu_si512(dst + d, _mm512_or_si512(mag, sign));
  }
}
#endif


// The 16 vectors' lane sums, in one vector, by a 4-level shuffle tree. Lane e = 4L + m of the
// result sums input slot 4m + L, so callers put token j in slot slot_of(j) and read it at lane j.
inline int slot_of(int j) { return 4 * (j % 4) + j / 4; }

inline __m512 sum16(const __m512* v) {
  __m512 w[8], z[4], u[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// float32 arithmetic on any storage type: head_dim in chunks of W = 16 lanes; q kept as float32;
// the softmax weights p as 16 floats per head.
template <typename T, typename C = T>
struct FmaOps {
  using Elem = T;   // queries and outputs
  using Cache = C;  // the K and V rows it reads
  using Q = float;
  using Mask = __mmask16;
  static constexpr int W = 16;
  static Mask tail(int64_t D) { return static_cast<Mask>(D % W ? (1u << (D % W)) - 1 : 0xFFFFu); }
  static Mask mask(int64_t c, int64_t NC, Mask tail) { return c == NC - 1 ? tail : Mask(0xFFFFu); }

  static void load_q(const T* qr, Q* qv, int64_t NC, Mask tl) {
    for (int64_t c = 0; c < NC; ++c)
      _mm512_storeu_ps(qv + c * W, load16(qr + c * W, mask(c, NC, tl)));
  }

  template <int NC>
  static __m512 dot(const Q* qh, const C* kr, int64_t nc, Mask tl) {
    const int64_t n = NC ? NC : nc;  // a constant where NC is
    __m512 d = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; ++c)
      d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * W), load16(kr + c * W, mask(c, n, tl)), d);
    return d;
  }

  static void store_p(__m512 p, float* pp) { _mm512_storeu_ps(pp, p); }

  // acc[g] = acc[g] * corr[g] + sum_j p[g][j] V[j] for GS query heads
  template <int GS, int NC>
  static void pv(float* acc, int64_t acc_stride, const float* corr, const float* pp, const C* vb,
                 int64_t token_stride, int64_t nt, int64_t nc, Mask tl) {
    const int64_t n = NC ? NC : nc;
    for (int64_t c = 0; c < n; ++c) {
      __m512 a[GS];
      for (int g = 0; g < GS; ++g)
        a[g] =
            _mm512_mul_ps(_mm512_loadu_ps(acc + g * acc_stride + c * W), _mm512_set1_ps(corr[g]));
      for (int64_t j = 0; j < nt; ++j) {
        const __m512 v = load16(vb + j * token_stride + c * W, mask(c, n, tl));
        for (int g = 0; g < GS; ++g)
          a[g] = _mm512_fmadd_ps(_mm512_set1_ps(pp[g * 16 + j]), v, a[g]);
      }
      for (int g = 0; g < GS; ++g) _mm512_storeu_ps(acc + g * acc_stride + c * W, a[g]);
    }
  }

  static void write(T* orow, const float* acc, float inv, int64_t D) {
    for (int64_t d = 0; d < D; ++d) store(orow + d, acc[d] * inv);
  }
};

#if defined(__AVX512BF16__)
#define FOUDRE_BF16_DOT 1
// bfloat16 caches with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 (exactly, in float32)
// and adds both products into a float32 lane, so K and V are never converted. head_dim in
// chunks of W = 32 bf16 lanes; q kept as bf16. P·V: rows j and j+1 of V are interleaved
// (unpacklo/hi_epi16, within 128-bit lanes) so that each float32 lane meets the pair
// (V[j][d], V[j+1][d]) and a broadcast pair (p[j], p[j+1]) of bf16 weights; a chunk's
// accumulator (two vectors) holds head_dim in that interleaved order, undone by write.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

struct Bf16DotOps {
  using Elem = uint16_t;
  using Cache = uint16_t;
  using Q = uint16_t;
  using Mask = __mmask32;
  static constexpr int W = 32;
  static Mask tail(int64_t D) { return static_cast<Mask>(D % W ? (1u << (D % W)) - 1 : ~0u); }
  static Mask mask(int64_t c, int64_t NC, Mask tail) { return c == NC - 1 ? tail : Mask(~0u); }

  static void load_q(const uint16_t* qr, Q* qv, int64_t NC, Mask tl) {
    for (int64_t c = 0; c < NC; ++c)
      _mm512_storeu_si512(qv + c * W, _mm512_maskz_loadu_epi16(mask(c, NC, tl), qr + c * W));
  }

  template <int NC>
  static __m512 dot(const Q* qh, const uint16_t* kr, int64_t nc, Mask tl) {
    const int64_t n = NC ? NC : nc;  // a constant where NC is
    __m512 d = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; ++c)
      d = _mm512_dpbf16_ps(d, as_bh(_mm512_loadu_si512(qh + c * W)),
                           as_bh(_mm512_maskz_loadu_epi16(mask(c, n, tl), kr + c * W)));
    return d;
  }

  static void store_p(__m512 p, float* pp) {  // 8 (p[2i], p[2i+1]) pairs in pp's first half
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  }

  template <int GS, int NC>
  static void pv(float* acc, int64_t acc_stride, const float* corr, const float* pp,
                 const uint16_t* vb, int64_t token_stride, int64_t nt, int64_t nc, Mask tl) {
    const int64_t n = NC ? NC : nc;
    for (int64_t c = 0; c < n; ++c) {
      const Mask m = mask(c, n, tl);
      __m512 lo[GS], hi[GS];
      for (int g = 0; g < GS; ++g) {
        const __m512 cv = _mm512_set1_ps(corr[g]);
        lo[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * acc_stride + c * W), cv);
        hi[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * acc_stride + c * W + 16), cv);
      }
      for (int64_t j = 0; j < nt; j += 2) {  // past nt: a zero row (the pool may hold NaN there)
        const __m512i r0 = _mm512_maskz_loadu_epi16(m, vb + j * token_stride + c * W);
        const __m512i r1 = j + 1 < nt
                               ? _mm512_maskz_loadu_epi16(m, vb + (j + 1) * token_stride + c * W)
                               : _mm512_setzero_si512();
        const __m512bh vlo = as_bh(_mm512_unpacklo_epi16(r0, r1));
        const __m512bh vhi = as_bh(_mm512_unpackhi_epi16(r0, r1));
        for (int g = 0; g < GS; ++g) {
          int32_t pair;
          std::memcpy(&pair, pp + g * 16 + j / 2, 4);
          const __m512bh p = as_bh(_mm512_set1_epi32(pair));
          lo[g] = _mm512_dpbf16_ps(lo[g], p, vlo);
          hi[g] = _mm512_dpbf16_ps(hi[g], p, vhi);
        }
      }
      for (int g = 0; g < GS; ++g) {
        _mm512_storeu_ps(acc + g * acc_stride + c * W, lo[g]);
        _mm512_storeu_ps(acc + g * acc_stride + c * W + 16, hi[g]);
      }
    }
  }

  static void write(uint16_t* orow, const float* acc, float inv, int64_t D) {
    for (int64_t c = 0; c * W < D; ++c)
      for (int k = 0; k < 16; ++k) {  // lane k of a chunk's lo vector, then of its hi vector
        const int64_t d = c * W + 8 * (k / 4) + k % 4;
        if (d < D) store(orow + d, acc[c * W + k] * inv);
        if (d + 4 < D) store(orow + d + 4, acc[c * W + 16 + k] * inv);
      }
  }
};
#endif  // __AVX512BF16__

// Scores of one query head against up to 16 tokens (rows of kb; lane j = token j, lanes past
// nt are 0): per token a 16-lane vector of partial dot products, summed across lanes by sum16.
template <class Ops, int NC>
inline __m512 qk_tile(const typename Ops::Q* qh, const typename Ops::Cache* kb,
                      int64_t token_stride, int64_t nt, int64_t nc, typename Ops::Mask tl) {
  __m512 v[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j)
    v[slot_of(j)] =
        j < nt ? Ops::template dot<NC>(qh, kb + j * token_stride, nc, tl) : _mm512_setzero_ps();
  return sum16(v);
}

// NC: head_dim's chunk count when known at compile time (0: computed from head_dim). C: the
// cache's elements, Ops::Cache, or codes (int8_t, Fp8) that each tile converts for Ops (then
// FmaOps<T, float>) into a scratch tile, with scales k_scale / v_scale (see the top).
template <class Ops, typename C, int NC>
void paged_decode_rows(const typename Ops::Elem* q, const C* k_cache, const C* v_cache,
                       const float* k_scale, const float* v_scale, typename Ops::Elem* out,
                       const int32_t* tokens, const int32_t* block_tables, const int32_t* seq_lens,
                       int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t table_width, int64_t q_stride, int64_t o_stride,
                       int64_t block_stride, int64_t token_stride, float scale, int64_t window,
                       const float* sinks) {
  using T = typename Ops::Elem;
  constexpr bool quantized = !std::is_same_v<C, typename Ops::Cache>;
  constexpr int W = Ops::W;
  const int64_t G = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t nc = (D + W - 1) / W;
  const int64_t BS = block_size;  // any size: tiles never cross a block
  const auto tl = Ops::tail(D);
  const int64_t acc_stride = nc * W;
  // a block's K rows for all heads (contiguous in the pool), prefetched a query head's share
  // at a time while the previous block is computed (all at once would stall on the misses)
  const int64_t block_bytes = BS * token_stride * static_cast<int64_t>(sizeof(C));
  const int64_t share = (block_bytes / num_heads + 63) / 64 * 64;
  // scales: a token's at token_stride / head_dim, a block's (for all heads) in scale_bytes
  const int64_t scale_token_stride = token_stride / D;
  const int64_t scale_bytes = quantized ? BS * scale_token_stride * 4 : 0;
  const __m512i scale_lanes = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(scale_token_stride)));
  // Each row's keys in kSplit parts of whole blocks (the first part the smaller, empty for a
  // row of one block), each with its own running max, sum and accumulators, merged after
  // (flash-decoding's split of the keys): a batch-1 step's attention then runs on both threads
  // of a 2-core host, where one task a row left the other idle (single-threaded it took a tenth
  // of a batch-1 int4 decode step at 300 keys). Fewer rows than threads: one task a part, their
  // states in a shared buffer (a cache line apart); else one task a row computing its parts one
  // after the other in the thread's scratch (a part a task there ran 0.65-0.85x as fast: the
  // second pass over q, the shared states). The same arithmetic either way, and the parts depend
  // on the row's length only: a row's result is the same bits in any batch, on any threads.
  constexpr int64_t kSplit = 2;
  const int64_t part_stride = num_heads * acc_stride;
  const int64_t part_floats = (part_stride + 2 * num_heads + 15) / 16 * 16;  // acc, m, l
  const bool task_a_part = rows < max_threads();
  std::unique_ptr<float[]> shared(new float[task_a_part ? rows * kSplit * part_floats + 16 : 0]);
  float* const states = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(shared.get()) + 63) / 64 * 64);  // 64-byte aligned
  // the first block read after part `part` of row r (-1: none before row `end`)
  const auto first_block = [&](int64_t r, int64_t part, int64_t end) -> int64_t {
    for (; r < end; ++r, part = 0)
      for (; part < kSplit; ++part) {
        const int64_t blk =
            first_block_of(block_tables, seq_lens, table_width, window, BS, r, part, kSplit);
        if (blk >= 0) return blk;
      }
    return -1;
  };
  const int64_t run = std::clamp<int64_t>(rows / (8 * max_threads()), 1, 16);
#pragma omp parallel
  {
    std::vector<typename Ops::Q> qv(num_heads * acc_stride);
    std::vector<float> corr(G);
    std::vector<float> pp(G * 16);
    // a quantized tile's K and V converted for Ops (16 tokens of acc_stride values)
    std::vector<typename Ops::Cache> kf(quantized ? 16 * acc_stride : 0);
    std::vector<typename Ops::Cache> vf(quantized ? 16 * acc_stride : 0);
    std::vector<float> own(task_a_part ? 0 : kSplit * part_floats), merged(acc_stride);
    const auto state = [&](int64_t r, int64_t part) {
      return task_a_part ? states + (r * kSplit + part) * part_floats : &own[part * part_floats];
    };
    int64_t loaded = -1;  // the row whose queries qv holds
    // part `part` of row r into its state; `follow`: the block the thread reads next (-1:
    // unknown), prefetched with the part's last tile as the part's own next blocks are
    const auto compute = [&](int64_t r, int64_t part, int64_t follow) {
      float* acc = state(r, part);
      float* m = acc + part_stride;
      float* l = m + num_heads;
      const int64_t tok = tokens[r], len = seq_lens[r];
      for (int64_t hg = 0; hg < num_heads; ++hg) {
        if (loaded != r) Ops::load_q(q + tok * q_stride + hg * D, &qv[hg * acc_stride], nc, tl);
        m[hg] = -FLT_MAX;
        l[hg] = 0.0f;
      }
      loaded = r;
      std::fill(acc, acc + part_stride, 0.0f);
      // this part's keys (a sliding window's walk starts at the first key it sees: earlier
      // blocks are not read)
      int64_t lo, hi;
      part_keys(len, window, BS, part, kSplit, lo, hi);
      for (int64_t pos = lo, nt = 0; pos < hi; pos += nt) {
        const int64_t b = pos / BS, j0 = pos % BS;
        const int64_t blk = block_tables[r * table_width + b];
        nt = std::min<int64_t>({16, hi - pos, BS - j0});
        const int64_t next = pos + nt >= hi                ? follow
                             : j0 + nt == BS ? block_tables[r * table_width + b + 1]
                                             : -1;
        const __mmask16 valid = static_cast<__mmask16>(nt == 16 ? 0xFFFFu : (1u << nt) - 1);
        if (quantized && next >= 0)
          for (int64_t at = 0; at < scale_bytes; at += 64) {
            const int64_t first = next * (block_stride / D);
            _mm_prefetch(reinterpret_cast<const char*>(k_scale + first) + at, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(v_scale + first) + at, _MM_HINT_T1);
          }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t off = blk * block_stride + j0 * token_stride + h * D;
          // what the products read: the cache's rows, or a tile of codes converted to float
          const typename Ops::Cache* kb;
          const typename Ops::Cache* vb;
          int64_t kv_stride;
          __m512 k_mul = _mm512_set1_ps(scale), v_mul = _mm512_set1_ps(1.0f);
          if constexpr (quantized) {
            for (int64_t j = 0; j < nt; ++j) {
              const int64_t at = off + j * token_stride;
              convert_row(&kf[j * acc_stride], k_cache + at, D, acc_stride);
              convert_row(&vf[j * acc_stride], v_cache + at, D, acc_stride);
            }
            const int64_t at = off / D;  // the first token's scale for head h
            const __m512 zero = _mm512_setzero_ps();
            k_mul = _mm512_mul_ps(
                _mm512_mask_i32gather_ps(zero, valid, scale_lanes, k_scale + at, 4),
                _mm512_set1_ps(scale * kUnit<C>));
            v_mul = _mm512_mul_ps(
                _mm512_mask_i32gather_ps(zero, valid, scale_lanes, v_scale + at, 4),
                _mm512_set1_ps(kUnit<C>));
            kb = kf.data();
            vb = vf.data();
            kv_stride = acc_stride;
          } else {
            kb = k_cache + off;
            vb = v_cache + off;
            kv_stride = token_stride;
          }
          for (int64_t g = 0; g < G; ++g) {
            const int64_t hg = h * G + g;
            if (next >= 0) {
              const char* kn = reinterpret_cast<const char*>(k_cache + next * block_stride);
              const char* vn = reinterpret_cast<const char*>(v_cache + next * block_stride);
              for (int64_t at = hg * share; at < (hg + 1) * share && at < block_bytes; at += 64) {
                _mm_prefetch(kn + at, _MM_HINT_T1);
                _mm_prefetch(vn + at, _MM_HINT_T1);
              }
            }
            const __m512 s = qk_tile<Ops, NC>(&qv[hg * acc_stride], kb, kv_stride, nt, nc, tl);
            const __m512 sc = _mm512_maskz_mul_ps(valid, s, k_mul);
            const float mx = std::max(m[hg], _mm512_mask_reduce_max_ps(valid, sc));
            const __m512 p =
                _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
            corr[g] = exp_nonpositive(m[hg] - mx);
            l[hg] = l[hg] * corr[g] + _mm512_reduce_add_ps(p);
            m[hg] = mx;
            Ops::store_p(quantized ? _mm512_mul_ps(p, v_mul) : p, &pp[g * 16]);
          }
          for (int64_t g0 = 0; g0 < G; g0 += 4) {  // query heads 4 at a time: in registers
            float* a = &acc[(h * G + g0) * acc_stride];
            const float* cr = &corr[g0];
            const float* p = &pp[g0 * 16];
            switch (std::min<int64_t>(4, G - g0)) {
              case 4:
                Ops::template pv<4, NC>(a, acc_stride, cr, p, vb, kv_stride, nt, nc, tl);
                break;
              case 3:
                Ops::template pv<3, NC>(a, acc_stride, cr, p, vb, kv_stride, nt, nc, tl);
                break;
              case 2:
                Ops::template pv<2, NC>(a, acc_stride, cr, p, vb, kv_stride, nt, nc, tl);
                break;
              default:
                Ops::template pv<1, NC>(a, acc_stride, cr, p, vb, kv_stride, nt, nc, tl);
            }
          }
        }
      }
    };
    // row r's parts merged: acc = sum_p acc_p e^(m_p - M), l likewise, M the largest m_p (an
    // empty part: m = -FLT_MAX, l = 0, acc = 0, adds nothing), then written out
    const auto merge = [&](int64_t r) {
      const int64_t tok = tokens[r];
      for (int64_t hg = 0; hg < num_heads; ++hg) {
        float mx = -FLT_MAX;
        for (int64_t part = 0; part < kSplit; ++part)
          mx = std::max(mx, state(r, part)[part_stride + hg]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float sum = 0.0f;
        for (int64_t part = 0; part < kSplit; ++part) {
          const float* acc = state(r, part);
          const float l = acc[part_stride + num_heads + hg];
          if (l == 0.0f) continue;
          const float f = exp_nonpositive(acc[part_stride + hg] - mx);
          const float* a = acc + hg * acc_stride;
          for (int64_t d = 0; d < acc_stride; ++d) merged[d] += a[d] * f;
          sum += l * f;
        }
        sum += sink_weight(sinks, hg, mx);
        Ops::write(out + tok * o_stride + hg * D, merged.data(), 1.0f / sum, D);
      }
    };
    if (task_a_part) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < rows * kSplit; ++task)
        compute(task / kSplit, task % kSplit, -1);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) merge(r);
    } else {
      // rows in runs of `run`, a run a task: the thread knows the row it reads next, and so
      // its first block (each part's first block would otherwise be read unprefetched)
#pragma omp for schedule(dynamic, 1)
      for (int64_t first = 0; first < rows; first += run) {
        const int64_t end = std::min(rows, first + run);
        for (int64_t r = first; r < end; ++r) {
          for (int64_t part = 0; part < kSplit; ++part)
            compute(r, part, first_block(r, part + 1, end));
          merge(r);
        }
      }
    }
  }
}

// head_dim's chunk count as a compile-time constant for the common sizes (64..256)
template <class Ops, typename C>
void paged_decode_avx512(const typename Ops::Elem* q, const C* k, const C* v, const float* ks,
                         const float* vs, typename Ops::Elem* out, const int32_t* tokens,
                         const int32_t* tables, const int32_t* lens, int64_t rows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t table_width, int64_t q_stride,
                         int64_t o_stride, int64_t block_stride, int64_t token_stride,
                         float scale, int64_t window, const float* sinks) {
  auto f = paged_decode_rows<Ops, C, 0>;
  switch ((head_dim + Ops::W - 1) / Ops::W) {
    case 2:
      f = paged_decode_rows<Ops, C, 2>;
      break;
    case 3:
      f = paged_decode_rows<Ops, C, 3>;
      break;
    case 4:
      f = paged_decode_rows<Ops, C, 4>;
      break;
    default:
      break;
  }
  f(q, k, v, ks, vs, out, tokens, tables, lens, rows, num_heads, num_kv_heads, head_dim,
    block_size, table_width, q_stride, o_stride, block_stride, token_stride, scale, window, sinks);
}
#endif  // AVX-512

#if defined(FOUDRE_AVX2)
// The AVX2 path (AMD Zen 2 and 3, Intel's client cores): the AVX-512 path's walk on 8 float32
// lanes. Tasks of (row, KV head, part): each row's keys in two parts of whole blocks as there,
// and one task for each KV head's query heads, so that a batch-1 step runs on every thread; each
// task's running max, sum and accumulators in a shared buffer, merged after (a row's result is
// the same bits on any threads and in any batch). Tiles of <= 16 tokens inside a block. K and V
// are read where they lie, 16 values at a time into two float32 vectors in registers
// (load16x): bfloat16 pairs split by a shift and a mask into the even and the odd positions
// (queries and accumulators kept in that order, undone as the output is written), other types
// in order. Per query head 8 scores at a time (qk16: each K load serves one head; the tile's
// rows are in L1 after the first), the online softmax on the tile's 16 scores of a head, P·V
// 16 values of head_dim at a time for up to 4 query heads in registers (pv16: each V load
// serves them all). Head sizes 64, 80, 96 and 128 are compiled as such (dispatch). Before,
// each 8-token tile's K and V rows were converted into float32 scratch rows, which cost more
// than the products: one thread, a 96-wide head, GQA 4, 512 keys in L2, 1.35-1.45x the time of
// this; two threads at 2048 keys 1.7x, cold (the cache read from memory, as in a decode step)
// 1.35x.

// lane j of the result: the sum of v[j]'s lanes
inline __m256 sum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
inline float reduce8(__m256 v, bool max) {
  __m128 q = max ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = max ? _mm_max_ps(q, _mm_movehl_ps(q, q)) : _mm_add_ps(q, _mm_movehl_ps(q, q));
  const __m128 r = _mm_movehdup_ps(q);
  return _mm_cvtss_f32(max ? _mm_max_ss(q, r) : _mm_add_ss(q, r));
}

// 16 values from p as float32 (int8 codes exactly, e4m3 as 2^-8 times their values): lane i of
// lo and hi holds position position16<C>(i) and position16<C>(8 + i)
template <typename C>
inline void load16x(const C* p, __m256& lo, __m256& hi) {
  lo = load8(p);
  hi = load8(p + 8);
}
template <>
inline void load16x(const uint16_t* p, __m256& lo, __m256& hi) {  // bfloat16: even, odd
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
}
template <typename C>
constexpr int64_t position16(int64_t i) {
  return i;
}
template <>
constexpr int64_t position16<uint16_t>(int64_t i) {
  return i < 8 ? 2 * i : 2 * (i - 8) + 1;
}
// the head_dim position of element i of a row of chunks in load16x's order
template <typename C>
constexpr int64_t dim_of(int64_t i) {
  return i / 16 * 16 + position16<C>(i % 16);
}

// Chunk c of a row of D values as load16x reads it: straight from the row where NC > 0 (D is
// 16 NC) or the chunk is whole, else through a copy zero-padded past D (the row's end may be
// the pool's); a row has NC chunks, or (NC = 0) D / 16 rounded up
template <typename C, int NC>
[[gnu::always_inline]] inline void load_chunk(const C* row, int64_t c, int64_t D, __m256& lo,
                                              __m256& hi) {
  if (NC > 0 || 16 * c + 16 <= D) {
    load16x(row + 16 * c, lo, hi);
    return;
  }
  C buf[16] = {};
  std::memcpy(buf, row + 16 * c, (D - 16 * c) * sizeof(C));
  load16x(buf, lo, hi);
}
template <int NC>
constexpr int64_t chunks(int64_t D) {
  return NC > 0 ? NC : (D + 15) / 16;
}

// The scores of GS query heads (qv: their rows of chunks of 16 floats, in load16x's order)
// against the tile's nt keys (rows kb, token_stride apart): sc[g * 16 + j]; a head's 8 tokens at
// a time in 8 accumulators, summed across lanes together (sum8; rows past nt read row nt - 1
// again, their lanes left out after). GS a constant: the heads' loop compiled for groups of 4
// ran 1.4x as fast as one over G at run time.
template <typename C, int GS, int NC>
inline void qk16(const float* qv, int64_t qstride, const C* kb, int64_t token_stride,
                 int64_t nt, int64_t D, float* sc) {
  for (int g = 0; g < GS; ++g) {
    for (int64_t t0 = 0; t0 < nt; t0 += 8) {
      const C* k[8];
      for (int t = 0; t < 8; ++t) k[t] = kb + std::min<int64_t>(t0 + t, nt - 1) * token_stride;
      __m256 a[8];
      for (auto& x : a) x = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks<NC>(D); ++c) {
        const float* qc = qv + g * qstride + 16 * c;
        const __m256 ql = _mm256_loadu_ps(qc), qh = _mm256_loadu_ps(qc + 8);
        for (int t = 0; t < 8; ++t) {
          __m256 lo, hi;
          load_chunk<C, NC>(k[t], c, D, lo, hi);
          a[t] = _mm256_fmadd_ps(ql, lo, a[t]);
          a[t] = _mm256_fmadd_ps(qh, hi, a[t]);
        }
      }
      _mm256_storeu_ps(sc + g * 16 + t0, sum8(a));
    }
  }
}

// acc[g] = acc[g] * corr[g] + sum_j p[g][j] V[j] for GS query heads (acc rows of chunks, in
// load16x's order; pp: 16 weights a head), a chunk of 16 values at a time in registers
template <typename C, int GS, int NC>
inline void pv16(float* acc, int64_t astride, const float* corr, const float* pp, const C* vb,
                 int64_t token_stride, int64_t nt, int64_t D) {
  for (int64_t c = 0; c < chunks<NC>(D); ++c) {
    __m256 a[GS][2];
    for (int g = 0; g < GS; ++g) {
      const __m256 cr = _mm256_set1_ps(corr[g]);
      a[g][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * astride + 16 * c), cr);
      a[g][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * astride + 16 * c + 8), cr);
    }
    for (int64_t j = 0; j < nt; ++j) {
      __m256 lo, hi;
      load_chunk<C, NC>(vb + j * token_stride, c, D, lo, hi);
      for (int g = 0; g < GS; ++g) {
        const __m256 p = _mm256_set1_ps(pp[g * 16 + j]);
        a[g][0] = _mm256_fmadd_ps(p, lo, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(p, hi, a[g][1]);
      }
    }
    for (int g = 0; g < GS; ++g) {
      _mm256_storeu_ps(acc + g * astride + 16 * c, a[g][0]);
      _mm256_storeu_ps(acc + g * astride + 16 * c + 8, a[g][1]);
    }
  }
}

// f(std::integral_constant<int, GS>{}, std::integral_constant<int, NC>{}) for a group of
// gs <= 4 query heads, with NC = head_dim / 16 for the common head sizes (64, 80, 96, 128: whole
// chunks, their loops unrolled), else NC = 0 (chunks counted at run time, a partial last one)
template <typename F>
inline void dispatch(int64_t gs, int64_t D, const F& f) {
  const auto heads = [&](auto nc) {
    switch (gs) {
      case 4: f(std::integral_constant<int, 4>{}, nc); break;
      case 3: f(std::integral_constant<int, 3>{}, nc); break;
      case 2: f(std::integral_constant<int, 2>{}, nc); break;
      default: f(std::integral_constant<int, 1>{}, nc);
    }
  };
  switch (D) {
    case 64: heads(std::integral_constant<int, 4>{}); break;
    case 80: heads(std::integral_constant<int, 5>{}); break;
    case 96: heads(std::integral_constant<int, 6>{}); break;
    case 128: heads(std::integral_constant<int, 8>{}); break;
    default: heads(std::integral_constant<int, 0>{});
  }
}

template <typename T, typename C>
void paged_decode_avx2(const T* q, const C* k_cache, const C* v_cache, const float* k_scale,
                       const float* v_scale, T* out, const int32_t* tokens,
                       const int32_t* block_tables, const int32_t* seq_lens, int64_t rows,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t table_width, int64_t q_stride,
                       int64_t o_stride, int64_t block_stride, int64_t token_stride, float scale,
                       int64_t window, const float* sinks) {
  constexpr bool quantized = !std::is_same_v<T, C>;
  constexpr int64_t kSplit = 2;
  const int64_t G = num_heads / num_kv_heads, D = head_dim, BS = block_size;
  const int64_t width = 16 * chunks<0>(D);  // a head's accumulators (and queries): its chunks
  const int64_t scale_token_stride = token_stride / D;
  // a task's state: acc [G, width], m [G], l [G], a cache line apart from the next
  const int64_t state_floats = (G * width + 2 * G + 15) / 16 * 16;
  const int64_t tasks = rows * num_kv_heads * kSplit;
  std::unique_ptr<float[]> buffer(new float[tasks * state_floats + 16]);
  float* const states = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.get()) + 63) / 64 * 64);  // 64-byte aligned
  const int64_t row_lines = (D * static_cast<int64_t>(sizeof(C)) + 63) / 64;  // a head's K row
  // tasks in runs of `run`, a run a task of the loop: the thread knows the task it computes
  // next, and prefetches that task's first block with its own last tile
  const int64_t run = std::clamp<int64_t>(tasks / (8 * max_threads()), 1, 16);
#pragma omp parallel
  {
    std::vector<float> qv(G * width), sc(G * 16), pp(G * 16), corr(G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t first_task = 0; first_task < tasks; first_task += run)  // (a run's tasks:)
    for (int64_t task = first_task, task_end = std::min(tasks, first_task + run);
         task < task_end; ++task) {
      const int64_t part = task % kSplit, h = task / kSplit % num_kv_heads;
      const int64_t r = task / kSplit / num_kv_heads;
      float* acc = states + task * state_floats;
      float* m = acc + G * width;
      float* l = m + G;
      const int64_t tok = tokens[r], len = seq_lens[r];
      for (int64_t g = 0; g < G; ++g) {  // the queries in load16x's order, zeros past D
        const T* qr = q + tok * q_stride + (h * G + g) * D;
        for (int64_t i = 0; i < width; ++i) {
          const int64_t d = dim_of<C>(i);
          qv[g * width + i] = d < D ? load(qr[d]) : 0.0f;
        }
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
      }
      std::fill(acc, acc + G * width, 0.0f);
      int64_t lo, hi;  // this part's keys
      part_keys(len, window, BS, part, kSplit, lo, hi);
      for (int64_t pos = lo, nt = 0; pos < hi; pos += nt) {
        const int64_t b = pos / BS, j0 = pos % BS;
        const int64_t blk = block_tables[r * table_width + b];
        nt = std::min<int64_t>({16, hi - pos, BS - j0});
        // as a block begins, the next block's rows of this head into L2 (a block's products
        // ahead of their use)
        int64_t next = -1, next_h = h;
        if ((pos == lo || j0 == 0) && (b + 1) * BS < hi) {
          next = block_tables[r * table_width + b + 1];
        } else if (pos + nt >= hi && task + 1 < task_end) {  // the next task's first block
          next = first_block_of(block_tables, seq_lens, table_width, window, BS,
                                (task + 1) / kSplit / num_kv_heads, (task + 1) % kSplit, kSplit);
          next_h = (task + 1) / kSplit % num_kv_heads;
        }
        if (next >= 0)
          for (int64_t j = 0; j < BS; ++j) {
            const int64_t at = next * block_stride + j * token_stride + next_h * D;
            for (int64_t line = 0; line < row_lines; ++line) {
              _mm_prefetch(reinterpret_cast<const char*>(k_cache + at) + 64 * line, _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(v_cache + at) + 64 * line, _MM_HINT_T1);
            }
          }
        const int64_t off = blk * block_stride + j0 * token_stride + h * D;
        alignas(32) float kmul[16], vmul[16];  // what a token's score and weight are scaled by
        for (int64_t j = 0; j < 16; ++j) {
          kmul[j] = scale;
          vmul[j] = 1.0f;
        }
        if constexpr (quantized) {  // a token's scales multiply its score and its weight
          for (int64_t j = 0; j < nt; ++j) {
            kmul[j] = k_scale[off / D + j * scale_token_stride] * (scale * kUnit<C>);
            vmul[j] = v_scale[off / D + j * scale_token_stride] * kUnit<C>;
          }
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4)  // query heads 4 at a time
          dispatch(std::min<int64_t>(4, G - g0), D, [&](auto gs, auto n) {
            qk16<C, decltype(gs)::value, decltype(n)::value>(&qv[g0 * width], width,
                                                             k_cache + off, token_stride, nt, D,
                                                             &sc[g0 * 16]);
          });
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 valid0 = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(nt)), lane));
        const __m256 valid1 = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(nt - 8)), lane));
        const __m256 none = _mm256_set1_ps(-FLT_MAX);
        for (int64_t g = 0; g < G; ++g) {
          const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(&sc[g * 16]), _mm256_load_ps(kmul));
          const __m256 s1 =
              _mm256_mul_ps(_mm256_loadu_ps(&sc[g * 16 + 8]), _mm256_load_ps(kmul + 8));
          const __m256 top = _mm256_max_ps(_mm256_blendv_ps(none, s0, valid0),
                                           _mm256_blendv_ps(none, s1, valid1));
          const float mx = std::max(m[g], reduce8(top, true));
          const __m256 x = _mm256_set1_ps(mx);
          const __m256 p0 = _mm256_and_ps(valid0, exp8(_mm256_sub_ps(s0, x)));
          const __m256 p1 = _mm256_and_ps(valid1, exp8(_mm256_sub_ps(s1, x)));
          corr[g] = exp_nonpositive(m[g] - mx);
          l[g] = l[g] * corr[g] + reduce8(_mm256_add_ps(p0, p1), false);
          m[g] = mx;
          _mm256_storeu_ps(&pp[g * 16], _mm256_mul_ps(p0, _mm256_load_ps(vmul)));
          _mm256_storeu_ps(&pp[g * 16 + 8], _mm256_mul_ps(p1, _mm256_load_ps(vmul + 8)));
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4)  // in registers
          dispatch(std::min<int64_t>(4, G - g0), D, [&](auto gs, auto n) {
            pv16<C, decltype(gs)::value, decltype(n)::value>(
                acc + g0 * width, width, &corr[g0], &pp[g0 * 16], v_cache + off, token_stride, nt,
                D);
          });
      }
    }
    // each (row, KV head)'s parts merged (an empty part adds nothing), then written out
    std::vector<float> merged(width);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < rows * num_kv_heads; ++rh) {
      const int64_t r = rh / num_kv_heads, h = rh % num_kv_heads;
      const float* part_state[kSplit];
      for (int64_t part = 0; part < kSplit; ++part)
        part_state[part] = states + (rh * kSplit + part) * state_floats;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -FLT_MAX;
        for (const float* st : part_state) mx = std::max(mx, st[G * width + g]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float sum = 0.0f;
        for (const float* st : part_state) {
          const float l = st[G * width + G + g];
          if (l == 0.0f) continue;
          const float f = exp_nonpositive(st[G * width + g] - mx);
          for (int64_t i = 0; i < width; ++i) merged[i] += st[g * width + i] * f;
          sum += l * f;
        }
        sum += sink_weight(sinks, h * G + g, mx);
        T* orow = out + tokens[r] * o_stride + (h * G + g) * D;
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < width; ++i) {
          const int64_t d = dim_of<C>(i);
          if (d < D) store(orow + d, merged[i] * inv);
        }
      }
    }
  }
}
#endif  // AVX2

#if defined(FOUDRE_NEON)
// The NEON path (aarch64): the AVX2 path's walk on 4 float32 lanes. Tasks of (row, KV head,
// part): each row's keys in two parts of whole blocks (part_keys), their running max, sum and
// accumulators in a shared buffer, merged after (a row's result the same bits on any threads
// and in any batch); tiles of <= 16 tokens inside a block, the next block's K and V rows
// prefetched into L2 as a block begins. K and V are read where they lie, 16 values of head_dim
// at a time into four float32 vectors in registers, in order (load16n: bfloat16 widened by a
// shift, float16 by FCVTL, int8 codes exactly, e4m3 through a float16's bits as 2^-8 their
// values). Per query head and token a chunk's 4 FMAs (each K load serving up to 4 heads), the
// online softmax on the tile's 16 scores of a head, P·V 16 values of head_dim at a time for up
// to 4 query heads in registers (each V load serving them all). (Not timed: no Arm machine.)

constexpr int32_t kLane4[4] = {0, 1, 2, 3};

struct F4x4 {
  float32x4_t v[4];
};

// chunk c (16 values) of a row of D: straight from the row where whole, else through a copy
// zero-padded past D (the row's end may be the pool's)
template <typename C>
[[gnu::always_inline]] inline F4x4 load16n(const C* row, int64_t c, int64_t D) {
  const C* p = row + 16 * c;
  C buf[16];
  if (16 * c + 16 > D) {
    std::memset(static_cast<void*>(buf), 0, sizeof buf);
    std::memcpy(static_cast<void*>(buf), p, (D - 16 * c) * sizeof(C));
    p = buf;
  }
  return {{load4(p), load4(p + 4), load4(p + 8), load4(p + 12)}};
}

// the scores of GS query heads (qv: their rows of chunks of 16 floats, zeros past D) against
// the tile's nt keys: sc[g * 16 + j]
template <typename C, int GS>
inline void qk16n(const float* qv, int64_t qstride, const C* kb, int64_t token_stride,
                  int64_t nt, int64_t D, float* sc) {
  const int64_t nc = (D + 15) / 16;
  for (int64_t t = 0; t < nt; ++t) {
    const C* k = kb + t * token_stride;
    float32x4_t a[GS][2];
    for (auto& h : a) h[0] = h[1] = vdupq_n_f32(0.0f);
    for (int64_t c = 0; c < nc; ++c) {
      const F4x4 kv = load16n(k, c, D);
      for (int g = 0; g < GS; ++g) {
        const float* qc = qv + g * qstride + 16 * c;
        a[g][0] = vfmaq_f32(a[g][0], vld1q_f32(qc), kv.v[0]);
        a[g][1] = vfmaq_f32(a[g][1], vld1q_f32(qc + 4), kv.v[1]);
        a[g][0] = vfmaq_f32(a[g][0], vld1q_f32(qc + 8), kv.v[2]);
        a[g][1] = vfmaq_f32(a[g][1], vld1q_f32(qc + 12), kv.v[3]);
      }
    }
    for (int g = 0; g < GS; ++g) sc[g * 16 + t] = vaddvq_f32(vaddq_f32(a[g][0], a[g][1]));
  }
}

// acc[g] = acc[g] * corr[g] + sum_j p[g][j] V[j] for GS query heads, 16 values at a time
template <typename C, int GS>
inline void pv16n(float* acc, int64_t astride, const float* corr, const float* pp, const C* vb,
                  int64_t token_stride, int64_t nt, int64_t D) {
  const int64_t nc = (D + 15) / 16;
  for (int64_t c = 0; c < nc; ++c) {
    float32x4_t a[GS][4];
    for (int g = 0; g < GS; ++g)
      for (int i = 0; i < 4; ++i)
        a[g][i] = vmulq_n_f32(vld1q_f32(acc + g * astride + 16 * c + 4 * i), corr[g]);
    for (int64_t j = 0; j < nt; ++j) {
      const F4x4 vv = load16n(vb + j * token_stride, c, D);
      for (int g = 0; g < GS; ++g) {
        const float p = pp[g * 16 + j];
        for (int i = 0; i < 4; ++i) a[g][i] = vfmaq_n_f32(a[g][i], vv.v[i], p);
      }
    }
    for (int g = 0; g < GS; ++g)
      for (int i = 0; i < 4; ++i) vst1q_f32(acc + g * astride + 16 * c + 4 * i, a[g][i]);
  }
}

// f(std::integral_constant<int, GS>{}) for a group of gs <= 4 query heads
template <typename F>
inline void heads4(int64_t gs, const F& f) {
  switch (gs) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

// a task's online softmax over the tile's scores sc (16 a head): weights into pp (times each
// token's vmul), each head's rescaling into corr
inline void softmax16n(int64_t G, int64_t nt, const float* sc, const float* kmul,
                       const float* vmul, float* m, float* l, float* pp, float* corr) {
  for (int64_t g = 0; g < G; ++g) {
    float32x4_t s[4];
    float32x4_t top = vdupq_n_f32(-FLT_MAX);
    for (int i = 0; i < 4; ++i) {
      s[i] = vmulq_f32(vld1q_f32(sc + g * 16 + 4 * i), vld1q_f32(kmul + 4 * i));
      const uint32x4_t ok = vcltq_s32(vaddq_s32(vdupq_n_s32(4 * i), vld1q_s32(kLane4)),
                                      vdupq_n_s32(static_cast<int32_t>(nt)));
      s[i] = vbslq_f32(ok, s[i], vdupq_n_f32(-FLT_MAX));
      top = vmaxq_f32(top, s[i]);
    }
    const float mx = std::max(m[g], vmaxvq_f32(top));
    float32x4_t sum = vdupq_n_f32(0.0f);
    for (int i = 0; i < 4; ++i) {
      const uint32x4_t ok = vcltq_s32(vaddq_s32(vdupq_n_s32(4 * i), vld1q_s32(kLane4)),
                                      vdupq_n_s32(static_cast<int32_t>(nt)));
      const float32x4_t p = vreinterpretq_f32_u32(
          vandq_u32(ok, vreinterpretq_u32_f32(exp4(vsubq_f32(s[i], vdupq_n_f32(mx))))));
      sum = vaddq_f32(sum, p);
      vst1q_f32(pp + g * 16 + 4 * i, vmulq_f32(p, vld1q_f32(vmul + 4 * i)));
    }
    corr[g] = exp_nonpositive(m[g] - mx);
    l[g] = l[g] * corr[g] + vaddvq_f32(sum);
    m[g] = mx;
  }
}

template <typename T, typename C>
void paged_decode_neon(const T* q, const C* k_cache, const C* v_cache, const float* k_scale,
                       const float* v_scale, T* out, const int32_t* tokens,
                       const int32_t* block_tables, const int32_t* seq_lens, int64_t rows,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t table_width, int64_t q_stride,
                       int64_t o_stride, int64_t block_stride, int64_t token_stride, float scale,
                       int64_t window, const float* sinks) {
  constexpr bool quantized = !std::is_same_v<T, C>;
  constexpr int64_t kSplit = 2;
  const int64_t G = num_heads / num_kv_heads, D = head_dim, BS = block_size;
  const int64_t width = (D + 15) / 16 * 16;  // a head's accumulators (and queries)
  const int64_t scale_token_stride = token_stride / D;
  // a task's state: acc [G, width], m [G], l [G], a cache line apart from the next
  const int64_t state_floats = (G * width + 2 * G + 15) / 16 * 16;
  const int64_t tasks = rows * num_kv_heads * kSplit;
  std::unique_ptr<float[]> buffer(new float[tasks * state_floats + 16]);
  float* const states = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.get()) + 63) / 64 * 64);  // 64-byte aligned
  const int64_t row_lines = (D * static_cast<int64_t>(sizeof(C)) + 63) / 64;  // a head's K row
#pragma omp parallel
  {
    std::vector<float> qv(G * width), sc(G * 16), pp(G * 16), corr(G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t part = task % kSplit, h = task / kSplit % num_kv_heads;
      const int64_t r = task / kSplit / num_kv_heads;
      float* acc = states + task * state_floats;
      float* m = acc + G * width;
      float* l = m + G;
      const int64_t tok = tokens[r], len = seq_lens[r];
      for (int64_t g = 0; g < G; ++g) {  // the queries, zeros past D
        const T* qr = q + tok * q_stride + (h * G + g) * D;
        for (int64_t i = 0; i < width; ++i) qv[g * width + i] = i < D ? load(qr[i]) : 0.0f;
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
      }
      std::fill(acc, acc + G * width, 0.0f);
      int64_t lo, hi;  // this part's keys
      part_keys(len, window, BS, part, kSplit, lo, hi);
      for (int64_t pos = lo, nt = 0; pos < hi; pos += nt) {
        const int64_t b = pos / BS, j0 = pos % BS;
        const int64_t blk = block_tables[r * table_width + b];
        nt = std::min<int64_t>({16, hi - pos, BS - j0});
        if ((pos == lo || j0 == 0) && (b + 1) * BS < hi) {  // the next block's rows into L2
          const int64_t next = block_tables[r * table_width + b + 1];
          for (int64_t j = 0; j < BS; ++j) {
            const int64_t at = next * block_stride + j * token_stride + h * D;
            for (int64_t line = 0; line < row_lines; ++line) {
              __builtin_prefetch(reinterpret_cast<const char*>(k_cache + at) + 64 * line, 0, 2);
              __builtin_prefetch(reinterpret_cast<const char*>(v_cache + at) + 64 * line, 0, 2);
            }
          }
        }
        const int64_t off = blk * block_stride + j0 * token_stride + h * D;
        alignas(16) float kmul[16], vmul[16];  // what a token's score and weight are scaled by
        for (int64_t j = 0; j < 16; ++j) {
          kmul[j] = scale;
          vmul[j] = 1.0f;
        }
        if constexpr (quantized) {  // a token's scales multiply its score and its weight
          for (int64_t j = 0; j < nt; ++j) {
            kmul[j] = k_scale[off / D + j * scale_token_stride] * (scale * kUnit<C>);
            vmul[j] = v_scale[off / D + j * scale_token_stride] * kUnit<C>;
          }
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4)  // query heads 4 at a time
          heads4(std::min<int64_t>(4, G - g0), [&](auto gs) {
            qk16n<C, decltype(gs)::value>(&qv[g0 * width], width, k_cache + off, token_stride,
                                          nt, D, &sc[g0 * 16]);
          });
        softmax16n(G, nt, sc.data(), kmul, vmul, m, l, pp.data(), corr.data());
        for (int64_t g0 = 0; g0 < G; g0 += 4)
          heads4(std::min<int64_t>(4, G - g0), [&](auto gs) {
            pv16n<C, decltype(gs)::value>(acc + g0 * width, width, &corr[g0], &pp[g0 * 16],
                                          v_cache + off, token_stride, nt, D);
          });
      }
    }
    // each (row, KV head)'s parts merged (an empty part adds nothing), then written out
    std::vector<float> merged(width);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < rows * num_kv_heads; ++rh) {
      const int64_t r = rh / num_kv_heads, h = rh % num_kv_heads;
      const float* part_state[kSplit];
      for (int64_t part = 0; part < kSplit; ++part)
        part_state[part] = states + (rh * kSplit + part) * state_floats;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -FLT_MAX;
        for (const float* st : part_state) mx = std::max(mx, st[G * width + g]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float sum = 0.0f;
        for (const float* st : part_state) {
          const float l = st[G * width + G + g];
          if (l == 0.0f) continue;
          const float f = exp_nonpositive(st[G * width + g] - mx);
          for (int64_t i = 0; i < width; ++i) merged[i] += st[g * width + i] * f;
          sum += l * f;
        }
        sum += sink_weight(sinks, h * G + g, mx);
        T* orow = out + tokens[r] * o_stride + (h * G + g) * D;
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) store(orow + d, merged[d] * inv);
      }
    }
  }
}
#endif  // NEON

// The decode rows' new tokens (their K and V from this step's projections, not yet in the pool),
// each written into its row's last slot (position len - 1) before any row reads: a row may read
// another's new token (a request admitted with a prefix-cache hit on a block that a row of the
// same step fills). Token tok's K row is at k + tok * k_stride, its KV heads one after the other
// (head_dim each); V's likewise. One pass on the kernel's threads, in place of two index_copy_
// calls and their dispatch (docs/architecture.md).
template <typename T>
void store_rows(const T* k_new, const T* v_new, int64_t k_stride, int64_t v_stride, T* k_cache,
                T* v_cache, const int32_t* tokens, const int32_t* tables, const int32_t* lens,
                int64_t rows, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int64_t table_width, int64_t block_stride, int64_t token_stride) {
  const size_t bytes = static_cast<size_t>(num_kv_heads * head_dim) * sizeof(T);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = lens[r] - 1, tok = tokens[r];
    const int64_t at =
        tables[r * table_width + pos / block_size] * block_stride + pos % block_size * token_stride;
    std::memcpy(k_cache + at, k_new + tok * k_stride, bytes);
    std::memcpy(v_cache + at, v_new + tok * v_stride, bytes);
  }
}

}  // namespace

#if defined(FOUDRE_AVX512)
#define FOUDRE_KERNEL(OPS, T, C) paged_decode_avx512<OPS, C>
#if defined(FOUDRE_BF16_DOT)
#define FOUDRE_BF16_OPS Bf16DotOps
#else
#define FOUDRE_BF16_OPS FmaOps<uint16_t>
#endif
#elif defined(FOUDRE_AVX2)
#define FOUDRE_KERNEL(OPS, T, C) paged_decode_avx2<T, C>
#define FOUDRE_BF16_OPS void
#elif defined(FOUDRE_NEON)
#define FOUDRE_KERNEL(OPS, T, C) paged_decode_neon<T, C>
#define FOUDRE_BF16_OPS void
#else
#define FOUDRE_KERNEL(OPS, T, C) paged_decode<T, C>
#define FOUDRE_BF16_OPS void
#endif

// NAME: every key of a row (the signature cpu_ops.cpp's decoder layers call); NAME_window: a
// sliding window, where a row of seq_len tokens sees its last `window` keys (0: all of them),
// and attention sinks: `sinks` (null: none) holds each query head's sink logit, which joins its
// softmax denominator as a key of value zero (gpt-oss); NAME_store: first writes each row's new
// token's K / V (k_new / v_new, tokens k_new_stride / v_new_stride elements apart; null: none)
// into its last slot (store_rows).
#define FOUDRE_PAGED_DECODE(NAME, OPS, T)                                                       \
  extern "C" void NAME##_window(                                                                \
      const void* q, const void* k, const void* v, void* out, const int32_t* tokens,            \
      const int32_t* tables, const int32_t* lens, int64_t rows, int64_t num_heads,              \
      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_width,          \
      int64_t q_stride, int64_t o_stride, int64_t block_stride, int64_t token_stride,           \
      float scale, int64_t window, const float* sinks) {                                        \
    FOUDRE_KERNEL(OPS, T, T)                                                                    \
    (static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), nullptr,     \
     nullptr, static_cast<T*>(out), tokens, tables, lens, rows, num_heads, num_kv_heads,        \
     head_dim, block_size, table_width, q_stride, o_stride, block_stride, token_stride, scale,  \
     window, sinks);                                                                            \
  }                                                                                             \
  extern "C" void NAME(const void* q, const void* k, const void* v, void* out,                  \
                       const int32_t* tokens, const int32_t* tables, const int32_t* lens,       \
                       int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, \
                       int64_t block_size, int64_t table_width, int64_t q_stride,               \
                       int64_t o_stride, int64_t block_stride, int64_t token_stride,            \
                       float scale) {                                                           \
    NAME##_window(q, k, v, out, tokens, tables, lens, rows, num_heads, num_kv_heads, head_dim,  \
                  block_size, table_width, q_stride, o_stride, block_stride, token_stride,      \
                  scale, 0, nullptr);                                                           \
  }                                                                                             \
  extern "C" void NAME##_store(                                                                 \
      const void* q, void* k, void* v, void* out, const int32_t* tokens, const int32_t* tables, \
      const int32_t* lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,               \
      int64_t head_dim, int64_t block_size, int64_t table_width, int64_t q_stride,              \
      int64_t o_stride, int64_t block_stride, int64_t token_stride, float scale, int64_t window, \
      const float* sinks, const void* k_new, const void* v_new, int64_t k_new_stride,           \
      int64_t v_new_stride) {                                                                   \
    if (k_new != nullptr)                                                                       \
      store_rows(static_cast<const T*>(k_new), static_cast<const T*>(v_new), k_new_stride,      \
                 v_new_stride, static_cast<T*>(k), static_cast<T*>(v), tokens, tables, lens,    \
                 rows, num_kv_heads, head_dim, block_size, table_width, block_stride,           \
                 token_stride);                                                                 \
    NAME##_window(q, k, v, out, tokens, tables, lens, rows, num_heads, num_kv_heads, head_dim,  \
                  block_size, table_width, q_stride, o_stride, block_stride, token_stride,      \
                  scale, window, sinks);                                                        \
  }

FOUDRE_PAGED_DECODE(paged_decode_f32, FmaOps<float>, float)
FOUDRE_PAGED_DECODE(paged_decode_bf16, FOUDRE_BF16_OPS, uint16_t)
FOUDRE_PAGED_DECODE(paged_decode_f16, FmaOps<Half>, Half)

// A quantized cache: k / v hold the codes (C: int8_t or Fp8), k_scale / v_scale their scales,
// laid out as the codes without head_dim; queries and outputs of type T. The window as above
// (cpu_ops.cpp's decoder layers pass 0); NAME_sinks also takes the sinks, as NAME_window.
#define FOUDRE_PAGED_DECODE_CODES(NAME, OPS, T, C)                                              \
  extern "C" void NAME##_sinks(                                                                 \
      const void* q, const void* k, const void* v, const float* k_scale, const float* v_scale,  \
      void* out, const int32_t* tokens, const int32_t* tables, const int32_t* lens,             \
      int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                  \
      int64_t block_size, int64_t table_width, int64_t q_stride, int64_t o_stride,              \
      int64_t block_stride, int64_t token_stride, float scale, int64_t window,                  \
      const float* sinks) {                                                                     \
    FOUDRE_KERNEL(OPS, T, C)                                                                    \
    (static_cast<const T*>(q), static_cast<const C*>(k), static_cast<const C*>(v), k_scale,     \
     v_scale, static_cast<T*>(out), tokens, tables, lens, rows, num_heads, num_kv_heads,        \
     head_dim, block_size, table_width, q_stride, o_stride, block_stride, token_stride, scale,  \
     window, sinks);                                                                            \
  }                                                                                             \
  extern "C" void NAME(const void* q, const void* k, const void* v, const float* k_scale,       \
                       const float* v_scale, void* out, const int32_t* tokens,                  \
                       const int32_t* tables, const int32_t* lens, int64_t rows,                \
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,               \
                       int64_t block_size, int64_t table_width, int64_t q_stride,               \
                       int64_t o_stride, int64_t block_stride, int64_t token_stride,            \
                       float scale, int64_t window) {                                           \
    NAME##_sinks(q, k, v, k_scale, v_scale, out, tokens, tables, lens, rows, num_heads,         \
                 num_kv_heads, head_dim, block_size, table_width, q_stride, o_stride,           \
                 block_stride, token_stride, scale, window, nullptr);                           \
  }

#if defined(FOUDRE_AVX512)
using F32CodesOps = FmaOps<float, float>;  // (aliases: a macro argument holds no comma)
using F16CodesOps = FmaOps<Half, float>;
#define FOUDRE_F32_CODES_OPS F32CodesOps
#define FOUDRE_F16_CODES_OPS F16CodesOps
#if defined(FOUDRE_BF16_DOT)
#define FOUDRE_BF16_CODES_OPS Bf16DotOps
#else
using Bf16CodesOps = FmaOps<uint16_t, float>;
#define FOUDRE_BF16_CODES_OPS Bf16CodesOps
#endif
#else
#define FOUDRE_F32_CODES_OPS void
#define FOUDRE_F16_CODES_OPS void
#define FOUDRE_BF16_CODES_OPS void
#endif

FOUDRE_PAGED_DECODE_CODES(paged_decode_f32_int8, FOUDRE_F32_CODES_OPS, float, int8_t)
FOUDRE_PAGED_DECODE_CODES(paged_decode_bf16_int8, FOUDRE_BF16_CODES_OPS, uint16_t, int8_t)
FOUDRE_PAGED_DECODE_CODES(paged_decode_f16_int8, FOUDRE_F16_CODES_OPS, Half, int8_t)
FOUDRE_PAGED_DECODE_CODES(paged_decode_f32_fp8, FOUDRE_F32_CODES_OPS, float, Fp8)
FOUDRE_PAGED_DECODE_CODES(paged_decode_bf16_fp8, FOUDRE_BF16_CODES_OPS, uint16_t, Fp8)
FOUDRE_PAGED_DECODE_CODES(paged_decode_f16_fp8, FOUDRE_F16_CODES_OPS, Half, Fp8)

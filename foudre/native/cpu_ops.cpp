// CPU ops for the model's layers, for float32 and bfloat16 rows.
//
// RMSNorm, SiLU(gate) * up and RoPE each replace a chain of torch ops (RMSNorm alone is eight,
// each a pass over memory and a dispatch) and round where that chain rounds: RoPE's results
// equal the torch path's bit for bit, RMSNorm's and SiLU's within a few float32 ulps before the
// last rounding (a sum in another order, a reciprocal instead of a division).
//
// The linear layer at decode-sized batches: at a few rows a matrix-vector product, bound by
// reading the weight. The kernel reads each weight row once for all the rows, on every core,
// and keeps the products in float32 (vdpbf16ps pairs for bfloat16 where the CPU has it) until
// one rounding at the end; its sums run in another order than torch's GEMMs. oneDNN's bfloat16
// path reads at 60-80% of its speed, MKL's float32 path at two to 64 rows at a quarter to a
// third.
//
// A prefill's bfloat16 GEMM on CPUs without bfloat16 arithmetic (gemm_bf16, the AVX2 build):
// the weight widened in registers where torch's path widens it in memory for MKL.
//
// The routed experts of a mixture-of-experts layer at decode sizes (moe_experts, moe_block):
// the (token, expert) pairs sorted by expert, each chosen expert's rows through the linear
// kernel, so only the chosen experts' weights are read; with the router and the routing too in
// moe_block, a sparse layer is one call.
//
// Built by foudre/native/build.py with -march=native; the ops exist where AVX-512 or AVX2 (with
// FMA) does (foudre_cpu_ops_available() says which), and foudre/layers/fused.py falls back to
// torch elsewhere. The AVX2 build (AMD Zen 2 and 3, Intel's client cores) runs the same ops on 8
// float32 lanes: its own elementwise ops and linear kernel (a bfloat16 weight step takes 16
// values in one load), the rest of the file shared.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FOUDRE_OPS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FOUDRE_OPS_AVX2 1
#endif

#if defined(FOUDRE_OPS_AVX512) || defined(FOUDRE_OPS_AVX2)
#include <immintrin.h>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(FOUDRE_OPS_AVX512)

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const uint16_t* p, __mmask16 m) {  // bfloat16: the high half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline void store(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline __m256i to_bf16(__m512 x) {  // round to nearest even, NaN to a quiet NaN: as torch does
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline void store(uint16_t* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, to_bf16(x));
}

// x rounded to T's precision (float32: unchanged), where the torch chain stores a T tensor
inline __m512 round_to(__m512 x, const float*) { return x; }
inline __m512 round_to(__m512 x, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

inline __m512 exp16(__m512 x) {  // e^x on [-87, 88] (clamped outside): 2^n e^f, |f| <= ln2/2
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), x's rows at x_stride elements; Offset (Gemma's
// norm, OffsetRMSNorm): out = T((1 + weight) * x * rsqrt(mean(x^2) + eps)), one rounding
template <bool Offset = false, typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t n, int64_t x_stride,
              float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = load(xr + i, lanes(n - i));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      const __m512 h = _mm512_mul_ps(load(xr + i, m), iv), w = load(weight + i, m);
      if constexpr (Offset)
        store(out + r * n + i, _mm512_mul_ps(h, _mm512_add_ps(_mm512_set1_ps(1.0f), w)), m);
      else
        store(out + r * n + i, _mm512_mul_ps(w, round_to(h, x)), m);
    }
  }
}

// x / (1 + e^-x), the division by a reciprocal estimate and one Newton step (within 2 ulp; a
// division costs 5x more here); where e^-x overflows float32, torch's x / inf is a signed zero:
// so is this
inline __m512 silu16(__m512 x) {
  const __m512 d =
      _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  return _mm512_mask_mul_ps(_mm512_mul_ps(x, inv),
                            _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.72f), _CMP_LT_OQ), x,
                            _mm512_setzero_ps());
}

// gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), as x / (1 + e^(-2u))
inline __m512 gelu16(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 u2 = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f),
                                  _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(u2)));
}

// out = T(act(gate)) * up over rows of [gate | up] (width 2 * n, at gu_stride elements)
template <typename T, typename Act>
void gated_mul(const T* gu, T* out, int64_t rows, int64_t n, int64_t gu_stride, Act act) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * gu_stride;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      store(out + r * n + i, _mm512_mul_ps(round_to(act(load(g + i, m)), g), load(g + n + i, m)),
            m);
    }
  }
}

// In place on heads rows of head_dim (tokens at token_stride elements, heads contiguous):
// x1, x2 = halves; x1' = x1 c - x2 s, x2' = x2 c + x1 s ("rotate half"), with c, s rounded to T
// and each product and sum rounded to T as torch's q * cos + rotate_half(q) * sin does.
template <typename T>
void rope(T* x, const float* cos, const float* sin, const int64_t* positions, int64_t tokens,
          int64_t heads, int64_t head_dim, int64_t token_stride, int64_t rot) {
  const int64_t half = rot / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* ct = cos + positions[t] * rot;
    const float* st = sin + positions[t] * rot;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = lanes(half - i);
      const __m512 c1 = round_to(load(ct + i, m), x), c2 = round_to(load(ct + half + i, m), x);
      const __m512 s1 = round_to(load(st + i, m), x), s2 = round_to(load(st + half + i, m), x);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x + t * token_stride + h * head_dim;
        const __m512 x1 = load(row + i, m), x2 = load(row + half + i, m);
        const __m512 a = round_to(_mm512_mul_ps(x1, c1), x);
        const __m512 b = round_to(_mm512_mul_ps(x2, s1), x);
        const __m512 c = round_to(_mm512_mul_ps(x2, c2), x);
        const __m512 d = round_to(_mm512_mul_ps(x1, s2), x);
        store(row + i, _mm512_sub_ps(a, b), m);
        store(row + half + i, _mm512_add_ps(c, d), m);
      }
    }
  }
}

// Dot products of weight rows with x rows: each step covers `step` elements of both; `V` holds
// them in the form the multiply-add takes.
template <typename T>
struct Dot;
template <>
struct Dot<float> {
  using V = __m512;
  static constexpr int64_t step = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(lanes(left), p); }
  static __m512 fma(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};
#if defined(__AVX512BF16__)
template <>
struct Dot<uint16_t> {  // pairs of bf16 products summed into float32 lanes (vdpbf16ps)
  using V = __m512bh;
  static constexpr int64_t step = 32;
  static V load(const uint16_t* p) { return reinterpret_cast<V>(_mm512_loadu_si512(p)); }
  static V load(const uint16_t* p, int64_t left) {
    const __mmask32 m = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1);
    return reinterpret_cast<V>(_mm512_maskz_loadu_epi16(m, p));
  }
  static __m512 fma(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#else
template <>
struct Dot<uint16_t> {  // bf16 widened to float32
  using V = __m512;
  static constexpr int64_t step = 16;
  static V load(const uint16_t* p) { return ::load(p, lanes(16)); }
  static V load(const uint16_t* p, int64_t left) { return ::load(p, lanes(left)); }
  static __m512 fma(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};
#endif

// y[m, n0 + r] = x[m] . w[n0 + r] (+ bias) for M rows of x and R weight rows from n0 (the last
// group re-reads row n - 1 for the rows past the end and stores only the rows that exist).
// Prefetch: fetch the next group's rows into L2 meanwhile. The hardware prefetcher alone streams
// these short rows (3-16 KiB) 10-15% below the bandwidth; a prefetch past the end is harmless.
template <typename T, int M, int R, bool Prefetch = false>
void linear_group(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t n,
                  int64_t k, int64_t n0) {
  using D = Dot<T>;
  const T* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(n0 + r, n - 1) * k;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + D::step <= k; i += D::step) {
    typename D::V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = D::load(x + m * x_stride + i);
    for (int r = 0; r < R; ++r) {
      if constexpr (Prefetch) {  // the same line of the next group's row, into L2
        const uintptr_t next = reinterpret_cast<uintptr_t>(wr[r] + i) + R * k * sizeof(T);
        _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      }
      const typename D::V wv = D::load(wr[r] + i);
      for (int m = 0; m < M; ++m) acc[m][r] = D::fma(acc[m][r], xv[m], wv);
    }
  }
  if (i < k) {
    typename D::V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = D::load(x + m * x_stride + i, k - i);
    for (int r = 0; r < R; ++r) {
      const typename D::V wv = D::load(wr[r] + i, k - i);
      for (int m = 0; m < M; ++m) acc[m][r] = D::fma(acc[m][r], xv[m], wv);
    }
  }
  const __mmask16 out = lanes(std::min<int64_t>(R, n - n0));
  const __m512 b = bias != nullptr ? load(bias + n0, out) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    alignas(64) float sums[16] = {};
    for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[m][r]);
    store(y + m * n + n0, _mm512_add_ps(_mm512_load_ps(sums), b), out);
  }
}

// x += y, rounded to T as torch's add of two T tensors rounds
template <typename T>
void add_(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store(x + i, _mm512_add_ps(load(x + i, m), load(y + i, m)), m);
  }
}

// acc += y * w (float32 sums of the experts' outputs), out = T(acc)
template <typename T>
void add_scaled(float* acc, const T* y, float w, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store(acc + i, _mm512_add_ps(load(acc + i, m), _mm512_mul_ps(load(y + i, m), wv)), m);
  }
}
template <typename T>
void store_rounded(T* out, const float* acc, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store(out + i, load(acc + i, m), m);
  }
}

// the weight rows of a task by the x rows it multiplies (1, 2, 3, 4 or more): as many as the
// accumulators (M * R) and the M x vectors leave of the 32 registers
constexpr int group_rows(int m) { return m == 1 ? 16 : (m == 2 ? 12 : (m == 3 ? 8 : 6)); }

#else  // AVX2 (AMD Zen 2 and 3, Intel's client cores): the same ops on 8 float32 lanes

inline __m256i lane_mask(int64_t n) {  // lanes 0 .. min(n, 8) - 1 set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load8(const float* p, int64_t n) {  // the first min(n, 8), the others zero
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
}
inline __m256 widen8(__m128i h) {  // bfloat16: the high half of a float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const uint16_t* p, int64_t n) {
  if (n >= 8) return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t part[8] = {};
  std::copy(p, p + n, part);
  return widen8(_mm_load_si128(reinterpret_cast<const __m128i*>(part)));
}
inline void store8(float* p, __m256 x, int64_t n) {
  if (n >= 8)
    _mm256_storeu_ps(p, x);
  else
    _mm256_maskstore_ps(p, lane_mask(n), x);
}
inline __m128i to_bf16(__m256 x) {  // round to nearest even, NaN to a quiet NaN: as torch does
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                         _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  // (16-bit values: the unsigned saturation keeps them; the packs work per 128-bit half)
  return _mm256_castsi256_si128(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0)));
}
inline void store8(uint16_t* p, __m256 x, int64_t n) {
  const __m128i h = to_bf16(x);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    alignas(16) uint16_t part[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(part), h);
    std::copy(part, part + n, p);
  }
}
// x rounded to T's precision (float32: unchanged), where the torch chain stores a T tensor
inline __m256 round_to(__m256 x, const float*) { return x; }
inline __m256 round_to(__m256 x, const uint16_t*) { return widen8(to_bf16(x)); }

inline float hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline __m256 exp8(__m256 x) {  // e^x on [-87, 88] (clamped outside): as exp16
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), f);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <bool Offset = false, typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t n, int64_t x_stride,
              float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = load8(xr + i, n - i);
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(hsum8(ss) / static_cast<float>(n) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 h = _mm256_mul_ps(load8(xr + i, n - i), iv), w = load8(weight + i, n - i);
      if constexpr (Offset)
        store8(out + r * n + i, _mm256_mul_ps(h, _mm256_add_ps(_mm256_set1_ps(1.0f), w)), n - i);
      else
        store8(out + r * n + i, _mm256_mul_ps(w, round_to(h, x)), n - i);
    }
  }
}

inline __m256 silu8(__m256 x) {  // as silu16 (a division: no rcp14 on AVX2)
  const __m256 d =
      _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
  return _mm256_blendv_ps(_mm256_div_ps(x, d), _mm256_mul_ps(x, _mm256_setzero_ps()),
                          _mm256_cmp_ps(x, _mm256_set1_ps(-88.72f), _CMP_LT_OQ));
}

inline __m256 gelu8(__m256 x) {  // as gelu16
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f),
                                  _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(u2)));
}

template <typename T, typename Act>
void gated_mul(const T* gu, T* out, int64_t rows, int64_t n, int64_t gu_stride, Act act) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * gu_stride;
    for (int64_t i = 0; i < n; i += 8)
      store8(out + r * n + i,
             _mm256_mul_ps(round_to(act(load8(g + i, n - i)), g), load8(g + n + i, n - i)), n - i);
  }
}

template <typename T>
void rope(T* x, const float* cos, const float* sin, const int64_t* positions, int64_t tokens,
          int64_t heads, int64_t head_dim, int64_t token_stride, int64_t rot) {
  const int64_t half = rot / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* ct = cos + positions[t] * rot;
    const float* st = sin + positions[t] * rot;
    for (int64_t i = 0; i < half; i += 8) {
      const int64_t m = half - i;
      const __m256 c1 = round_to(load8(ct + i, m), x), c2 = round_to(load8(ct + half + i, m), x);
      const __m256 s1 = round_to(load8(st + i, m), x), s2 = round_to(load8(st + half + i, m), x);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x + t * token_stride + h * head_dim;
        const __m256 x1 = load8(row + i, m), x2 = load8(row + half + i, m);
        const __m256 a = round_to(_mm256_mul_ps(x1, c1), x);
        const __m256 b = round_to(_mm256_mul_ps(x2, s1), x);
        const __m256 c = round_to(_mm256_mul_ps(x2, c2), x);
        const __m256 d = round_to(_mm256_mul_ps(x1, s2), x);
        store8(row + i, _mm256_sub_ps(a, b), m);
        store8(row + half + i, _mm256_add_ps(c, d), m);
      }
    }
  }
}

// Dot products of weight rows with x rows, a step of `step` columns: float32 8; bfloat16 16, one
// load of each and their even columns widened by a shift, their odd ones by a mask (2
// instructions for 16, where widening 8 at a time took 2 for 8)
template <typename T>
struct Dot;
template <>
struct Dot<float> {
  static constexpr int64_t step = 8;
  struct X {
    __m256 v;
  };
  static X load_x(const float* p) { return {_mm256_loadu_ps(p)}; }
  static void fma(__m256& acc, const X& x, const float* w) {
    acc = _mm256_fmadd_ps(x.v, _mm256_loadu_ps(w), acc);
  }
};
template <>
struct Dot<uint16_t> {
  static constexpr int64_t step = 16;
  struct X {
    __m256 even, odd;
  };
  static __m256 even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static __m256 odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(~0xFFFF)));
  }
  static X load_x(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {even(v), odd(v)};
  }
  static void fma(__m256& acc, const X& x, const uint16_t* w) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    acc = _mm256_fmadd_ps(x.even, even(v), acc);
    acc = _mm256_fmadd_ps(x.odd, odd(v), acc);
  }
};

// y[m, n0 + r] = x[m] . w[n0 + r] (+ bias) for M rows of x and R weight rows from n0 (the last
// group re-reads row n - 1 for the rows past the end and stores only the rows that exist); the
// columns past the last whole step in plain loops. Prefetch: as the AVX-512 kernel's.
template <typename T, int M, int R, bool Prefetch = false>
void linear_group(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t n,
                  int64_t k, int64_t n0) {
  using D = Dot<T>;
  const T* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(n0 + r, n - 1) * k;
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t whole = k / D::step * D::step;
  for (int64_t i = 0; i < whole; i += D::step) {
    typename D::X xv[M];
    for (int m = 0; m < M; ++m) xv[m] = D::load_x(x + m * x_stride + i);
    for (int r = 0; r < R; ++r) {
      if constexpr (Prefetch) {  // the same line of the next group's row, into L2
        if ((i * static_cast<int64_t>(sizeof(T))) % 64 == 0) {
          const uintptr_t next = reinterpret_cast<uintptr_t>(wr[r] + i) + R * k * sizeof(T);
          _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
        }
      }
      for (int m = 0; m < M; ++m) D::fma(acc[m][r], xv[m], wr[r] + i);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R && n0 + r < n; ++r) {
      float sum = hsum8(acc[m][r]);
      for (int64_t i = whole; i < k; ++i)
        sum += to_float(x[m * x_stride + i]) * to_float(wr[r][i]);
      const float out = bias != nullptr ? sum + to_float(bias[n0 + r]) : sum;
      store8(y + m * n + n0 + r, _mm256_set1_ps(out), 1);
    }
}

// the weight rows of a task by the x rows it multiplies (1, 2, 3, 4 or more): as many as the
// accumulators and x's vectors leave of the 16 registers
constexpr int group_rows(int m) { return m == 1 ? 8 : (m == 2 ? 4 : 2); }

template <typename T>
void add_(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    store8(x + i, _mm256_add_ps(load8(x + i, n - i), load8(y + i, n - i)), n - i);
}

// acc += y * w (float32 sums of the experts' outputs), out = T(acc)
template <typename T>
void add_scaled(float* acc, const T* y, float w, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t i = 0; i < n; i += 8)
    store8(acc + i, _mm256_add_ps(load8(acc + i, n - i), _mm256_mul_ps(load8(y + i, n - i), wv)),
           n - i);
}
template <typename T>
void store_rounded(T* out, const float* acc, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(out + i, load8(acc + i, n - i), n - i);
}

// The bfloat16 GEMM of a prefill on a CPU without bfloat16 arithmetic (AVX2: AMD Zen 2 and 3,
// Intel's client cores), y [rows, n] = x [rows, k] @ w [n, k]^T (+ bias), bfloat16 in and out,
// float32 products and sums, one rounding. torch's path there (linear.py's _chunked) widens each
// chunk of the weight to float32 in memory and MKL copies it again into its packed panels: the
// two took a quarter of a 128-token prefill. Here the weight is read as it lies and widened in
// registers (16 values a load: even columns by a shift, odd ones by a mask, as Dot<uint16_t>),
// x widened once into float32 rows whose 16-column steps hold the even columns then the odd
// ones, so each of x's vectors meets the weight's half of the same columns. Tiles of 3 x rows by
// 3 weight rows: 9 accumulators, 3 of x's vectors and one of the weight in 16 registers, 18 FMAs
// a step against 12 loads (the compiler, left alone, read x from memory in each FMA: 24 loads, at
// 0.7x the speed). Tasks of kGemmBlock weight rows (144 KiB of a row of 1536 in L2), each over
// every tile of 3 x rows (their 18 KiB staying in L1 along the block). One thread, weights in
// the caches: 82 GFLOP/s where MKL's sgemm ran 85; the projections of a 494.7M Llama at 128 rows,
// two threads, in turns: 1.1-1.6x torch's path, at 1024 rows 0.9-1.05x; its whole prefill 1.32x
// at 128 tokens, 1.08x at 256, 0.97x at 512 (linear.GEMM_ROWS).
constexpr int64_t kGemmBlock = 48;

template <int MT, int NT>
[[gnu::always_inline]] inline void gemm_tile(const float* xw, int64_t xw_stride,
                                             const uint16_t* w, int64_t k, int64_t whole,
                                             float* out, int64_t out_stride) {
  __m256 acc[MT][NT];
  for (auto& row : acc)
    for (auto& v : row) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 16) {
    for (int half = 0; half < 2; ++half) {
      __m256 xv[MT];
      for (int m = 0; m < MT; ++m) {
        xv[m] = _mm256_loadu_ps(xw + m * xw_stride + i + 8 * half);
        asm("" : "+x"(xv[m]));  // in a register, read once for the NT weight rows
      }
      for (int r = 0; r < NT; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + i));
        const __m256 wv = half == 0 ? Dot<uint16_t>::even(v) : Dot<uint16_t>::odd(v);
        for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_fmadd_ps(xv[m], wv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NT; ++r) out[m * out_stride + r] = hsum8(acc[m][r]);
}

// the tiles of x rows [m0, m0 + MT) with the weight rows [n0, n1) into out [MT, n1 - n0]: 3 or
// 4 weight rows a tile (as the registers allow), then one at a time
template <int MT>
void gemm_rows(const float* xw, int64_t xw_stride, const uint16_t* w, int64_t k, int64_t whole,
               int64_t n0, int64_t n1, float* out, int64_t out_stride) {
  constexpr int NT = MT == 3 ? 3 : 4;
  int64_t n = n0;
  for (; n + NT <= n1; n += NT)
    gemm_tile<MT, NT>(xw, xw_stride, w + n * k, k, whole, out + (n - n0), out_stride);
  for (; n < n1; ++n)
    gemm_tile<MT, 1>(xw, xw_stride, w + n * k, k, whole, out + (n - n0), out_stride);
}

// 0, or -2 where x's float32 copy could not be allocated
int gemm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, const uint16_t* bias,
              uint16_t* y, int64_t rows, int64_t n, int64_t k) {
  const int64_t whole = k / 16 * 16;  // the columns past it in plain loops
  // x widened, each 16-column step's even columns then its odd ones (kept for the next call:
  // the largest x a calling thread has passed, up to GEMM_ROWS x the widest k: 14 MiB at 256 x
  // 14336)
  thread_local std::vector<float> widened;
  try {
    widened.resize(static_cast<size_t>(rows * whole));
  } catch (const std::bad_alloc&) {
    return -2;
  }
  float* xw = widened.data();
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < whole; i += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * x_stride + i));
      _mm256_storeu_ps(xw + m * whole + i, Dot<uint16_t>::even(v));
      _mm256_storeu_ps(xw + m * whole + i + 8, Dot<uint16_t>::odd(v));
    }
  const int64_t blocks = (n + kGemmBlock - 1) / kGemmBlock;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * kGemmBlock, n1 = std::min(n, n0 + kGemmBlock), width = n1 - n0;
    float out[3][kGemmBlock];
    for (int64_t m0 = 0; m0 < rows; m0 += 3) {
      const int64_t mt = std::min<int64_t>(3, rows - m0);
      const float* xm = xw + m0 * whole;
      if (mt == 3)
        gemm_rows<3>(xm, whole, w, k, whole, n0, n1, out[0], kGemmBlock);
      else if (mt == 2)
        gemm_rows<2>(xm, whole, w, k, whole, n0, n1, out[0], kGemmBlock);
      else
        gemm_rows<1>(xm, whole, w, k, whole, n0, n1, out[0], kGemmBlock);
      for (int64_t m = 0; m < mt; ++m) {
        const uint16_t* xr = x + (m0 + m) * x_stride;
        for (int64_t j = 0; j < width; ++j) {
          const uint16_t* wr = w + (n0 + j) * k;
          float sum = out[m][j];
          for (int64_t i = whole; i < k; ++i) sum += to_float(xr[i]) * to_float(wr[i]);
          out[m][j] = bias != nullptr ? sum + to_float(bias[n0 + j]) : sum;
        }
        store_rounded(y + (m0 + m) * n + n0, out[m], width);
      }
    }
  }
  return 0;
}
#define FOUDRE_GEMM_BF16 1

#endif  // AVX-512 / AVX2

// out = T(silu(gate)) * up and T(gelu_tanh(gate)) * up over rows of [gate | up] (SwiGLU, GeGLU)
#if defined(FOUDRE_OPS_AVX512)
#define FOUDRE_ACT(NAME) NAME##16
#else
#define FOUDRE_ACT(NAME) NAME##8
#endif
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t n, int64_t gu_stride) {
  gated_mul(gu, out, rows, n, gu_stride, [](auto x) { return FOUDRE_ACT(silu)(x); });
}
template <typename T>
void gelu_mul(const T* gu, T* out, int64_t rows, int64_t n, int64_t gu_stride) {
  gated_mul(gu, out, rows, n, gu_stride, [](auto x) { return FOUDRE_ACT(gelu)(x); });
}
#undef FOUDRE_ACT

// Each task takes R weight rows at a time and multiplies them with the x rows: one pass for one
// to three rows (M = rows), else four x rows at a time (M = 4), the weight rows coming from
// memory once and then from L1/L2 for the next four. The tasks are handed out guided, as
// native/cpu_qmatmul.cpp's (where it says why): a bf16 494.7M Llama's batch-1 decode layers took
// 0.965x the time of equal static shares, interleaved.
template <typename T, int M, int R>
void linear_groups(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t rows,
                   int64_t n, int64_t k) {
#pragma omp parallel for schedule(guided)
  for (int64_t n0 = 0; n0 < n; n0 += R) {
    if constexpr (M < 4) {
      linear_group<T, M, R, true>(x, x_stride, w, bias, y, n, k, n0);
    } else {
      for (int64_t m = 0; m < rows; m += 4) {
        const T* xm = x + m * x_stride;
        T* ym = y + m * n;
        switch (std::min<int64_t>(rows - m, 4)) {
          case 1: linear_group<T, 1, R>(xm, x_stride, w, bias, ym, n, k, n0); break;
          case 2: linear_group<T, 2, R>(xm, x_stride, w, bias, ym, n, k, n0); break;
          case 3: linear_group<T, 3, R>(xm, x_stride, w, bias, ym, n, k, n0); break;
          default: linear_group<T, 4, R>(xm, x_stride, w, bias, ym, n, k, n0); break;
        }
      }
    }
  }
}

// y [rows, n] = x [rows, k] @ w [n, k]^T (+ bias [n]). R weight rows per task: group_rows.
template <typename T>
void linear(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t rows,
            int64_t n, int64_t k) {
  switch (rows) {
    case 1: linear_groups<T, 1, group_rows(1)>(x, x_stride, w, bias, y, rows, n, k); break;
    case 2: linear_groups<T, 2, group_rows(2)>(x, x_stride, w, bias, y, rows, n, k); break;
    case 3: linear_groups<T, 3, group_rows(3)>(x, x_stride, w, bias, y, rows, n, k); break;
    default: linear_groups<T, 4, group_rows(4)>(x, x_stride, w, bias, y, rows, n, k); break;
  }
}


// y [rows, n] = x [rows, k] @ w[n0 : n0 + R]^T for one group of R weight rows, four x rows at a
// time (then the one to three left): one task of the experts' products below.
template <typename T, int R>
void rows_group(const T* x, int64_t x_stride, const T* w, T* y, int64_t rows, int64_t n,
                int64_t k, int64_t n0) {
  for (int64_t m = 0; m < rows; m += 4) {
    const T* xm = x + m * x_stride;
    T* ym = y + m * n;
    switch (std::min<int64_t>(rows - m, 4)) {
      case 1: linear_group<T, 1, R, true>(xm, x_stride, w, nullptr, ym, n, k, n0); break;
      case 2: linear_group<T, 2, R>(xm, x_stride, w, nullptr, ym, n, k, n0); break;
      case 3: linear_group<T, 3, R>(xm, x_stride, w, nullptr, ym, n, k, n0); break;
      default: linear_group<T, 4, R>(xm, x_stride, w, nullptr, ym, n, k, n0); break;
    }
  }
}

// For each expert e with rows [start[e], start[e + 1]) of x: y's rows = x's rows @ w_e^T, with
// w_e = w + e * n * k ([n, k]). Every (expert, group of weight rows) pair is one task of one
// parallel loop, so the chosen experts' weights stream on every core at once.
template <typename T>
void experts_linear(const T* x, const T* w, T* y, const std::vector<int64_t>& start, int64_t n,
                    int64_t k) {
  struct Task {
    int64_t expert, n0;
    int m;  // the expert's rows, up to 4: its tasks' weight rows are group_rows(m)
  };
  std::vector<Task> tasks;
  const int64_t experts = static_cast<int64_t>(start.size()) - 1;
  constexpr int kRows[5] = {0, group_rows(1), group_rows(2), group_rows(3), group_rows(4)};
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    const int m = static_cast<int>(std::min<int64_t>(rows, 4));
    for (int64_t n0 = 0; n0 < n; n0 += kRows[m]) tasks.push_back({e, n0, m});
  }
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task t = tasks[i];
    const int64_t s = start[t.expert], rows = start[t.expert + 1] - s;
    const T* we = w + t.expert * n * k;
    switch (t.m) {
      case 1: rows_group<T, kRows[1]>(x + s * k, k, we, y + s * n, rows, n, k, t.n0); break;
      case 2: rows_group<T, kRows[2]>(x + s * k, k, we, y + s * n, rows, n, k, t.n0); break;
      case 3: rows_group<T, kRows[3]>(x + s * k, k, we, y + s * n, rows, n, k, t.n0); break;
      default: rows_group<T, kRows[4]>(x + s * k, k, we, y + s * n, rows, n, k, t.n0); break;
    }
  }
}

// The routed experts of a mixture-of-experts layer, for a decode-sized batch: row t of x goes to
// the experts ids[t, 0..top_k) with the float32 weights weights[t, ...], and
//   out[t] = sum_j weights[t, j] * down_e(T(silu(gate_e(x_t))) * up_e(x_t)),  e = ids[t, j],
// with gate_up [experts, 2 * inter, hidden] (gate rows, then up rows) and down [experts, hidden,
// inter]. Only the chosen experts' weights are read. The rows are sorted by expert (stable), each
// expert's rows go through the linear kernel above and silu_mul, and each product y * w is added
// to a float32 sum in increasing expert order, then rounded once: the bits of layers/moe.py's
// grouped path over the same kernels. Returns 1, before writing anything, for an id outside
// 0..experts. by_expert is that walk around any experts' products: run(xs, gu, act, ys, start)
// fills ys from xs, the rows sorted by expert (expert e's from start[e] to start[e + 1]), with
// gu and act its scratch ([n, 2 * inter], [n, inter]).
template <typename T, typename Experts>
void by_expert(const T* x, int64_t rows, int64_t hidden, int64_t inter, const int64_t* ids,
               const float* weights, int64_t top_k, int64_t experts, T* out, Experts run) {
  const int64_t n = rows * top_k;
  std::vector<int64_t> start(experts + 1, 0), order(n);
  for (int64_t j = 0; j < n; ++j) ++start[ids[j] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t j = 0; j < n; ++j) order[next[ids[j]]++] = j;
  std::vector<T> xs(n * hidden), gu(n * 2 * inter), act(n * inter), ys(n * hidden);
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + order[i] / top_k * hidden;
    std::copy(row, row + hidden, xs.data() + i * hidden);
  }
  run(xs.data(), gu.data(), act.data(), ys.data(), start);
  std::vector<float> sum(rows * hidden, 0.0f);
  for (int64_t i = 0; i < n; ++i)  // in expert order: each row's terms add up as torch's do
    add_scaled(sum.data() + order[i] / top_k * hidden, ys.data() + i * hidden,
               weights[order[i]], hidden);
  for (int64_t r = 0; r < rows; ++r)
    store_rounded(out + r * hidden, sum.data() + r * hidden, hidden);
}

template <typename T>
int moe_experts(const T* x, int64_t rows, int64_t hidden, int64_t inter, const int64_t* ids,
                const float* weights, int64_t top_k, const T* gate_up, const T* down,
                int64_t experts, T* out) {
  for (int64_t j = 0; j < rows * top_k; ++j)
    if (ids[j] < 0 || ids[j] >= experts) return 1;
  by_expert(x, rows, hidden, inter, ids, weights, top_k, experts, out,
            [&](const T* xs, T* gu, T* act, T* ys, const std::vector<int64_t>& start) {
              experts_linear(xs, gate_up, gu, start, 2 * inter, hidden);
              silu_mul(gu, act, rows * top_k, inter, 2 * inter);
              experts_linear(act, down, ys, start, hidden, inter);
            });
  return 0;
}

// A router's choice for each of `rows` rows of `experts` logits: the softmax (float32) over the
// row, its top_k experts (highest probability first; the lower index first among equals) and
// their probabilities, renormalised to sum to 1 when `renormalize`. What layers/moe.py's route()
// computes with torch ops, within float32 rounding (exp and the sum run in another order).
template <typename T>
void route(const T* logits, int64_t rows, int64_t experts, int64_t top_k, bool renormalize,
           int64_t* ids, float* weights) {
  std::vector<float> p(experts);
  std::vector<char> taken(experts);
  for (int64_t r = 0; r < rows; ++r) {
    const T* l = logits + r * experts;
    float m = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) m = std::max(m, to_float(l[e]));
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = std::exp(to_float(l[e]) - m);
      sum += p[e];
    }
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    int64_t* id = ids + r * top_k;
    float* w = weights + r * top_k;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      id[j] = best;
      w[j] = p[best];
    }
    if (renormalize) {
      float total = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) total += w[j];
      for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
    }
  }
}

// A whole mixture-of-experts block at decode sizes, in one call: the router's logits (the linear
// kernel, rounded to T as the router's Linear rounds them), route(), one count per chosen expert
// of the first `counted` rows (the others pad the batch) added to counts[experts], then
// moe_experts(). The bits of layers/moe.py's path through the same kernels.
template <typename T>
int moe_block(const T* x, int64_t rows, int64_t hidden, int64_t inter, const T* router,
              int64_t experts, int64_t top_k, bool renormalize, const T* gate_up, const T* down,
              int64_t* counts, int64_t counted, T* out) {
  std::vector<T> logits(rows * experts);
  linear(x, hidden, router, static_cast<const T*>(nullptr), logits.data(), rows, experts, hidden);
  std::vector<int64_t> ids(rows * top_k);
  std::vector<float> weights(rows * top_k);
  route(logits.data(), rows, experts, top_k, renormalize, ids.data(), weights.data());
  for (int64_t j = 0; j < std::min(counted, rows) * top_k; ++j) ++counts[ids[j]];
  return moe_experts(x, rows, hidden, inter, ids.data(), weights.data(), top_k, gate_up, down,
                     experts, out);
}

// The paged-attention decode kernel (native/cpu_paged_decode.cpp), passed by address
using PagedDecode = void (*)(const void* q, const void* k, const void* v, void* out,
                             const int32_t* tokens, const int32_t* tables, const int32_t* lens,
                             int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t table_width,
                             int64_t q_stride, int64_t o_stride, int64_t block_stride,
                             int64_t token_stride, float scale);

// The decode kernel over a quantized cache: codes k / v, their scales (the same file's
// FOUDRE_PAGED_DECODE_CODES), and a sliding window (0 here)
using PagedDecodeCodes = void (*)(const void* q, const void* k, const void* v,
                                  const float* k_scale, const float* v_scale, void* out,
                                  const int32_t* tokens, const int32_t* tables,
                                  const int32_t* lens, int64_t rows, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  int64_t table_width, int64_t q_stride, int64_t o_stride,
                                  int64_t block_stride, int64_t token_stride, float scale,
                                  int64_t window);

// A quantized projection (native/cpu_qmatmul.cpp's foudre_qmm_f32 / _bf16, passed by address in
// its descriptor): kind, x, codes, scales, zero points, scale type, groups, group, the scales'
// row stride, y, m, n, k
using QuantMatmul = void (*)(int kind, const void* x, const void* q, const void* s, const void* z,
                             float zc, int st, int64_t groups, int64_t group, int64_t s_stride,
                             void* y, int64_t m, int64_t n, int64_t k);
// kQmmZeroConst: the one zero point (float32 bits) where kQmmZeros is 0
enum QuantSlot { kQmmFn, kQmmKind, kQmmCodes, kQmmScales, kQmmZeros, kQmmScaleType, kQmmGroups,
                 kQmmGroup, kQmmBias, kQmmColumns, kQmmZeroConst, kQmmScaleStride, kQmmSlots };

// a float32 stored as its bits among int64 entries (a table's multipliers, a zero point)
inline float float_bits(int64_t bits) {
  const auto b = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// y [rows, n] = x [rows, k] @ W^T (+ bias): W float (w, bias) unless `quant` describes a
// QuantLinear (QuantSlot entries), whose bias is added after its result's rounding, as
// QuantLinear.forward adds it; x padded with zero columns to the kernel's kQmmColumns if wider
template <typename T>
void project(const int64_t* quant, const T* x, const T* w, const T* bias, T* y, int64_t rows,
             int64_t n, int64_t k) {
  if (quant == nullptr) {
    linear(x, k, w, bias, y, rows, n, k);
    return;
  }
  const auto vp = [quant](QuantSlot i) { return reinterpret_cast<const void*>(quant[i]); };
  const int64_t kp = quant[kQmmColumns];
  std::vector<T> padded;
  if (kp != k) {
    padded.assign(rows * kp, T{});
    for (int64_t r = 0; r < rows; ++r) std::copy(x + r * k, x + (r + 1) * k, &padded[r * kp]);
    x = padded.data();
  }
  reinterpret_cast<QuantMatmul>(quant[kQmmFn])(
      static_cast<int>(quant[kQmmKind]), x, vp(kQmmCodes), vp(kQmmScales), vp(kQmmZeros),
      float_bits(quant[kQmmZeroConst]),
      static_cast<int>(quant[kQmmScaleType]), quant[kQmmGroups], quant[kQmmGroup],
      quant[kQmmScaleStride], y, rows, n, kp);
  if (quant[kQmmBias] != 0)
    for (int64_t r = 0; r < rows; ++r) add_(y + r * n, static_cast<const T*>(vp(kQmmBias)), n);
}

// A layer's KV cache: float (the model's dtype), or int8 / float8 e4m3fn codes with scales
enum KVCodes { kFloatKV, kInt8KV, kFp8KV };

// x to float8 e4m3fn as torch converts (c10's fp8e4m3fn_from_fp32_value): nearest even, NaN
// from 480 up
inline uint8_t to_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t code;
  if (bits >= 1087u << 20) {
    code = 0x7F;
  } else if (bits < 121u << 23) {  // a subnormal e4m3: the float addition rounds it
    const uint32_t denorm = 141u << 23;
    float d;
    std::memcpy(&d, &denorm, 4);
    const float sum = std::fabs(f) + d;
    std::memcpy(&bits, &sum, 4);
    code = static_cast<uint8_t>(bits - denorm);
  } else {
    const uint32_t odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + odd;
    code = static_cast<uint8_t>(bits >> 20);
  }
  return code | static_cast<uint8_t>(sign >> 24);
}

// The K/V codes of attention/kv_quant.py's quantize_kv, bit for bit, for n heads of D values at x:
// per head s = max(max|x|, 1e-8) / qmax, codes x / s rounded to nearest even, as int8 clamped
// to +-127 (qmax 127) or as e4m3 (qmax 448); codes [n, D] bytes, scales [n]. Exported as
// foudre_quantize_kv_* for the tests that compare the two.
template <typename T>
void quantize_kv(const T* x, int64_t n, int64_t D, int64_t kind, uint8_t* codes, float* scales) {
  for (int64_t h = 0; h < n; ++h) {
    const T* row = x + h * D;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(row[d])));
    const float s = std::max(amax, 1e-8f) / (kind == kInt8KV ? 127.0f : 448.0f);
    scales[h] = s;
    for (int64_t d = 0; d < D; ++d) {
      const float y = to_float(row[d]) / s;
      if (kind == kInt8KV) {
        const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(y)));
        codes[h * D + d] = static_cast<uint8_t>(static_cast<int8_t>(r));
      } else {
        codes[h * D + d] = to_e4m3(y);
      }
    }
  }
}

// A Mamba-2 mixer's decode token per row on its state pools (native/cpu_ssm.cpp's
// foudre_mamba_step_f32 / _bf16, passed by address): `layer` its descriptor (pools and small
// parameters), each row's state slot, the (source, destination) slot pairs to copy after it,
// in_proj's output -> y [rows, heads * head_dim]
using MambaStep = void (*)(const int64_t* layer, const int64_t* slots, int64_t rows,
                           const int64_t* copies, int64_t num_copies, const void* proj,
                           int64_t proj_stride, void* y);

// y = T(y * s): a family's multiplier on a sublayer's output or on the embedding rows, as
// torch multiplies a tensor by a scalar (in float32, one rounding)
template <typename T>
void scale_(T* y, float s, int64_t n) {
  float buf[256];
  for (int64_t i = 0; i < n; i += 256) {
    const int64_t m = std::min<int64_t>(256, n - i);
    for (int64_t j = 0; j < m; ++j) buf[j] = to_float(y[i + j]) * s;
    store_rounded(y + i, buf, m);
  }
}

// Per layer, the addresses decode_layers reads (0 where a layer has none), then a sparse layer's
// integers: a layer with a router (kRouter) runs moe_block, counting into its int64
// counts[kExperts], and then its shared expert where it has one (at kGateUp, kDown); a layer
// without a norm at kPostNorm has no MLP. A quantized KV cache: its codes at kKCache /
// kVCache, their scales at kKScales / kVScales, kKVCodes its KVCodes (kFloatKV: a float cache).
// A quantized projection: the address of its QuantSlot descriptor at kQKVQuant .. kDownQuant
// (0: the float weight at kQKV .. kDown).
// A Mamba-2 layer (kMamba: its MambaStep descriptor; 0 for attention) has in_proj at kQKV,
// kQKVBias, kQKVQuant (kMambaWidth outputs) and out_proj at kO, kOQuant (kMambaInner inputs).
// kResidual: the float32 bits of the multiplier on both sublayers' outputs (1.0f: none); kRope:
// whether attention rotates q and k, by the layer's own tables at kCos / kSin where given (else
// the step's). Gemma's layers: kOffsetNorms (every norm of the layer is (1 + weight) x / rms(x)
// in float32, q/k norms included), kGelu (GeGLU in place of SwiGLU), kMixerOutNorm /
// kMlpOutNorm (norms of each sublayer's output before its residual add; 0: none). kGroup: the
// KV cache group of an attention layer (its rows' slots and block tables: the step's group
// kGroup ones). kOBias: a float out_proj's bias (a Mamba-2 layer's, gpt-oss's o_proj).
enum LayerPointer {
  kInputNorm, kQKV, kQKVBias, kO, kPostNorm, kGateUp, kDown, kQNorm, kKNorm, kKCache, kVCache,
  kKScales, kVScales, kKVCodes, kQKVQuant, kOQuant, kGateUpQuant, kDownQuant,
  kRouter, kExpertsGateUp, kExpertsDown, kCounts, kExperts, kTopK, kRenormalize, kMoeIntermediate,
  kMamba, kMambaWidth, kMambaInner, kResidual, kRope,
  kOffsetNorms, kGelu, kMixerOutNorm, kMlpOutNorm, kCos, kSin, kGroup, kOBias,
  kParallel, kMixerIn, kMixerOut, kSections, kGateMult, kDownMult,  // Falcon-H1
  kDeltaNet, kDeltaStep, kBA, kBAQuant, kBAWidth, kOGate, kOGateQuant, kSharedGate,  // Qwen3-Next
  kWindow, kSinks, kOssAttention, kRouterBias, kOssExperts,  // gpt-oss: decode_gpt_oss.h
  kMla, kMoeGrouped, kMlpIntermediate,  // DeepSeek-V3: decode_mla.h's descriptors, own MLP size
  kLayerPointers
};

#include "decode_gpt_oss.h"

// x += T(y * scale) (or x += y where scale is 1), the sublayer's output y added to the stream
template <typename T>
void add_residual(T* x, T* y, float scale, int64_t n) {
  if (scale != 1.0f) scale_(y, scale, n);
  add_(x, y, n);
}

// The state slots a step's Mamba-2 layers read and the snapshot copies they make: each row's
// slot, and (source, destination) pairs, all within the pools' num_slots
struct StateRows {
  const void* step;  // a MambaStep
  const int64_t* slots;
  int64_t num_slots;
  const int64_t* copies;
  int64_t num_copies;
  bool valid(int64_t rows) const {
    for (int64_t r = 0; r < rows; ++r)
      if (slots[r] < 0 || slots[r] >= num_slots) return false;
    for (int64_t i = 0; i < 2 * num_copies; ++i)
      if (copies[i] < 0 || copies[i] >= num_slots) return false;
    return true;
  }
};

// What a decode step's attention layers read besides their own pointers: the RoPE tables
// (rot columns a position), each row's position, the paged-attention kernel and its tables
// (tokens, context lengths), and per cache group (`groups` of them, each its own pages: the
// sliding-window layers') each row's KV slot ([groups, rows]) and block table ([groups, rows,
// table_width]).
struct AttentionRows {
  const float* cos;
  const float* sin;
  int64_t rot;
  const int64_t* positions;
  const int64_t* slots;
  const void* kernel;  // a PagedDecode, or a PagedDecodeCodes over quantized caches
  const int32_t* tokens;
  const int32_t* tables;
  const int32_t* lens;
  int64_t table_width, block_size, groups;
  float scale;
};

// rms_norm, or Gemma's (1 + weight) form where `offset`
template <typename T>
void any_norm(bool offset, const T* x, const T* w, T* out, int64_t rows, int64_t n,
              int64_t x_stride, float eps) {
  if (offset)
    rms_norm<true>(x, w, out, rows, n, x_stride, eps);
  else
    rms_norm(x, w, out, rows, n, x_stride, eps);
}

#include "decode_qwen3_next.h"  // Qwen3-Next's gated DeltaNet layer and sigmoid gates
#include "decode_mla.h"

// An attention layer's mixer over the normed rows h: q|k|v (q/k norms, RoPE), the new K/V into
// the rows' slots, paged attention, o_proj into y [rows, hidden]
template <typename T>
void attention_layer(const int64_t* p, const AttentionRows& a, const T* h, T* y, int64_t rows,
                     int64_t hidden, int64_t heads, int64_t kv_heads, int64_t D, float eps,
                     T* qkv, T* att) {
  const auto w = [p](LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
  const auto quant = [p](LayerPointer i) { return reinterpret_cast<const int64_t*>(p[i]); };
  const int64_t q_size = heads * D, kv_size = kv_heads * D, qkv_width = q_size + 2 * kv_size;
  const int64_t token_stride = kv_size, block_stride = a.block_size * kv_size;
  T* k_cache = reinterpret_cast<T*>(p[kKCache]);
  T* v_cache = reinterpret_cast<T*>(p[kVCache]);
  const int64_t kv_codes = p[kKVCodes];
  const int64_t* slots = a.slots + p[kGroup] * rows;
  const int32_t* tables = a.tables + p[kGroup] * rows * a.table_width;
  project(quant(kQKVQuant), h, w(kQKV), w(kQKVBias), qkv, rows, qkv_width, hidden);
  if (p[kQNorm] != 0) {  // q/k norm over each head, before RoPE (qwen3, gemma)
    const bool offset = p[kOffsetNorms] != 0;
    for (int64_t r = 0; r < rows; ++r) {
      T* row = qkv + r * qkv_width;
      any_norm(offset, row, w(kQNorm), row, heads, D, D, eps);
      any_norm(offset, row + q_size, w(kKNorm), row + q_size, kv_heads, D, D, eps);
    }
  }
  if (p[kRope] != 0) {
    const float* cos = p[kCos] != 0 ? reinterpret_cast<const float*>(p[kCos]) : a.cos;
    const float* sin = p[kSin] != 0 ? reinterpret_cast<const float*>(p[kSin]) : a.sin;
    rope(qkv, cos, sin, a.positions, rows, heads + kv_heads, D, qkv_width, a.rot);
  }
  for (int64_t r = 0; r < rows; ++r) {  // the new token's K and V into its slot
    const T* row = qkv + r * qkv_width;
    const int64_t at =
        slots[r] / a.block_size * block_stride + slots[r] % a.block_size * token_stride;
    if (kv_codes != kFloatKV) {  // codes of a byte, scales at the codes' offset / head_dim
      uint8_t* codes[2] = {reinterpret_cast<uint8_t*>(p[kKCache]),
                           reinterpret_cast<uint8_t*>(p[kVCache])};
      float* scales[2] = {reinterpret_cast<float*>(p[kKScales]),
                          reinterpret_cast<float*>(p[kVScales])};
      for (int i = 0; i < 2; ++i)
        quantize_kv(row + q_size + i * kv_size, kv_heads, D, kv_codes, codes[i] + at,
                    scales[i] + at / D);
      continue;
    }
    std::copy(row + q_size, row + q_size + kv_size, k_cache + at);
    std::copy(row + q_size + kv_size, row + qkv_width, v_cache + at);
  }
  if (p[kOssAttention] != 0)
    oss_attention<T>(p, qkv, k_cache, v_cache, att, a.tokens, tables, a.lens, rows, heads,
                     kv_heads, D, a.block_size, a.table_width, qkv_width, q_size, block_stride,
                     token_stride, a.scale);
  else if (kv_codes != kFloatKV)
    reinterpret_cast<PagedDecodeCodes>(const_cast<void*>(a.kernel))(
        qkv, k_cache, v_cache, reinterpret_cast<const float*>(p[kKScales]),
        reinterpret_cast<const float*>(p[kVScales]), att, a.tokens, tables, a.lens, rows,
        heads, kv_heads, D, a.block_size, a.table_width, qkv_width, q_size, block_stride,
        token_stride, a.scale, 0);
  else
    reinterpret_cast<PagedDecode>(const_cast<void*>(a.kernel))(
        qkv, k_cache, v_cache, att, a.tokens, tables, a.lens, rows, heads, kv_heads, D,
        a.block_size, a.table_width, qkv_width, q_size, block_stride, token_stride, a.scale);
  if (p[kOGate] != 0 || p[kOGateQuant] != 0)  // (Qwen3-Next: qkv is free by now)
    gate_attention(p, h, att, qkv, rows, hidden, q_size);
  project(quant(kOQuant), att, w(kO), w(kOBias), y, rows, hidden, q_size);
}

// A Mamba-2 layer's mixer over the normed rows h: in_proj, the MambaStep (conv window, state
// update, gated norm; the states of the rows' slots in place, then the snapshot copies),
// out_proj into y [rows, hidden]
template <typename T>
void mamba_layer(const int64_t* p, const StateRows& s, const T* h, T* y, int64_t rows,
                 int64_t hidden, T* proj, T* inner) {
  const auto w = [p](LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
  const auto quant = [p](LayerPointer i) { return reinterpret_cast<const int64_t*>(p[i]); };
  const int64_t width = p[kMambaWidth];
  project(quant(kQKVQuant), h, w(kQKV), w(kQKVBias), proj, rows, width, hidden);
  reinterpret_cast<MambaStep>(const_cast<void*>(s.step))(
      reinterpret_cast<const int64_t*>(p[kMamba]), s.slots, rows, s.copies, s.num_copies, proj,
      width, inner);
  project(quant(kOQuant), inner, w(kO), w(kOBias), y, rows, hidden, p[kMambaInner]);
}

// A layer's MLP over the normed rows h into y: the dense gate|up, SiLU * up, down; or the
// sparse block (router, experts), plus its shared expert where it has one (the dense MLP's
// entries: every row through it, added to the experts' output)
template <typename T>
void mlp_layer(const int64_t* p, const T* h, T* y, int64_t rows, int64_t hidden,
               int64_t intermediate, int64_t counted, T* gate_up, T* act, T* shared) {
  const auto w = [p](LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
  const auto quant = [p](LayerPointer i) { return reinterpret_cast<const int64_t*>(p[i]); };
  if (p[kOssExperts] != 0) return oss_moe(p, h, y, rows, hidden, counted);
  const bool dense = p[kGateUp] != 0 || p[kGateUpQuant] != 0;
  T* dense_out = y;
  if (p[kMoeGrouped] != 0) {  // DeepSeek-V3's routing
    const int64_t* g = reinterpret_cast<const int64_t*>(p[kMoeGrouped]);
    grouped_moe_block(h, rows, hidden, p[kMoeIntermediate], w(kRouter), p[kExperts], p[kTopK],
                      p[kRenormalize] != 0, w(kExpertsGateUp), w(kExpertsDown),
                      reinterpret_cast<int64_t*>(p[kCounts]), counted, y,
                      reinterpret_cast<const float*>(g[kGroupedBias]), g[kGroupedGroups],
                      g[kGroupedTopkGroup], float_bits(g[kGroupedScaling]),
                      reinterpret_cast<const int64_t*>(g[kGroupedTable]));
    if (!dense) return;
    dense_out = shared;
  } else if (p[kRouter] != 0) {  // route's ids are in range: moe_block cannot fail
    moe_block(h, rows, hidden, p[kMoeIntermediate], w(kRouter), p[kExperts], p[kTopK],
              p[kRenormalize] != 0, w(kExpertsGateUp), w(kExpertsDown),
              reinterpret_cast<int64_t*>(p[kCounts]), counted, y);
    if (!dense) return;
    dense_out = shared;
  }
  project(quant(kGateUpQuant), h, w(kGateUp), static_cast<const T*>(nullptr), gate_up, rows,
          2 * intermediate, hidden);
  if (p[kGelu] != 0)
    gelu_mul(gate_up, act, rows, intermediate, 2 * intermediate);
  else
    silu_mul(gate_up, act, rows, intermediate, 2 * intermediate);
  project(quant(kDownQuant), act, w(kDown), static_cast<const T*>(nullptr), dense_out, rows,
          hidden, intermediate);
  if (p[kSharedGate] != 0) gate_shared(p, h, dense_out, gate_up, rows, hidden);
  if (dense_out != y) add_(y, dense_out, rows * hidden);
}

#include "decode_falcon_h1.h"

// A decode step (one new token in each of `rows` rows) from the tokens `ids` to the final
// hidden states: the rows of the embedding table `embed` [vocab, hidden] (times embed_scale
// where it is not 1) as the residual stream, every decoder layer in place on it, then the final
// RMSNorm (`final_norm`) into out [rows, hidden]: the kernels above, the paged-attention kernel
// and the Mamba-2 step (attention layers and Mamba-2 layers, each then its MLP if it has one),
// called in the order and with the roundings of the models' Python path through them
// (models/llama.py, bamba.py, mamba2.py, granite_moe_hybrid.py), so both give the same bits;
// sparse layers count the experts chosen by the first `counted` rows. With a `head` (a
// QuantSlot descriptor, as a projection's: the model's quantized lm_head), then its `head_n`
// logits of every row into float32 logits [rows, head_n], as QuantLinear's forward computes
// them (in T) and compute_logits widens them. Returns, before touching anything, 1 for a
// position outside the RoPE tables, 2 for a slot outside the cache's num_slots, 3 for a token
// outside the vocabulary, 4 for a state slot outside the pools; else 0.
template <typename T>
int decode_layers(T* out, int64_t rows, const int64_t* layers, int64_t num_layers, int64_t hidden,
                  int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                  float eps, int64_t max_positions, int64_t num_slots, const AttentionRows& a,
                  const StateRows& s, int64_t counted, const T* embed, float embed_scale,
                  int64_t vocab, const int64_t* ids, const T* final_norm, bool final_offset,
                  const int64_t* head, int64_t head_n, float* logits) {
  for (int64_t r = 0; r < rows; ++r) {
    if (a.positions[r] < 0 || a.positions[r] >= max_positions) return 1;
    if (ids[r] < 0 || ids[r] >= vocab) return 3;
  }
  for (int64_t i = 0; i < a.groups * rows; ++i)
    if (a.slots[i] < 0 || a.slots[i] >= num_slots) return 2;
  int64_t width = 0, inner = 0;  // the Mamba-2 layers' widest in_proj and inner size
  int64_t widest = intermediate;  // the widest MLP (a layer's own size at kMlpIntermediate)
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * kLayerPointers;
    width = std::max(width, p[kMambaWidth]);
    inner = std::max(inner, p[kMambaInner]);
    widest = std::max(widest, p[kMlpIntermediate]);
  }
  if (width > 0 && !s.valid(rows)) return 4;
  std::vector<T> stream(rows * hidden);
  T* x = stream.data();
  for (int64_t r = 0; r < rows; ++r)
    std::copy(embed + ids[r] * hidden, embed + (ids[r] + 1) * hidden, x + r * hidden);
  if (embed_scale != 1.0f) scale_(x, embed_scale, rows * hidden);
  const int64_t D = head_dim, q_size = heads * D, qkv_width = q_size + 2 * kv_heads * D;
  std::vector<T> h(rows * hidden), qkv(rows * qkv_width), att(rows * q_size), y(rows * hidden),
      gate_up(rows * 2 * widest), act(rows * widest), proj(rows * width),
      mixed(rows * inner), shared(rows * hidden), in(rows * hidden);
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * kLayerPointers;
    const auto w = [p](LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
    const float residual = float_bits(p[kResidual]);
    const bool offset = p[kOffsetNorms] != 0;
    if (p[kParallel] != 0) {  // Falcon-H1: this row and the next, one layer
      parallel_layer(p, p + kLayerPointers, a, s, x, rows, hidden, heads, kv_heads, D,
                     intermediate, eps, ParallelScratch<T>{h.data(), in.data(), y.data(),
                     shared.data(), qkv.data(), att.data(), proj.data(), mixed.data(),
                     gate_up.data(), act.data()});
      ++l;
      continue;
    }
    any_norm(offset, x, w(kInputNorm), h.data(), rows, hidden, hidden, eps);
    if (p[kMamba] != 0)
      mamba_layer(p, s, h.data(), y.data(), rows, hidden, proj.data(), mixed.data());
    else if (p[kDeltaNet] != 0)
      deltanet_layer(p, s, h.data(), y.data(), rows, hidden, proj.data(), mixed.data());
    else if (p[kMla] != 0)
      mla_layer(p, a, h.data(), y.data(), rows, hidden, heads);
    else
      attention_layer(p, a, h.data(), y.data(), rows, hidden, heads, kv_heads, D, eps,
                      qkv.data(), att.data());
    if (p[kMixerOutNorm] != 0)  // (in place: each row is read whole before it is written)
      any_norm(offset, y.data(), w(kMixerOutNorm), y.data(), rows, hidden, hidden, eps);
    add_residual(x, y.data(), residual, rows * hidden);
    if (p[kPostNorm] == 0) continue;  // no MLP (Mamba-2's blocks)
    any_norm(offset, x, w(kPostNorm), h.data(), rows, hidden, hidden, eps);
    mlp_layer(p, h.data(), y.data(), rows, hidden,
              p[kMlpIntermediate] != 0 ? p[kMlpIntermediate] : intermediate, counted,
              gate_up.data(), act.data(), shared.data());
    if (p[kMlpOutNorm] != 0)
      any_norm(offset, y.data(), w(kMlpOutNorm), y.data(), rows, hidden, hidden, eps);
    add_residual(x, y.data(), residual, rows * hidden);
  }
  any_norm(final_offset, x, final_norm, out, rows, hidden, hidden, eps);
  if (head != nullptr) {  // in T, as QuantLinear's forward rounds them, then widened exactly
    constexpr bool wide = std::is_same_v<T, float>;
    std::unique_ptr<T[]> rounded(wide ? nullptr : new T[rows * head_n]);  // (not zeroed)
    T* dst = wide ? reinterpret_cast<T*>(logits) : rounded.get();
    project(head, out, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), dst, rows,
            head_n, hidden);
    if constexpr (!wide)
      for (int64_t i = 0; i < rows * head_n; ++i) logits[i] = to_float(rounded[i]);
  }
  return 0;
}

}  // namespace

extern "C" {
int foudre_cpu_ops_available() { return 1; }
// the entries of a layer in decode_layers' table (cpu_decode.py checks its table against it)
int foudre_decode_layer_pointers() { return kLayerPointers; }

#define FOUDRE_OPS(SUFFIX, T)                                                                      \
  void foudre_rms_norm_##SUFFIX(const void* x, const void* w, void* out, int64_t rows, int64_t n,  \
                                int64_t x_stride, float eps) {                                     \
    rms_norm(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(out), rows, n,    \
             x_stride, eps);                                                                       \
  }                                                                                                \
  void foudre_offset_rms_norm_##SUFFIX(const void* x, const void* w, void* out, int64_t rows,    \
                                       int64_t n, int64_t x_stride, float eps) {                   \
    rms_norm<true>(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(out), rows, \
                   n, x_stride, eps);                                                              \
  }                                                                                                \
  void foudre_gelu_mul_##SUFFIX(const void* gu, void* out, int64_t rows, int64_t n,                \
                                int64_t gu_stride) {                                               \
    gelu_mul(static_cast<const T*>(gu), static_cast<T*>(out), rows, n, gu_stride);                 \
  }                                                                                                \
  void foudre_silu_mul_##SUFFIX(const void* gu, void* out, int64_t rows, int64_t n,                \
                                int64_t gu_stride) {                                               \
    silu_mul(static_cast<const T*>(gu), static_cast<T*>(out), rows, n, gu_stride);                 \
  }                                                                                                \
  void foudre_rope_##SUFFIX(void* x, const float* cos, const float* sin, const int64_t* positions, \
                            int64_t tokens, int64_t heads, int64_t head_dim,                       \
                            int64_t token_stride) {                                                \
    rope(static_cast<T*>(x), cos, sin, positions, tokens, heads, head_dim, token_stride,         \
         head_dim);                                                                                \
  }                                                                                                \
  void foudre_linear_##SUFFIX(const void* x, int64_t x_stride, const void* w, const void* bias,    \
                              void* y, int64_t rows, int64_t n, int64_t k) {                       \
    linear(static_cast<const T*>(x), x_stride, static_cast<const T*>(w),                           \
           static_cast<const T*>(bias), static_cast<T*>(y), rows, n, k);                           \
  }                                                                                                \
  int foudre_decode_layers_##SUFFIX(                                                               \
      void* out, int64_t rows, const int64_t* layers, int64_t num_layers, int64_t hidden,          \
      int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, float eps,          \
      const float* cos, const float* sin, int64_t rot, int64_t max_positions,                      \
      const int64_t* positions, const int64_t* slots, int64_t num_slots, const void* attention,    \
      const int32_t* tokens, const int32_t* tables, const int32_t* lens, int64_t table_width,      \
      int64_t block_size, int64_t groups, float scale, const void* mamba,                          \
      const int64_t* state_slots, int64_t num_state_slots, const int64_t* state_copies,            \
      int64_t num_copies, int64_t counted,                                                         \
      const void* embed, float embed_scale, int64_t vocab, const int64_t* ids,                     \
      const void* final_norm, int64_t final_offset, const int64_t* head, int64_t head_n,         \
      void* logits) {                                                                              \
    const AttentionRows a{cos,    sin,    rot,  positions,   slots,      attention, tokens,        \
                          tables, lens, table_width, block_size, groups,    scale};                \
    const StateRows s{mamba, state_slots, num_state_slots, state_copies, num_copies};              \
    return decode_layers(static_cast<T*>(out), rows, layers, num_layers, hidden, heads, kv_heads,  \
                         head_dim, intermediate, eps, max_positions, num_slots, a, s, counted,     \
                         static_cast<const T*>(embed), embed_scale, vocab, ids,                    \
                         static_cast<const T*>(final_norm), final_offset != 0, head, head_n,    \
                         static_cast<float*>(logits));                                             \
  }                                                                                                \
  void foudre_quantize_kv_##SUFFIX(const void* x, int64_t n, int64_t head_dim, int64_t kind,      \
                                   void* codes, float* scales) {                                   \
    quantize_kv(static_cast<const T*>(x), n, head_dim, kind, static_cast<uint8_t*>(codes),         \
                scales);                                                                           \
  }                                                                                                \
  int foudre_moe_experts_##SUFFIX(const void* x, int64_t rows, int64_t hidden, int64_t inter,      \
                                  const int64_t* ids, const float* weights, int64_t top_k,         \
                                  const void* gate_up, const void* down, int64_t experts,          \
                                  void* out) {                                                     \
    return moe_experts(static_cast<const T*>(x), rows, hidden, inter, ids, weights, top_k,         \
                       static_cast<const T*>(gate_up), static_cast<const T*>(down), experts,       \
                       static_cast<T*>(out));                                                      \
  }                                                                                                \
  void foudre_route_##SUFFIX(const void* logits, int64_t rows, int64_t experts, int64_t top_k,     \
                             int renormalize, int64_t* ids, float* weights) {                      \
    route(static_cast<const T*>(logits), rows, experts, top_k, renormalize != 0, ids, weights);    \
  }                                                                                                \
  int foudre_moe_block_##SUFFIX(const void* x, int64_t rows, int64_t hidden, int64_t inter,        \
                                const void* router, int64_t experts, int64_t top_k,                \
                                int renormalize, const void* gate_up, const void* down,            \
                                int64_t* counts, int64_t counted, void* out) {                     \
    return moe_block(static_cast<const T*>(x), rows, hidden, inter,                                \
                     static_cast<const T*>(router), experts, top_k, renormalize != 0,              \
                     static_cast<const T*>(gate_up), static_cast<const T*>(down), counts, counted, \
                     static_cast<T*>(out));                                                        \
  }

FOUDRE_OPS(f32, float)
FOUDRE_OPS(bf16, uint16_t)
FOUDRE_MLA_OPS(f32, float)
FOUDRE_MLA_OPS(bf16, uint16_t)

// Qwen3-Next's sigmoid gates for the Python path (decode_qwen3_next.h's sigmoid_gate)
void foudre_sigmoid_gate_f32(const void* x, const void* gate, void* out, int64_t rows, int64_t n,
                             int64_t gate_cols) {
  sigmoid_gate(static_cast<const float*>(x), static_cast<const float*>(gate),
               static_cast<float*>(out), rows, n, gate_cols);
}
void foudre_sigmoid_gate_bf16(const void* x, const void* gate, void* out, int64_t rows, int64_t n,
                              int64_t gate_cols) {
  sigmoid_gate(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(gate),
               static_cast<uint16_t*>(out), rows, n, gate_cols);
}

// 0; -1 where this build has no such GEMM (AVX-512: torch's path); -2 out of memory
int foudre_gemm_bf16(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                     int64_t rows, int64_t n, int64_t k) {
#if defined(FOUDRE_GEMM_BF16)
  return gemm_bf16(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(w),
                   static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), rows, n, k);
#else
  (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)rows, (void)n, (void)k;
  return -1;
#endif
}
}

#else
extern "C" int foudre_cpu_ops_available() { return 0; }
#endif

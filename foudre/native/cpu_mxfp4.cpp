// MXFP4 (OCP Microscaling FP4) weights on the CPU: y [M, N] = x [M, K] @ W^T (+ bias), W kept
// packed as gpt-oss checkpoints store it:
//   blocks [N, K / 32, 16] uint8: per block of 32 columns, 16 bytes of E2M1 codes, byte j holding
//                                 column 2j in its low nibble and 2j + 1 in its high one
//   scales [N, K / 32] uint8:     the block's E8M0 exponent s, w = e2m1(code) * 2^(s - 127)
// E2M1 codes 0..15: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated (bit 3 the sign).
// x and y float32 or bfloat16 (x converted to float32 once per call: exact); bias float32 or null.
//
// The weight is never expanded: each block's 32 codes become float32 in registers (a table of
// the 16 values times the block's scale, both exact: a power of two times a value with one
// mantissa bit), multiplied with x in float32 and summed in float32 accumulators, rounded once
// to y's dtype. x is first rearranged per block as the nibbles lie (the 16 even columns, then
// the 16 odd ones), so the low nibbles meet the first half and the high ones the second.
// Each task is a range of weight rows; a row is streamed once from memory and multiplied with
// up to 4 x rows at a time (the row then read again from L1 for the next 4). Tasks are split
// over torch's OpenMP threads (one libgomp pool).
//
// Three paths, by what the compiler targets (built with -march=native, or FOUDRE_KERNEL_MARCH):
//   AVX-512   the 16-entry table in a register, vpermps of 16 codes at once (2 per block)
//   AVX2      (with FMA and F16C) the 8 magnitudes in a register, vpermps of 8 codes, the sign
//             bit xor-ed in (4 per block)
//   portable  plain loops over the same table

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FOUDRE_MX_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FOUDRE_MX_AVX2 1
#endif

namespace {

constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr int kRows = 4;          // x rows a pass over a weight row serves
constexpr int64_t kTask = 8;      // weight rows a task
constexpr int64_t kAhead = 1024;  // bytes ahead of the block read that a row's stream prefetches

// 2^(s - 127) for each E8M0 byte (s = 0: the float32 subnormal 2^-127; 255: +inf)
struct Scales {
  float v[256];
  Scales() {
    for (int s = 0; s < 256; ++s) v[s] = std::ldexp(1.0f, s - 127);
  }
};
const Scales kScales;

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {  // bfloat16: the high half of a float32
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) {  // round to nearest even, NaN to a quiet NaN
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *p = std::isnan(v) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// x [m, k] in float32 with each block of 32 columns as the nibbles lie: columns 0, 2, .., 30,
// then 1, 3, .., 31
template <typename T>
std::vector<float> nibble_order(const T* x, int64_t m, int64_t k) {
  std::vector<float> xd(static_cast<size_t>(m * k));
#pragma omp parallel for schedule(static) if (m * k >= 65536)
  for (int64_t r = 0; r < m; ++r) {
    const T* row = x + r * k;
    float* out = xd.data() + r * k;
    for (int64_t b = 0; b < k; b += 32)
      for (int j = 0; j < 16; ++j) {
        out[b + j] = load1(row + b + 2 * j);
        out[b + 16 + j] = load1(row + b + 2 * j + 1);
      }
  }
  return xd;
}

// acc[r] = sum over the row's blocks of w . x[r] (x in nibble order), R rows of x k apart
template <int R>
inline void row_dot(const uint8_t* q, const uint8_t* s, const float* x, int64_t k, float* acc) {
  const int64_t nb = k / 32;
#if defined(FOUDRE_MX_AVX512)
  // A accumulators a row of x (the low and the high nibbles' products; for one or two rows
  // also by even and odd block): FMA chains short of their latency
  constexpr int A = R <= 2 ? 4 : 2;
  const __m512 table = _mm512_loadu_ps(kE2M1);
  __m512 a[R][A];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < A; ++i) a[r][i] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int i) {
    _mm_prefetch(reinterpret_cast<const char*>(q + 16 * b + kAhead), _MM_HINT_T0);
    const __m512 lut = _mm512_mul_ps(table, _mm512_set1_ps(kScales.v[s[b]]));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b)));
    const __m512 lo = _mm512_permutexvar_ps(codes, lut);  // (vpermps reads the low 4 bits)
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + 32 * b;
      a[r][i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), a[r][i]);
      a[r][i + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), a[r][i + 1]);
    }
  };
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    step(b, 0);
    step(b + 1, A - 2);
  }
  if (b < nb) step(b, 0);
  for (int r = 0; r < R; ++r) {
    __m512 sum = a[r][0];
    for (int i = 1; i < A; ++i) sum = _mm512_add_ps(sum, a[r][i]);
    acc[r] = _mm512_reduce_add_ps(sum);
  }
#elif defined(FOUDRE_MX_AVX2)
  constexpr int A = R <= 2 ? 4 : 2;  // accumulators a row of x (FMA chains short of latency)
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  __m256 a[R][A];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < A; ++i) a[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(q + 16 * b + kAhead), _MM_HINT_T0);
    const __m256 lut = _mm256_mul_ps(magnitudes, _mm256_set1_ps(kScales.v[s[b]]));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
    const __m128i nibbles[2] = {_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)};
    for (int h = 0; h < 2; ++h)      // the even columns (low nibbles), then the odd ones
      for (int part = 0; part < 2; ++part) {  // their first 8, then their last 8
        const __m256i c = _mm256_cvtepu8_epi32(part ? _mm_srli_si128(nibbles[h], 8) : nibbles[h]);
        // vpermps reads the low 3 bits: the magnitude; bit 3, the sign, moved to bit 31
        const __m256 w = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, c),
                                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 28), sign)));
        const int i = (2 * h + part) % A;
        for (int r = 0; r < R; ++r)
          a[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * k + 32 * b + 16 * h + 8 * part), a[r][i]);
      }
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = a[r][0];
    for (int i = 1; i < A; ++i) sum = _mm256_add_ps(sum, a[r][i]);
    const __m128 v = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 v2 = _mm_add_ps(v, _mm_movehl_ps(v, v));
    acc[r] = _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
  }
#else
  float a[R][16] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = kScales.v[s[b]];
    float w[32];
    for (int j = 0; j < 16; ++j) {
      w[j] = kE2M1[q[16 * b + j] & 15] * scale;
      w[16 + j] = kE2M1[q[16 * b + j] >> 4] * scale;
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + 32 * b;
      for (int j = 0; j < 16; ++j) a[r][j] += w[j] * xb[j] + w[16 + j] * xb[16 + j];
    }
  }
  for (int r = 0; r < R; ++r) {
    float t = 0.0f;
    for (int j = 0; j < 16; ++j) t += a[r][j];
    acc[r] = t;
  }
#endif
}

template <typename T>
void matmul(const T* x, const uint8_t* blocks, const uint8_t* scales, const float* bias, T* y,
            int64_t m, int64_t n, int64_t k) {
  const std::vector<float> xd = nibble_order(x, m, k);
  const int64_t tasks = (n + kTask - 1) / kTask;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = std::min(n, (t + 1) * kTask);
    for (int64_t row = t * kTask; row < n1; ++row) {
      const uint8_t* q = blocks + row * (k / 2);
      const uint8_t* s = scales + row * (k / 32);
      const float b = bias ? bias[row] : 0.0f;
      float acc[kRows];
      for (int64_t r = 0; r < m; r += kRows) {
        const float* xr = xd.data() + r * k;
        const int64_t rows = std::min<int64_t>(kRows, m - r);
        switch (rows) {
          case 4: row_dot<4>(q, s, xr, k, acc); break;
          case 3: row_dot<3>(q, s, xr, k, acc); break;
          case 2: row_dot<2>(q, s, xr, k, acc); break;
          default: row_dot<1>(q, s, xr, k, acc); break;
        }
        for (int64_t i = 0; i < rows; ++i) store1(y + (r + i) * n + row, acc[i] + b);
      }
    }
  }
}

// an MXFP4 value (at most two significant bits) stored without rounding: bfloat16 holds it
// exactly, its float32 bits' high half
inline void exact(float* p, float v) { *p = v; }
inline void exact(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *p = static_cast<uint16_t>(u >> 16);
}

#if defined(FOUDRE_MX_AVX512)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // exact: the high halves of the float32 bits
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#elif defined(FOUDRE_MX_AVX2)
inline void store8x2(float* p, __m256 a, __m256 b) {
  _mm256_storeu_ps(p, a);
  _mm256_storeu_ps(p + 8, b);
}
inline void store8x2(uint16_t* p, __m256 a, __m256 b) {  // exact: the float32 bits' high halves
  const __m256i ha = _mm256_srli_epi32(_mm256_castps_si256(a), 16);
  const __m256i hb = _mm256_srli_epi32(_mm256_castps_si256(b), 16);
  // (packus pairs 128-bit lanes: a0-3 b0-3 a4-7 b4-7; the permute puts a's then b's)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(_mm256_packus_epi32(ha, hb), 0xD8));
}
#endif

// one block's 32 values in column order at o
template <typename T>
inline void dequantize_block(const uint8_t* q, uint8_t s, T* o) {
#if defined(FOUDRE_MX_AVX512)
  const __m512 lut = _mm512_mul_ps(_mm512_loadu_ps(kE2M1), _mm512_set1_ps(kScales.v[s]));
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512 lo = _mm512_permutexvar_ps(codes, lut);  // the even columns
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut);  // the odd ones
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  store16(o, _mm512_permutex2var_ps(lo, first, hi));
  store16(o + 16, _mm512_permutex2var_ps(lo, second, hi));
#elif defined(FOUDRE_MX_AVX2)
  const __m256 lut = _mm256_mul_ps(_mm256_loadu_ps(kE2M1), _mm256_set1_ps(kScales.v[s]));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i nibbles[2] = {_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)};
  auto values = [&](int h, int part) {
    const __m256i c = _mm256_cvtepu8_epi32(part ? _mm_srli_si128(nibbles[h], 8) : nibbles[h]);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, c),
                         _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 28), sign)));
  };
  for (int part = 0; part < 2; ++part) {  // columns 16 part .. 16 part + 15
    const __m256 e = values(0, part), od = values(1, part);
    const __m256 ul = _mm256_unpacklo_ps(e, od), uh = _mm256_unpackhi_ps(e, od);
    store8x2(o + 16 * part, _mm256_permute2f128_ps(ul, uh, 0x20), _mm256_permute2f128_ps(ul, uh, 0x31));
  }
#else
  const float scale = kScales.v[s];
  for (int j = 0; j < 16; ++j) {
    exact(o + 2 * j, kE2M1[q[j] & 15] * scale);
    exact(o + 2 * j + 1, kE2M1[q[j] >> 4] * scale);
  }
#endif
}

template <typename T>
void dequantize(const uint8_t* blocks, const uint8_t* scales, T* out, int64_t n0, int64_t n1,
                int64_t k) {
#pragma omp parallel for schedule(static)
  for (int64_t row = n0; row < n1; ++row) {
    const uint8_t* q = blocks + row * (k / 2);
    const uint8_t* s = scales + row * (k / 32);
    T* o = out + (row - n0) * k;
    for (int64_t b = 0; b < k / 32; ++b) dequantize_block(q + 16 * b, s[b], o + 32 * b);
  }
}

}  // namespace

extern "C" {

// 1: AVX-512, 2: AVX2, 0: portable
int foudre_mxfp4_path() {
#if defined(FOUDRE_MX_AVX512)
  return 1;
#elif defined(FOUDRE_MX_AVX2)
  return 2;
#else
  return 0;
#endif
}

// y [m, n] = x [m, k] @ W^T + bias (bias float32 [n] or null); k a multiple of 32
void foudre_mxfp4_mm_f32(const float* x, const uint8_t* blocks, const uint8_t* scales,
                         const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  matmul(x, blocks, scales, bias, y, m, n, k);
}
void foudre_mxfp4_mm_bf16(const uint16_t* x, const uint8_t* blocks, const uint8_t* scales,
                          const float* bias, uint16_t* y, int64_t m, int64_t n, int64_t k) {
  matmul(x, blocks, scales, bias, y, m, n, k);
}

// rows n0..n1 of W [n1 - n0, k] (row-major, columns in order)
void foudre_mxfp4_dequantize_f32(const uint8_t* blocks, const uint8_t* scales, float* out,
                                 int64_t n0, int64_t n1, int64_t k) {
  dequantize(blocks, scales, out, n0, n1, k);
}
void foudre_mxfp4_dequantize_bf16(const uint8_t* blocks, const uint8_t* scales, uint16_t* out,
                                  int64_t n0, int64_t n1, int64_t k) {
  dequantize(blocks, scales, out, n0, n1, k);
}

}  // extern "C"

// -- gpt-oss's experts -------------------------------------------------------------------------
// The routed experts of a gpt-oss layer with MXFP4 weights at decode sizes in one call
// (cpu_moe_experts.h's driver), the layout of quant/mxfp4.MXFP4Experts: gate_up blocks [E, 2I,
// H / 32, 16] and scales [E, 2I, H / 32] (gate and up rows interleaved, as checkpoints store
// them), down blocks [E, H, I / 32, 16] and scales [E, H, I / 32], biases [E, 2I] and [E, H] in
// float32 or bfloat16 (or null). Each product is row_dot over x in nibble order, the rows of an
// expert 4 at a time as matmul takes them: the bits of foudre_mxfp4_mm's products.

#include "cpu_moe_experts.h"

namespace {

struct Mxfp4Weights {
  const uint8_t* blocks[2];
  const uint8_t* scales[2];
  const void* biases[2];
  int bias_bf16;
  int64_t hidden, inter;
  bool interleaved;

  void arrange(const float* in, int64_t m, int64_t k, float* out) const {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < k; b += 32)
        for (int j = 0; j < 16; ++j) {
          out[r * k + b + j] = in[r * k + b + 2 * j];
          out[r * k + b + 16 + j] = in[r * k + b + 2 * j + 1];
        }
  }
  template <int R>
  void dot(int which, int64_t e, int64_t n, const float* x, int64_t k, float* acc) const {
    const int64_t rows = which == 0 ? 2 * inter : hidden;
    const int64_t at = e * rows + n;
    row_dot<R>(blocks[which] + at * (k / 2), scales[which] + at * (k / 32), x, k, acc);
  }
  float bias(int which, int64_t e, int64_t n) const {
    if (biases[which] == nullptr) return 0.0f;
    const int64_t at = e * (which == 0 ? 2 * inter : hidden) + n;
    return bias_bf16 ? load1(static_cast<const uint16_t*>(biases[which]) + at)
                     : static_cast<const float*>(biases[which])[at];
  }
};

template <typename T>
int mxfp4_experts(const T* x, int64_t rows, int64_t hidden, int64_t inter, const int64_t* ids,
                  const float* weights, int64_t top_k, const uint8_t* gate_up_blocks,
                  const uint8_t* gate_up_scales, const void* gate_up_bias,
                  const uint8_t* down_blocks, const uint8_t* down_scales, const void* down_bias,
                  int bias_bf16, int64_t num_experts, int interleaved, float alpha, float limit,
                  T* out) {
  const Mxfp4Weights w{{gate_up_blocks, down_blocks}, {gate_up_scales, down_scales},
                       {gate_up_bias, down_bias}, bias_bf16, hidden, inter, interleaved != 0};
  return foudre_moe::gpt_oss_experts(w, x, rows, hidden, inter, ids, weights, top_k,
                                     num_experts, alpha, limit, out);
}

}  // namespace

extern "C" {

// x [rows, hidden]; ids (int64) and weights (float32) [rows, top_k]; the weights above;
// bias_bf16: the biases are bfloat16 (else float32); interleaved: gate and up in the even and
// odd rows of gate_up (else its halves); out [rows, hidden]. Returns 1 for an id outside
// 0..experts. hidden and inter multiples of 32.
int foudre_mxfp4_gpt_oss_experts_f32(const float* x, int64_t rows, int64_t hidden, int64_t inter,
                                     const int64_t* ids, const float* weights, int64_t top_k,
                                     const uint8_t* gub, const uint8_t* gus, const void* gu_bias,
                                     const uint8_t* db, const uint8_t* ds, const void* d_bias,
                                     int bias_bf16, int64_t experts, int interleaved,
                                     float alpha, float limit, float* out) {
  return mxfp4_experts(x, rows, hidden, inter, ids, weights, top_k, gub, gus, gu_bias, db, ds,
                       d_bias, bias_bf16, experts, interleaved, alpha, limit, out);
}
int foudre_mxfp4_gpt_oss_experts_bf16(const uint16_t* x, int64_t rows, int64_t hidden,
                                      int64_t inter, const int64_t* ids, const float* weights,
                                      int64_t top_k, const uint8_t* gub, const uint8_t* gus,
                                      const void* gu_bias, const uint8_t* db, const uint8_t* ds,
                                      const void* d_bias, int bias_bf16, int64_t experts,
                                      int interleaved, float alpha, float limit, uint16_t* out) {
  return mxfp4_experts(x, rows, hidden, inter, ids, weights, top_k, gub, gus, gu_bias, db, ds,
                       d_bias, bias_bf16, experts, interleaved, alpha, limit, out);
}

}  // extern "C"

// Helpers shared by the paged-attention kernels (cpu_paged_decode.cpp, cpu_paged_prefill.cpp):
// the storage types' scalar loads and stores, float8 e4m3fn codes, exp over non-positive
// inputs, and their AVX-512, AVX2 and NEON forms. FOUDRE_AVX512, FOUDRE_AVX2 or FOUDRE_NEON
// (aarch64) names the vector path the compiler targets (cpu_paged.py builds with
// -march=native). Each kernel is its own library: internal linkage here.
// (foudre/native/build.py hashes this header with the sources that include it.)

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FOUDRE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FOUDRE_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define FOUDRE_NEON 1
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(FOUDRE_NEON)
#include <arm_neon.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

// float16 storage: GCC's C++ has _Float16 on x86 only; on Arm, __fp16 (a storage type whose
// arithmetic is float32's, which is all the kernels ask of it)
#if defined(__aarch64__) || defined(__arm__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

// the threads a parallel loop runs on (one where the build has no OpenMP)
inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float load(Half x) { return static_cast<float>(x); }

// The quantized cache's codes: int8, and float8 e4m3fn (sign, 4 exponent bits with bias 7, 3
// mantissa bits; no infinities), whose 256 values a table holds.
struct Fp8 {
  uint8_t bits;
};
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(float(m), -9);
      value[b] = b & 0x80 ? -v : v;
    }
  }
};
const Fp8Table kFp8;
inline float load(int8_t x) { return static_cast<float>(x); }
inline float load(Fp8 x) { return kFp8.value[x.bits]; }

// what the vector loads' values are to be multiplied by: e4m3 codes load as 2^-8 their values
template <typename C>
constexpr float kUnit = 1.0f;
template <>
constexpr float kUnit<Fp8> = 256.0f;

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch converts
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}
inline void store(Half* p, float x) { *p = static_cast<Half>(x); }

// exp(x) for x <= 0: 2^n * e^f with n = round(x / ln 2) and |f| <= ln(2) / 2, e^f by its
// degree-6 Taylor polynomial (relative error below 2e-7); inputs under -87 give ~0.
#pragma omp declare simd notinbranch
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = __builtin_floorf(t + 0.5f);
  const float f = (t - n) * 0.693147180559945309f;
  const float p =
      1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 +
                                          f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(FOUDRE_AVX512)

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFFu) : n > 0 ? static_cast<__mmask16>((1u << n) - 1) : 0;
}

// 16 values of a row as float32
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const _Float16* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
// int8 codes exactly (float8 e4m3 codes: each kernel's own load16 overload)
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

inline __m512 exp16(__m512 x) {  // exp_nonpositive on 16 lanes
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

#endif  // AVX-512

#if defined(FOUDRE_AVX2)

// 8 values as float32: int8 codes exactly, e4m3 as 2^-8 times its value (kUnit)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const _Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
}
inline __m256 load8(const Fp8* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16(-0x8000));
  const __m128i rest = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3F80));
  return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

// head_dim values into a float32 row of width (a multiple of 8; zeros past head_dim)
template <typename C>
inline void convert_row8(float* dst, const C* src, int64_t D, int64_t width) {
  const int64_t whole = D / 8 * 8;
  for (int64_t d = 0; d < whole; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
  for (int64_t d = whole; d < width; ++d) dst[d] = d < D ? load(src[d]) / kUnit<C> : 0.0f;
}

inline __m256 exp8(__m256 x) {  // exp_nonpositive on 8 lanes (as exp16)
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif  // AVX2

#if defined(FOUDRE_NEON)

// 4 values as float32: int8 codes exactly, e4m3 as 2^-8 times its value (kUnit), as load8
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const uint16_t* p) {  // bfloat16: the high halves of float32s
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
inline float32x4_t load4(const Half* p) { return vcvt_f32_f16(vld1_f16(p)); }
inline uint8x8_t load4_bytes(const void* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return vreinterpret_u8_u32(vdup_n_u32(u));
}
inline float32x4_t load4(const int8_t* p) {
  const int8x8_t b = vreinterpret_s8_u8(load4_bytes(p));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
}
inline float32x4_t load4(const Fp8* p) {  // its bits moved into a float16's (load8's)
  const uint16x4_t w = vget_low_u16(vmovl_u8(load4_bytes(p)));
  const uint16x4_t sign = vand_u16(vshl_n_u16(w, 8), vdup_n_u16(0x8000));
  const uint16x4_t rest = vand_u16(vshl_n_u16(w, 7), vdup_n_u16(0x3F80));
  return vcvt_f32_f16(vreinterpret_f16_u16(vorr_u16(sign, rest)));
}

// head_dim values into a float32 row of width (zeros past head_dim), as convert_row8
template <typename C>
inline void convert_row4(float* dst, const C* src, int64_t D, int64_t width) {
  const int64_t whole = D / 4 * 4;
  for (int64_t d = 0; d < whole; d += 4) vst1q_f32(dst + d, load4(src + d));
  for (int64_t d = whole; d < width; ++d) dst[d] = d < D ? load(src[d]) / kUnit<C> : 0.0f;
}

inline float32x4_t exp4(float32x4_t x) {  // exp_nonpositive on 4 lanes (as exp8)
  x = vmaxq_f32(x, vdupq_n_f32(-87.0f));
  const float32x4_t t = vmulq_f32(x, vdupq_n_f32(1.44269504088896341f));
  const float32x4_t n = vrndnq_f32(t);
  const float32x4_t f = vmulq_f32(vsubq_f32(t, n), vdupq_n_f32(0.693147180559945309f));
  float32x4_t p = vdupq_n_f32(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = vfmaq_f32(vdupq_n_f32(c), p, f);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

#endif  // NEON

}  // namespace

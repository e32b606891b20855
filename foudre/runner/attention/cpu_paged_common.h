// Helpers shared by the paged-attention kernels (cpu_paged_decode.cpp, cpu_paged_prefill.cpp):
// the storage types' scalar loads and stores, float8 e4m3fn codes, exp over non-positive
// inputs, and their AVX-512 forms. Each kernel is its own library: internal linkage here.
// (foudre/layers/native.py hashes this header with the sources that include it.)

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float load(_Float16 x) { return static_cast<float>(x); }

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

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch converts
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}
inline void store(_Float16* p, float x) { *p = static_cast<_Float16>(x); }

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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

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

}  // namespace

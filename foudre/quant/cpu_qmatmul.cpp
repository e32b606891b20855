// Weight-only quantized linears on the CPU at decode-sized batches: y [M, N] = x [M, K] @ W^T
// for int8 weights per output channel (w = q * s) or group-wise (w = q * s[group], GGUF's Q8_0
// with groups of 32) and int4 group-wise ones (w = (q - z) * s), x and y float32 or bfloat16.
// Bound by reading the weight: each task takes R packed weight rows and multiplies them with
// every x row (four at a time, the weight rows coming from memory once and then from L1), the
// tasks split over torch's OpenMP threads by output-row ranges.
//
// Layouts (built by cpu_qmatmul.py): int8 [N, K] int8, K padded with zeros to a multiple of 64;
// int4 [N, K / 2] bytes, K padded to a multiple of 128, each 128 columns as 64 bytes whose low
// nibbles hold columns 0..63 and high nibbles columns 64..127 (one AND, or a shift and an AND,
// unpacks 64 codes in column order); float32 scales s and s * z [N, groups] (padded with zeros).
// Group-wise int8 as int8, with float32 scales [N, groups] (groups of 32 columns or more).
// x comes padded to the same K.
//
// Three paths, by what the compiler targets (built with -march=native):
//   VNNI      (AVX512-VNNI): x quantized to int8 per block of 32 (d = max|x| / 127, as llama.cpp's
//             Q8_0), the weight codes as the unsigned operand of vpdpbusd (int8 weights + 128):
//             sum_k u_k q_k per 4 columns in int32 lanes, scaled per lane by d (and the group
//             scale) into float32 accumulators; the offsets (128, or the zero point z) are
//             taken off through each block's sum of q: int8: y = s (sum d u q - 128 sum_b d_b
//             sum q), int4: y = sum s d u q - sum_g s z sum_{b in g} d_b sum q, group-wise int8
//             the same with z = 128 (per block of 32 this is llama.cpp's Q8_0 x Q8_0 dot).
//   AVX-512   the codes widened to float32 (int4: dequantized as q s - s z) and multiplied with
//             x in float32: no activation rounding.
//   portable  the same in plain loops.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FOUDRE_AVX512 1
#if defined(__AVX512VNNI__)
#define FOUDRE_VNNI 1
#endif
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16: the high half of a float32
  const uint32_t u = static_cast<uint32_t>(x) << 16;
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

// The weight rows of the task at n0 (past the end: row n - 1 again, its results not stored).
template <int R>
void row_ptrs(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t n0, const uint8_t** wr) {
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(n0 + r, n - 1) * row_bytes;
}

// The parallel loop: tasks of R weight rows, x's rows in tiles of four (then the one to three
// left); Tile<MT, R>::run(m0, n0) computes y[m0 : m0 + MT, n0 : n0 + R].
template <template <int, int> class Tile, typename Args>
void for_tiles(const Args& a, int64_t m, int64_t n) {
  const auto task = [&](auto rows_c, int64_t n0) {
    constexpr int R = decltype(rows_c)::value;
    for (int64_t m0 = 0; m0 < m; m0 += 4) {
      switch (std::min<int64_t>(m - m0, 4)) {
        case 1: Tile<1, R>::run(a, m0, n0); break;
        case 2: Tile<2, R>::run(a, m0, n0); break;
        case 3: Tile<3, R>::run(a, m0, n0); break;
        default: Tile<4, R>::run(a, m0, n0); break;
      }
    }
  };
  if (m == 1) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += 8) task(std::integral_constant<int, 8>{}, n0);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += 4) task(std::integral_constant<int, 4>{}, n0);
  }
}

template <typename T>
struct Args {
  const T* x;       // [m, k]
  const uint8_t* w;  // packed rows of row_bytes
  int64_t row_bytes;
  const float* s;   // int8: [n]; int4: [n, groups]
  const float* sz;  // int4: s * z [n, groups]
  int64_t groups, group;
  T* y;  // [m, n]
  int64_t m, n, k;
  // VNNI: x quantized ([m, k] int8), d per 4 columns ([m, k / 4]), per-row or per-group
  // corrections ([m] or [m, groups])
  const int8_t* xq;
  const float* dl;
  const float* corr;
};

inline int code4(const uint8_t* row, int64_t c) {  // int4 code of column c in the paired layout
  const int64_t i = c % 128;
  const uint8_t b = row[(c / 128) * 64 + i % 64];
  return i < 64 ? (b & 15) : (b >> 4);
}

// -- portable --------------------------------------------------------------------------------

template <typename T>
struct Portable {
  template <int MT, int R>
  struct Int8 {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      for (int r = 0; r < R && n0 + r < a.n; ++r) {
        const auto* wr = reinterpret_cast<const int8_t*>(a.w + (n0 + r) * a.row_bytes);
        for (int mi = 0; mi < MT; ++mi) {
          const T* x = a.x + (m0 + mi) * a.k;
          float acc[16] = {};
          for (int64_t c = 0; c < a.k; c += 16)
            for (int j = 0; j < 16; ++j)
              acc[j] += static_cast<float>(wr[c + j]) * to_float(x[c + j]);
          float sum = 0;
          for (float v : acc) sum += v;
          store1(a.y + (m0 + mi) * a.n + n0 + r, sum * a.s[n0 + r]);
        }
      }
    }
  };
  template <int MT, int R>
  struct Int4 {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      for (int r = 0; r < R && n0 + r < a.n; ++r) {
        const uint8_t* wr = a.w + (n0 + r) * a.row_bytes;
        const float* s = a.s + (n0 + r) * a.groups;
        const float* sz = a.sz + (n0 + r) * a.groups;
        for (int mi = 0; mi < MT; ++mi) {
          const T* x = a.x + (m0 + mi) * a.k;
          float acc[16] = {};
          for (int64_t c = 0; c < a.k; c += 16) {
            const int64_t g = c / a.group;
            for (int j = 0; j < 16; ++j)
              acc[j] += (static_cast<float>(code4(wr, c + j)) * s[g] - sz[g]) * to_float(x[c + j]);
          }
          float sum = 0;
          for (float v : acc) sum += v;
          store1(a.y + (m0 + mi) * a.n + n0 + r, sum);
        }
      }
    }
  };
  template <int MT, int R>
  struct Int8G {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      for (int r = 0; r < R && n0 + r < a.n; ++r) {
        const auto* wr = reinterpret_cast<const int8_t*>(a.w + (n0 + r) * a.row_bytes);
        const float* s = a.s + (n0 + r) * a.groups;
        for (int mi = 0; mi < MT; ++mi) {
          const T* x = a.x + (m0 + mi) * a.k;
          float acc[16] = {};
          for (int64_t c = 0; c < a.k; c += 16) {
            const float sg = s[c / a.group];
            for (int j = 0; j < 16; ++j)
              acc[j] += static_cast<float>(wr[c + j]) * sg * to_float(x[c + j]);
          }
          float sum = 0;
          for (float v : acc) sum += v;
          store1(a.y + (m0 + mi) * a.n + n0 + r, sum);
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

// y[m0 + mi, n0 + r] = finish(m0 + mi, n0 + r, acc[mi][r]), for the rows that exist
template <typename T, int MT, int R, typename F>
void store_tile(const Args<T>& a, int64_t m0, int64_t n0, __m512 (&acc)[MT][R], F&& finish) {
  for (int mi = 0; mi < MT; ++mi)
    for (int r = 0; r < R && n0 + r < a.n; ++r)
      store1(a.y + (m0 + mi) * a.n + n0 + r, finish(m0 + mi, n0 + r, acc[mi][r]));
}

template <typename T>
struct Float512 {
  template <int MT, int R>
  struct Int8 {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      row_ptrs<R>(a.w, a.row_bytes, a.n, n0, wr);
      __m512 acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t c = 0; c < a.k; c += 16) {
        __m512 xv[MT];
        for (int mi = 0; mi < MT; ++mi) xv[mi] = load16(a.x + (m0 + mi) * a.k + c);
        for (int r = 0; r < R; ++r) {
          const __m512 wv = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r] + c))));
          for (int mi = 0; mi < MT; ++mi) acc[mi][r] = _mm512_fmadd_ps(xv[mi], wv, acc[mi][r]);
        }
      }
      store_tile<T, MT, R>(a, m0, n0, acc, [&](int64_t, int64_t nr, __m512 v) {
        return _mm512_reduce_add_ps(v) * a.s[nr];
      });
    }
  };
  template <int MT, int R>
  struct Int4 {
    // 16 columns c..c+15 of (c % 128 < 64 ? low : high) nibbles, dequantized
    static __m512 dequant(const uint8_t* row, const float* s, const float* sz, int64_t c,
                          int64_t group) {
      const int64_t i = c % 128, g = c / group;
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (c / 128) * 64 + i % 64)));
      const __m512i q =
          i < 64 ? _mm512_and_si512(b, _mm512_set1_epi32(15)) : _mm512_srli_epi32(b, 4);
      return _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s[g]), _mm512_set1_ps(sz[g]));
    }
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      row_ptrs<R>(a.w, a.row_bytes, a.n, n0, wr);
      const float *s[R], *sz[R];
      for (int r = 0; r < R; ++r) {
        const int64_t nr = std::min<int64_t>(n0 + r, a.n - 1);
        s[r] = a.s + nr * a.groups;
        sz[r] = a.sz + nr * a.groups;
      }
      __m512 acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t c = 0; c < a.k; c += 16) {
        __m512 xv[MT];
        for (int mi = 0; mi < MT; ++mi) xv[mi] = load16(a.x + (m0 + mi) * a.k + c);
        for (int r = 0; r < R; ++r) {
          const __m512 wv = dequant(wr[r], s[r], sz[r], c, a.group);
          for (int mi = 0; mi < MT; ++mi) acc[mi][r] = _mm512_fmadd_ps(xv[mi], wv, acc[mi][r]);
        }
      }
      store_tile<T, MT, R>(a, m0, n0, acc,
                           [](int64_t, int64_t, __m512 v) { return _mm512_reduce_add_ps(v); });
    }
  };
  template <int MT, int R>
  struct Int8G {  // 16 columns at a time, all in one group (groups are multiples of 32)
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      row_ptrs<R>(a.w, a.row_bytes, a.n, n0, wr);
      const float* s[R];
      for (int r = 0; r < R; ++r) s[r] = a.s + std::min<int64_t>(n0 + r, a.n - 1) * a.groups;
      __m512 acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t c = 0; c < a.k; c += 16) {
        __m512 xv[MT];
        for (int mi = 0; mi < MT; ++mi) xv[mi] = load16(a.x + (m0 + mi) * a.k + c);
        for (int r = 0; r < R; ++r) {
          const __m512 q = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r] + c))));
          const __m512 wv = _mm512_mul_ps(q, _mm512_set1_ps(s[r][c / a.group]));
          for (int mi = 0; mi < MT; ++mi) acc[mi][r] = _mm512_fmadd_ps(xv[mi], wv, acc[mi][r]);
        }
      }
      store_tile<T, MT, R>(a, m0, n0, acc,
                           [](int64_t, int64_t, __m512 v) { return _mm512_reduce_add_ps(v); });
    }
  };
};

#endif  // FOUDRE_AVX512

#if defined(FOUDRE_VNNI)

// x [m, k] to int8 per block of 32 columns: xq, d per 4 columns (dl), and d * sum(q) per block
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* xq, float* dl, float* bsum) {
#pragma omp parallel for schedule(static) if (m * k >= 65536)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < k / 32; ++b) {
      const T* p = x + i * k + b * 32;
      const __m512 lo = load16(p), hi = load16(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      int8_t* q = xq + i * k + b * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
      _mm256_storeu_ps(dl + i * (k / 4) + b * 8, _mm256_set1_ps(d));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      bsum[i * (k / 32) + b] = d * static_cast<float>(sum);
    }
  }
}

template <typename T>
struct Vnni {
  template <int MT, int R>
  struct Int8 {
    static void run(const Args<T>& a, int64_t m0, int64_t n0) {
      const uint8_t* wr[R];
      row_ptrs<R>(a.w, a.row_bytes, a.n, n0, wr);
      __m512 acc[MT][R];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int64_t c = 0; c < a.k; c += 64) {
        __m512i wv[R];
        for (int r = 0; r < R; ++r) wv[r] = _mm512_xor_si512(_mm512_loadu_si512(wr[r] + c), flip);
        for (int mi = 0; mi < MT; ++mi) {
          const __m512i xv = _mm512_loadu_si512(a.xq + (m0 + mi) * a.k + c);
          const __m512 d = _mm512_loadu_ps(a.dl + (m0 + mi) * (a.k / 4) + c / 4);
          for (int r = 0; r < R; ++r) {
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
            acc[mi][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[mi][r]);
          }
        }
      }
      store_tile<T, MT, R>(a, m0, n0, acc, [&](int64_t mr, int64_t nr, __m512 v) {
        return (_mm512_reduce_add_ps(v) - 128.0f * a.corr[mr]) * a.s[nr];
      });
    }
  };
  // Group-wise weights: int4 paired nibbles, or int8 (Int8W: as its unsigned code q + 128, the
  // zero point z = 128 taken off with the others). Split: groups of 32, two per 64 columns
  // (lanes 0-7 and 8-15); else one group per 64
  template <bool Int8W, bool Split>
  struct Grouped {
    template <int MT, int R>
    struct Tile {
      static void run(const Args<T>& a, int64_t m0, int64_t n0) {
        const uint8_t* wr[R];
        row_ptrs<R>(a.w, a.row_bytes, a.n, n0, wr);
        const float *s[R], *sz[R];
        for (int r = 0; r < R; ++r) {
          const int64_t nr = std::min<int64_t>(n0 + r, a.n - 1);
          s[r] = a.s + nr * a.groups;
          sz[r] = a.sz + nr * a.groups;
        }
        __m512 acc[MT][R];
        for (auto& row : acc)
          for (auto& v : row) v = _mm512_setzero_ps();
        const __m512i low = _mm512_set1_epi8(15);
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
        for (int64_t c = 0; c < a.k; c += 64) {  // 64 columns (int4: the low or high nibbles)
          const bool high = c % 128 != 0;
          const int64_t g0 = c / a.group, g1 = (c + 32) / a.group;  // of lanes 0-7, 8-15
          __m512i wv[R];
          __m512 sv[R];
          for (int r = 0; r < R; ++r) {
            if constexpr (Int8W) {
              wv[r] = _mm512_xor_si512(_mm512_loadu_si512(wr[r] + c), flip);
            } else {
              const __m512i v = _mm512_loadu_si512(wr[r] + (c / 128) * 64);
              wv[r] = _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, low);
            }
            sv[r] = _mm512_set1_ps(s[r][g0]);
            if constexpr (Split)
              sv[r] = _mm512_mask_broadcastss_ps(sv[r], 0xFF00, _mm_load_ss(s[r] + g1));
          }
          for (int mi = 0; mi < MT; ++mi) {
            const __m512i xv = _mm512_loadu_si512(a.xq + (m0 + mi) * a.k + c);
            const __m512 d = _mm512_loadu_ps(a.dl + (m0 + mi) * (a.k / 4) + c / 4);
            for (int r = 0; r < R; ++r) {
              const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
              const __m512 scale = _mm512_mul_ps(d, sv[r]);
              acc[mi][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[mi][r]);
            }
          }
        }
        // the zero points: acc -= s z * (sum over the group's blocks of d sum q), 16 groups
        // a step
        for (int64_t g = 0; g < a.groups; g += 16) {
          const __mmask16 mask = a.groups - g >= 16 ? 0xFFFF : (1u << (a.groups - g)) - 1;
          for (int mi = 0; mi < MT; ++mi) {
            const __m512 cv = _mm512_maskz_loadu_ps(mask, a.corr + (m0 + mi) * a.groups + g);
            for (int r = 0; r < R; ++r)
              acc[mi][r] =
                  _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(mask, sz[r] + g), cv, acc[mi][r]);
          }
        }
        store_tile<T, MT, R>(a, m0, n0, acc,
                             [](int64_t, int64_t, __m512 v) { return _mm512_reduce_add_ps(v); });
      }
    };
  };
};

enum class Kind { Int8, Int8Grouped, Int4 };

// quantize x, then the tiles; int8: corr = sum of a row's block sums, grouped: per group (times
// 128 for int8, whose zero point is that offset)
template <typename T, Kind K>
void vnni_matmul(Args<T> a) {
  constexpr bool grouped = K != Kind::Int8, w8 = K == Kind::Int8Grouped;
  const int64_t blocks = a.k / 32;
  std::vector<int8_t> xq(a.m * a.k);
  std::vector<float> dl(a.m * a.k / 4), bsum(a.m * blocks);
  quantize_rows(a.x, a.m, a.k, xq.data(), dl.data(), bsum.data());
  const int64_t per_row = grouped ? a.groups : 1;
  std::vector<float> corr(a.m * per_row, 0.0f);
  for (int64_t i = 0; i < a.m; ++i)
    for (int64_t b = 0; b < blocks; ++b)
      corr[i * per_row + (grouped ? b * 32 / a.group : 0)] +=
          (w8 ? 128.0f : 1.0f) * bsum[i * blocks + b];
  a.xq = xq.data();
  a.dl = dl.data();
  a.corr = corr.data();
  if constexpr (grouped) {
    if (a.group == 32)
      for_tiles<Vnni<T>::template Grouped<w8, true>::template Tile>(a, a.m, a.n);
    else
      for_tiles<Vnni<T>::template Grouped<w8, false>::template Tile>(a, a.m, a.n);
  } else {
    for_tiles<Vnni<T>::template Int8>(a, a.m, a.n);
  }
}

#endif  // FOUDRE_VNNI

template <typename T>
void int8_matmul(const Args<T>& a) {
#if defined(FOUDRE_VNNI)
  vnni_matmul<T, Kind::Int8>(a);
#elif defined(FOUDRE_AVX512)
  for_tiles<Float512<T>::template Int8>(a, a.m, a.n);
#else
  for_tiles<Portable<T>::template Int8>(a, a.m, a.n);
#endif
}

template <typename T>
void int8g_matmul(const Args<T>& a) {
#if defined(FOUDRE_VNNI)
  vnni_matmul<T, Kind::Int8Grouped>(a);
#elif defined(FOUDRE_AVX512)
  for_tiles<Float512<T>::template Int8G>(a, a.m, a.n);
#else
  for_tiles<Portable<T>::template Int8G>(a, a.m, a.n);
#endif
}

template <typename T>
void int4_matmul(const Args<T>& a) {
#if defined(FOUDRE_VNNI)
  vnni_matmul<T, Kind::Int4>(a);
#elif defined(FOUDRE_AVX512)
  for_tiles<Float512<T>::template Int4>(a, a.m, a.n);
#else
  for_tiles<Portable<T>::template Int4>(a, a.m, a.n);
#endif
}

}  // namespace

extern "C" {

// 2: VNNI (int8 activations), 1: AVX-512 float, 0: portable
int foudre_qmm_path() {
#if defined(FOUDRE_VNNI)
  return 2;
#elif defined(FOUDRE_AVX512)
  return 1;
#else
  return 0;
#endif
}

// y [m, n] = x [m, k] @ (q * s)^T; q int8 [n, k], k a multiple of 64
#define FOUDRE_QMM_INT8(NAME, T)                                                              \
  void NAME(const void* x, const void* q, const float* s, void* y, int64_t m, int64_t n,      \
            int64_t k) {                                                                      \
    int8_matmul<T>({static_cast<const T*>(x), static_cast<const uint8_t*>(q), k, s, nullptr, \
                    0, 0, static_cast<T*>(y), m, n, k, nullptr, nullptr, nullptr});           \
  }
// y [m, n] = x [m, k] @ ((q - z) * s)^T; q paired nibbles [n, k / 2], k a multiple of 128;
// s and s * z [n, groups] for groups of `group` columns
#define FOUDRE_QMM_INT4(NAME, T)                                                                \
  void NAME(const void* x, const void* q, const float* s, const float* sz, int64_t groups,     \
            int64_t group, void* y, int64_t m, int64_t n, int64_t k) {                          \
    int4_matmul<T>({static_cast<const T*>(x), static_cast<const uint8_t*>(q), k / 2, s, sz,    \
                    groups, group, static_cast<T*>(y), m, n, k, nullptr, nullptr, nullptr});    \
  }

// y [m, n] = x [m, k] @ (q * s[group])^T; q int8 [n, k], k a multiple of 64; s [n, groups] for
// groups of `group` columns (a multiple of 32)
#define FOUDRE_QMM_INT8G(NAME, T)                                                            \
  void NAME(const void* x, const void* q, const float* s, int64_t groups, int64_t group,     \
            void* y, int64_t m, int64_t n, int64_t k) {                                      \
    int8g_matmul<T>({static_cast<const T*>(x), static_cast<const uint8_t*>(q), k, s, s,     \
                     groups, group, static_cast<T*>(y), m, n, k, nullptr, nullptr, nullptr}); \
  }

FOUDRE_QMM_INT8(foudre_qmm_int8_f32, float)
FOUDRE_QMM_INT8(foudre_qmm_int8_bf16, uint16_t)
FOUDRE_QMM_INT8G(foudre_qmm_int8g_f32, float)
FOUDRE_QMM_INT8G(foudre_qmm_int8g_bf16, uint16_t)
FOUDRE_QMM_INT4(foudre_qmm_int4_f32, float)
FOUDRE_QMM_INT4(foudre_qmm_int4_bf16, uint16_t)

}  // extern "C"

// gpt-oss's routed experts with float weights (float32 or bfloat16, the model's dtype) at
// decode sizes in one call: cpu_moe_experts.h's driver over stacked weights in
// layers/moe.ClampedSwiGLUExperts' layout,
//   gate_up [E, 2I, H] (gate rows, then up rows)   gate_up_bias [E, 2I]
//   down    [E, H, I]                              down_bias    [E, H]
// all of x's type. A weight row's dot with up to 4 x rows (float32) reads the row once: its
// values widened to float32 in registers, multiplied and summed in float32 (AVX-512: 16 lanes,
// two accumulators a row of x; otherwise plain loops over 16 lanes the compiler vectorizes).
//
// And the same experts quantized to int8 per output channel (quant/experts.QuantExperts of
// int8 QuantLinears, gpt-oss's biases and activation kept): each expert's codes [N, K] int8 and
// scales [N] (float32 or bfloat16) where its modules hold them (a table of pointers), w = q * s;
// the codes widened to float32 and multiplied with x in float32, x not rounded (the weight's
// bytes bound a decode step, not these conversions), the sum times the row's scale plus the
// bias rounded once.

#include <cstdint>

#include "cpu_moe_experts.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define FOUDRE_MOE_AVX512 1
#endif

namespace {

using foudre_moe::widen;
constexpr int64_t kAhead = 4096;  // bytes ahead of the weight read that row_dot prefetches

#if defined(FOUDRE_MOE_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16: the high halves of float32s
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {  // int8 codes, exact in float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif
inline float widen(int8_t q) { return static_cast<float>(q); }

// acc[r] = w . x[r] over k columns, R rows of x k apart
template <int R, typename T>
inline void row_dot(const T* w, const float* x, int64_t k, float* acc) {
  int64_t c = 0;
#if defined(FOUDRE_MOE_AVX512)
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (; c + 32 <= k; c += 32) {
    // a few KiB ahead of the stream (an expert's rows lie one after another): at batch 1 a
    // core's read is bound by the misses it keeps in flight (as cpu_qmatmul.cpp's kAhead)
    const char* ahead = reinterpret_cast<const char*>(w + c) + kAhead;
    _mm_prefetch(ahead, _MM_HINT_T0);
    if (sizeof(T) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    const __m512 w0 = load16(w + c), w1 = load16(w + c + 16);
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * k + c), a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * k + c + 16), a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
#else
  float a[R][16] = {};
  for (; c + 16 <= k; c += 16)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 16; ++l) a[r][l] += widen(w[c + l]) * x[r * k + c + l];
  for (int r = 0; r < R; ++r) {
    float t = 0.0f;
    for (int l = 0; l < 16; ++l) t += a[r][l];
    acc[r] = t;
  }
#endif
  for (; c < k; ++c)
    for (int r = 0; r < R; ++r) acc[r] += widen(w[c]) * x[r * k + c];
}

template <typename T>
struct FloatWeights {
  const T* gate_up;
  const T* gate_up_bias;
  const T* down;
  const T* down_bias;
  int64_t hidden, inter;
  bool interleaved = false;

  void arrange(const float* in, int64_t m, int64_t k, float* out) const {
    std::copy(in, in + m * k, out);
  }
  template <int R>
  void dot(int which, int64_t e, int64_t n, const float* x, int64_t k, float* acc) const {
    const T* w = which == 0 ? gate_up + (e * 2 * inter + n) * hidden : down + (e * hidden + n) * inter;
    row_dot<R>(w, x, k, acc);
  }
  float bias(int which, int64_t e, int64_t n) const {
    const T* b = which == 0 ? gate_up_bias : down_bias;
    return b == nullptr ? 0.0f : widen(b[e * (which == 0 ? 2 * inter : hidden) + n]);
  }
};

template <typename T>
int experts(const T* x, int64_t rows, int64_t hidden, int64_t inter, const int64_t* ids,
            const float* weights, int64_t top_k, const T* gate_up, const T* gate_up_bias,
            const T* down, const T* down_bias, int64_t num_experts, float alpha, float limit,
            T* out) {
  const FloatWeights<T> w{gate_up, gate_up_bias, down, down_bias, hidden, inter};
  return foudre_moe::gpt_oss_experts(w, x, rows, hidden, inter, ids, weights, top_k,
                                     num_experts, alpha, limit, out);
}

// expert e's tensors at table[6 e + i]: gate_up codes, scales, bias; down codes, scales, bias
struct Int8Weights {
  const int64_t* table;
  int scales_bf16, bias_bf16;
  int64_t hidden, inter;
  bool interleaved = false;

  static float at(const void* p, int64_t i, int bf16) {
    return bf16 ? widen(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  const void* ptr(int64_t e, int i) const { return reinterpret_cast<const void*>(table[6 * e + i]); }
  void arrange(const float* in, int64_t m, int64_t k, float* out) const {
    std::copy(in, in + m * k, out);
  }
  template <int R>
  void dot(int which, int64_t e, int64_t n, const float* x, int64_t k, float* acc) const {
    row_dot<R>(static_cast<const int8_t*>(ptr(e, 3 * which)) + n * k, x, k, acc);
    const float s = at(ptr(e, 3 * which + 1), n, scales_bf16);
    for (int r = 0; r < R; ++r) acc[r] *= s;
  }
  float bias(int which, int64_t e, int64_t n) const {
    const void* b = ptr(e, 3 * which + 2);
    return b == nullptr ? 0.0f : at(b, n, bias_bf16);
  }
};

template <typename T>
int int8_experts(const T* x, int64_t rows, int64_t hidden, int64_t inter, const int64_t* ids,
                 const float* weights, int64_t top_k, const int64_t* table, int scales_bf16,
                 int bias_bf16, int64_t num_experts, float alpha, float limit, T* out) {
  const Int8Weights w{table, scales_bf16, bias_bf16, hidden, inter};
  return foudre_moe::gpt_oss_experts(w, x, rows, hidden, inter, ids, weights, top_k,
                                     num_experts, alpha, limit, out);
}

}  // namespace

extern "C" {

// x [rows, hidden]; ids (int64) and weights (float32) [rows, top_k]; table [experts, 6] the
// addresses of each expert's gate_up codes [2I, H] int8, scales [2I], bias [2I] (or 0), down
// codes [H, I], scales [H], bias [H] (or 0); scales_bf16 / bias_bf16: bfloat16 (else float32);
// out [rows, hidden]. Returns 1 for an id outside 0..experts.
int foudre_gpt_oss_int8_experts_f32(const float* x, int64_t rows, int64_t hidden, int64_t inter,
                                    const int64_t* ids, const float* weights, int64_t top_k,
                                    const int64_t* table, int scales_bf16, int bias_bf16,
                                    int64_t experts, float alpha, float limit, float* out) {
  return int8_experts(x, rows, hidden, inter, ids, weights, top_k, table, scales_bf16, bias_bf16,
                      experts, alpha, limit, out);
}
int foudre_gpt_oss_int8_experts_bf16(const uint16_t* x, int64_t rows, int64_t hidden,
                                     int64_t inter, const int64_t* ids, const float* weights,
                                     int64_t top_k, const int64_t* table, int scales_bf16,
                                     int bias_bf16, int64_t experts, float alpha, float limit,
                                     uint16_t* out) {
  return int8_experts(x, rows, hidden, inter, ids, weights, top_k, table, scales_bf16, bias_bf16,
                      experts, alpha, limit, out);
}

// 1: AVX-512, 0: portable
int foudre_moe_path() {
#if defined(FOUDRE_MOE_AVX512)
  return 1;
#else
  return 0;
#endif
}

// x [rows, hidden]; ids (int64) and weights (float32) [rows, top_k]; the weights and biases
// above (a bias may be null); out [rows, hidden]. Returns 1 for an id outside 0..experts.
int foudre_gpt_oss_experts_f32(const float* x, int64_t rows, int64_t hidden, int64_t inter,
                               const int64_t* ids, const float* weights, int64_t top_k,
                               const float* gate_up, const float* gate_up_bias,
                               const float* down, const float* down_bias, int64_t num_experts,
                               float alpha, float limit, float* out) {
  return experts(x, rows, hidden, inter, ids, weights, top_k, gate_up, gate_up_bias, down,
                 down_bias, num_experts, alpha, limit, out);
}
int foudre_gpt_oss_experts_bf16(const uint16_t* x, int64_t rows, int64_t hidden, int64_t inter,
                                const int64_t* ids, const float* weights, int64_t top_k,
                                const uint16_t* gate_up, const uint16_t* gate_up_bias,
                                const uint16_t* down, const uint16_t* down_bias,
                                int64_t num_experts, float alpha, float limit, uint16_t* out) {
  return experts(x, rows, hidden, inter, ids, weights, top_k, gate_up, gate_up_bias, down,
                 down_bias, num_experts, alpha, limit, out);
}

}  // extern "C"

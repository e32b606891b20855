// CPU kernels of the recurrent layers at decode: one token per row, each row's state read and
// written in place in its pool slot (no gather into a batch and scatter back).
//
//   foudre_ssm_update     Mamba-2's selective-state update: h = exp(dt A) h + dt x B^T,
//                         y = h C (+ D x), h [heads, head_dim, d_state] float32 per slot
//   foudre_ssm_scan       the same, token by token over each row of a prefill (the state stays
//                         in cache between tokens), snapshots of the state after chosen tokens
//   foudre_conv_update_*  the causal depthwise conv1d over a window state [window, channels]
//                         (float32 or bfloat16) and the row's new input, then the window shifts
//   foudre_gated_delta_*  the gated delta rule (gated DeltaNet): S = S exp(g);
//                         S += beta k (v - S^T k)^T; o = S^T q, S [v_heads, dk, dv] float32;
//                         one token a row (_update) or a prefill's rows token by token (_scan)
//   foudre_deltanet_step_* a gated DeltaNet layer's decode token per row between its
//                         projections (conv window, gates, delta rule, gated norm, snapshots)
//
// Each is a pass over the state (bound by memory bandwidth: a Mamba-2 layer of 32 heads x 64 x
// 128 reads and writes 1 MiB a row), vectorized along the state's last dimension (d_state,
// dv) and parallel over (row, head) pairs with OpenMP. The paths, chosen when compiled
// (foudre_ssm_isa() says which): AVX-512 (16 lanes, masked tails), AVX2 with FMA (8 lanes),
// portable loops elsewhere (aarch64 included: the compiler vectorizes what it can). The state
// updates round where the torch references round (h * exp(dt A) + (dt x) B, each product its
// own rounding: -ffp-contract=off); the sums over the state (y, S^T k, S^T q) run in another
// order than torch's, a few float32 ulps apart.
//
// Rows must name distinct slots (a slot is one request's state). Built by
// foudre/native/build.py; called from foudre/layers/ssm_ops.py.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FOUDRE_SSM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define FOUDRE_SSM_AVX2 1
#include <immintrin.h>
#endif

namespace {

// Work below this many state elements runs on one thread (a fork costs more than it saves).
constexpr int64_t kParallelElements = 1 << 15;

// The vector type of the build: W float32 lanes, loads and stores of the first n <= W lanes.
#if defined(FOUDRE_SSM_AVX512)
struct Vec {
  static constexpr int64_t W = 16;
  __m512 v;
  static __mmask16 mask(int64_t n) {
    return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  }
  static Vec load(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  void store(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec zero() { return {_mm512_setzero_ps()}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
constexpr int kIsa = 2;
#elif defined(FOUDRE_SSM_AVX2)
struct Vec {
  static constexpr int64_t W = 8;
  __m256 v;
  static __m256i mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load(const float* p, int64_t n) {
    return {n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask(n))};
  }
  void store(float* p, int64_t n) const {
    if (n >= 8)
      _mm256_storeu_ps(p, v);
    else
      _mm256_maskstore_ps(p, mask(n), v);
  }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec zero() { return {_mm256_setzero_ps()}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  float sum() const {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
};
constexpr int kIsa = 1;
#else
struct Vec {  // one lane: the loops stay plain for the compiler to vectorize where it can
  static constexpr int64_t W = 1;
  float v;
  static Vec load(const float* p, int64_t) { return {*p}; }
  void store(float* p, int64_t) const { *p = v; }
  static Vec set1(float x) { return {x}; }
  static Vec zero() { return {0.0f}; }
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  float sum() const { return v; }
};
constexpr int kIsa = 0;
#endif

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16: the high half of a float32
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  *out = x != x ? uint16_t{0x7FC0} : rounded;  // (a select: the loops stay vectorizable)
}

// One (row, head): h = h * exp(dt a) + (dt x) B^T over [head_dim, d_state], y = h C (+ D x).
void ssm_head(float* h, int64_t head_dim, int64_t d_state, const float* x, float dt, float a,
              const float* b, const float* c, const float* d, float* y) {
  const Vec da = Vec::set1(std::exp(dt * a));
  for (int64_t p = 0; p < head_dim; ++p) {
    float* hp = h + p * d_state;
    const Vec dx = Vec::set1(dt * x[p]);
    Vec acc = Vec::zero();
    for (int64_t n = 0; n < d_state; n += Vec::W) {
      const int64_t m = d_state - n;
      const Vec hn = Vec::load(hp + n, m) * da + dx * Vec::load(b + n, m);
      hn.store(hp + n, m);
      acc = Vec::fmadd(hn, Vec::load(c + n, m), acc);
    }
    y[p] = acc.sum() + (d ? x[p] * *d : 0.0f);
  }
}

// One (row, v head) of the gated delta rule over S [dk, dv]; q and k already scaled.
void delta_head(float* s, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                float decay, float beta, float* o, float* kv) {
  const Vec eg = Vec::set1(decay);
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {  // S *= exp(g); kv = S^T k
    float* row = s + i * dv;
    const Vec ki = Vec::set1(k[i]);
    for (int64_t j = 0; j < dv; j += Vec::W) {
      const int64_t m = dv - j;
      const Vec sj = Vec::load(row + j, m) * eg;
      sj.store(row + j, m);
      Vec::fmadd(sj, ki, Vec::load(kv + j, m)).store(kv + j, m);
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    kv[j] = (v[j] - kv[j]) * beta;  // the delta
    o[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; ++i) {  // S += k delta^T; o = S^T q
    float* row = s + i * dv;
    const Vec ki = Vec::set1(k[i]), qi = Vec::set1(q[i]);
    for (int64_t j = 0; j < dv; j += Vec::W) {
      const int64_t m = dv - j;
      const Vec sj = Vec::load(row + j, m) + ki * Vec::load(kv + j, m);
      sj.store(row + j, m);
      Vec::fmadd(sj, qi, Vec::load(o + j, m)).store(o + j, m);
    }
  }
}

// The conv window update of one row: out = sum_k w[k] window_k + bias (the window's `window`
// states then x; w [window + 1, channels] float32), then the window drops its oldest input and
// takes x. Loops over channels (contiguous in the state, x and w: the compiler vectorizes
// them); acc: channels floats.
template <typename T>
void conv_row(T* state, int64_t channels, int64_t window, const T* x, const float* w,
              const float* bias, bool silu, T* out, float* acc) {
  for (int64_t k = 0; k <= window; ++k) {
    const T* in = k < window ? state + k * channels : x;
    const float* wk = w + k * channels;
    if (k == 0)
      for (int64_t c = 0; c < channels; ++c) acc[c] = to_float(in[c]) * wk[c];
    else
      for (int64_t c = 0; c < channels; ++c) acc[c] += to_float(in[c]) * wk[c];
  }
  if (bias)
    for (int64_t c = 0; c < channels; ++c) acc[c] += bias[c];
  if (silu)
    for (int64_t c = 0; c < channels; ++c) acc[c] = acc[c] / (1.0f + std::exp(-acc[c]));
  for (int64_t c = 0; c < channels; ++c) from_float(acc[c], out + c);
  if (window > 0) {
    std::memmove(state, state + channels, (window - 1) * channels * sizeof(T));
    std::memcpy(state + (window - 1) * channels, x, channels * sizeof(T));
  }
}

template <typename T>
void conv_update(T* state, int64_t slot_stride, const int64_t* slots, int64_t rows,
                 int64_t channels, int64_t window, const T* x, int64_t x_stride, const T* weight,
                 int64_t w_stride_c, int64_t w_stride_k, const T* bias, int silu, T* out) {
  // the weight as [window + 1, channels] float32 (then the bias): read once for all the rows
  std::vector<float> w((window + 2) * channels);
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t k = 0; k <= window; ++k)
      w[k * channels + c] = to_float(weight[c * w_stride_c + k * w_stride_k]);
    if (bias) w[(window + 1) * channels + c] = to_float(bias[c]);
  }
  const float* wb = bias ? w.data() + (window + 1) * channels : nullptr;
#pragma omp parallel if (rows > 1 && rows * channels * (window + 1) >= kParallelElements)
  {
    std::vector<float> acc(channels);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      conv_row(state + slots[r] * slot_stride, channels, window, x + r * x_stride, w.data(), wb,
               silu != 0, out + r * channels, acc.data());
  }
}

inline float inv_norm(const float* x, int64_t n) {  // 1 / sqrt(sum x^2 + 1e-6): as l2norm's
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return 1.0f / std::sqrt(ss + 1e-6f);
}

// The inputs of the gated delta rule: per token t, q and k [k_heads, dk], v [v_heads, dv], g
// and beta [v_heads] at their token strides; o [T, v_heads, dv] contiguous.
struct DeltaTokens {
  int64_t k_heads, v_heads, dk, dv;
  const float* q;
  int64_t q_stride;
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
  const float* g;
  int64_t g_stride;
  const float* beta;
  int64_t beta_stride;
  float scale;
  bool l2norm;
  float* o;
};

// Token t of value head h over its state s [dk, dv]; buf: 2 dk + dv floats (q and k scaled,
// then S^T k and the delta).
void delta_token(const DeltaTokens& in, int64_t t, int64_t h, float* s, float* buf) {
  const int64_t dk = in.dk, hk = h / (in.v_heads / in.k_heads);
  const float* qt = in.q + t * in.q_stride + hk * dk;
  const float* kt = in.k + t * in.k_stride + hk * dk;
  const float qs = in.l2norm ? inv_norm(qt, dk) : 1.0f, ks = in.l2norm ? inv_norm(kt, dk) : 1.0f;
  float* qn = buf;
  float* kn = buf + dk;
  for (int64_t j = 0; j < dk; ++j) {
    qn[j] = qt[j] * qs * in.scale;
    kn[j] = kt[j] * ks;
  }
  delta_head(s, dk, in.dv, qn, kn, in.v + t * in.v_stride + h * in.dv,
             std::exp(in.g[t * in.g_stride + h]), in.beta[t * in.beta_stride + h],
             in.o + (t * in.v_heads + h) * in.dv, kn + dk);
}

// The sizes and float32 parameters of one Mamba-2 mixer for mamba_decode.
struct MambaLayer {
  int64_t heads, head_dim, d_state, groups, window;
  const float* conv_w;  // [window + 1, conv_dim]
  const float* conv_b;  // [conv_dim] or null
  const float* dt_bias;
  const float* a;  // -exp(A_log)
  const float* d;
  float dt_min, dt_max;
  const float* norm_w;  // [heads * head_dim] or null (norm_mode 2)
  int64_t norm_groups;
  float eps;
  int norm_mode;  // 0: norm(y silu(z)) w, 1: norm(y) w silu(z), 2: y silu(z)
};

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// One decode token per row of a Mamba-2 mixer, from in_proj's output (z | xBC | dt, row
// stride proj_stride) to what out_proj takes (y [rows, heads * head_dim]): the conv window
// (SiLU'd, in float32 from there on), dt = softplus(dt + dt_bias) clamped, the state update of
// each head (foudre_ssm_update's, D included), then the gated RMSNorm over each of norm_groups
// slices; the conv window and the state of each row's slot updated in place.
template <typename T>
void mamba_decode(T* conv, int64_t conv_stride, float* state, int64_t state_stride,
                  const int64_t* slots, int64_t rows, const MambaLayer& m, const T* proj,
                  int64_t proj_stride, T* y) {
  const int64_t inner = m.heads * m.head_dim, gn = m.groups * m.d_state;
  const int64_t conv_dim = inner + 2 * gn, per_group = m.heads / m.groups;
  std::vector<float> xbc(rows * conv_dim), dt(rows * m.heads), yf(rows * inner);
#pragma omp parallel if (rows > 1)
  {
    std::vector<T> scratch(conv_dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = proj + r * proj_stride;
      conv_row(conv + slots[r] * conv_stride, conv_dim, m.window, row + inner, m.conv_w,
               m.conv_b, true, scratch.data(), xbc.data() + r * conv_dim);
      for (int64_t h = 0; h < m.heads; ++h) {
        const float v = softplus(to_float(row[inner + conv_dim + h]) + m.dt_bias[h]);
        dt[r * m.heads + h] = std::fmin(std::fmax(v, m.dt_min), m.dt_max);
      }
    }
  }
  const int64_t pairs = rows * m.heads, size = m.head_dim * m.d_state;
#pragma omp parallel for schedule(static) if (pairs * size >= kParallelElements)
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = i / m.heads, h = i % m.heads, g = h / per_group;
    const float* xr = xbc.data() + r * conv_dim;
    ssm_head(state + slots[r] * state_stride + h * size, m.head_dim, m.d_state,
             xr + h * m.head_dim, dt[i], m.a[h], xr + inner + g * m.d_state,
             xr + inner + gn + g * m.d_state, m.d + h, yf.data() + i * m.head_dim);
  }
  const int64_t span = inner / m.norm_groups;
  for (int64_t r = 0; r < rows; ++r) {
    const T* z = proj + r * proj_stride;
    float* yr = yf.data() + r * inner;
    if (m.norm_mode != 1)
      for (int64_t i = 0; i < inner; ++i) yr[i] *= silu(to_float(z[i]));
    if (m.norm_mode != 2)
      for (int64_t g = 0; g < m.norm_groups; ++g) {
        float* part = yr + g * span;
        float ss = 0.0f;
        for (int64_t i = 0; i < span; ++i) ss += part[i] * part[i];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(span) + m.eps);
        for (int64_t i = 0; i < span; ++i) part[i] *= inv * m.norm_w[g * span + i];
      }
    if (m.norm_mode == 1)
      for (int64_t i = 0; i < inner; ++i) yr[i] *= silu(to_float(z[i]));
    for (int64_t i = 0; i < inner; ++i) from_float(yr[i], y + r * inner + i);
  }
}

// A Mamba-2 layer as the native decode step (native/cpu_ops.cpp's decode_layers) describes it:
// its pools (conv window and state, at their slot strides), sizes and float32 parameters (the
// floats as their float32 bits), in MambaSlot order.
enum MambaSlot { kConv, kConvStride, kState, kStateStride, kHeads, kHeadDim, kDState, kGroups,
                 kWindow, kConvW, kConvB, kDtBias, kA, kD, kDtMin, kDtMax, kNormW, kNormGroups,
                 kEps, kNormMode, kMambaSlots };

inline float bits_float(int64_t bits) {
  const auto b = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// mamba_decode on the layer `p` describes, then the (source, destination) slot pairs `copies`
// copied in both pools (the prefix cache's snapshots of decode rows: the state after the step)
template <typename T>
void mamba_step(const int64_t* p, const int64_t* slots, int64_t rows, const int64_t* copies,
                int64_t num_copies, const T* proj, int64_t proj_stride, T* y) {
  const auto f = [p](MambaSlot i) { return reinterpret_cast<const float*>(p[i]); };
  const MambaLayer m{p[kHeads],         p[kHeadDim], p[kDState],
                     p[kGroups],        p[kWindow],  f(kConvW),
                     f(kConvB),         f(kDtBias),  f(kA),
                     f(kD),             bits_float(p[kDtMin]), bits_float(p[kDtMax]),
                     f(kNormW),         p[kNormGroups], bits_float(p[kEps]),
                     static_cast<int>(p[kNormMode])};
  T* conv = reinterpret_cast<T*>(p[kConv]);
  float* state = reinterpret_cast<float*>(p[kState]);
  mamba_decode(conv, p[kConvStride], state, p[kStateStride], slots, rows, m, proj, proj_stride, y);
  for (int64_t i = 0; i < num_copies; ++i) {
    const int64_t from = copies[2 * i], to = copies[2 * i + 1];
    std::memcpy(conv + to * p[kConvStride], conv + from * p[kConvStride],
                p[kConvStride] * sizeof(T));
    std::memcpy(state + to * p[kStateStride], state + from * p[kStateStride],
                p[kStateStride] * sizeof(float));
  }
}


// ---------------------------------------------------------------- gated DeltaNet decode step
// Qwen3-Next's gated DeltaNet, one decode token per row from its two projections' outputs to
// what out_proj takes (layers/gated_deltanet.py calls it at decode, and so does the native
// decode step of native/cpu_ops.cpp, through decode_qwen3_next.h: the same bits either way).

// A gated DeltaNet layer as deltanet_step reads it (DeltaSlot order): its pools (conv window in
// T, delta-rule state in float32) at their slot strides, the sizes, float32 copies of the conv
// weight [window + 1, conv_dim], a = -exp(A_log) and dt_bias, the gated norm's weight (T: the
// model's own parameter) and the floats (norm eps, q's scale) as their float32 bits.
enum DeltaSlot { kDeltaConv, kDeltaConvStride, kDeltaState, kDeltaStateStride, kDeltaKHeads,
                 kDeltaVHeads, kDeltaDk, kDeltaDv, kDeltaWindow, kDeltaConvW, kDeltaA,
                 kDeltaDtBias, kDeltaNormW, kDeltaEps, kDeltaScale, kDeltaSlots };

template <typename T>
inline float rounded(float x) {  // x rounded to T (a cast to the model's dtype and back)
  T t;
  from_float(x, &t);
  return to_float(t);
}

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// One row's conv input (q | k | v of every key head, from in_proj_qkvz's per-key-head groups
// q [dk] | k [dk] | v [r dv] | z [r dv]) through the conv window, rounded to T as the conv's
// output, then SiLU rounded to T (F.silu on it) into mixed [conv_dim] float32; and the row's
// gates from in_proj_ba's groups b [r] | a [r]: beta = sigmoid(b) rounded to T, g = a_h *
// softplus(a + dt_bias). in, out: conv_dim scratch of T; acc: conv_dim floats.
template <typename T>
void delta_inputs(const int64_t* p, T* window_state, const T* qkvz, const T* ba, float* mixed,
                  float* g, float* beta, T* in, T* out, float* acc) {
  const int64_t hk = p[kDeltaKHeads], hv = p[kDeltaVHeads], dk = p[kDeltaDk], dv = p[kDeltaDv];
  const int64_t r = hv / hk, key_dim = hk * dk, conv_dim = 2 * key_dim + hv * dv;
  const int64_t group = 2 * dk + 2 * r * dv;
  for (int64_t h = 0; h < hk; ++h) {
    const T* src = qkvz + h * group;
    std::memcpy(in + h * dk, src, dk * sizeof(T));
    std::memcpy(in + key_dim + h * dk, src + dk, dk * sizeof(T));
    std::memcpy(in + 2 * key_dim + h * r * dv, src + 2 * dk, r * dv * sizeof(T));
  }
  conv_row(window_state, conv_dim, p[kDeltaWindow], in,
           reinterpret_cast<const float*>(p[kDeltaConvW]), nullptr, false, out, acc);
  for (int64_t c = 0; c < conv_dim; ++c) mixed[c] = rounded<T>(silu(to_float(out[c])));
  const float* a = reinterpret_cast<const float*>(p[kDeltaA]);
  const float* dt_bias = reinterpret_cast<const float*>(p[kDeltaDtBias]);
  for (int64_t h = 0; h < hv; ++h) {
    const T* pair = ba + (h / r) * 2 * r + h % r;
    beta[h] = rounded<T>(sigmoid(to_float(pair[0])));
    g[h] = a[h] * softplus(to_float(pair[r]) + dt_bias[h]);
  }
}

// The gated RMSNorm of one (row, v head): o rounded to T, normed in float32 and rounded, times
// the weight in T, then times silu(z) in float32: y = T(T(w T(o / rms(o))) silu(z)).
template <typename T>
void delta_norm(const float* o, const T* z, const T* w, int64_t dv, float eps, T* y) {
  float ss = 0.0f;
  for (int64_t i = 0; i < dv; ++i) {
    const float v = rounded<T>(o[i]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dv) + eps);
  for (int64_t i = 0; i < dv; ++i) {
    const float hn = rounded<T>(rounded<T>(o[i]) * inv);
    const float hw = rounded<T>(to_float(w[i]) * hn);
    from_float(hw * silu(to_float(z[i])), y + i);
  }
}

// One decode token per row of the gated DeltaNet the descriptor p describes: qkvz [rows,
// k_heads * (2 dk + 2 r dv)] and ba [rows, 2 v_heads] (T, contiguous) -> y [rows, v_heads * dv]
// (T): the conv window, the gates, the delta rule on each row's state slot (q and k L2-normed,
// q scaled), the gated norm; then the (source, destination) slot pairs `copies` copied in both
// pools (the prefix cache's snapshots of decode rows: the state after the step).
template <typename T>
void deltanet_step(const int64_t* p, const int64_t* slots, int64_t rows, const int64_t* copies,
                   int64_t num_copies, const T* qkvz, const T* ba, T* y) {
  const int64_t hk = p[kDeltaKHeads], hv = p[kDeltaVHeads], dk = p[kDeltaDk], dv = p[kDeltaDv];
  const int64_t r = hv / hk, key_dim = hk * dk, value_dim = hv * dv;
  const int64_t conv_dim = 2 * key_dim + value_dim, group = 2 * dk + 2 * r * dv;
  T* conv = reinterpret_cast<T*>(p[kDeltaConv]);
  float* state = reinterpret_cast<float*>(p[kDeltaState]);
  const int64_t conv_stride = p[kDeltaConvStride], state_stride = p[kDeltaStateStride];
  std::vector<float> mixed(rows * conv_dim), g(rows * hv), beta(rows * hv), o(rows * value_dim);
#pragma omp parallel if (rows > 1 && rows * conv_dim * p[kDeltaWindow] >= kParallelElements)
  {
    std::vector<T> in(conv_dim), out(conv_dim);
    std::vector<float> acc(conv_dim);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i)
      delta_inputs(p, conv + slots[i] * conv_stride, qkvz + i * hk * group, ba + i * 2 * hv,
                   mixed.data() + i * conv_dim, g.data() + i * hv, beta.data() + i * hv,
                   in.data(), out.data(), acc.data());
  }
  const DeltaTokens in{hk,       hv,       dk,        dv, mixed.data(), conv_dim,
                       mixed.data() + key_dim, conv_dim, mixed.data() + 2 * key_dim, conv_dim,
                       g.data(), hv,       beta.data(), hv, bits_float(p[kDeltaScale]), true,
                       o.data()};
  const int64_t pairs = rows * hv;
#pragma omp parallel if (pairs * dk * dv >= kParallelElements)
  {
    std::vector<float> buf(2 * dk + dv);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i)
      delta_token(in, i / hv, i % hv, state + slots[i / hv] * state_stride + (i % hv) * dk * dv,
                  buf.data());
  }
  const T* norm_w = reinterpret_cast<const T*>(p[kDeltaNormW]);
  const float eps = bits_float(p[kDeltaEps]);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t row = i / hv, h = i % hv;
    const T* z = qkvz + row * hk * group + (h / r) * group + 2 * dk + r * dv + (h % r) * dv;
    delta_norm(o.data() + i * dv, z, norm_w, dv, eps, y + i * dv);
  }
  for (int64_t i = 0; i < num_copies; ++i) {
    const int64_t from = copies[2 * i], to = copies[2 * i + 1];
    std::memcpy(conv + to * conv_stride, conv + from * conv_stride, conv_stride * sizeof(T));
    std::memcpy(state + to * state_stride, state + from * state_stride,
                state_stride * sizeof(float));
  }
}

}  // namespace

extern "C" {

// 2: AVX-512, 1: AVX2 with FMA, 0: the portable loops (the paths this build takes)
int foudre_ssm_isa() { return kIsa; }

// Per row r (its state at slots[r] * slot_stride floats into `state`, [heads, head_dim,
// d_state]), per head h: h = h exp(dt A_h) + (dt x) B_g^T, y = h C_g (+ D_h x), g = h's group
// (heads / groups heads a group). x [rows, heads, head_dim] and dt [rows, heads] with row
// strides, B and C [rows, groups, d_state] likewise; y [rows, heads, head_dim] contiguous.
// D may be null.
void foudre_ssm_update(float* state, int64_t slot_stride, const int64_t* slots, int64_t rows,
                       int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups,
                       const float* x, int64_t x_stride, const float* dt, int64_t dt_stride,
                       const float* a, const float* b, int64_t b_stride, const float* c,
                       int64_t c_stride, const float* d, float* y) {
  const int64_t per_group = heads / groups;
  const int64_t pairs = rows * heads;
#pragma omp parallel for schedule(static) if (pairs * head_dim * d_state >= kParallelElements)
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = i / heads, h = i % heads, g = h / per_group;
    ssm_head(state + slots[r] * slot_stride + h * head_dim * d_state, head_dim, d_state,
             x + r * x_stride + h * head_dim, dt[r * dt_stride + h], a[h],
             b + r * b_stride + g * d_state, c + r * c_stride + g * d_state, d ? d + h : nullptr,
             y + i * head_dim);
  }
}

// The selective scan of a prefill: row r's tokens cu[r]..cu[r+1] (x [T, heads, head_dim], dt
// [T, heads], B and C [T, groups, d_state], each with its token stride) one after the other
// from the state at slots[r], updated in place (as foudre_ssm_update, token by token); y [T,
// heads, head_dim] contiguous. Where snap_slot (null: none) names a slot >= 0 for a token, the
// state after that token is also copied there (the prefix cache's snapshots).
void foudre_ssm_scan(float* state, int64_t slot_stride, const int64_t* slots, const int64_t* cu,
                     int64_t rows, int64_t heads, int64_t head_dim, int64_t d_state,
                     int64_t groups, const float* x, int64_t x_stride, const float* dt,
                     int64_t dt_stride, const float* a, const float* b, int64_t b_stride,
                     const float* c, int64_t c_stride, const float* d, const int64_t* snap_slot,
                     float* y) {
  const int64_t per_group = heads / groups, size = head_dim * d_state;
  const int64_t pairs = rows * heads;
  const bool parallel = pairs > 1 && (cu[rows] - cu[0]) * heads * size >= kParallelElements;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = i / heads, h = i % heads, g = h / per_group;
    float* hs = state + slots[r] * slot_stride + h * size;
    for (int64_t t = cu[r]; t < cu[r + 1]; ++t) {
      ssm_head(hs, head_dim, d_state, x + t * x_stride + h * head_dim, dt[t * dt_stride + h], a[h],
               b + t * b_stride + g * d_state, c + t * c_stride + g * d_state,
               d ? d + h : nullptr, y + (t * heads + h) * head_dim);
      if (snap_slot && snap_slot[t] >= 0)
        std::memcpy(state + snap_slot[t] * slot_stride + h * size, hs, size * sizeof(float));
    }
  }
}

// The causal conv1d of one new input per row: row r's window state [window, channels] at
// slots[r] * slot_stride elements into `state`, x [rows, channels] (row stride x_stride),
// weight [channels, window + 1] (element (c, k) at c * w_stride_c + k * w_stride_k), bias
// [channels] or null; out [rows, channels] contiguous (SiLU applied where silu != 0).
void foudre_conv_update_f32(float* state, int64_t slot_stride, const int64_t* slots,
                            int64_t rows, int64_t channels, int64_t window, const float* x,
                            int64_t x_stride, const float* weight, int64_t w_stride_c,
                            int64_t w_stride_k, const float* bias, int silu, float* out) {
  conv_update(state, slot_stride, slots, rows, channels, window, x, x_stride, weight, w_stride_c,
              w_stride_k, bias, silu, out);
}

void foudre_conv_update_bf16(uint16_t* state, int64_t slot_stride, const int64_t* slots,
                             int64_t rows, int64_t channels, int64_t window, const uint16_t* x,
                             int64_t x_stride, const uint16_t* weight, int64_t w_stride_c,
                             int64_t w_stride_k, const uint16_t* bias, int silu, uint16_t* out) {
  conv_update(state, slot_stride, slots, rows, channels, window, x, x_stride, weight, w_stride_c,
              w_stride_k, bias, silu, out);
}

// The gated delta rule, one token per row: per row r and value head h (its state [dk, dv] in
// the slot's [v_heads, dk, dv] at slots[r] * slot_stride floats into `state`; key head
// h / (v_heads / k_heads)): S = S exp(g); S += k (beta (v - S^T k))^T; o = S^T q, with q and k
// L2-normalized first where l2norm != 0 (eps 1e-6) and q times `scale`. q, k [rows, k_heads,
// dk], v [rows, v_heads, dv], g and beta [rows, v_heads], each with its row stride; o [rows,
// v_heads, dv] contiguous.
void foudre_gated_delta_update(float* state, int64_t slot_stride, const int64_t* slots,
                               int64_t rows, int64_t k_heads, int64_t v_heads, int64_t dk,
                               int64_t dv, const float* q, int64_t q_stride, const float* k,
                               int64_t k_stride, const float* v, int64_t v_stride,
                               const float* g, int64_t g_stride, const float* beta,
                               int64_t beta_stride, float scale, int l2norm, float* o) {
  const DeltaTokens in{k_heads, v_heads,  dk, dv,       q,    q_stride,    k,     k_stride,
                       v,       v_stride, g,  g_stride, beta, beta_stride, scale, l2norm != 0,
                       o};
  const int64_t pairs = rows * v_heads;
#pragma omp parallel if (pairs * dk * dv >= kParallelElements)
  {
    std::vector<float> buf(2 * dk + dv);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t r = i / v_heads, h = i % v_heads;
      delta_token(in, r, h, state + slots[r] * slot_stride + h * dk * dv, buf.data());
    }
  }
}

// The gated delta rule over the rows of a prefill: row r's tokens cu[r]..cu[r+1] (laid out as
// foudre_gated_delta_update's rows) one after the other from the state at slots[r], updated in
// place; o [T, v_heads, dv] contiguous. Where snap_slot (null: none) names a slot >= 0 for a
// token, the state after that token is also copied there.
void foudre_gated_delta_scan(float* state, int64_t slot_stride, const int64_t* slots,
                             const int64_t* cu, int64_t rows, int64_t k_heads, int64_t v_heads,
                             int64_t dk, int64_t dv, const float* q, int64_t q_stride,
                             const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                             const float* g, int64_t g_stride, const float* beta,
                             int64_t beta_stride, float scale, int l2norm,
                             const int64_t* snap_slot, float* o) {
  const DeltaTokens in{k_heads, v_heads,  dk, dv,       q,    q_stride,    k,     k_stride,
                       v,       v_stride, g,  g_stride, beta, beta_stride, scale, l2norm != 0,
                       o};
  const int64_t pairs = rows * v_heads, size = dk * dv;
  const bool parallel = pairs > 1 && (cu[rows] - cu[0]) * v_heads * size >= kParallelElements;
#pragma omp parallel if (parallel)
  {
    std::vector<float> buf(2 * dk + dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t r = i / v_heads, h = i % v_heads;
      float* s = state + slots[r] * slot_stride + h * size;
      for (int64_t t = cu[r]; t < cu[r + 1]; ++t) {
        delta_token(in, t, h, s, buf.data());
        if (snap_slot && snap_slot[t] >= 0)
          std::memcpy(state + snap_slot[t] * slot_stride + h * size, s, size * sizeof(float));
      }
    }
  }
}

#define FOUDRE_MAMBA_DECODE(SUFFIX, T)                                                          \
  void foudre_mamba_decode_##SUFFIX(                                                            \
      T* conv, int64_t conv_stride, float* state, int64_t state_stride, const int64_t* slots,   \
      int64_t rows, int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups,           \
      int64_t window, const float* conv_w, const float* conv_b, const float* dt_bias,           \
      const float* a, const float* d, float dt_min, float dt_max, const float* norm_w,          \
      int64_t norm_groups, float eps, int norm_mode, const T* proj, int64_t proj_stride, T* y) { \
    const MambaLayer m{heads,   head_dim, d_state, groups, window, conv_w,      conv_b, dt_bias, \
                       a,       d,        dt_min,  dt_max, norm_w, norm_groups, eps,    norm_mode}; \
    mamba_decode(conv, conv_stride, state, state_stride, slots, rows, m, proj, proj_stride, y); \
  }

#define FOUDRE_MAMBA_STEP(SUFFIX, T)                                                            \
  void foudre_mamba_step_##SUFFIX(const int64_t* layer, const int64_t* slots, int64_t rows,     \
                                  const int64_t* copies, int64_t num_copies, const void* proj,  \
                                  int64_t proj_stride, void* y) {                               \
    mamba_step(layer, slots, rows, copies, num_copies, static_cast<const T*>(proj), proj_stride, \
               static_cast<T*>(y));                                                             \
  }

// the entries of a Mamba-2 layer's descriptor (ssm_ops.py checks its descriptors against it)
int foudre_mamba_slots() { return kMambaSlots; }

// A Mamba-2 layer's decode step for the native decoder layers (mamba_step above)
FOUDRE_MAMBA_STEP(f32, float)
FOUDRE_MAMBA_STEP(bf16, uint16_t)

// A Mamba-2 mixer's decode token per row between its two projections (mamba_decode above):
// the conv window [window, conv_dim] (T) and the state [heads, head_dim, d_state] (float32)
// of each row's slot in place; proj [rows, >= heads * head_dim + conv_dim + heads] (T, row
// stride proj_stride) -> y [rows, heads * head_dim] (T, contiguous).
FOUDRE_MAMBA_DECODE(f32, float)
FOUDRE_MAMBA_DECODE(bf16, uint16_t)

// Qwen3-Next's gated DeltaNet decode token per row (deltanet_step above): the conv window
// [window, conv_dim] (T) and the state [v_heads, dk, dv] (float32) of each row's slot in place,
// then the snapshot copies; qkvz and ba (T, contiguous) -> y [rows, v_heads * dv] (T).
#define FOUDRE_DELTANET_STEP(SUFFIX, T)                                                          \
  void foudre_deltanet_step_##SUFFIX(const int64_t* layer, const int64_t* slots, int64_t rows,   \
                                     const int64_t* copies, int64_t num_copies,                  \
                                     const void* qkvz, const void* ba, void* y) {                \
    deltanet_step(layer, slots, rows, copies, num_copies, static_cast<const T*>(qkvz),           \
                  static_cast<const T*>(ba), static_cast<T*>(y));                                \
  }
FOUDRE_DELTANET_STEP(f32, float)
FOUDRE_DELTANET_STEP(bf16, uint16_t)

// the entries of a gated DeltaNet layer's descriptor (ssm_ops.py checks its descriptors)
int foudre_deltanet_slots() { return kDeltaSlots; }

}  // extern "C"

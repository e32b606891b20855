// Paged decode attention on the CPU: the C++ twin of the Triton kernel in triton_paged.py.
//
// Each decode row walks its block table with an online softmax (running max m, running sum l,
// rescaled accumulator), reading K/V straight from the paged pool: nothing is gathered, padded
// or masked. Work is spread over torch's OpenMP threads (the library resolves to the libgomp
// torch loaded). Products and sums are float32 whatever the storage type (float32, bfloat16 or
// float16); the bfloat16 path rounds the softmax weights to bfloat16 for the P·V products, as
// FlashAttention does on GPUs.
//
// Three paths, by what the compiler targets (cpu_paged.py builds with -march=native):
//   paged_decode            portable: one task per (row, KV head), loops for the vectorizer
//   paged_decode_avx512     AVX-512: the same tasks, head_dim in 16-lane float32 chunks
//   paged_decode_bf16_dot   AVX512-BF16, bfloat16 caches: one task per row, vdpbf16ps (below)

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
void paged_decode(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* tokens,
                  const int32_t* block_tables, const int32_t* seq_lens, int64_t rows,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t table_width, int64_t q_stride, int64_t o_stride, int64_t block_stride,
                  int64_t token_stride, float scale, int64_t window) {
  const int64_t G = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t BS = block_size;
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
        const T* kb = k_cache + blk * block_stride + j0 * token_stride + h * D;
        const T* vb = v_cache + blk * block_stride + j0 * token_stride + h * D;
        for (int64_t j = 0; j < nt; ++j) {
          const T* kr = kb + j * token_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(kr[d]);
            s[g * BS + j] = dot;
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
          const T* vr = vb + j * token_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * BS + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vr[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = out + tok * o_stride + (h * G + g) * D;
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; ++d) store(orow + d, acc[g * D + d] * inv);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FOUDRE_AVX512 1
// The AVX-512 paths: one task per decode row, walking its blocks in order in tiles of <= 16
// tokens, each tile for every KV head in turn, so that a block's K and V rows (all heads: one
// contiguous run in the [blocks, block_size, heads, dim] pool) are read front to back, once,
// while the next block is prefetched. Per tile and query head: 16 scores in one vector, the
// online-softmax update, then P·V into float32 accumulators. How scores and P·V are computed
// is the Ops policy: FmaOps (float32 FMAs, any storage type) or Bf16DotOps (AVX512-BF16).

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const _Float16* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
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
template <typename T>
struct FmaOps {
  using Elem = T;
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
  static __m512 dot(const Q* qh, const T* kr, int64_t nc, Mask tl) {
    const int64_t n = NC ? NC : nc;  // a constant where NC is
    __m512 d = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; ++c)
      d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * W), load16(kr + c * W, mask(c, n, tl)), d);
    return d;
  }

  static void store_p(__m512 p, float* pp) { _mm512_storeu_ps(pp, p); }

  // acc[g] = acc[g] * corr[g] + sum_j p[g][j] V[j] for GS query heads
  template <int GS, int NC>
  static void pv(float* acc, int64_t acc_stride, const float* corr, const float* pp, const T* vb,
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
inline __m512 qk_tile(const typename Ops::Q* qh, const typename Ops::Elem* kb, int64_t token_stride,
                      int64_t nt, int64_t nc, typename Ops::Mask tl) {
  __m512 v[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j)
    v[slot_of(j)] =
        j < nt ? Ops::template dot<NC>(qh, kb + j * token_stride, nc, tl) : _mm512_setzero_ps();
  return sum16(v);
}

// NC: head_dim's chunk count when known at compile time (0: computed from head_dim)
template <class Ops, int NC>
void paged_decode_rows(const typename Ops::Elem* q, const typename Ops::Elem* k_cache,
                       const typename Ops::Elem* v_cache, typename Ops::Elem* out,
                       const int32_t* tokens, const int32_t* block_tables, const int32_t* seq_lens,
                       int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t table_width, int64_t q_stride, int64_t o_stride,
                       int64_t block_stride, int64_t token_stride, float scale, int64_t window) {
  using T = typename Ops::Elem;
  constexpr int W = Ops::W;
  const int64_t G = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t nc = (D + W - 1) / W;
  const int64_t BS = block_size;  // any size: tiles never cross a block
  const auto tl = Ops::tail(D);
  const int64_t acc_stride = nc * W;
  // a block's K rows for all heads (contiguous in the pool), prefetched a query head's share
  // at a time while the previous block is computed (all at once would stall on the misses)
  const int64_t block_bytes = BS * token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t share = (block_bytes / num_heads + 63) / 64 * 64;
#pragma omp parallel
  {
    std::vector<typename Ops::Q> qv(num_heads * acc_stride);
    std::vector<float> acc(num_heads * acc_stride), m(num_heads), l(num_heads), corr(G);
    std::vector<float> pp(G * 16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t tok = tokens[r], len = seq_lens[r];
      for (int64_t hg = 0; hg < num_heads; ++hg) {
        Ops::load_q(q + tok * q_stride + hg * D, &qv[hg * acc_stride], nc, tl);
        m[hg] = -FLT_MAX;
        l[hg] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      // a sliding window starts the walk at the first key it sees: earlier blocks are not read
      const int64_t start = window > 0 && len > window ? len - window : 0;
      for (int64_t pos = start, nt = 0; pos < len; pos += nt) {
        const int64_t b = pos / BS, j0 = pos % BS;
        const int64_t blk = block_tables[r * table_width + b];
        nt = std::min<int64_t>({16, len - pos, BS - j0});
        const int64_t next =
            j0 + nt == BS && pos + nt < len ? block_tables[r * table_width + b + 1] : -1;
        const __mmask16 valid = static_cast<__mmask16>(nt == 16 ? 0xFFFFu : (1u << nt) - 1);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t off = blk * block_stride + j0 * token_stride + h * D;
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
            const __m512 s =
                qk_tile<Ops, NC>(&qv[hg * acc_stride], k_cache + off, token_stride, nt, nc, tl);
            const __m512 sc = _mm512_maskz_mul_ps(valid, s, _mm512_set1_ps(scale));
            const float mx = std::max(m[hg], _mm512_mask_reduce_max_ps(valid, sc));
            const __m512 p =
                _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
            corr[g] = exp_nonpositive(m[hg] - mx);
            l[hg] = l[hg] * corr[g] + _mm512_reduce_add_ps(p);
            m[hg] = mx;
            Ops::store_p(p, &pp[g * 16]);
          }
          for (int64_t g0 = 0; g0 < G; g0 += 4) {  // query heads 4 at a time: in registers
            float* a = &acc[(h * G + g0) * acc_stride];
            const float* cr = &corr[g0];
            const float* p = &pp[g0 * 16];
            const T* vb = v_cache + off;
            switch (std::min<int64_t>(4, G - g0)) {
              case 4:
                Ops::template pv<4, NC>(a, acc_stride, cr, p, vb, token_stride, nt, nc, tl);
                break;
              case 3:
                Ops::template pv<3, NC>(a, acc_stride, cr, p, vb, token_stride, nt, nc, tl);
                break;
              case 2:
                Ops::template pv<2, NC>(a, acc_stride, cr, p, vb, token_stride, nt, nc, tl);
                break;
              default:
                Ops::template pv<1, NC>(a, acc_stride, cr, p, vb, token_stride, nt, nc, tl);
            }
          }
        }
      }
      for (int64_t hg = 0; hg < num_heads; ++hg)
        Ops::write(out + tok * o_stride + hg * D, &acc[hg * acc_stride], 1.0f / l[hg], D);
    }
  }
}

// head_dim's chunk count as a compile-time constant for the common sizes (64..256)
template <class Ops, typename T>
void paged_decode_avx512(const T* q, const T* k, const T* v, T* out, const int32_t* tokens,
                         const int32_t* tables, const int32_t* lens, int64_t rows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t table_width, int64_t q_stride,
                         int64_t o_stride, int64_t block_stride, int64_t token_stride,
                         float scale, int64_t window) {
  auto f = paged_decode_rows<Ops, 0>;
  switch ((head_dim + Ops::W - 1) / Ops::W) {
    case 2:
      f = paged_decode_rows<Ops, 2>;
      break;
    case 3:
      f = paged_decode_rows<Ops, 3>;
      break;
    case 4:
      f = paged_decode_rows<Ops, 4>;
      break;
    default:
      break;
  }
  f(q, k, v, out, tokens, tables, lens, rows, num_heads, num_kv_heads, head_dim, block_size,
    table_width, q_stride, o_stride, block_stride, token_stride, scale, window);
}
#endif  // AVX-512

}  // namespace

#if defined(FOUDRE_AVX512)
#define FOUDRE_KERNEL(OPS, T) paged_decode_avx512<OPS, T>
#if defined(FOUDRE_BF16_DOT)
#define FOUDRE_BF16_OPS Bf16DotOps
#else
#define FOUDRE_BF16_OPS FmaOps<uint16_t>
#endif
#else
#define FOUDRE_KERNEL(OPS, T) paged_decode<T>
#define FOUDRE_BF16_OPS void
#endif

// NAME: every key of a row (the signature cpu_ops.cpp's decoder layers call); NAME_window: a
// sliding window, where a row of seq_len tokens sees its last `window` keys (0: all of them).
#define FOUDRE_PAGED_DECODE(NAME, OPS, T)                                                       \
  extern "C" void NAME##_window(                                                                \
      const void* q, const void* k, const void* v, void* out, const int32_t* tokens,            \
      const int32_t* tables, const int32_t* lens, int64_t rows, int64_t num_heads,              \
      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_width,          \
      int64_t q_stride, int64_t o_stride, int64_t block_stride, int64_t token_stride,           \
      float scale, int64_t window) {                                                            \
    FOUDRE_KERNEL(OPS, T)                                                                       \
    (static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),              \
     static_cast<T*>(out), tokens, tables, lens, rows, num_heads, num_kv_heads, head_dim,       \
     block_size, table_width, q_stride, o_stride, block_stride, token_stride, scale, window);   \
  }                                                                                             \
  extern "C" void NAME(const void* q, const void* k, const void* v, void* out,                  \
                       const int32_t* tokens, const int32_t* tables, const int32_t* lens,       \
                       int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, \
                       int64_t block_size, int64_t table_width, int64_t q_stride,               \
                       int64_t o_stride, int64_t block_stride, int64_t token_stride,            \
                       float scale) {                                                           \
    NAME##_window(q, k, v, out, tokens, tables, lens, rows, num_heads, num_kv_heads, head_dim,  \
                  block_size, table_width, q_stride, o_stride, block_stride, token_stride,      \
                  scale, 0);                                                                    \
  }

FOUDRE_PAGED_DECODE(paged_decode_f32, FmaOps<float>, float)
FOUDRE_PAGED_DECODE(paged_decode_bf16, FOUDRE_BF16_OPS, uint16_t)
FOUDRE_PAGED_DECODE(paged_decode_f16, FmaOps<_Float16>, _Float16)

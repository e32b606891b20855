// Paged prefill attention on the CPU: FlashAttention-2 over the block table.
//
// The rows of a step that compute several tokens (prompt chunks, speculative verification)
// attend to their own context: the prefix already in the cache (prefix hits, earlier chunks)
// and the chunk itself, whose K/V the backend wrote first. Nothing is gathered out of the pool
// and no mask tensor exists: one task per (sequence, KV head, tile of BQ query positions) walks
// the key range that tile can see, BK keys at a time, straight from the blocks, with an online
// softmax (running max m, running sum l, rescaled float32 accumulator). The causal limit and the
// sliding window are tile bounds: a tile starts at the first key any of its queries sees
// (rounded down to a multiple of BK, an absolute grid) and ends after its last query; only the
// tiles on the diagonal or on the window's edge compute per-lane masks. The query heads of a
// GQA group share each K/V tile, packed once.
//
// Layout: a query position is a SIMD lane. Scores are computed transposed, S^T[key][lane] =
// K · Q^T, by broadcasting a key's values against vectors of 16 query lanes (8 with AVX2), so
// the softmax's max and sum over keys are vertical (lane-wise) operations, and P·V as
// O^T[d][lane] += V[key][d] · P^T[key][lane], again a broadcast against query lanes. Both
// products are one micro-kernel (gemm below) over packed tiles of 32-bit words: float32 values
// (FMA), or pairs of bfloat16 (vdpbf16ps, AVX512-BF16), where a pair runs along head_dim for Q
// and K and along the keys for P and V. Each lane's arithmetic is independent of the other
// lanes and the key tiles lie on a fixed grid, so a query's output does not depend on the
// chunk or the batch it is computed in. Masked scores are exact zeros; tiles a lane does not
// see leave its state unchanged (rescaled by exp(0) = 1, plus zero).
//
// Five paths, by what the compiler targets (cpu_paged.py builds with -march=native):
//   prefill_f32<PortableTile>  portable C++ (loops over lanes for the vectorizer), float32 math
//   prefill_f32<Avx2Tile>      AVX2 + FMA: the same tiles on 8 lanes, a register-blocked kernel
//   prefill_f32<NeonTile>      NEON (aarch64): the AVX2 tiles on 4 lanes
//   prefill_avx512<F32Ops>     AVX-512 FMAs, any storage type converted to float32 when packed
//   prefill_avx512<Bf16Ops>    AVX512-BF16 on bfloat16 caches; the softmax weights are rounded
//                              to bfloat16 for P·V, as FlashAttention does (and the decode
//                              kernel)
//
// A quantized cache (kv_cache_dtype int8 / fp8: 8-bit codes, one float32 scale per token and KV
// head) is read as it lies: a tile's codes are converted when packed (AVX-512: int8 by vpmovsxbd
// + vcvtdq2ps, e4m3 by moving its bits into a float16's for vcvtph2ps; exact values, which
// bfloat16 holds exactly too, so the AVX512-BF16 path packs them as bfloat16), and the scales
// never touch a code: S^T's row of a key is multiplied by its scale with the softmax scale, and
// a key's weights P^T by its value scale once they joined the running sum.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_paged_common.h"

namespace {

constexpr int BQ = 32;  // query positions (lanes) per task
constexpr int BK = 32;  // keys per tile (even: bfloat16 pairs of keys)


// One sequence's multi-token row and one unit of work.
struct Seq {
  int64_t q_tok;   // flat index of its first new token in q / out
  int64_t q_len;   // new tokens
  int64_t ctx;     // context after them: the new tokens are positions ctx - q_len .. ctx - 1
  const int32_t* table;
};

struct Task {
  int64_t seq, head, q0, nq;  // query positions q0 .. q0 + nq - 1 of the row (row-relative)
  int64_t k_first, k_end;     // the keys its queries see: [k_first, k_end)
  int64_t k_begin() const { return k_first / BK * BK; }  // its first tile, on the BK grid
};

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, q_stride, o_stride, block_stride,
      token_stride, window;
  float scale;
  const float* k_scale;  // a quantized cache's scales (else null): laid out as the codes
  const float* v_scale;  // without head_dim (a code's offset / head_dim)
  const float* sinks;    // each query head's attention sink logit (null: none)
};

// The attention sink's term of query head hg's softmax denominator, exp(sinks[hg] - m), for a
// lane's running max m of the same (scaled) scores: a key whose value is zero (0 without sinks).
inline float sink_weight(const Shape& sh, int64_t hg, float m) {
  return sh.sinks == nullptr ? 0.0f : std::exp(sh.sinks[hg] - m);
}

// The tasks of a step, longest key range first (dynamic scheduling then balances the cores).
std::vector<Task> make_tasks(const std::vector<Seq>& seqs, const Shape& sh) {
  std::vector<Task> tasks;
  for (int64_t r = 0; r < static_cast<int64_t>(seqs.size()); ++r) {
    const Seq& s = seqs[r];
    for (int64_t q0 = 0; q0 < s.q_len; q0 += BQ) {
      const int64_t nq = std::min<int64_t>(BQ, s.q_len - q0);
      const int64_t first = s.ctx - s.q_len + q0, last = first + nq - 1;
      const int64_t k_first = sh.window > 0 ? std::max<int64_t>(0, first - sh.window + 1) : 0;
      for (int64_t h = 0; h < sh.num_kv_heads; ++h)
        tasks.push_back(Task{r, h, q0, nq, k_first, last + 1});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return a.k_end - a.k_first > b.k_end - b.k_first;
  });
  return tasks;
}

#if defined(FOUDRE_AVX512)
// ---------------------------------------------------------------------------------------------
// AVX-512 paths. Packed tiles hold 32-bit words: a float32, or a pair of bfloat16 (PAIR = 2).
//   Q  [G][PK][BQ]   PK = Dp / PAIR words per head_dim (Dp: head_dim rounded up to 8)
//   K  [BK][PK]      a key's row
//   V  [BK/PAIR][Dp] a key's (or a pair of keys') values along head_dim
//   P  [BK/PAIR][BQ] softmax weights of a key (or a pair of keys) for each lane
//   O  [G][Dp][BQ]   float32 accumulators, transposed
constexpr int MV = BQ / 16;  // lane vectors per tile row
constexpr int NR = 8;        // keys per micro-kernel call of S^T = K·Q^T (divides BK)
constexpr int DR = 8;        // head_dim rows per call of O^T += V^T·P^T (divides Dp)

// C[n][v] (+)= sum_k A[n][k] (x) B[k][v]: NR rows of the broadcast side A (strides a_n, a_k in
// words) against MV vectors of B (row stride BQ words); C rows c_stride floats apart. With ACC,
// C is loaded and scaled lane-wise by alpha first (the online softmax's rescaling).
template <class Ops, bool ACC, int NR>
inline void gemm(float* C, int64_t c_stride, const __m512* alpha, const uint32_t* A, int64_t a_n,
                 int64_t a_k, const uint32_t* B, int64_t K) {
  __m512 c[NR][MV];
#pragma GCC unroll 8
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v)
      c[n][v] = ACC ? _mm512_mul_ps(_mm512_loadu_ps(C + n * c_stride + v * 16), alpha[v])
                    : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512i b[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) b[v] = _mm512_loadu_si512(B + k * BQ + v * 16);
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(A[n * a_n + k * a_k]));
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) c[n][v] = Ops::madd(c[n][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(C + n * c_stride + v * 16, c[n][v]);
}

// 16 values of a row as float32 (the codes' exact values)
// e4m3's bits in a float16's (sign to bit 15, the rest to bits 7-13): its value times 2^-8
// (float16's exponent bias is 15, e4m3's 7), subnormals included; then times 2^8, exactly
inline __m512 load16(const Fp8* p, __mmask16 m) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000));
  const __m256i rest = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
}


// float32 arithmetic on any storage type: values converted when packed.
template <typename T>
struct F32Ops {
  using Elem = T;
  static constexpr int PAIR = 1;
  static __m512 madd(__m512 c, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), c);
  }
  static uint32_t word(const T* row, int64_t d, int64_t D) {  // value d of a row (0 past D)
    const float x = d < D ? load(row[d]) : 0.0f;
    uint32_t w;
    std::memcpy(&w, &x, 4);
    return w;
  }
  template <typename C>  // a K or V row: T, or codes
  static void pack_row(uint32_t* dst, const C* row, int64_t D, int64_t Dp) {
    if constexpr (std::is_same_v<C, T>) {
      for (int64_t d = 0; d < Dp; ++d) dst[d] = word(row, d, D);
    } else {
      for (int64_t d = 0; d < Dp; d += 16)
        _mm512_mask_storeu_ps(dst + d, lanes(Dp - d), load16(row + d, lanes(D - d)));
    }
  }
  // V rows of the tile (null rows: zeros): V[j][d]
  template <typename C>
  static void pack_v(uint32_t* dst, const C* const* rows, int64_t D, int64_t Dp) {
    for (int64_t j = 0; j < BK; ++j) {
      if (rows[j] != nullptr)
        pack_row(dst + j * Dp, rows[j], D, Dp);
      else
        std::fill(dst + j * Dp, dst + (j + 1) * Dp, 0u);
    }
  }
  // weights of key j for the MV lane vectors
  static void pack_p(uint32_t* dst, const float* p) {  // p[j][lane], j < BK
    std::memcpy(dst, p, BK * BQ * 4);
  }
};

#if defined(__AVX512BF16__)
#define FOUDRE_BF16_DOT 1
// bfloat16 with AVX512-BF16: vdpbf16ps multiplies pairs of bfloat16 exactly and adds both
// products into a float32 lane. Q and K pair consecutive head_dim values (their rows as 32-bit
// words, as stored); P and V pair consecutive keys: V's rows 2i and 2i+1 are interleaved.
struct Bf16Ops {
  using Elem = uint16_t;
  static constexpr int PAIR = 2;
  static __m512 madd(__m512 c, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(c, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
  static uint32_t word(const uint16_t* row, int64_t p, int64_t D) {  // pair p of a row
    const uint32_t lo = 2 * p < D ? row[2 * p] : 0u, hi = 2 * p + 1 < D ? row[2 * p + 1] : 0u;
    return lo | hi << 16;
  }
  // 16 values of a row as bfloat16: stored so, or codes (whose values bfloat16 holds exactly)
  static __m256i bf16x16(const uint16_t* p, __mmask16 m) { return _mm256_maskz_loadu_epi16(m, p); }
  template <typename C>
  static __m256i bf16x16(const C* p, __mmask16 m) {
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(load16(p, m)));
  }
  template <typename C>
  static void pack_row(uint32_t* dst, const C* row, int64_t D, int64_t Dp) {
    if constexpr (std::is_same_v<C, uint16_t>) {
      if (D == Dp) {
        std::memcpy(dst, row, D * 2);
        return;
      }
      for (int64_t p = 0; p < Dp / 2; ++p) dst[p] = word(row, p, D);
    } else {
      uint16_t* out = reinterpret_cast<uint16_t*>(dst);
      for (int64_t d = 0; d < Dp; d += 16)
        _mm256_mask_storeu_epi16(out + d, lanes(Dp - d), bf16x16(row + d, lanes(D - d)));
    }
  }
  template <typename C>
  static void pack_v(uint32_t* dst, const C* const* rows, int64_t D, int64_t Dp) {
    for (int64_t j = 0; j < BK; j += 2) {
      uint32_t* out = dst + (j / 2) * Dp;
      const C* r0 = rows[j];
      const C* r1 = rows[j + 1];
      for (int64_t d = 0; d < Dp; d += 16) {
        const __mmask16 mk = lanes(D - d);
        const __m512i a =
            r0 ? _mm512_cvtepu16_epi32(bf16x16(r0 + d, mk)) : _mm512_setzero_si512();
        const __m512i b =
            r1 ? _mm512_cvtepu16_epi32(bf16x16(r1 + d, mk)) : _mm512_setzero_si512();
        const __m512i w = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
        if (Dp - d >= 16)
          _mm512_storeu_si512(out + d, w);
        else
          _mm512_mask_storeu_epi32(out + d, static_cast<__mmask16>((1u << (Dp - d)) - 1), w);
      }
    }
  }
  static void pack_p(uint32_t* dst, const float* p) {  // pairs of keys, rounded to bfloat16
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    for (int j = 0; j < BK; j += 2)
      for (int v = 0; v < MV; ++v) {
        // low half: key j, high half: key j + 1; then interleaved into (j, j + 1) pairs
        const __m512i two = reinterpret_cast<__m512i>(
            _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + (j + 1) * BQ + v * 16),
                                _mm512_loadu_ps(p + j * BQ + v * 16)));
        _mm512_storeu_si512(dst + (j / 2) * BQ + v * 16, _mm512_permutexvar_epi16(idx, two));
      }
  }
};
#endif  // __AVX512BF16__

// C: the cache's elements, T (Ops::Elem), or codes with scales (sh.k_scale, sh.v_scale)
template <class Ops, typename C>
void prefill_avx512(const typename Ops::Elem* q, const C* k_cache, const C* v_cache,
                    typename Ops::Elem* out, const std::vector<Seq>& seqs, const Shape& sh) {
  using T = typename Ops::Elem;
  constexpr bool quantized = !std::is_same_v<C, T>;
  constexpr int PAIR = Ops::PAIR;
  const std::vector<Task> tasks = make_tasks(seqs, sh);
  const int64_t G = sh.num_heads / sh.num_kv_heads, D = sh.head_dim;
  const int64_t Dp = (D + 7) / 8 * 8, PK = Dp / PAIR, KJ = BK / PAIR;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale = _mm512_set1_ps(sh.scale);
  const int64_t window = sh.window;
#pragma omp parallel
  {
    std::vector<uint32_t> qp(G * PK * BQ), kt(BK * PK), vt(KJ * Dp), pt(KJ * BQ);
    std::vector<float> acc(G * Dp * BQ), st(BK * BQ), m(G * BQ), l(G * BQ);
    std::vector<__mmask16> valid(BK * MV);
    std::vector<const C*> krows(BK), vrows(BK);
    std::vector<float> kmul(BK, sh.scale), vmul(BK, 1.0f);  // per key: scale (x its scales)
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
      const Task& task = tasks[t];
      const Seq& sq = seqs[task.seq];
      const int64_t first = sq.ctx - sq.q_len + task.q0, last = first + task.nq - 1;
      __m512i qpos[MV];  // each lane's position, -1 past the row's queries (sees nothing)
      for (int v = 0; v < MV; ++v) {
        const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(v * 16));
        const __mmask16 live = _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32(task.nq));
        qpos[v] = _mm512_mask_add_epi32(_mm512_set1_epi32(-1), live, at,
                                        _mm512_set1_epi32(static_cast<int32_t>(first)));
      }
      std::fill(qp.begin(), qp.end(), 0u);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < task.nq; ++i) {
          const T* qr = q + (sq.q_tok + task.q0 + i) * sh.q_stride + (task.head * G + g) * D;
          for (int64_t w = 0; w < PK; ++w) qp[(g * PK + w) * BQ + i] = Ops::word(qr, w, D);
        }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -FLT_MAX);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t j0 = task.k_begin(); j0 < task.k_end; j0 += BK) {
        // rows [lo, nk) of the tile are keys the queries may see; the others (before the
        // window, past the last query) are zeros, never read: they may hold anything
        const int64_t nk = std::min<int64_t>(BK, task.k_end - j0);
        const int64_t lo = std::max<int64_t>(0, task.k_first - j0);
        // each key's row in its block (one division per tile, then a walk along the blocks)
        int64_t b = (j0 + lo) / sh.block_size, at = (j0 + lo) % sh.block_size;
        for (int64_t jj = 0; jj < BK; ++jj) {
          krows[jj] = vrows[jj] = nullptr;
          if (jj < lo || jj >= nk) continue;
          const int64_t off = sq.table[b] * sh.block_stride + at * sh.token_stride +
                              task.head * sh.head_dim;
          krows[jj] = k_cache + off;
          vrows[jj] = v_cache + off;
          if constexpr (quantized) {
            kmul[jj] = sh.scale * sh.k_scale[off / D];
            vmul[jj] = sh.v_scale[off / D];
          }
          if (++at == sh.block_size) {
            at = 0;
            ++b;
          }
        }
        for (int64_t jj = 0; jj < BK; ++jj) {
          if (krows[jj] != nullptr)
            Ops::pack_row(&kt[jj * PK], krows[jj], D, Dp);
          else
            std::fill(&kt[jj * PK], &kt[(jj + 1) * PK], 0u);
        }
        Ops::pack_v(vt.data(), vrows.data(), D, Dp);
        // every lane sees every key of the tile: no masks
        const bool full = task.nq == BQ && j0 + BK - 1 <= first &&
                          (window <= 0 || last - j0 < window);
        if (!full)
          for (int64_t jj = 0; jj < BK; ++jj) {
            const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(j0 + jj));
            for (int v = 0; v < MV; ++v) {
              __mmask16 ok = _mm512_cmple_epi32_mask(j, qpos[v]);
              if (window > 0)
                ok &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(qpos[v], j),
                                              _mm512_set1_epi32(static_cast<int32_t>(window)));
              valid[jj * MV + v] = jj < nk ? ok : 0;
            }
          }
        for (int64_t g = 0; g < G; ++g) {
          // S^T = K · Q^T for the BK keys
          for (int64_t n = 0; n < BK; n += NR)
            gemm<Ops, false, NR>(&st[n * BQ], BQ, nullptr, &kt[n * PK], PK, 1, &qp[g * PK * BQ],
                                 PK);
          // the online softmax, lane-wise: scores -> weights in place in st
          __m512 alpha[MV];
          for (int v = 0; v < MV; ++v) {
            float* mv = &m[g * BQ + v * 16];
            float* lv = &l[g * BQ + v * 16];
            const __m512 m_old = _mm512_loadu_ps(mv);
            __m512 mx = m_old;
            for (int64_t jj = 0; jj < BK; ++jj) {
              float* at = &st[jj * BQ + v * 16];
              __m512 s = _mm512_mul_ps(_mm512_loadu_ps(at),
                                       quantized ? _mm512_set1_ps(kmul[jj]) : scale);
              if (!full) s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[jj * MV + v], s);
              _mm512_storeu_ps(at, s);
              mx = _mm512_max_ps(mx, s);
            }
            alpha[v] = exp16(_mm512_sub_ps(m_old, mx));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t jj = 0; jj < BK; ++jj) {
              float* at = &st[jj * BQ + v * 16];
              __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(at), mx));
              if (!full) p = _mm512_maskz_mov_ps(valid[jj * MV + v], p);
              sum = _mm512_add_ps(sum, p);
              if constexpr (quantized) p = _mm512_mul_ps(p, _mm512_set1_ps(vmul[jj]));
              _mm512_storeu_ps(at, p);
            }
            _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), alpha[v], sum));
            _mm512_storeu_ps(mv, mx);
          }
          Ops::pack_p(pt.data(), st.data());
          // O^T = O^T * alpha + V^T · P^T
          float* ag = &acc[g * Dp * BQ];
          for (int64_t d = 0; d < Dp; d += DR)
            gemm<Ops, true, DR>(ag + d * BQ, BQ, alpha, &vt[d], 1, Dp, pt.data(), KJ);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        alignas(64) float inv[BQ];
        for (int v = 0; v < MV; ++v)
          _mm512_storeu_ps(inv + v * 16, _mm512_div_ps(_mm512_set1_ps(1.0f),
                                                       _mm512_loadu_ps(&l[g * BQ + v * 16])));
        if (sh.sinks != nullptr)
          for (int64_t i = 0; i < task.nq; ++i)
            inv[i] = 1.0f / (l[g * BQ + i] + sink_weight(sh, task.head * G + g, m[g * BQ + i]));
        const float* ag = &acc[g * Dp * BQ];
        for (int64_t i = 0; i < task.nq; ++i) {
          T* orow = out + (sq.q_tok + task.q0 + i) * sh.o_stride + (task.head * G + g) * D;
          for (int64_t d = 0; d < D; ++d) store(orow + d, ag[d * BQ + i] * inv[i]);
        }
      }
    }
  }
}
#endif  // AVX-512

// ---------------------------------------------------------------------------------------------
// Paths without AVX-512: the AVX-512 float32 path's tasks and tiles, float32 values throughout,
// each K and V row converted once (zeros past head_dim and for the rows a tile's queries do not
// see; e4m3 codes as 2^-8 their values, kUnit, the factor folded into the scales):
//   Q [G][Dp][BQ], K and V [BK][Dp], S [BK][BQ] (scores, then weights), O [G][Dp][BQ]
// and where a tile is not seen whole, lane masks M [BK][BQ] (all ones: the query sees the key).
// A Tile computes one query head's part of a tile (S, the online softmax, O): PortableTile in
// plain loops for the vectorizer, Avx2Tile on 8 lanes with a register-blocked micro-kernel.
// (The portable loops, which store every partial score, took 16% of a 1024-token prefill of the
// 494.7M Llama in int4 on a Zen 3; Avx2Tile 9%.)

struct PortableTile {
  template <typename C>
  static void row(float* dst, const C* src, int64_t D, int64_t Dp) {
    for (int64_t d = 0; d < Dp; ++d) dst[d] = d < D ? load(src[d]) / kUnit<C> : 0.0f;
  }
  // kmul: each key's factor of its score (the softmax scale, times its scale for codes); vmul:
  // of its weight (codes: its value scale); valid: null where every lane sees every key
  template <bool Quantized>
  static void step(const float* kt, const float* vt, const float* qg, int64_t Dp, float* st,
                   float* ag, float* mg, float* lg, const uint32_t* valid, const float* kmul,
                   const float* vmul) {
    float mx[BQ], alpha[BQ], sum[BQ];
    for (int64_t i = 0; i < BQ; ++i) mx[i] = mg[i];
    for (int64_t jj = 0; jj < BK; ++jj) {
      float* sr = &st[jj * BQ];
      for (int64_t i = 0; i < BQ; ++i) sr[i] = 0.0f;
      for (int64_t d = 0; d < Dp; ++d) {
        const float kd = kt[jj * Dp + d];
        const float* qd = &qg[d * BQ];
#pragma omp simd
        for (int64_t i = 0; i < BQ; ++i) sr[i] += kd * qd[i];
      }
      for (int64_t i = 0; i < BQ; ++i) {
        sr[i] = valid == nullptr || valid[jj * BQ + i] ? sr[i] * kmul[jj] : -INFINITY;
        mx[i] = sr[i] > mx[i] ? sr[i] : mx[i];
      }
    }
    for (int64_t i = 0; i < BQ; ++i) {
      alpha[i] = exp_nonpositive(mg[i] - mx[i]);
      sum[i] = 0.0f;
    }
    for (int64_t jj = 0; jj < BK; ++jj) {
      float* sr = &st[jj * BQ];
      for (int64_t i = 0; i < BQ; ++i) {
        sr[i] = valid == nullptr || valid[jj * BQ + i] ? exp_nonpositive(sr[i] - mx[i]) : 0.0f;
        sum[i] += sr[i];
        if constexpr (Quantized) sr[i] *= vmul[jj];
      }
    }
    for (int64_t i = 0; i < BQ; ++i) {
      lg[i] = lg[i] * alpha[i] + sum[i];
      mg[i] = mx[i];
    }
    for (int64_t d = 0; d < Dp; ++d) {
      float* ad = &ag[d * BQ];
#pragma omp simd
      for (int64_t i = 0; i < BQ; ++i) ad[i] *= alpha[i];
      for (int64_t jj = 0; jj < BK; ++jj) {
        const float vd = vt[jj * Dp + d];
        const float* pr = &st[jj * BQ];
#pragma omp simd
        for (int64_t i = 0; i < BQ; ++i) ad[i] += vd * pr[i];
      }
    }
  }
};

#if defined(FOUDRE_AVX2)
constexpr int MV8 = BQ / 8;  // lane vectors per tile row
constexpr int NR8 = 2;       // broadcast rows per micro-kernel call (divides BK and Dp)

// C[n][.] (+)= sum_k A[n * a_n + k * a_k] B[k][.] for NR8 rows of C (row stride BQ): NR8
// broadcasts against the MV8 vectors of a row of B, 8 accumulators of the 16 ymm registers; with
// ACC, C is loaded and scaled lane-wise by alpha first (the online softmax's rescaling)
template <bool ACC>
inline void gemm8(float* C, const __m256* alpha, const float* A, int64_t a_n, int64_t a_k,
                  const float* B, int64_t K) {
  __m256 c[NR8][MV8];
  for (int n = 0; n < NR8; ++n)
#pragma GCC unroll 4
    for (int v = 0; v < MV8; ++v)
      c[n][v] = ACC ? _mm256_mul_ps(_mm256_loadu_ps(C + n * BQ + v * 8), alpha[v])
                    : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[MV8];
#pragma GCC unroll 4
    for (int v = 0; v < MV8; ++v) b[v] = _mm256_loadu_ps(B + k * BQ + v * 8);
    for (int n = 0; n < NR8; ++n) {
      const __m256 a = _mm256_broadcast_ss(A + n * a_n + k * a_k);
#pragma GCC unroll 4
      for (int v = 0; v < MV8; ++v) c[n][v] = _mm256_fmadd_ps(a, b[v], c[n][v]);
    }
  }
  for (int n = 0; n < NR8; ++n)
#pragma GCC unroll 4
    for (int v = 0; v < MV8; ++v) _mm256_storeu_ps(C + n * BQ + v * 8, c[n][v]);
}

struct Avx2Tile {
  template <typename C>
  static void row(float* dst, const C* src, int64_t D, int64_t Dp) {
    convert_row8(dst, src, D, Dp);
  }
  template <bool Quantized>
  static void step(const float* kt, const float* vt, const float* qg, int64_t Dp, float* st,
                   float* ag, float* mg, float* lg, const uint32_t* valid, const float* kmul,
                   const float* vmul) {
    for (int64_t n = 0; n < BK; n += NR8)  // S = K · Q^T
      gemm8<false>(&st[n * BQ], nullptr, &kt[n * Dp], Dp, 1, qg, Dp);
    __m256 alpha[MV8];  // the online softmax, lane-wise: scores -> weights in place in st
    for (int v = 0; v < MV8; ++v) {
      const auto ok = [&](int64_t jj) {
        return _mm256_castsi256_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(valid + jj * BQ + v * 8)));
      };
      const __m256 m_old = _mm256_loadu_ps(mg + v * 8);
      __m256 mx = m_old;
      for (int64_t jj = 0; jj < BK; ++jj) {
        float* at = &st[jj * BQ + v * 8];
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(at), _mm256_set1_ps(kmul[jj]));
        if (valid != nullptr) s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, ok(jj));
        _mm256_storeu_ps(at, s);
        mx = _mm256_max_ps(mx, s);
      }
      alpha[v] = exp8(_mm256_sub_ps(m_old, mx));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t jj = 0; jj < BK; ++jj) {
        float* at = &st[jj * BQ + v * 8];
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), mx));
        if (valid != nullptr) p = _mm256_and_ps(p, ok(jj));
        sum = _mm256_add_ps(sum, p);
        if constexpr (Quantized) p = _mm256_mul_ps(p, _mm256_set1_ps(vmul[jj]));
        _mm256_storeu_ps(at, p);
      }
      _mm256_storeu_ps(lg + v * 8, _mm256_fmadd_ps(_mm256_loadu_ps(lg + v * 8), alpha[v], sum));
      _mm256_storeu_ps(mg + v * 8, mx);
    }
    for (int64_t d = 0; d < Dp; d += NR8)  // O^T = O^T * alpha + V^T · P^T
      gemm8<true>(ag + d * BQ, alpha, &vt[d], 1, Dp, st, BK);
  }
};
#define FOUDRE_F32_TILE Avx2Tile
#elif defined(FOUDRE_NEON)
constexpr int MV4 = BQ / 4;  // lane vectors per tile row
constexpr int NR4 = 2;       // broadcast rows per micro-kernel call (divides BK and Dp)

// gemm8 on 4 lanes (NEON, aarch64): NR4 broadcasts against the MV4 vectors of a row of B, 16
// accumulators of the 32 vector registers; with ACC, C loaded and scaled by alpha first
template <bool ACC>
inline void gemm4(float* C, const float32x4_t* alpha, const float* A, int64_t a_n, int64_t a_k,
                  const float* B, int64_t K) {
  float32x4_t c[NR4][MV4];
  for (int n = 0; n < NR4; ++n)
#pragma GCC unroll 8
    for (int v = 0; v < MV4; ++v)
      c[n][v] = ACC ? vmulq_f32(vld1q_f32(C + n * BQ + v * 4), alpha[v]) : vdupq_n_f32(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    float32x4_t b[MV4];
#pragma GCC unroll 8
    for (int v = 0; v < MV4; ++v) b[v] = vld1q_f32(B + k * BQ + v * 4);
    for (int n = 0; n < NR4; ++n) {
      const float a = A[n * a_n + k * a_k];
#pragma GCC unroll 8
      for (int v = 0; v < MV4; ++v) c[n][v] = vfmaq_n_f32(c[n][v], b[v], a);
    }
  }
  for (int n = 0; n < NR4; ++n)
#pragma GCC unroll 8
    for (int v = 0; v < MV4; ++v) vst1q_f32(C + n * BQ + v * 4, c[n][v]);
}

// Avx2Tile on 4 lanes (not timed: no Arm machine)
struct NeonTile {
  template <typename C>
  static void row(float* dst, const C* src, int64_t D, int64_t Dp) {
    convert_row4(dst, src, D, Dp);
  }
  template <bool Quantized>
  static void step(const float* kt, const float* vt, const float* qg, int64_t Dp, float* st,
                   float* ag, float* mg, float* lg, const uint32_t* valid, const float* kmul,
                   const float* vmul) {
    for (int64_t n = 0; n < BK; n += NR4)  // S = K · Q^T
      gemm4<false>(&st[n * BQ], nullptr, &kt[n * Dp], Dp, 1, qg, Dp);
    float32x4_t alpha[MV4];  // the online softmax, lane-wise: scores -> weights in place in st
    for (int v = 0; v < MV4; ++v) {
      const auto ok = [&](int64_t jj) { return vld1q_u32(valid + jj * BQ + v * 4); };
      const float32x4_t m_old = vld1q_f32(mg + v * 4);
      float32x4_t mx = m_old;
      for (int64_t jj = 0; jj < BK; ++jj) {
        float* at = &st[jj * BQ + v * 4];
        float32x4_t s = vmulq_n_f32(vld1q_f32(at), kmul[jj]);
        if (valid != nullptr) s = vbslq_f32(ok(jj), s, vdupq_n_f32(-INFINITY));
        vst1q_f32(at, s);
        mx = vmaxq_f32(mx, s);
      }
      alpha[v] = exp4(vsubq_f32(m_old, mx));
      float32x4_t sum = vdupq_n_f32(0.0f);
      for (int64_t jj = 0; jj < BK; ++jj) {
        float* at = &st[jj * BQ + v * 4];
        float32x4_t p = exp4(vsubq_f32(vld1q_f32(at), mx));
        if (valid != nullptr)
          p = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(p), ok(jj)));
        sum = vaddq_f32(sum, p);
        if constexpr (Quantized) p = vmulq_n_f32(p, vmul[jj]);
        vst1q_f32(at, p);
      }
      vst1q_f32(lg + v * 4, vfmaq_f32(sum, vld1q_f32(lg + v * 4), alpha[v]));
      vst1q_f32(mg + v * 4, mx);
    }
    for (int64_t d = 0; d < Dp; d += NR4)  // O^T = O^T * alpha + V^T · P^T
      gemm4<true>(ag + d * BQ, alpha, &vt[d], 1, Dp, st, BK);
  }
};
#define FOUDRE_F32_TILE NeonTile
#else
#define FOUDRE_F32_TILE PortableTile
#endif  // AVX2, NEON

// T: the queries' and outputs' type; C: the cache's (T, or int8_t / Fp8 codes with scales)
template <typename T, typename C, class Tile>
void prefill_f32(const T* q, const C* k_cache, const C* v_cache, T* out,
                 const std::vector<Seq>& seqs, const Shape& sh) {
  constexpr bool quantized = !std::is_same_v<T, C>;
  const std::vector<Task> tasks = make_tasks(seqs, sh);
  const int64_t G = sh.num_heads / sh.num_kv_heads, D = sh.head_dim, Dp = (D + 7) / 8 * 8;
  const int64_t window = sh.window;
#pragma omp parallel
  {
    std::vector<float> qp(G * Dp * BQ), kt(BK * Dp), vt(BK * Dp), st(BK * BQ);
    std::vector<float> acc(G * Dp * BQ), m(G * BQ), l(G * BQ);
    std::vector<uint32_t> valid(BK * BQ);
    std::vector<float> kmul(BK, sh.scale), vmul(BK, 1.0f);  // per key (codes: x its scales)
    int64_t qpos[BQ];  // each lane's position, -1 past the row's queries (sees nothing)
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
      const Task& task = tasks[t];
      const Seq& sq = seqs[task.seq];
      const int64_t first = sq.ctx - sq.q_len + task.q0, last = first + task.nq - 1;
      for (int64_t i = 0; i < BQ; ++i) qpos[i] = i < task.nq ? first + i : -1;
      std::fill(qp.begin(), qp.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < task.nq; ++i) {
          const T* qr = q + (sq.q_tok + task.q0 + i) * sh.q_stride + (task.head * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qp[(g * Dp + d) * BQ + i] = load(qr[d]);
        }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -FLT_MAX);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t j0 = task.k_begin(); j0 < task.k_end; j0 += BK) {
        // rows [lo, nk) of the tile are keys the queries may see; the others (before the
        // window, past the last query) are zeros, never read: they may hold anything
        const int64_t nk = std::min<int64_t>(BK, task.k_end - j0);
        const int64_t lo = std::max<int64_t>(0, task.k_first - j0);
        int64_t b = (j0 + lo) / sh.block_size, at = (j0 + lo) % sh.block_size;
        for (int64_t jj = 0; jj < BK; ++jj) {
          if (jj < lo || jj >= nk) {
            std::fill(&kt[jj * Dp], &kt[(jj + 1) * Dp], 0.0f);
            std::fill(&vt[jj * Dp], &vt[(jj + 1) * Dp], 0.0f);
            continue;
          }
          const int64_t off =
              sq.table[b] * sh.block_stride + at * sh.token_stride + task.head * D;
          Tile::row(&kt[jj * Dp], k_cache + off, D, Dp);
          Tile::row(&vt[jj * Dp], v_cache + off, D, Dp);
          if constexpr (quantized) {
            kmul[jj] = sh.scale * sh.k_scale[off / D] * kUnit<C>;
            vmul[jj] = sh.v_scale[off / D] * kUnit<C>;
          }
          if (++at == sh.block_size) {
            at = 0;
            ++b;
          }
        }
        // every lane sees every key of the tile: no masks
        const bool full = task.nq == BQ && j0 + BK - 1 <= first &&
                          (window <= 0 || last - j0 < window);
        if (!full)
          for (int64_t jj = 0; jj < BK; ++jj) {
            const int64_t j = j0 + jj;
            for (int64_t i = 0; i < BQ; ++i)
              valid[jj * BQ + i] =
                  jj < nk && j <= qpos[i] && (window <= 0 || qpos[i] - j < window) ? ~0u : 0u;
          }
        for (int64_t g = 0; g < G; ++g)
          Tile::template step<quantized>(kt.data(), vt.data(), &qp[g * Dp * BQ], Dp, st.data(),
                                         &acc[g * Dp * BQ], &m[g * BQ], &l[g * BQ],
                                         full ? nullptr : valid.data(), kmul.data(),
                                         vmul.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* ag = &acc[g * Dp * BQ];
        for (int64_t i = 0; i < task.nq; ++i) {
          T* orow = out + (sq.q_tok + task.q0 + i) * sh.o_stride + (task.head * G + g) * D;
          const float inv =
              1.0f / (l[g * BQ + i] + sink_weight(sh, task.head * G + g, m[g * BQ + i]));
          for (int64_t d = 0; d < D; ++d) store(orow + d, ag[d * BQ + i] * inv);
        }
      }
    }
  }
}

template <typename T, typename C, class Fast>
void prefill(const void* q, const void* k, const void* v, void* out, const int32_t* q_starts,
             const int32_t* q_lens, const int32_t* seq_lens, const int32_t* tables, int64_t rows,
             int64_t table_width, const Shape& sh) {
  std::vector<Seq> seqs;
  for (int64_t r = 0; r < rows; ++r)
    seqs.push_back(Seq{q_starts[r], q_lens[r], seq_lens[r], tables + r * table_width});
  const T* qt = static_cast<const T*>(q);
  const C* kt = static_cast<const C*>(k);
  const C* vt = static_cast<const C*>(v);
  T* ot = static_cast<T*>(out);
#if defined(FOUDRE_AVX512)
  prefill_avx512<Fast, C>(qt, kt, vt, ot, seqs, sh);
#else
  prefill_f32<T, C, FOUDRE_F32_TILE>(qt, kt, vt, ot, seqs, sh);
#endif
}

}  // namespace

#if defined(FOUDRE_AVX512)
#define FOUDRE_F32_OPS F32Ops<float>
#define FOUDRE_F16_OPS F32Ops<Half>
#if defined(FOUDRE_BF16_DOT)
#define FOUDRE_BF16_OPS Bf16Ops
#else
#define FOUDRE_BF16_OPS F32Ops<uint16_t>
#endif
#else
#define FOUDRE_F32_OPS void
#define FOUDRE_F16_OPS void
#define FOUDRE_BF16_OPS void
#endif

// Row r computes q_lens[r] tokens, flat indices q_starts[r].., at the last positions of a
// context of seq_lens[r] tokens held in blocks tables[r]; their K/V are already in the cache.
// window > 0: a query at position p sees keys p - window + 1 .. p (else 0 .. p). sinks (null:
// none): each query head's attention sink logit, a key of value zero in its softmax (gpt-oss).
#define FOUDRE_PAGED_PREFILL(NAME, T, OPS)                                                        \
  extern "C" void NAME(const void* q, const void* k, const void* v, void* out,                   \
                       const int32_t* q_starts, const int32_t* q_lens, const int32_t* seq_lens,  \
                       const int32_t* tables, int64_t rows, int64_t num_heads,                   \
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,               \
                       int64_t table_width, int64_t q_stride, int64_t o_stride,                  \
                       int64_t block_stride, int64_t token_stride, int64_t window, float scale,  \
                       const float* sinks) {                                                     \
    const Shape sh{num_heads,    num_kv_heads, head_dim, block_size, q_stride, o_stride,         \
                   block_stride, token_stride, window,   scale,      nullptr,  nullptr,  sinks}; \
    prefill<T, T, OPS>(q, k, v, out, q_starts, q_lens, seq_lens, tables, rows, table_width, sh); \
  }

FOUDRE_PAGED_PREFILL(paged_prefill_f32, float, FOUDRE_F32_OPS)
FOUDRE_PAGED_PREFILL(paged_prefill_bf16, uint16_t, FOUDRE_BF16_OPS)
FOUDRE_PAGED_PREFILL(paged_prefill_f16, Half, FOUDRE_F16_OPS)

// A quantized cache: k / v hold the codes (C: int8_t or Fp8), k_scale / v_scale their scales,
// laid out as the codes without head_dim; queries and outputs of type T.
#define FOUDRE_PAGED_PREFILL_CODES(NAME, T, C, OPS)                                               \
  extern "C" void NAME(const void* q, const void* k, const void* v, const float* k_scale,        \
                       const float* v_scale, void* out, const int32_t* q_starts,                 \
                       const int32_t* q_lens, const int32_t* seq_lens, const int32_t* tables,    \
                       int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,  \
                       int64_t block_size, int64_t table_width, int64_t q_stride,                \
                       int64_t o_stride, int64_t block_stride, int64_t token_stride,             \
                       int64_t window, float scale, const float* sinks) {                        \
    const Shape sh{num_heads,    num_kv_heads, head_dim, block_size, q_stride, o_stride,         \
                   block_stride, token_stride, window,   scale,      k_scale,  v_scale,  sinks}; \
    prefill<T, C, OPS>(q, k, v, out, q_starts, q_lens, seq_lens, tables, rows, table_width, sh); \
  }

FOUDRE_PAGED_PREFILL_CODES(paged_prefill_f32_int8, float, int8_t, FOUDRE_F32_OPS)
FOUDRE_PAGED_PREFILL_CODES(paged_prefill_bf16_int8, uint16_t, int8_t, FOUDRE_BF16_OPS)
FOUDRE_PAGED_PREFILL_CODES(paged_prefill_f16_int8, Half, int8_t, FOUDRE_F16_OPS)
FOUDRE_PAGED_PREFILL_CODES(paged_prefill_f32_fp8, float, Fp8, FOUDRE_F32_OPS)
FOUDRE_PAGED_PREFILL_CODES(paged_prefill_bf16_fp8, uint16_t, Fp8, FOUDRE_BF16_OPS)
FOUDRE_PAGED_PREFILL_CODES(paged_prefill_f16_fp8, Half, Fp8, FOUDRE_F16_OPS)

// DeepSeek-V3's parts of the native decode step (included by cpu_ops.cpp after its helpers:
// project, rms_norm, rope, linear, moe_experts, the paged-decode kernel's type, AttentionRows):
// multi-head latent attention in the absorbed form over the latent pages, and the sigmoid,
// group-limited routing of its experts. models/deepseek_v3.py and layers/moe.py call the same
// functions (exported below) at decode sizes, so both paths give the same bits.

// The absorbed query: out[t, h, :rank] = q[t, h, :nope] @ W_UK[h] (W_UK[h] = kv_b's first nope
// rows of head h, kv_b [heads, nope + v, rank]: kv_b_proj's weight), float32 sums over the nope
// values in order, one rounding to T. q's rows at q_stride, heads at q_head; out's rows at
// out_stride, heads at out_head. Each W_UK row is read once for all the rows.
template <typename T>
void latent_absorb(const T* q, int64_t q_stride, int64_t q_head, const T* kv_b, T* out,
                   int64_t out_stride, int64_t out_head, int64_t rows, int64_t heads,
                   int64_t nope, int64_t v, int64_t rank) {
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<float> acc(rows * rank, 0.0f);
    const T* w = kv_b + h * (nope + v) * rank;
    for (int64_t i = 0; i < nope; ++i) {
      const T* wi = w + i * rank;
      for (int64_t t = 0; t < rows; ++t) {
        const float qi = to_float(q[t * q_stride + h * q_head + i]);
        float* a = acc.data() + t * rank;
        for (int64_t j = 0; j < rank; ++j) a[j] += qi * to_float(wi[j]);
      }
    }
    for (int64_t t = 0; t < rows; ++t)
      store_rounded(out + t * out_stride + h * out_head, acc.data() + t * rank, rank);
  }
}

// float32 dot product of n values: 16 running sums (lane l takes the values l, l + 16, ...),
// then added in lane order
template <typename A, typename B>
float dot16(const A* a, const B* b, int64_t n) {
  float s[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) s[l] += to_float(a[i + l]) * to_float(b[i + l]);
  for (int l = 0; i + l < n; ++l) s[l] += to_float(a[i + l]) * to_float(b[i + l]);
  float total = 0.0f;
  for (int l = 0; l < 16; ++l) total += s[l];
  return total;
}

// The values out of the latent: out[t, h, :v] = W_UV[h] @ o[t, h, :rank] (W_UV[h] = kv_b's
// last v rows of head h), each a dot16, rounded to T. o's rows at o_stride, heads at o_head;
// out [rows, heads, v].
template <typename T>
void latent_unabsorb(const T* o, int64_t o_stride, int64_t o_head, const T* kv_b, T* out,
                     int64_t rows, int64_t heads, int64_t nope, int64_t v, int64_t rank) {
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < heads; ++h) {
    const T* w = kv_b + (h * (nope + v) + nope) * rank;
    std::vector<float> acc(v);
    for (int64_t t = 0; t < rows; ++t) {
      const T* ot = o + t * o_stride + h * o_head;
      for (int64_t j = 0; j < v; ++j) acc[j] = dot16(ot, w + j * rank, rank);
      store_rounded(out + (t * heads + h) * v, acc.data(), v);
    }
  }
}

// DeepSeek-V3's routing of `rows` rows x [rows, hidden] over `experts`: float32 logits (dot16 of
// x and each router row), scores sigmoid(logit); each row chooses by score + bias[e] (float32),
// among the experts of its best topk_group of n_group equal groups only where topk_group <
// n_group (a group ranked by the sum of its two best biased scores; the lower group first among
// equals), the top_k best (the lower index first among equals); its weights are their scores,
// divided by their sum (+ 1e-20) when `renormalize`, times `scaling`. What layers/moe.py's
// route_grouped computes with torch ops, within float32 rounding.
template <typename T>
void route_grouped(const T* x, int64_t rows, int64_t hidden, const T* router, int64_t experts,
                   const float* bias, int64_t top_k, int64_t n_group, int64_t topk_group,
                   bool renormalize, float scaling, int64_t* ids, float* weights) {
  std::vector<float> score(experts), choice(experts), group(n_group);
  std::vector<char> taken(std::max(experts, n_group));
  const int64_t per = experts / n_group;
  const auto best = [&taken](const float* v, int64_t n) {  // the lower index first among equals
    int64_t b = -1;
    for (int64_t e = 0; e < n; ++e)
      if (!taken[e] && (b < 0 || v[e] > v[b])) b = e;
    taken[b] = 1;
    return b;
  };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < experts; ++e) {
      const float logit = dot16(x + r * hidden, router + e * hidden, hidden);
      score[e] = 1.0f / (1.0f + std::exp(-logit));
      choice[e] = score[e] + bias[e];
    }
    if (n_group > 1 && topk_group < n_group) {
      for (int64_t g = 0; g < n_group; ++g) {
        std::fill(taken.begin(), taken.end(), 0);
        const int64_t a = best(choice.data() + g * per, per), b = best(choice.data() + g * per, per);
        group[g] = choice[g * per + a] + choice[g * per + b];
      }
      std::fill(taken.begin(), taken.end(), 0);
      for (int64_t j = 0; j < topk_group; ++j) best(group.data(), n_group);
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[e / per]) choice[e] = -INFINITY;
    }
    std::fill(taken.begin(), taken.end(), 0);
    int64_t* id = ids + r * top_k;
    float* w = weights + r * top_k;
    for (int64_t j = 0; j < top_k; ++j) {
      id[j] = best(choice.data(), experts);
      w[j] = score[id[j]];
    }
    if (renormalize) {
      float total = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) total += w[j];
      total += 1e-20f;
      for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
    }
    for (int64_t j = 0; j < top_k; ++j) w[j] *= scaling;
  }
}

// The routed experts quantized (quant/experts.QuantExperts of QuantLinears on cpu_qmatmul, SiLU
// between them): table[e] the address of expert e's gate_up QuantSlot descriptor, table[experts
// + e] its down's. cpu_ops.cpp's by_expert around each expert's rows through project(),
// silu_mul and project(), as layers/moe.grouped_experts calls the modules. The ids are
// route_grouped's: in range.
template <typename T>
void quant_moe_experts(const T* x, int64_t rows, int64_t hidden, int64_t inter, const int64_t* ids,
                       const float* weights, int64_t top_k, const int64_t* table,
                       int64_t experts, T* out) {
  by_expert(x, rows, hidden, inter, ids, weights, top_k, experts, out,
            [&](const T* xs, T* gu, T* act, T* ys, const std::vector<int64_t>& start) {
              const T* none = nullptr;
              for (int64_t e = 0; e < experts; ++e) {
                const int64_t s = start[e], m = start[e + 1] - s;
                if (m == 0) continue;
                const auto* gate_up = reinterpret_cast<const int64_t*>(table[e]);
                const auto* down = reinterpret_cast<const int64_t*>(table[experts + e]);
                project(gate_up, xs + s * hidden, none, none, gu + s * 2 * inter, m, 2 * inter,
                        hidden);
                silu_mul(gu + s * 2 * inter, act + s * inter, m, inter, 2 * inter);
                project(down, act + s * inter, none, none, ys + s * hidden, m, hidden, inter);
              }
            });
}

// A DeepSeek-V3 sparse layer's routed experts at decode sizes in one call: route_grouped, one
// count per chosen expert of the first `counted` rows added to counts[experts], then
// moe_experts, or quant_moe_experts over `table` where given (the ids are in range: it cannot
// fail).
template <typename T>
int grouped_moe_block(const T* x, int64_t rows, int64_t hidden, int64_t inter, const T* router,
                      int64_t experts, int64_t top_k, bool renormalize, const T* gate_up,
                      const T* down, int64_t* counts, int64_t counted, T* out, const float* bias,
                      int64_t n_group, int64_t topk_group, float scaling,
                      const int64_t* table = nullptr) {
  std::vector<int64_t> ids(rows * top_k);
  std::vector<float> weights(rows * top_k);
  route_grouped(x, rows, hidden, router, experts, bias, top_k, n_group, topk_group, renormalize,
                scaling, ids.data(), weights.data());
  for (int64_t j = 0; j < std::min(counted, rows) * top_k; ++j) ++counts[ids[j]];
  if (table != nullptr) {
    quant_moe_experts(x, rows, hidden, inter, ids.data(), weights.data(), top_k, table, experts,
                      out);
    return 0;
  }
  return moe_experts(x, rows, hidden, inter, ids.data(), weights.data(), top_k, gate_up, down,
                     experts, out);
}

// A layer's grouped routing (at kMoeGrouped: 0 for softmax routing): the correction bias
// (float32 [experts]), n_group, topk_group, routed_scaling_factor's float32 bits, and the
// quantized experts' table (quant_moe_experts; 0: float experts at kExpertsGateUp / kDown)
enum GroupedSlot { kGroupedBias, kGroupedGroups, kGroupedTopkGroup, kGroupedScaling,
                   kGroupedTable };

// A latent attention layer's descriptor (at kMla): its projections (float weight, bias, QuantSlot
// descriptor or 0), norms, kv_b_proj's weight, sizes and the norms' epsilon's float32 bits. No
// q_a_proj (q_lora_rank 0): q_b_proj over the normed rows themselves.
enum MlaSlot { kMlaQA, kMlaQABias, kMlaQAQuant, kMlaQANorm, kMlaQB, kMlaQBQuant, kMlaKVA,
               kMlaKVABias, kMlaKVAQuant, kMlaKVANorm, kMlaKVB, kMlaQRank, kMlaRank, kMlaRope,
               kMlaNope, kMlaV, kMlaQNormEps, kMlaKVNormEps, kMlaSlots };

// A latent attention layer's mixer over the normed rows h into y [rows, hidden], as
// models/deepseek_v3.py's LatentAttention computes a decode step: the query (q_a_proj,
// q_a_layernorm, q_b_proj), the latent and rope key (kv_a_proj_with_mqa, kv_a_layernorm), RoPE on
// both rope parts, the absorbed query [q_nope W_UK, q_rope], the token's [latent, k_rope] into its
// page slot (K and V the same memory: the cache's K pointer), the paged decode kernel with one KV
// head of rank + rope values (its values the keys), W_UV on the first rank values, o_proj (its
// bias at kOBias, float).
template <typename T>
void mla_layer(const int64_t* p, const AttentionRows& a, const T* h, T* y, int64_t rows,
               int64_t hidden, int64_t heads) {
  const int64_t* m = reinterpret_cast<const int64_t*>(p[kMla]);
  const auto w = [m](MlaSlot i) { return reinterpret_cast<const T*>(m[i]); };
  const auto quant = [m](MlaSlot i) { return reinterpret_cast<const int64_t*>(m[i]); };
  const int64_t q_rank = m[kMlaQRank], rank = m[kMlaRank], rope_dim = m[kMlaRope];
  const int64_t nope = m[kMlaNope], v = m[kMlaV], qk = nope + rope_dim, D = rank + rope_dim;
  std::vector<T> qa(rows * q_rank), q(rows * heads * qk), kva(rows * D), lat(rows * rank),
      kv(rows * D), qd(rows * heads * D), att(rows * heads * D), o(rows * heads * v);
  const T* q_in = h;
  if (q_rank > 0) {
    project(quant(kMlaQAQuant), h, w(kMlaQA), w(kMlaQABias), qa.data(), rows, q_rank, hidden);
    rms_norm(qa.data(), w(kMlaQANorm), qa.data(), rows, q_rank, q_rank,
             float_bits(m[kMlaQNormEps]));
    q_in = qa.data();
  }
  project(quant(kMlaQBQuant), q_in, w(kMlaQB), static_cast<const T*>(nullptr), q.data(), rows,
          heads * qk, q_rank > 0 ? q_rank : hidden);
  project(quant(kMlaKVAQuant), h, w(kMlaKVA), w(kMlaKVABias), kva.data(), rows, D, hidden);
  rms_norm(kva.data(), w(kMlaKVANorm), lat.data(), rows, rank, D, float_bits(m[kMlaKVNormEps]));
  // the rows [latent, k_rope] and the queries' rope parts, each head's after its latent part
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(lat.data() + r * rank, lat.data() + (r + 1) * rank, kv.data() + r * D);
    std::copy(kva.data() + r * D + rank, kva.data() + (r + 1) * D, kv.data() + r * D + rank);
    for (int64_t hd = 0; hd < heads; ++hd) {
      const T* src = q.data() + (r * heads + hd) * qk + nope;
      std::copy(src, src + rope_dim, qd.data() + (r * heads + hd) * D + rank);
    }
  }
  rope(qd.data() + rank, a.cos, a.sin, a.positions, rows, heads, D, heads * D, a.rot);
  rope(kv.data() + rank, a.cos, a.sin, a.positions, rows, 1, D, D, a.rot);
  latent_absorb(q.data(), heads * qk, qk, w(kMlaKVB), qd.data(), heads * D, D, rows, heads, nope,
                v, rank);
  T* pages = reinterpret_cast<T*>(p[kKCache]);
  const int64_t* slots = a.slots + p[kGroup] * rows;
  const int32_t* tables = a.tables + p[kGroup] * rows * a.table_width;
  const int64_t block_stride = a.block_size * D;
  for (int64_t r = 0; r < rows; ++r)
    std::copy(kv.data() + r * D, kv.data() + (r + 1) * D,
              pages + slots[r] / a.block_size * block_stride + slots[r] % a.block_size * D);
  reinterpret_cast<PagedDecode>(const_cast<void*>(a.kernel))(
      qd.data(), pages, pages, att.data(), a.tokens, tables, a.lens, rows, heads, 1, D,
      a.block_size, a.table_width, heads * D, heads * D, block_stride, D, a.scale);
  latent_unabsorb(att.data(), heads * D, D, w(kMlaKVB), o.data(), rows, heads, nope, v, rank);
  const auto lp = [p](LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
  project(reinterpret_cast<const int64_t*>(p[kOQuant]), o.data(), lp(kO), lp(kOBias), y, rows,
          hidden, heads * v);
}

// The exported forms of the functions above for the Python path (fused.py), in cpu_ops.cpp's
// extern "C" block, once per dtype
#define FOUDRE_MLA_OPS(SUFFIX, T)                                                                \
  void foudre_latent_absorb_##SUFFIX(const void* q, int64_t q_stride, int64_t q_head,            \
                                     const void* kv_b, void* out, int64_t rows, int64_t heads,   \
                                     int64_t nope, int64_t v, int64_t rank) {                    \
    latent_absorb(static_cast<const T*>(q), q_stride, q_head, static_cast<const T*>(kv_b),       \
                  static_cast<T*>(out), heads * rank, rank, rows, heads, nope, v, rank);         \
  }                                                                                              \
  void foudre_latent_unabsorb_##SUFFIX(const void* o, int64_t o_stride, int64_t o_head,          \
                                       const void* kv_b, void* out, int64_t rows,                \
                                       int64_t heads, int64_t nope, int64_t v, int64_t rank) {   \
    latent_unabsorb(static_cast<const T*>(o), o_stride, o_head, static_cast<const T*>(kv_b),     \
                    static_cast<T*>(out), rows, heads, nope, v, rank);                           \
  }                                                                                              \
  int foudre_grouped_moe_block_##SUFFIX(                                                         \
      const void* x, int64_t rows, int64_t hidden, int64_t inter, const void* router,            \
      int64_t experts, int64_t top_k, int renormalize, const void* gate_up, const void* down,    \
      int64_t* counts, int64_t counted, void* out, const float* bias, int64_t n_group,           \
      int64_t topk_group, float scaling) {                                                       \
    return grouped_moe_block(static_cast<const T*>(x), rows, hidden, inter,                      \
                             static_cast<const T*>(router), experts, top_k, renormalize != 0,    \
                             static_cast<const T*>(gate_up), static_cast<const T*>(down),        \
                             counts, counted, static_cast<T*>(out), bias, n_group, topk_group,   \
                             scaling);                                                           \
  }                                                                                              \
  void foudre_route_grouped_##SUFFIX(const void* x, int64_t rows, int64_t hidden,                \
                                     const void* router, int64_t experts, const float* bias,     \
                                     int64_t top_k, int64_t n_group, int64_t topk_group,         \
                                     int renormalize, float scaling, int64_t* ids,               \
                                     float* weights) {                                           \
    route_grouped(static_cast<const T*>(x), rows, hidden, static_cast<const T*>(router),         \
                  experts, bias, top_k, n_group, topk_group, renormalize != 0, scaling, ids,     \
                  weights);                                                                      \
  }

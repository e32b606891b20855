// The routed experts of a gpt-oss mixture-of-experts layer at decode sizes in one native call,
// for any weight format (cpu_moe.cpp: float32 / bfloat16 weights; cpu_mxfp4.cpp: MXFP4):
//
//   out[t] = sum over j of weights[t, j] * expert(ids[t, j], x[t])
//   expert(e, x) = down[e] . act(gate_up[e] . x + gate_up_bias[e]) + down_bias[e]
//   act: gpt-oss's clamped SwiGLU, g = min(gate, limit), u = clamp(up, -limit, limit),
//        (u + 1) * g * sigmoid(alpha * g)
//
// It computes what layers/moe.grouped_experts computes with the expert's own calls, in the
// same order: the (row, slot) pairs sorted by expert (stable), each expert's rows through its
// projections together (4 rows of x per pass over a weight row, as the kernels of one product
// take them), each product's float32 sum plus its bias rounded once to x's type T, the
// activation with the roundings of torch's ops in T (one per op), the experts' outputs times
// their float32 weights added in float32 in increasing expert order and rounded once. Only the
// chosen experts' weights are read. The two products run as two OpenMP loops over tasks of
// (expert, a few weight rows): one pass over the memory of each chosen expert.
//
// A weight format is a class W with
//   void arrange(const float* in, int64_t m, int64_t k, float* out) const   x rows as dot reads
//   template <int R> void dot(int which, int64_t e, int64_t n, const float* x, int64_t k,
//                             float* acc) const      acc[r] = row n of projection `which` (0:
//                                                    gate_up, 1: down) of expert e . x[r], R
//                                                    rows of x k apart
//   float bias(int which, int64_t e, int64_t n) const
//   bool interleaved                                 gate and up in the even / odd outputs
//                                                    (MXFP4 checkpoints) or the two halves

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace foudre_moe {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bfloat16: the high half of a float32
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void narrow(float* p, float v) { *p = v; }
inline void narrow(uint16_t* p, float v) {  // round to nearest even, NaN to a quiet NaN
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *p = std::isnan(v) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
// v rounded to T, as a float
template <typename T>
inline float rounded(float v) {
  T t;
  narrow(&t, v);
  return widen(t);
}

// layers/moe.clamped_swiglu in T: each torch op computes in float32 and rounds to T
template <typename T>
inline float clamped_swiglu(float gate, float up, float alpha, float limit) {
  const float g = gate > limit ? limit : gate;  // (NaN stays NaN, as torch's clamp)
  const float u = up > limit ? limit : (up < -limit ? -limit : up);
  const float z = rounded<T>(alpha * g);
  const float s = rounded<T>(1.0f / (1.0f + std::exp(-z)));
  return rounded<T>(rounded<T>(u + 1.0f) * rounded<T>(g * s));
}

constexpr int kRows = 4;        // x rows a pass over a weight row serves
constexpr int64_t kTask = 8;    // weight rows a task

// pair p of the sorted order: row[p], weight[p]; expert e's pairs start[e] .. start[e + 1]
struct Groups {
  std::vector<int64_t> row, start;
  std::vector<float> weight;
};

// false for an id outside 0..experts
inline bool group_pairs(const int64_t* ids, const float* weights, int64_t rows, int64_t top_k,
                        int64_t experts, Groups& g) {
  const int64_t pairs = rows * top_k;
  g.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (ids[p] < 0 || ids[p] >= experts) return false;
    ++g.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  g.row.resize(pairs);
  g.weight.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {  // stable: pairs in (row, slot) order within an expert
    const int64_t at = next[ids[p]]++;
    g.row[at] = p / top_k;
    g.weight[at] = weights[p];
  }
  return true;
}

// y [pairs, n] = rounded(x [pairs, k] . projection `which` of each pair's expert + bias)
template <typename T, typename W>
void project(const W& w, int which, const Groups& g, const float* x, int64_t k, int64_t n,
             float* y) {
  const int64_t experts = static_cast<int64_t>(g.start.size()) - 1;
  std::vector<int64_t> task_expert, task_row;
  for (int64_t e = 0; e < experts; ++e)
    if (g.start[e + 1] > g.start[e])
      for (int64_t n0 = 0; n0 < n; n0 += kTask) {
        task_expert.push_back(e);
        task_row.push_back(n0);
      }
  const int64_t tasks = static_cast<int64_t>(task_expert.size());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t e = task_expert[t], p0 = g.start[e], p1 = g.start[e + 1];
    const int64_t n1 = std::min(n, task_row[t] + kTask);
    for (int64_t row = task_row[t]; row < n1; ++row) {
      const float b = w.bias(which, e, row);
      float acc[kRows];
      for (int64_t p = p0; p < p1; p += kRows) {
        const float* xp = x + p * k;
        const int64_t m = std::min<int64_t>(kRows, p1 - p);
        switch (m) {
          case 4: w.template dot<4>(which, e, row, xp, k, acc); break;
          case 3: w.template dot<3>(which, e, row, xp, k, acc); break;
          case 2: w.template dot<2>(which, e, row, xp, k, acc); break;
          default: w.template dot<1>(which, e, row, xp, k, acc); break;
        }
        for (int64_t i = 0; i < m; ++i) y[(p + i) * n + row] = rounded<T>(acc[i] + b);
      }
    }
  }
}

// out [rows, hidden] = the experts' weighted sum (see the top); 1 for an id outside 0..experts
template <typename T, typename W>
int gpt_oss_experts(const W& w, const T* x, int64_t rows, int64_t hidden, int64_t inter,
                    const int64_t* ids, const float* weights, int64_t top_k, int64_t experts,
                    float alpha, float limit, T* out) {
  Groups g;
  if (!group_pairs(ids, weights, rows, top_k, experts, g)) return 1;
  const int64_t pairs = rows * top_k;
  std::vector<float> in(pairs * std::max(hidden, inter)), xs(pairs * hidden);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t c = 0; c < hidden; ++c) in[p * hidden + c] = widen(x[g.row[p] * hidden + c]);
  w.arrange(in.data(), pairs, hidden, xs.data());
  std::vector<float> gate_up(pairs * 2 * inter);
  project<T>(w, 0, g, xs.data(), hidden, 2 * inter, gate_up.data());
  for (int64_t p = 0; p < pairs; ++p) {
    const float* h = gate_up.data() + p * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float gate = w.interleaved ? h[2 * i] : h[i];
      const float up = w.interleaved ? h[2 * i + 1] : h[inter + i];
      in[p * inter + i] = clamped_swiglu<T>(gate, up, alpha, limit);
    }
  }
  std::vector<float> hs(pairs * inter), ys(pairs * hidden);
  w.arrange(in.data(), pairs, inter, hs.data());
  project<T>(w, 1, g, hs.data(), inter, hidden, ys.data());
  // each row's pairs in increasing expert order (the sorted order), summed in float32
  std::vector<float> acc(rows * hidden, 0.0f);
  for (int64_t p = 0; p < pairs; ++p) {
    float* a = acc.data() + g.row[p] * hidden;
    const float* y = ys.data() + p * hidden;
    const float wt = g.weight[p];
    for (int64_t c = 0; c < hidden; ++c) a[c] += y[c] * wt;
  }
  for (int64_t i = 0; i < rows * hidden; ++i) narrow(out + i, acc[i]);
  return 0;
}

}  // namespace foudre_moe

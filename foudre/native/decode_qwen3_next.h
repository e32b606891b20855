// Qwen3-Next's parts of the native decode step (native/cpu_ops.cpp includes this after its
// helpers: project, add_, the LayerPointer table and StateRows):
//
//   sigmoid_gate    out = T(x * T(sigmoid(gate))): the gated attention's output gate (one gate
//                   a channel) and the sparse block's gated shared expert (one gate a row),
//                   rounded as torch rounds `x * torch.sigmoid(gate)`; exported as
//                   foudre_sigmoid_gate_* for the Python path (layers/fused.py), which so gives
//                   the same bits
//   deltanet_layer  a gated DeltaNet layer: in_proj_qkvz and in_proj_ba, the DeltaStep
//                   (native/cpu_ssm.cpp's foudre_deltanet_step_*, passed by address in the
//                   layer's kDeltaStep: conv window, gates, delta rule, gated norm on each
//                   row's state slot, then the snapshot copies), out_proj
//   gate_attention  the gated attention's gate: output_gate (float or quantized) on the normed
//                   rows, its sigmoid times the attention's output before o_proj
//   gate_shared     the shared expert's gate: shared_expert_gate on the normed rows, its
//                   sigmoid times the shared expert's output before it joins the experts'

// A gated DeltaNet layer's decode token per row: `layer` its descriptor (DeltaSlot in
// native/cpu_ssm.cpp), each row's state slot, the (source, destination) slot pairs to copy
// after it, in_proj_qkvz's and in_proj_ba's outputs -> y [rows, v_heads * dv]
using DeltaStep = void (*)(const int64_t* layer, const int64_t* slots, int64_t rows,
                           const int64_t* copies, int64_t num_copies, const void* qkvz,
                           const void* ba, void* y);

inline float rounded_as(float x, const float*) { return x; }
inline float rounded_as(float x, const uint16_t*) {  // to bfloat16 (nearest even) and back
  if (x != x) return x;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline void put_rounded(float x, float* out) { *out = x; }
inline void put_rounded(float x, uint16_t* out) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  *out = x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// out [rows, n] = T(x * T(sigmoid(gate))), gate [rows, gate_cols] (gate_cols n: one a channel;
// 1: one a row); out may be x
template <typename T>
void sigmoid_gate(const T* x, const T* gate, T* out, int64_t rows, int64_t n, int64_t gate_cols) {
  const auto sigmoid = [out](T g) {
    return rounded_as(1.0f / (1.0f + std::exp(-to_float(g))), out);
  };
#pragma omp parallel for schedule(static) if (rows * n >= (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    const T* gr = gate + r * gate_cols;
    T* o = out + r * n;
    if (gate_cols == 1) {  // one gate a row: its sigmoid once
      const float s = sigmoid(gr[0]);
      for (int64_t c = 0; c < n; ++c) put_rounded(to_float(xr[c]) * s, o + c);
    } else {
      for (int64_t c = 0; c < n; ++c) put_rounded(to_float(xr[c]) * sigmoid(gr[c]), o + c);
    }
  }
}

// A gated DeltaNet layer's mixer over the normed rows h: in_proj_qkvz (kQKV, kQKVQuant) into
// proj, in_proj_ba (kBA, kBAQuant: kBAWidth outputs) after it, the DeltaStep, out_proj (kO,
// kOQuant: kMambaInner inputs) into y [rows, hidden]; kMambaWidth: both projections' outputs
template <typename T>
void deltanet_layer(const int64_t* p, const StateRows& s, const T* h, T* y, int64_t rows,
                    int64_t hidden, T* proj, T* inner) {
  const auto w = [p](LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
  const auto quant = [p](LayerPointer i) { return reinterpret_cast<const int64_t*>(p[i]); };
  const T* none = nullptr;
  const int64_t ba_width = p[kBAWidth], qkvz_width = p[kMambaWidth] - ba_width;
  T* ba = proj + rows * qkvz_width;
  project(quant(kQKVQuant), h, w(kQKV), none, proj, rows, qkvz_width, hidden);
  project(quant(kBAQuant), h, w(kBA), none, ba, rows, ba_width, hidden);
  reinterpret_cast<DeltaStep>(p[kDeltaStep])(reinterpret_cast<const int64_t*>(p[kDeltaNet]),
                                             s.slots, rows, s.copies, s.num_copies, proj, ba,
                                             inner);
  project(quant(kOQuant), inner, w(kO), none, y, rows, hidden, p[kMambaInner]);
}

// att [rows, q_size] *= sigmoid(output_gate(h)) (kOGate, kOGateQuant), the gate's
// projection into scratch [rows, q_size]
template <typename T>
void gate_attention(const int64_t* p, const T* h, T* att, T* scratch, int64_t rows,
                    int64_t hidden, int64_t q_size) {
  project(reinterpret_cast<const int64_t*>(p[kOGateQuant]), h,
          reinterpret_cast<const T*>(p[kOGate]), static_cast<const T*>(nullptr), scratch, rows,
          q_size, hidden);
  sigmoid_gate(att, scratch, att, rows, q_size, q_size);
}

// shared [rows, hidden] *= sigmoid(shared_expert_gate(h)) (kSharedGate, one output a row), the
// gate's projection into scratch [rows]
template <typename T>
void gate_shared(const int64_t* p, const T* h, T* shared, T* scratch, int64_t rows,
                 int64_t hidden) {
  project(static_cast<const int64_t*>(nullptr), h, reinterpret_cast<const T*>(p[kSharedGate]),
          static_cast<const T*>(nullptr), scratch, rows, 1, hidden);
  sigmoid_gate(shared, scratch, shared, rows, hidden, 1);
}

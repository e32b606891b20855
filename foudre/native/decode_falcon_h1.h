// Falcon-H1's parallel decoder layer for decode_layers (native/cpu_ops.cpp includes this inside
// its namespace, after the helpers it uses: any_norm, project, scale_, add_, silu_mul,
// attention_layer, the MambaStep, LayerPointer). Two rows of the layers' table make one layer:
// the first (kParallel 1) its attention (its KV cache and cache group), the second (kParallel 2)
// its Mamba-2 mixer (its state), MLP and their multipliers. Each row's kMixerIn / kMixerOut
// multiply its mixer's input and output; kSections (the second row) names the column ranges of
// in_proj's output to scale ([count, (first, end, float32 bits) x count]); kGateMult and
// kDownMult the MLP's gate before its SiLU and its output. The roundings are
// models/falcon_h1.py's: every product, sum and kernel output rounded to T where torch rounds
// it, so both paths give the same bits.

// y = T(x * m) where m is not 1 (else x itself), into `scratch` [n]
template <typename T>
const T* times(const T* x, int64_t bits, T* scratch, int64_t n) {
  const float m = float_bits(bits);
  if (m == 1.0f) return x;
  std::copy(x, x + n, scratch);
  scale_(scratch, m, n);
  return scratch;
}

template <typename T>
void scale_if(T* y, int64_t bits, int64_t n) {
  const float m = float_bits(bits);
  if (m != 1.0f) scale_(y, m, n);
}

// The buffers a parallel layer writes: the normed rows, a mixer's scaled input and each
// mixer's output (hidden wide each), q|k|v and attention (the attention's), in_proj's output
// and the mixer's inner rows (the Mamba-2's), gate|up and the activation (the MLP's)
template <typename T>
struct ParallelScratch {
  T *h, *in, *y, *other, *qkv, *att, *proj, *inner, *gate_up, *act;
};

// FalconH1DecoderLayer's forward on the rows x [rows, hidden] in place, from the table's rows
// `pa` (attention) and `pm` (mixer, MLP):
//   h = norm(x)
//   x += T(T(mamba(h * ssm_in) * ssm_out) + T(attention(h * attn_in) * attn_out))
//   x += T(down(T(silu(T(gate * gate_mult))) * up) * down_mult)     over pre_ff_norm(x)
// with the mixer's in_proj output scaled per section before its step.
template <typename T>
void parallel_layer(const int64_t* pa, const int64_t* pm, const AttentionRows& a,
                    const StateRows& s, T* x, int64_t rows, int64_t hidden, int64_t heads,
                    int64_t kv_heads, int64_t D, int64_t intermediate, float eps,
                    const ParallelScratch<T>& b) {
  const auto w = [](const int64_t* p, LayerPointer i) { return reinterpret_cast<const T*>(p[i]); };
  const auto quant = [](const int64_t* p, LayerPointer i) {
    return reinterpret_cast<const int64_t*>(p[i]);
  };
  const bool offset = pa[kOffsetNorms] != 0;
  const int64_t n = rows * hidden;
  any_norm(offset, x, w(pa, kInputNorm), b.h, rows, hidden, hidden, eps);
  attention_layer(pa, a, times(b.h, pa[kMixerIn], b.in, n), b.y, rows, hidden, heads, kv_heads,
                  D, eps, b.qkv, b.att);
  scale_if(b.y, pa[kMixerOut], n);
  const int64_t width = pm[kMambaWidth];  // (in_proj of the mixer's input, then its sections)
  project(quant(pm, kQKVQuant), times(b.h, pm[kMixerIn], b.in, n), w(pm, kQKV), w(pm, kQKVBias),
          b.proj, rows, width, hidden);
  if (pm[kSections] != 0) {
    const int64_t* sec = reinterpret_cast<const int64_t*>(pm[kSections]);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < sec[0]; ++i) {
        const int64_t* e = sec + 1 + 3 * i;
        scale_(b.proj + r * width + e[0], float_bits(e[2]), e[1] - e[0]);
      }
  }
  reinterpret_cast<MambaStep>(const_cast<void*>(s.step))(
      reinterpret_cast<const int64_t*>(pm[kMamba]), s.slots, rows, s.copies, s.num_copies, b.proj,
      width, b.inner);
  project(quant(pm, kOQuant), b.inner, w(pm, kO), w(pm, kOBias), b.other, rows, hidden,
          pm[kMambaInner]);
  scale_if(b.other, pm[kMixerOut], n);
  add_(b.other, b.y, n);  // mamba + attention, then onto the stream
  add_(x, b.other, n);
  any_norm(offset, x, w(pm, kPostNorm), b.h, rows, hidden, hidden, eps);
  const int64_t wide = 2 * intermediate;
  project(quant(pm, kGateUpQuant), b.h, w(pm, kGateUp), static_cast<const T*>(nullptr), b.gate_up,
          rows, wide, hidden);
  const float gate = float_bits(pm[kGateMult]);
  if (gate != 1.0f)
    for (int64_t r = 0; r < rows; ++r) scale_(b.gate_up + r * wide, gate, intermediate);
  silu_mul(b.gate_up, b.act, rows, intermediate, wide);
  project(quant(pm, kDownQuant), b.act, w(pm, kDown), static_cast<const T*>(nullptr), b.y, rows,
          hidden, intermediate);
  scale_if(b.y, pm[kDownMult], n);
  add_(x, b.y, n);
}

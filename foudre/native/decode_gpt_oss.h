// gpt-oss's parts of the native decode step (decode_layers in cpu_ops.cpp, which includes this
// file after its LayerPointer table): attention with a sliding window and sinks, through the
// paged kernels' windowed variants, and the sparse block of models/gpt_oss.py (the router with
// its bias, route(), the counts, then the clamped-SwiGLU experts through their own kernel,
// passed by address as the MambaStep is: float, int8 or MXFP4 weights). The same kernels as the
// Python path, called with the same arguments, so the same bits.

// native/cpu_paged_decode.cpp's NAME_window over a float cache: a sliding window (0: every
// key) and each query head's sink logit (float32, or null)
using PagedDecodeWindow = void (*)(const void* q, const void* k, const void* v, void* out,
                                   const int32_t* tokens, const int32_t* tables,
                                   const int32_t* lens, int64_t rows, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   int64_t table_width, int64_t q_stride, int64_t o_stride,
                                   int64_t block_stride, int64_t token_stride, float scale,
                                   int64_t window, const float* sinks);

// NAME_CODES_sinks over a quantized cache (codes and their scales)
using PagedDecodeCodesSinks = void (*)(const void* q, const void* k, const void* v,
                                       const float* k_scale, const float* v_scale, void* out,
                                       const int32_t* tokens, const int32_t* tables,
                                       const int32_t* lens, int64_t rows, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t table_width, int64_t q_stride,
                                       int64_t o_stride, int64_t block_stride,
                                       int64_t token_stride, float scale, int64_t window,
                                       const float* sinks);

// The experts' kernels (cpu_moe.cpp's foudre_gpt_oss_experts_* and _int8_experts_*,
// cpu_mxfp4.cpp's foudre_mxfp4_gpt_oss_experts_*), as layers/fused_moe.py and quant/mxfp4.py
// call them
using OssExpertsFloat = int (*)(const void* x, int64_t rows, int64_t hidden, int64_t inter,
                                const int64_t* ids, const float* weights, int64_t top_k,
                                const void* gate_up, const void* gate_up_bias, const void* down,
                                const void* down_bias, int64_t experts, float alpha, float limit,
                                void* out);
using OssExpertsInt8 = int (*)(const void* x, int64_t rows, int64_t hidden, int64_t inter,
                               const int64_t* ids, const float* weights, int64_t top_k,
                               const int64_t* table, int scales_bf16, int bias_bf16,
                               int64_t experts, float alpha, float limit, void* out);
using OssExpertsMxfp4 = int (*)(const void* x, int64_t rows, int64_t hidden, int64_t inter,
                                const int64_t* ids, const float* weights, int64_t top_k,
                                const void* gub, const void* gus, const void* gu_bias,
                                const void* db, const void* ds, const void* d_bias,
                                int bias_bf16, int64_t experts, int interleaved, float alpha,
                                float limit, void* out);

// A gpt-oss layer's experts descriptor (at kOssExperts): the kind (OssKind), the kernel's
// address, alpha and limit (float32 bits), the intermediate size, then the kind's tensors and
// flags: float: gate_up,
// its bias, down, its bias; int8: the table (fused_moe.gpt_oss_int8_experts'), flags
// scales_bf16 and bias_bf16; MXFP4: gate_up blocks, scales, bias, down blocks, scales, bias,
// flags bias_bf16 and interleaved
enum OssKind { kOssFloat, kOssInt8, kOssMxfp4 };
enum OssSlot { kOssKind, kOssFn, kOssAlpha, kOssLimit, kOssInter, kOssT0, kOssT1, kOssT2,
               kOssT3, kOssT4, kOssT5, kOssFlag0, kOssFlag1, kOssSlots };

// The attention kernel of a layer with a window or sinks (kOssAttention: its NAME_window, or
// NAME_CODES_sinks over a quantized cache), as attention_layer calls the plain one
template <typename T>
void oss_attention(const int64_t* p, const void* qkv, const void* k_cache, const void* v_cache,
                   void* att, const int32_t* tokens, const int32_t* tables, const int32_t* lens,
                   int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, int64_t block_size,
                   int64_t table_width, int64_t qkv_width, int64_t q_size, int64_t block_stride,
                   int64_t token_stride, float scale) {
  const auto* sinks = reinterpret_cast<const float*>(p[kSinks]);
  const void* kernel = reinterpret_cast<const void*>(p[kOssAttention]);
  if (p[kKVCodes] != kFloatKV)
    reinterpret_cast<PagedDecodeCodesSinks>(const_cast<void*>(kernel))(
        qkv, k_cache, v_cache, reinterpret_cast<const float*>(p[kKScales]),
        reinterpret_cast<const float*>(p[kVScales]), att, tokens, tables, lens, rows, heads,
        kv_heads, D, block_size, table_width, qkv_width, q_size, block_stride, token_stride,
        scale, p[kWindow], sinks);
  else
    reinterpret_cast<PagedDecodeWindow>(const_cast<void*>(kernel))(
        qkv, k_cache, v_cache, att, tokens, tables, lens, rows, heads, kv_heads, D, block_size,
        table_width, qkv_width, q_size, block_stride, token_stride, scale, p[kWindow], sinks);
}

// gpt-oss's sparse block over the normed rows h into y: the router (kRouter, its bias at
// kRouterBias), route() (top-k of the softmax, renormalised), the ids of the first `counted`
// rows added to counts, then the experts' kernel (kOssExperts' descriptor)
template <typename T>
void oss_moe(const int64_t* p, const T* h, T* y, int64_t rows, int64_t hidden, int64_t counted) {
  const auto* d = reinterpret_cast<const int64_t*>(p[kOssExperts]);
  const int64_t experts = p[kExperts], top_k = p[kTopK], inter = d[kOssInter];
  std::vector<T> logits(rows * experts);
  linear(h, hidden, reinterpret_cast<const T*>(p[kRouter]),
         reinterpret_cast<const T*>(p[kRouterBias]), logits.data(), rows, experts, hidden);
  std::vector<int64_t> ids(rows * top_k);
  std::vector<float> weights(rows * top_k);
  route(logits.data(), rows, experts, top_k, p[kRenormalize] != 0, ids.data(), weights.data());
  auto* counts = reinterpret_cast<int64_t*>(p[kCounts]);
  for (int64_t j = 0; j < std::min(counted, rows) * top_k; ++j) ++counts[ids[j]];
  const auto t = [d](OssSlot i) { return reinterpret_cast<const void*>(d[i]); };
  const float alpha = float_bits(d[kOssAlpha]), limit = float_bits(d[kOssLimit]);
  void* fn = const_cast<void*>(t(kOssFn));
  // (route's ids are in range: the kernels cannot fail)
  if (d[kOssKind] == kOssFloat)
    reinterpret_cast<OssExpertsFloat>(fn)(h, rows, hidden, inter, ids.data(), weights.data(),
                                          top_k, t(kOssT0), t(kOssT1), t(kOssT2), t(kOssT3),
                                          experts, alpha, limit, y);
  else if (d[kOssKind] == kOssInt8)
    reinterpret_cast<OssExpertsInt8>(fn)(h, rows, hidden, inter, ids.data(), weights.data(),
                                         top_k, reinterpret_cast<const int64_t*>(d[kOssT0]),
                                         static_cast<int>(d[kOssFlag0]),
                                         static_cast<int>(d[kOssFlag1]), experts, alpha, limit, y);
  else
    reinterpret_cast<OssExpertsMxfp4>(fn)(h, rows, hidden, inter, ids.data(), weights.data(),
                                          top_k, t(kOssT0), t(kOssT1), t(kOssT2), t(kOssT3),
                                          t(kOssT4), t(kOssT5), static_cast<int>(d[kOssFlag0]),
                                          experts, static_cast<int>(d[kOssFlag1]), alpha, limit,
                                          y);
}

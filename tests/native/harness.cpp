// A driver for the native kernels on a machine without Python: built together with the kernel
// sources for another architecture (aarch64) and run under qemu-user by tests/native/
// test_cross.py, which writes each call's inputs, runs this, and compares the outputs with the
// references computed on the host, as the host's own kernel tests do.
//
// stdin: the kernel's name (a line), then the call: int64 P, P float64 parameters, int64 A, and
// A arrays (int64 byte count, then the bytes). stdout: the output array's bytes.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
int foudre_qmm_path();
void foudre_qmm_f32(int kind, const void* x, const void* q, const void* s, const void* z,
                    float zc, int st, int64_t groups, int64_t group, int64_t s_stride, void* y,
                    int64_t m, int64_t n, int64_t k);
void foudre_qmm_bf16(int kind, const void* x, const void* q, const void* s, const void* z,
                     float zc, int st, int64_t groups, int64_t group, int64_t s_stride, void* y,
                     int64_t m, int64_t n, int64_t k);
#define FOUDRE_DECODE(NAME)                                                                   \
  void NAME(const void* q, const void* k, const void* v, void* out, const int32_t* tokens,     \
            const int32_t* tables, const int32_t* lens, int64_t rows, int64_t num_heads,       \
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_width,   \
            int64_t q_stride, int64_t o_stride, int64_t block_stride, int64_t token_stride,    \
            float scale, int64_t window, const float* sinks, const void* k_new,                \
            const void* v_new, int64_t k_new_stride, int64_t v_new_stride);
FOUDRE_DECODE(paged_decode_f32_store)
FOUDRE_DECODE(paged_decode_bf16_store)
FOUDRE_DECODE(paged_decode_f16_store)
#define FOUDRE_PREFILL(NAME)                                                                  \
  void NAME(const void* q, const void* k, const void* v, void* out, const int32_t* q_starts,   \
            const int32_t* q_lens, const int32_t* seq_lens, const int32_t* tables,             \
            int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,           \
            int64_t block_size, int64_t table_width, int64_t q_stride, int64_t o_stride,       \
            int64_t block_stride, int64_t token_stride, int64_t window, float scale,           \
            const float* sinks);
FOUDRE_PREFILL(paged_prefill_f32)
FOUDRE_PREFILL(paged_prefill_bf16)
FOUDRE_PREFILL(paged_prefill_f16)
#define FOUDRE_DECODE_CODES(NAME)                                                             \
  void NAME(const void* q, const void* k, const void* v, const float* k_scale,                 \
            const float* v_scale, void* out, const int32_t* tokens, const int32_t* tables,     \
            const int32_t* lens, int64_t rows, int64_t num_heads, int64_t num_kv_heads,        \
            int64_t head_dim, int64_t block_size, int64_t table_width, int64_t q_stride,       \
            int64_t o_stride, int64_t block_stride, int64_t token_stride, float scale,         \
            int64_t window, const float* sinks);
#define FOUDRE_PREFILL_CODES(NAME)                                                            \
  void NAME(const void* q, const void* k, const void* v, const float* k_scale,                 \
            const float* v_scale, void* out, const int32_t* q_starts, const int32_t* q_lens,   \
            const int32_t* seq_lens, const int32_t* tables, int64_t rows, int64_t num_heads,   \
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_width,   \
            int64_t q_stride, int64_t o_stride, int64_t block_stride, int64_t token_stride,    \
            int64_t window, float scale, const float* sinks);
#define FOUDRE_CODES(T)                        \
  FOUDRE_DECODE_CODES(paged_decode_##T##_sinks) \
  FOUDRE_PREFILL_CODES(paged_prefill_##T)
FOUDRE_CODES(f32_int8)
FOUDRE_CODES(bf16_int8)
FOUDRE_CODES(f16_int8)
FOUDRE_CODES(f32_fp8)
FOUDRE_CODES(bf16_fp8)
FOUDRE_CODES(f16_fp8)
}

using DecodeCodes = decltype(&paged_decode_f32_int8_sinks);
using PrefillCodes = decltype(&paged_prefill_f32_int8);

// the kernels over a quantized cache, by name's suffix ("f32_int8", ...)
template <typename F>
F by_type(const std::string& type, F f32_int8, F bf16_int8, F f16_int8, F f32_fp8, F bf16_fp8,
          F f16_fp8) {
  const std::string names[] = {"f32_int8", "bf16_int8", "f16_int8",
                               "f32_fp8",  "bf16_fp8",  "f16_fp8"};
  const F fns[] = {f32_int8, bf16_int8, f16_int8, f32_fp8, bf16_fp8, f16_fp8};
  for (int i = 0; i < 6; ++i)
    if (names[i] == type) return fns[i];
  throw "unknown type " + type;
}

using Decode = decltype(&paged_decode_f32_store);
using Prefill = decltype(&paged_prefill_f32);

namespace {

bool read_exact(void* p, size_t n) { return std::fread(p, 1, n, stdin) == n; }

int64_t read_i64() {
  int64_t v = 0;
  if (!read_exact(&v, sizeof v)) throw std::string("truncated input");
  return v;
}

struct Call {
  std::vector<double> p;
  std::vector<std::vector<uint64_t>> arrays;  // (8-byte aligned storage)
  std::vector<int64_t> sizes;
  const void* a(size_t i) const { return sizes[i] ? arrays[i].data() : nullptr; }
  int64_t i(size_t j) const { return static_cast<int64_t>(p[j]); }
};

Call read_call() {
  Call c;
  c.p.resize(read_i64());
  if (!c.p.empty() && !read_exact(c.p.data(), c.p.size() * sizeof(double)))
    throw std::string("truncated parameters");
  int64_t n = read_i64();
  for (int64_t j = 0; j < n; ++j) {
    int64_t bytes = read_i64();
    c.arrays.emplace_back((bytes + 7) / 8);
    c.sizes.push_back(bytes);
    if (bytes && !read_exact(c.arrays.back().data(), bytes)) throw std::string("truncated array");
  }
  return c;
}

void write(const void* p, size_t n) { std::fwrite(p, 1, n, stdout); }

}  // namespace

int main() {
  char line[64] = {0};
  if (!std::fgets(line, sizeof line, stdin)) return 2;
  std::string name(line);
  name.erase(name.find_last_not_of("\r\n") + 1);
  try {
    if (name == "path") {
      int path = foudre_qmm_path();
      write(&path, sizeof path);
      return 0;
    }
    Call c = read_call();
    if (name == "qmm_f32" || name == "qmm_bf16") {
      // p: kind, zc, st, groups, group, s_stride, m, n, k; arrays: x, q, s, z
      int64_t m = c.i(6), n = c.i(7), k = c.i(8);
      size_t elem = name == "qmm_f32" ? 4 : 2;
      std::vector<uint8_t> y(m * n * elem);
      auto fn = name == "qmm_f32" ? foudre_qmm_f32 : foudre_qmm_bf16;
      fn(static_cast<int>(c.p[0]), c.a(0), c.a(1), c.a(2), c.a(3), static_cast<float>(c.p[1]),
         static_cast<int>(c.p[2]), c.i(3), c.i(4), c.i(5), y.data(), m, n, k);
      write(y.data(), y.size());
    } else if (name.rfind("paged_decode_", 0) == 0 && name.find('_', 13) != std::string::npos) {
      // a quantized cache: p as paged_decode's; arrays: q, codes [2, blocks, block_size,
      // kv_heads, d], scales [2, blocks, block_size, kv_heads] (float32), tables, lens, sinks
      const DecodeCodes fn = by_type<DecodeCodes>(
          name.substr(13), paged_decode_f32_int8_sinks, paged_decode_bf16_int8_sinks,
          paged_decode_f16_int8_sinks, paged_decode_f32_fp8_sinks, paged_decode_bf16_fp8_sinks,
          paged_decode_f16_fp8_sinks);
      int64_t rows = c.i(0), heads = c.i(1), kvh = c.i(2), d = c.i(3), bs = c.i(4);
      const auto* k = static_cast<const uint8_t*>(c.a(1));
      const auto* ks = static_cast<const float*>(c.a(2));
      std::vector<uint8_t> out(c.sizes[0]);
      std::vector<int32_t> tokens(rows);
      for (int64_t r = 0; r < rows; ++r) tokens[r] = static_cast<int32_t>(r);
      fn(c.a(0), k, k + c.sizes[1] / 2, ks, ks + c.sizes[2] / 8, out.data(), tokens.data(),
         static_cast<const int32_t*>(c.a(3)), static_cast<const int32_t*>(c.a(4)), rows, heads,
         kvh, d, bs, c.i(5), heads * d, heads * d, bs * kvh * d, kvh * d,
         static_cast<float>(c.p[6]), c.i(7), static_cast<const float*>(c.a(5)));
      write(out.data(), out.size());
    } else if (name.rfind("paged_prefill_", 0) == 0 && name.find('_', 14) != std::string::npos) {
      // a quantized cache: p as paged_prefill's; arrays: q, codes, scales (as the decode's),
      // q_starts, q_lens, seq_lens, tables, sinks
      const PrefillCodes fn = by_type<PrefillCodes>(
          name.substr(14), paged_prefill_f32_int8, paged_prefill_bf16_int8,
          paged_prefill_f16_int8, paged_prefill_f32_fp8, paged_prefill_bf16_fp8,
          paged_prefill_f16_fp8);
      int64_t rows = c.i(0), heads = c.i(1), kvh = c.i(2), d = c.i(3), bs = c.i(4);
      const auto* k = static_cast<const uint8_t*>(c.a(1));
      const auto* ks = static_cast<const float*>(c.a(2));
      std::vector<uint8_t> out(c.sizes[0]);
      fn(c.a(0), k, k + c.sizes[1] / 2, ks, ks + c.sizes[2] / 8, out.data(),
         static_cast<const int32_t*>(c.a(3)), static_cast<const int32_t*>(c.a(4)),
         static_cast<const int32_t*>(c.a(5)), static_cast<const int32_t*>(c.a(6)), rows, heads,
         kvh, d, bs, c.i(5), heads * d, heads * d, bs * kvh * d, kvh * d, c.i(6),
         static_cast<float>(c.p[7]), static_cast<const float*>(c.a(7)));
      write(out.data(), out.size());
    } else if (name.rfind("paged_decode_", 0) == 0) {
      // p: rows, heads, kv_heads, head_dim, block_size, table_width, scale, window; arrays:
      // q [rows, heads, d], cache [2, blocks, block_size, kv_heads, d], tables, lens, sinks
      // [heads] (empty: none), then optionally each row's new token's K and V [rows, kv_heads,
      // d] (empty: none), written into its last slot by the kernel; name's suffix the storage
      // type (f32, bf16, f16)
      const std::string type = name.substr(13);
      const Decode fn = type == "f32"    ? paged_decode_f32_store
                        : type == "bf16" ? paged_decode_bf16_store
                        : type == "f16"  ? paged_decode_f16_store
                                         : nullptr;
      const bool fresh = c.sizes.size() > 6 && c.sizes[5] != 0;
      if (fn == nullptr) throw "unknown type " + type;
      int64_t rows = c.i(0), heads = c.i(1), kvh = c.i(2), d = c.i(3), bs = c.i(4);
      const auto* k = static_cast<const uint8_t*>(c.a(1));
      std::vector<uint8_t> out(c.sizes[0]);
      std::vector<int32_t> tokens(rows);  // row r: query and output r
      for (int64_t r = 0; r < rows; ++r) tokens[r] = static_cast<int32_t>(r);
      fn(c.a(0), k, k + c.sizes[1] / 2, out.data(), tokens.data(),
         static_cast<const int32_t*>(c.a(2)), static_cast<const int32_t*>(c.a(3)), rows, heads,
         kvh, d, bs, c.i(5), heads * d, heads * d, bs * kvh * d, kvh * d,
         static_cast<float>(c.p[6]), c.i(7), static_cast<const float*>(c.a(4)),
         fresh ? c.a(5) : nullptr, fresh ? c.a(6) : nullptr, kvh * d, kvh * d);
      write(out.data(), out.size());
    } else if (name.rfind("paged_prefill_", 0) == 0) {
      // p: rows, heads, kv_heads, head_dim, block_size, table_width, window, scale; arrays:
      // q [tokens, heads, d], cache as the decode's, q_starts, q_lens, seq_lens, tables, sinks
      const std::string type = name.substr(14);
      const Prefill fn = type == "f32"    ? paged_prefill_f32
                         : type == "bf16" ? paged_prefill_bf16
                         : type == "f16"  ? paged_prefill_f16
                                          : nullptr;
      if (fn == nullptr) throw "unknown type " + type;
      int64_t rows = c.i(0), heads = c.i(1), kvh = c.i(2), d = c.i(3), bs = c.i(4);
      const auto* k = static_cast<const uint8_t*>(c.a(1));
      std::vector<uint8_t> out(c.sizes[0]);
      fn(c.a(0), k, k + c.sizes[1] / 2, out.data(), static_cast<const int32_t*>(c.a(2)),
         static_cast<const int32_t*>(c.a(3)), static_cast<const int32_t*>(c.a(4)),
         static_cast<const int32_t*>(c.a(5)), rows, heads, kvh, d, bs, c.i(5), heads * d,
         heads * d, bs * kvh * d, kvh * d, c.i(6), static_cast<float>(c.p[7]),
         static_cast<const float*>(c.a(6)));
      write(out.data(), out.size());
    } else {
      std::fprintf(stderr, "unknown kernel %s\n", name.c_str());
      return 2;
    }
  } catch (const std::string& e) {
    std::fprintf(stderr, "%s\n", e.c_str());
    return 2;
  }
  return 0;
}

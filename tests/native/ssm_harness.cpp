// A driver for the recurrent layers' kernels (foudre/native/cpu_ssm.cpp) on a machine without
// Python: built with that source for aarch64 and run under qemu-user by
// tests/native/test_ssm_cross.py, which writes each call's inputs and compares the outputs with
// the torch references computed on the host.
//
// stdin (as harness.cpp's): the kernel's name (a line), then int64 P, P float64 parameters,
// int64 A, and A arrays (int64 byte count, then the bytes). stdout: the output array's bytes,
// then the state pool's (updated in place).
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

extern "C" {
int foudre_ssm_isa();
void foudre_ssm_update(float* state, int64_t slot_stride, const int64_t* slots, int64_t rows,
                       int64_t heads, int64_t head_dim, int64_t d_state, int64_t groups,
                       const float* x, int64_t x_stride, const float* dt, int64_t dt_stride,
                       const float* a, const float* b, int64_t b_stride, const float* c,
                       int64_t c_stride, const float* d, float* y);
void foudre_ssm_scan(float* state, int64_t slot_stride, const int64_t* slots, const int64_t* cu,
                     int64_t rows, int64_t heads, int64_t head_dim, int64_t d_state,
                     int64_t groups, const float* x, int64_t x_stride, const float* dt,
                     int64_t dt_stride, const float* a, const float* b, int64_t b_stride,
                     const float* c, int64_t c_stride, const float* d, const int64_t* snap_slot,
                     float* y);
void foudre_conv_update_f32(float* state, int64_t slot_stride, const int64_t* slots,
                            int64_t rows, int64_t channels, int64_t window, const float* x,
                            int64_t x_stride, const float* weight, int64_t w_stride_c,
                            int64_t w_stride_k, const float* bias, int silu, float* out);
void foudre_conv_update_bf16(uint16_t* state, int64_t slot_stride, const int64_t* slots,
                             int64_t rows, int64_t channels, int64_t window, const uint16_t* x,
                             int64_t x_stride, const uint16_t* weight, int64_t w_stride_c,
                             int64_t w_stride_k, const uint16_t* bias, int silu, uint16_t* out);
void foudre_gated_delta_update(float* state, int64_t slot_stride, const int64_t* slots,
                               int64_t rows, int64_t k_heads, int64_t v_heads, int64_t dk,
                               int64_t dv, const float* q, int64_t q_stride, const float* k,
                               int64_t k_stride, const float* v, int64_t v_stride,
                               const float* g, int64_t g_stride, const float* beta,
                               int64_t beta_stride, float scale, int l2norm, float* o);
}

namespace {

template <typename T>
T read() {
  T v;
  if (std::fread(&v, sizeof v, 1, stdin) != 1) throw "short input";
  return v;
}

std::vector<char> read_array() {
  std::vector<char> bytes(read<int64_t>());
  if (!bytes.empty() && std::fread(bytes.data(), 1, bytes.size(), stdin) != bytes.size())
    throw "short input";
  return bytes;
}

void write(const void* p, size_t n) { std::fwrite(p, 1, n, stdout); }

template <typename T>
T* as(std::vector<char>& a) {
  return a.empty() ? nullptr : reinterpret_cast<T*>(a.data());
}

// the contiguous layouts the test sends: rows at their natural strides
int run(const std::string& name, const std::vector<double>& p, std::vector<std::vector<char>>& a) {
  auto i = [&](size_t k) { return static_cast<int64_t>(p[k]); };
  if (name == "isa") {
    const int isa = foudre_ssm_isa();
    write(&isa, sizeof isa);
    return 0;
  }
  if (name == "ssm_update" || name == "ssm_scan") {
    // params: slot_stride, rows (tokens for the scan), heads, head_dim, d_state, groups, rows
    // arrays: state, slots, x, dt, a, b, c, d, (scan:) cu, snap
    const int64_t t = i(1), heads = i(2), hd = i(3), n = i(4), groups = i(5);
    std::vector<float> y(t * heads * hd);
    if (name == "ssm_update")
      foudre_ssm_update(as<float>(a[0]), i(0), as<int64_t>(a[1]), t, heads, hd, n, groups,
                        as<float>(a[2]), heads * hd, as<float>(a[3]), heads, as<float>(a[4]),
                        as<float>(a[5]), groups * n, as<float>(a[6]), groups * n,
                        as<float>(a[7]), y.data());
    else
      foudre_ssm_scan(as<float>(a[0]), i(0), as<int64_t>(a[1]), as<int64_t>(a[8]), i(6), heads,
                      hd, n, groups, as<float>(a[2]), heads * hd, as<float>(a[3]), heads,
                      as<float>(a[4]), as<float>(a[5]), groups * n, as<float>(a[6]), groups * n,
                      as<float>(a[7]), as<int64_t>(a[9]), y.data());
    write(y.data(), y.size() * sizeof(float));
    write(a[0].data(), a[0].size());
    return 0;
  }
  if (name == "conv_f32" || name == "conv_bf16") {
    // params: slot_stride, rows, channels, window, silu; arrays: state, slots, x, weight, bias
    const int64_t rows = i(1), channels = i(2), window = i(3);
    std::vector<char> out(rows * channels * (name == "conv_f32" ? 4 : 2));
    if (name == "conv_f32")
      foudre_conv_update_f32(as<float>(a[0]), i(0), as<int64_t>(a[1]), rows, channels, window,
                             as<float>(a[2]), channels, as<float>(a[3]), window + 1, 1,
                             as<float>(a[4]), static_cast<int>(i(4)), as<float>(out));
    else
      foudre_conv_update_bf16(as<uint16_t>(a[0]), i(0), as<int64_t>(a[1]), rows, channels,
                              window, as<uint16_t>(a[2]), channels, as<uint16_t>(a[3]),
                              window + 1, 1, as<uint16_t>(a[4]), static_cast<int>(i(4)),
                              as<uint16_t>(out));
    write(out.data(), out.size());
    write(a[0].data(), a[0].size());
    return 0;
  }
  if (name == "gated_delta") {
    // params: slot_stride, rows, k_heads, v_heads, dk, dv, scale, l2norm
    // arrays: state, slots, q, k, v, g, beta
    const int64_t rows = i(1), hk = i(2), hv = i(3), dk = i(4), dv = i(5);
    std::vector<float> o(rows * hv * dv);
    foudre_gated_delta_update(as<float>(a[0]), i(0), as<int64_t>(a[1]), rows, hk, hv, dk, dv,
                              as<float>(a[2]), hk * dk, as<float>(a[3]), hk * dk,
                              as<float>(a[4]), hv * dv, as<float>(a[5]), hv, as<float>(a[6]),
                              hv, static_cast<float>(p[6]), static_cast<int>(i(7)), o.data());
    write(o.data(), o.size() * sizeof(float));
    write(a[0].data(), a[0].size());
    return 0;
  }
  std::fprintf(stderr, "unknown kernel %s\n", name.c_str());
  return 1;
}

}  // namespace

int main() {
  try {
    std::string name;
    for (int ch = std::getchar(); ch != '\n' && ch != EOF; ch = std::getchar())
      name += static_cast<char>(ch);
    std::vector<double> params(read<int64_t>());
    for (double& v : params) v = read<double>();
    std::vector<std::vector<char>> arrays(read<int64_t>());
    for (auto& array : arrays) array = read_array();
    return run(name, params, arrays);
  } catch (const char* e) {
    std::fprintf(stderr, "%s\n", e);
    return 1;
  }
}

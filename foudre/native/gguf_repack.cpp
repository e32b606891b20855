// GGUF's blocks of 32 values repacked at load straight into the 16-row blocks that
// cpu_qmatmul.cpp's kernels read (cpu_qmatmul.interleave's layouts), one row at a time, without
// the codes ever being unpacked into rows first:
//   int8x16 (kind 4) from Q4_0, Q5_0 or Q8_0: per block of 16 rows and pair of groups of 32
//     columns, the two groups' codes (code + 128 as a byte; line j of 64 bytes holds columns
//     4 j .. 4 j + 3 of the 16 rows, row r's at 4 r), then their 16 rows' float16 scales, group
//     by group (x16_codes, x16_scales);
//   int4x16 (kind 5) from Q4_0: per block and group, 4 lines of 64 bytes (line j: 4 bytes of
//     each row, row r's at 4 r, low nibbles columns 8 j .. 8 j + 3, high nibbles 8 j + 4 ..
//     8 j + 7; codes 0..15, zero point 8 for all), then the 16 rows' float16 scales (x4_group);
//     from Q4_1 and Q4_K (and Q4_0 beside them) with float32 scales and zero points stored
//     after them (foudre_gguf_x16_zeros).
// The scales are the file's float16 d, copied as they are (what the Python path's float16 ->
// float32 -> float16 round trip gives for every d but a NaN). And tensors of these types and of
// Q4_K, Q5_K and Q6_K dequantized (foudre_gguf_dequantize: an embedding table) to float32 or
// bfloat16, in float32 as the gguf package computes them, then rounded to bfloat16 as torch
// rounds (nearest even). One thread: no barrier to wait on when the host's other cores are busy.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// ggml's type numbers
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kInt8x16 = 4, kInt4x16 = 5;  // cpu_qmatmul.KINDS
constexpr int kInt4x16Zeros = 6;  // int4x16 with float32 scales and zero points (stored)
constexpr int64_t kCodes = 512;                  // a group's code bytes in a block (16 x 32)

inline int64_t source_block_bytes(int type) {
  return type == kQ4_0 ? 18 : type == kQ5_0 ? 22 : type == kQ8_0 ? 34 : 0;
}

// bytes of one 16-row block per K columns
inline int64_t block_bytes(int kind, int64_t k) {
  return kind == kInt8x16 ? k / 64 * 2 * (kCodes + 32) : k / 32 * (8 * 32 + 32);
}

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// float16 bits to float32, exactly (subnormals, infinities and NaNs too)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 31, man = h & 0x3ff, bits;
  if (exp == 31) {
    bits = sign | 0x7f800000 | man << 13;
  } else if (exp != 0) {
    bits = sign | (exp + 112) << 23 | man << 13;
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | exp << 23 | (man & 0x3ff) << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t to_bfloat16(float f) {  // (never a NaN here: see foudre_gguf_dequantize)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline bool is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0; }

// the 32 signed codes (value = code * d) of a source block
inline void signed_codes(int type, const uint8_t* b, int8_t out[32]) {
  if (type == kQ8_0) {
    std::memcpy(out, b + 2, 32);
  } else if (type == kQ4_0) {
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<int8_t>((b[2 + j] & 15) - 8);
      out[j + 16] = static_cast<int8_t>((b[2 + j] >> 4) - 8);
    }
  } else {  // Q5_0: bit j of the little-endian qh is value j's fifth bit
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<int8_t>(((b[6 + j] & 15) | ((qh >> j) & 1) << 4) - 16);
      out[j + 16] = static_cast<int8_t>(((b[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
    }
  }
}

// one row (src: its blocks; null: a padding row, codes 0 and scales 0) as row r of int8x16
// blocks; the groups whose d is a NaN counted
int64_t row_int8x16(int type, const uint8_t* src, int64_t k, uint8_t* block, int64_t r) {
  int64_t special = 0;
  int8_t q[32];
  for (int64_t g = 0; g < k / 32; ++g) {
    uint8_t* codes = block + g / 2 * 2 * (kCodes + 32) + g % 2 * kCodes + 4 * r;
    uint16_t d = 0;
    if (src != nullptr) {
      const uint8_t* b = src + g * source_block_bytes(type);
      signed_codes(type, b, q);
      d = half_bits(b);
      special += is_nan(d);
    } else {
      std::memset(q, 0, sizeof q);
    }
    for (int j = 0; j < 8; ++j) {  // columns 4 j .. 4 j + 3, each + 128 (its top bit flipped)
      uint32_t w;
      std::memcpy(&w, q + 4 * j, 4);
      w ^= 0x80808080u;
      std::memcpy(codes + 64 * j, &w, 4);
    }
    uint8_t* scale = block + g / 2 * 2 * (kCodes + 32) + 2 * kCodes + g % 2 * 32 + 2 * r;
    std::memcpy(scale, &d, 2);
  }
  return special;
}

// one Q4_0 row (null: padding) as row r of int4x16 blocks; the groups whose d is 0, infinite or
// a NaN counted (their zero point is not 8 in the Python path's form: the caller repacks so)
int64_t row_int4x16(const uint8_t* src, int64_t k, uint8_t* block, int64_t r) {
  int64_t special = 0;
  for (int64_t g = 0; g < k / 32; ++g) {
    uint8_t* group = block + g * (8 * 32 + 32);
    uint8_t* line = group + 4 * r;
    if (src == nullptr) {
      for (int j = 0; j < 4; ++j) std::memset(line + 64 * j, 0, 4);
      std::memset(group + 8 * 32 + 2 * r, 0, 2);
      continue;
    }
    const uint8_t* b = src + g * 18;
    const uint8_t* qs = b + 2;  // value j: low nibble of qs[j], value j + 16: its high nibble
    for (int i = 0; i < 4; ++i) {
      line[i] = static_cast<uint8_t>((qs[i] & 15) | (qs[i + 4] & 15) << 4);
      line[64 + i] = static_cast<uint8_t>((qs[8 + i] & 15) | (qs[12 + i] & 15) << 4);
      line[128 + i] = static_cast<uint8_t>((qs[i] >> 4) | (qs[i + 4] & 0xf0));
      line[192 + i] = static_cast<uint8_t>((qs[8 + i] >> 4) | (qs[12 + i] & 0xf0));
    }
    const uint16_t d = half_bits(b);
    special += (d & 0x7fff) == 0 || (d & 0x7c00) == 0x7c00;
    std::memcpy(group + 8 * 32 + 2 * r, &d, 2);
  }
  return special;
}

// Q4_0, Q4_1 and Q4_K rows as int4x16 blocks with float32 scales s and zero points z stored
// (per group, after its 4 lines: the 16 rows' s, then their z), in gguf_quant's form of
// w = q s - c: z = c / s, and where s is 0 codes 0, s = |c|, z = sign(c) (0 for c = 0). Q4_0:
// s = d, c = 8 s; Q4_1: s = d, c = -m; Q4_K (per 256 columns d, dmin and 6-bit sc, m per 32):
// s = d sc, c = dmin m, all in float32 as numpy computes them.
struct ZeroPoints {
  float first;      // the first group's z (NaN until one is seen)
  int64_t differ;   // groups whose z differs from it
  int64_t special;  // groups whose s, c or z is not finite (the caller takes the general path)
};

// Q4_K's 6-bit scale and min of sub-block j from its 12 bytes
inline void q4_k_scale_min(const uint8_t* p, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = p[j] & 63;
    *m = p[j + 4] & 63;
  } else {
    *sc = (p[j + 4] & 15) | (p[j - 4] >> 6) << 4;
    *m = (p[j + 4] >> 4) | (p[j] >> 6) << 4;
  }
}

// group g's 32 codes (0..15) of a row, s and c
inline void q4_group(int type, const uint8_t* row, int64_t g, uint8_t q[32], float* s, float* c) {
  if (type == kQ4_K) {
    const uint8_t* b = row + g / 8 * 144;
    const int j = static_cast<int>(g % 8);
    int sc, m;
    q4_k_scale_min(b + 4, j, &sc, &m);
    *s = half_to_float(half_bits(b)) * static_cast<float>(sc);
    *c = half_to_float(half_bits(b + 2)) * static_cast<float>(m);
    const uint8_t* qs = b + 16 + 32 * (j / 2);  // sub-block 2i: low nibbles, 2i + 1: high
    for (int l = 0; l < 32; ++l) q[l] = j % 2 ? qs[l] >> 4 : qs[l] & 15;
    return;
  }
  const int64_t size = type == kQ4_0 ? 18 : 20;
  const uint8_t* b = row + g * size;
  *s = half_to_float(half_bits(b));
  *c = type == kQ4_0 ? 8.0f * *s : -half_to_float(half_bits(b + 2));
  const uint8_t* qs = b + size - 16;
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 15;
    q[j + 16] = qs[j] >> 4;
  }
}

inline bool finite(float x) { return x - x == 0.0f; }

void row_int4x16_zeros(int type, const uint8_t* src, int64_t k, uint8_t* block, int64_t r,
                       ZeroPoints* zp) {
  constexpr int64_t kGroupBytes = 8 * 32 + 2 * 16 * 4;
  for (int64_t g = 0; g < k / 32; ++g) {
    uint8_t* group = block + g * kGroupBytes;
    uint8_t* line = group + 4 * r;
    uint8_t q[32] = {0};
    float s = 0.0f, z = 0.0f, c = 0.0f;
    if (src != nullptr) {
      q4_group(type, src, g, q, &s, &c);
      if (!finite(s) || !finite(c)) {
        ++zp->special;
      } else if (s == 0.0f) {  // one value, -c: codes 0, s = |c|, z = sign(c)
        std::memset(q, 0, sizeof q);
        s = std::fabs(c);
        z = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
      } else {
        z = c / s;
        zp->special += !finite(z);
      }
      if (zp->first != zp->first) zp->first = z;
      zp->differ += z != zp->first;
    }
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i)
        line[64 * j + i] = static_cast<uint8_t>(q[8 * j + i] | q[8 * j + i + 4] << 4);
    std::memcpy(group + 8 * 32 + 4 * r, &s, 4);
    std::memcpy(group + 8 * 32 + 64 + 4 * r, &z, 4);
  }
}

// K-quant blocks of 256 values, as the gguf package dequantizes them (float32, in its order of
// operations): Q4_K and Q5_K d sc q - dmin m (sub-blocks of 32: d sc and dmin m first, then the
// product, then the difference), Q6_K (d sc) (q - 32) (sub-blocks of 16, sc an int8)
inline int64_t k_block_bytes(int type) {
  return type == kQ4_K ? 144 : type == kQ5_K ? 176 : type == kQ6_K ? 210 : 0;
}

// whether the block's d (and dmin) are finite
inline bool k_block_finite(int type, const uint8_t* b) {
  if (type == kQ6_K) return (half_bits(b + 208) & 0x7c00) != 0x7c00;
  return (half_bits(b) & 0x7c00) != 0x7c00 && (half_bits(b + 2) & 0x7c00) != 0x7c00;
}

void k_block_values(int type, const uint8_t* b, float out[256]) {
  if (type == kQ6_K) {  // ql: per half of 128, values 0..63 low nibbles, 64..127 high nibbles;
    const uint8_t *ql = b, *qh = b + 128;  // qh: bits 2t..2t + 1 of byte l: value 32 t + l's
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(half_bits(b + 208));
    for (int p = 0; p < 256; ++p) {
      const int h = p / 128, r = p % 128;
      const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
      const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      const float ds = d * static_cast<float>(sc[p / 16]);
      out[p] = ds * static_cast<float>((lo | hi << 4) - 32);
    }
    return;
  }
  const float d = half_to_float(half_bits(b)), dmin = half_to_float(half_bits(b + 2));
  const uint8_t* qs = b + (type == kQ4_K ? 16 : 48);  // Q5_K: the fifth bits at 16 (32 bytes)
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    q4_k_scale_min(b + 4, j, &sc, &m);
    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
      if (type == kQ5_K) q |= ((b[16 + l] >> j) & 1) << 4;
      const float v = dj * static_cast<float>(q);
      out[32 * j + l] = v - mj;
    }
  }
}

// Q6_K's codes (0..63) of a block of 256 values
inline void q6_k_codes(const uint8_t* b, uint8_t q[256]) {
  for (int p = 0; p < 256; ++p) {
    const int h = p / 128, r = p % 128;
    const int lo = (b[64 * h + r % 64] >> (4 * (r / 64))) & 15;
    const int hi = (b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
    q[p] = static_cast<uint8_t>(lo | hi << 4);
  }
}

// a Q6_K row (k / 256 blocks) as packing.pack_int6's row (per 128 columns 104 bytes: the low
// nibbles, two columns a byte; the top two bits of columns 2i, 2i + 64, 2i + 1, 2i + 65 in byte
// i's bits 0-1, 2-3, 4-5, 6-7; the 8 int8 sub-scales) and its float16 d per 256 columns; the
// blocks whose d is a NaN counted
int64_t row_int6(const uint8_t* src, int64_t k, uint8_t* out, uint16_t* d) {
  int64_t special = 0;
  uint8_t q[256];
  for (int64_t blk = 0; blk < k / 256; ++blk) {
    const uint8_t* b = src + blk * 210;
    q6_k_codes(b, q);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* c = q + 128 * half;
      uint8_t* o = out + (2 * blk + half) * 104;
      for (int i = 0; i < 64; ++i)
        o[i] = static_cast<uint8_t>((c[2 * i] & 15) | (c[2 * i + 1] & 15) << 4);
      for (int i = 0; i < 32; ++i)
        o[64 + i] = static_cast<uint8_t>((c[2 * i] >> 4) | (c[2 * i + 64] >> 4) << 2 |
                                         (c[2 * i + 1] >> 4) << 4 | (c[2 * i + 65] >> 4) << 6);
      std::memcpy(o + 96, b + 192 + 8 * half, 8);
    }
    d[blk] = half_bits(b + 208);
    special += is_nan(d[blk]);
  }
  return special;
}

// n values of a K-quant tensor into dst (float32 or bfloat16); as foudre_gguf_dequantize
int64_t dequantize_k(int type, const uint8_t* src, int64_t n, void* dst, int out_type) {
  const int64_t size = k_block_bytes(type);
  if (n % 256 != 0) return -1;
  for (int64_t b = 0; b < n / 256; ++b)
    if (!k_block_finite(type, src + b * size)) return 1;
  float v[256];
  for (int64_t b = 0; b < n / 256; ++b) {
    k_block_values(type, src + b * size, v);
    if (out_type == 0) {
      std::memcpy(static_cast<float*>(dst) + 256 * b, v, sizeof v);
    } else {
      uint16_t* out = static_cast<uint16_t*>(dst) + 256 * b;
      for (int j = 0; j < 256; ++j) out[j] = to_bfloat16(v[j]);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Rows first .. first + n - 1 of a weight in 16-row blocks (dst: every block, kind 4 int8x16 or
// 5 int4x16, k columns: a multiple of 64, of 128 for int4x16) from the rows of a GGUF tensor of
// ggml type `type` (src: its first row, row_bytes apart; row order[i] for the i-th, or i where
// order is null; src null: padding rows). Returns the groups whose d the caller must not take
// so (see row_int8x16, row_int4x16), or -1 for a kind or type it does not take.
int64_t foudre_gguf_x16(int kind, int type, const uint8_t* src, int64_t row_bytes,
                        const int64_t* order, int64_t n, int64_t k, uint8_t* dst, int64_t first) {
  if (source_block_bytes(type) == 0 || (kind != kInt8x16 && kind != kInt4x16) ||
      (kind == kInt4x16 && type != kQ4_0))
    return -1;
  const int64_t bytes = block_bytes(kind, k);
  int64_t special = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = first + i;
    const uint8_t* row =
        src == nullptr ? nullptr : src + (order == nullptr ? i : order[i]) * row_bytes;
    uint8_t* block = dst + r / 16 * bytes;
    special += kind == kInt8x16 ? row_int8x16(type, row, k, block, r % 16)
                                : row_int4x16(row, k, block, r % 16);
  }
  return special;
}

// As foudre_gguf_x16 for int4x16 blocks with float32 scales and zero points stored (k a multiple
// of 128; of 256 for Q4_K) from Q4_0, Q4_1 or Q4_K rows (row_int4x16_zeros). *first_z: the first
// group's zero point (NaN on the first call: set then), *differ: counts the groups whose zero
// point differs from it (the caller holds one pair for all of a module's parts). Returns the
// groups the caller must not take so (row_int4x16_zeros), or -1 for a type it does not take.
int64_t foudre_gguf_x16_zeros(int type, const uint8_t* src, int64_t row_bytes,
                              const int64_t* order, int64_t n, int64_t k, uint8_t* dst,
                              int64_t first, float* first_z, int64_t* differ) {
  if (type != kQ4_0 && type != kQ4_1 && type != kQ4_K) return -1;
  const int64_t bytes = k / 32 * (8 * 32 + 2 * 16 * 4);
  ZeroPoints zp{*first_z, *differ, 0};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = first + i;
    const uint8_t* row =
        src == nullptr ? nullptr : src + (order == nullptr ? i : order[i]) * row_bytes;
    row_int4x16_zeros(type, row, k, dst + r / 16 * bytes, r % 16, &zp);
  }
  *first_z = zp.first;
  *differ = zp.differ;
  return zp.special;
}

// Rows first .. first + n - 1 of a 6-bit weight (q: packing.pack_int6's rows of k / 16 * 13
// bytes; d: its float16 d, k / 256 a row) from the n rows of a Q6_K tensor (src: its first
// row; row order[i] the i-th, or i where order is null). Returns the blocks whose d is a NaN
// (the caller takes the general path then).
int64_t foudre_gguf_int6(const uint8_t* src, const int64_t* order, int64_t n, int64_t k,
                         uint8_t* q, uint16_t* d, int64_t first) {
  const int64_t row_bytes = k / 256 * 210;
  int64_t special = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = first + i;
    const uint8_t* row = src + (order == nullptr ? i : order[i]) * row_bytes;
    special += row_int6(row, k, q + r * (k / 16 * 13), d + r * (k / 256));
  }
  return special;
}

// n values of a tensor of ggml type `type` (Q4_0, Q5_0 or Q8_0, n a multiple of 32; Q4_K, Q5_K
// or Q6_K, n a multiple of 256) at src as float32 (out_type 0) or bfloat16 (2) at dst. Returns
// 0; 1 where a block's d (or dmin) is infinite or a NaN (its values NaNs or infinities, which
// torch's bfloat16 rounding writes as its own vector code decides: the caller takes the general
// path), -1 for a type it does not take.
int64_t foudre_gguf_dequantize(int type, const uint8_t* src, int64_t n, void* dst, int out_type) {
  if (out_type != 0 && out_type != 2) return -1;
  if (k_block_bytes(type) != 0) return dequantize_k(type, src, n, dst, out_type);
  const int64_t size = source_block_bytes(type);
  if (size == 0 || n % 32 != 0) return -1;
  for (int64_t b = 0; b < n / 32; ++b)
    if ((half_bits(src + b * size) & 0x7c00) == 0x7c00) return 1;
  int8_t q[32];
  for (int64_t b = 0; b < n / 32; ++b) {
    const uint8_t* block = src + b * size;
    signed_codes(type, block, q);
    const float d = half_to_float(half_bits(block));
    if (out_type == 0) {
      float* out = static_cast<float*>(dst) + 32 * b;
      for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q[j]);
    } else {
      uint16_t* out = static_cast<uint16_t*>(dst) + 32 * b;
      for (int j = 0; j < 32; ++j) out[j] = to_bfloat16(d * static_cast<float>(q[j]));
    }
  }
  return 0;
}

}  // extern "C"

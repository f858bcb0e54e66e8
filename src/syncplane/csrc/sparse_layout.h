// Layout of a chunked top-k payload (syncplane/kernels.py: SparseLayout, the definition),
// shared by cpu_kernels.cpp and cuda_kernels.cu so the two can never disagree on an offset.
// ext.py hashes every header in csrc/ into the build's name, so an edit here rebuilds both.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define SPARSE_HD __host__ __device__
#else
#define SPARSE_HD
#endif

namespace sparse {

struct Layout {
  int64_t numel, k, chunk;
  int bits;
  int64_t full, tail, chunks;

  SPARSE_HD Layout(int64_t n, int64_t k_, int64_t c, int b)
      : numel(n), k(k_), chunk(c), bits(b), full(n / c), tail(n % c), chunks(n / c + (n % c > 0 ? 1 : 0)) {}
  // bits of an offset inside a chunk of `length` values
  SPARSE_HD static int width(int64_t length) {
    int w = 0;
    for (int64_t v = length - 1; v > 0; v >>= 1) ++w;
    return w > 1 ? w : 1;
  }
  SPARSE_HD int64_t kept(int64_t length) const { return k < length ? k : length; }
  // a bitmap when it is no larger than the offsets (decided by the sizes alone)
  SPARSE_HD bool bitmap(int64_t length) const { return length <= kept(length) * width(length); }
  SPARSE_HD int64_t index_bytes(int64_t length) const {
    if (length == 0) return 0;
    const int64_t n_bits = bitmap(length) ? length : kept(length) * width(length);
    return (n_bits + 7) / 8;
  }
  SPARSE_HD int64_t value_bytes(int64_t length) const { return (kept(length) * bits + 7) / 8; }
  SPARSE_HD int64_t length_of(int64_t c) const { return c < full ? chunk : tail; }
  SPARSE_HD int64_t index_section() const { return full * index_bytes(chunk) + index_bytes(tail); }
  SPARSE_HD int64_t value_section() const { return full * value_bytes(chunk) + value_bytes(tail); }
  SPARSE_HD int64_t nbytes() const { return 4 * chunks + index_section() + value_section(); }
  // byte offsets of chunk c's indices and codes, from the start of the payload
  SPARSE_HD int64_t index_at(int64_t c) const { return 4 * chunks + c * index_bytes(chunk); }
  SPARSE_HD int64_t codes_at(int64_t c) const { return 4 * chunks + index_section() + c * value_bytes(chunk); }
};

// LSB-first bit stream: item bits are ORed into a zeroed byte range
SPARSE_HD inline void put_bits(uint8_t* bytes, int64_t pos, uint32_t value, int width) {
  for (int b = 0; b < width; ++b, ++pos) {
    if ((value >> b) & 1u) bytes[pos >> 3] |= static_cast<uint8_t>(1u << (pos & 7));
  }
}

SPARSE_HD inline uint32_t get_bits(const uint8_t* bytes, int64_t pos, int width) {
  uint32_t value = 0;
  for (int b = 0; b < width; ++b, ++pos) value |= static_cast<uint32_t>((bytes[pos >> 3] >> (pos & 7)) & 1u) << b;
  return value;
}

}  // namespace sparse

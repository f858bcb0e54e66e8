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

// how a chunk's kept positions travel (kernels.py: SparseLayout.index_mode)
enum IndexMode : int { kOffsets = 0, kBitmap = 1, kEliasFano = 2 };

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
  // Elias-Fano's low part: floor(log2(length / kept)) bits per position (0 when length < 2 kept)
  SPARSE_HD int low_width(int64_t length) const {
    int l = 0;
    for (int64_t q = length / kept(length); q > 1; q >>= 1) ++l;
    return l;
  }
  SPARSE_HD int64_t elias_fano_bits(int64_t length) const {
    const int64_t n = kept(length);
    const int l = low_width(length);
    return n * l + n + ((length - 1) >> l) + 1;
  }
  // the smallest of the three encodings, decided by the sizes alone (ties: bitmap, offsets)
  SPARSE_HD IndexMode mode(int64_t length) const {
    const int64_t offsets = kept(length) * width(length), ef = elias_fano_bits(length);
    if (length <= offsets && length <= ef) return kBitmap;
    return offsets <= ef ? kOffsets : kEliasFano;
  }
  SPARSE_HD int64_t index_bits(int64_t length) const {
    switch (mode(length)) {
      case kBitmap: return length;
      case kOffsets: return kept(length) * width(length);
      default: return elias_fano_bits(length);
    }
  }
  SPARSE_HD int64_t index_bytes(int64_t length) const { return length == 0 ? 0 : (index_bits(length) + 7) / 8; }
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

// Writes and reads a chunk's kept positions (ascending) in the chunk's index mode; one
// definition for both compiled twins. Elias-Fano: position j's low `low_width` bits at
// [j*l, (j+1)*l), then a unary bit for j at kept*l + (i >> l) + j.
struct IndexCodec {
  IndexMode mode;
  int64_t length, kept;
  int width, low;

  SPARSE_HD IndexCodec(const Layout& L, int64_t length_)
      : mode(L.mode(length_)), length(length_), kept(L.kept(length_)), width(Layout::width(length_)),
        low(L.low_width(length_)) {}

  SPARSE_HD void put(uint8_t* bytes, int64_t j, int64_t i) const {
    if (mode == kBitmap) {
      put_bits(bytes, i, 1u, 1);
    } else if (mode == kOffsets) {
      put_bits(bytes, j * width, static_cast<uint32_t>(i), width);
    } else {
      put_bits(bytes, j * low, static_cast<uint32_t>(i) & ((1u << low) - 1u), low);
      put_bits(bytes, kept * low + (i >> low) + j, 1u, 1);
    }
  }
};

// Reads the positions back in order; -1 marks a malformed chunk (too few set bits, an offset
// outside the chunk, Elias-Fano positions not strictly ascending).
struct IndexReader {
  IndexCodec codec;
  const uint8_t* bytes;
  int64_t pos, end, last;

  SPARSE_HD IndexReader(const Layout& L, const uint8_t* bytes_, int64_t length)
      : codec(L, length), bytes(bytes_), pos(0), end(length), last(-1) {
    if (codec.mode == kEliasFano) {
      pos = codec.kept * codec.low;
      end = L.elias_fano_bits(length);
    }
  }
  SPARSE_HD bool bit(int64_t p) const { return (bytes[p >> 3] >> (p & 7)) & 1u; }
  SPARSE_HD int64_t next(int64_t j) {
    if (codec.mode == kOffsets) {
      const int64_t offset = get_bits(bytes, j * codec.width, codec.width);
      return offset < codec.length ? offset : -1;
    }
    while (pos < end && !bit(pos)) ++pos;
    if (pos >= end) return -1;
    const int64_t at = pos++;
    if (codec.mode == kBitmap) return at;
    const int64_t high = at - codec.kept * codec.low - j;
    const int64_t offset = (high << codec.low) | get_bits(bytes, j * codec.low, codec.low);
    if (offset >= codec.length || offset <= last) return -1;
    last = offset;
    return offset;
  }
  // after the last position: no set bit may remain (bitmap and Elias-Fano)
  SPARSE_HD bool rest_clear() {
    if (codec.mode == kOffsets) return true;
    for (; pos < end; ++pos) {
      if (bit(pos)) return false;
    }
    return true;
  }
};

}  // namespace sparse

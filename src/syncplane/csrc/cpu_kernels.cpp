// CPU kernels for syncplane's communication hot path.
//
// Why these exist: a decentralized step packs a model's many small tensors into
// one flat buffer (so the network sees a few large messages), and combines the
// buffers received from neighbours as out = a*x + sum_j w_j*y_j.  Done with
// torch ops that is one pass over memory per tensor and per neighbour; here it
// is a single multithreaded pass. The combine accumulates in float32 for 16-bit
// inputs and in float64 for float32/float64 ones, with the weights kept in the
// accumulation type, so a k-neighbour average of fp32 tensors is correctly rounded
// (one rounding at the end) instead of carrying k+1 fp32 roundings.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "sparse_layout.h"

namespace {

constexpr int64_t kGrain = 1 << 15;   // elements per parallel task
constexpr int64_t kBlock = 1024;      // elements per accumulation block

void check_same_dtype(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                      const char* op) {
  TORCH_CHECK(flat.is_contiguous(), op, ": flat buffer must be contiguous");
  TORCH_CHECK(flat.device().is_cpu(), op, ": flat buffer must be on the CPU");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.scalar_type() == flat.scalar_type(), op, ": tensor ", i, " has dtype ",
                t.scalar_type(), " but the flat buffer has ", flat.scalar_type());
    // any memory format (channels_last too): copied as raw memory, in memory order
    TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": tensor ", i, " has gaps in memory (not dense)");
    TORCH_CHECK(t.device().is_cpu(), op, ": tensor ", i, " is not on the CPU");
  }
}

// Offsets of every tensor inside the flat buffer (exclusive prefix sum of numel).
std::vector<int64_t> offsets_of(const std::vector<at::Tensor>& tensors, int64_t flat_numel,
                                const char* op) {
  std::vector<int64_t> offsets(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) offsets[i + 1] = offsets[i] + tensors[i].numel();
  TORCH_CHECK(offsets.back() <= flat_numel, op, ": tensors hold ", offsets.back(),
              " elements but the flat buffer only ", flat_numel);
  return offsets;
}

// Copies between the flat buffer and the tensors over the concatenated index
// space, so one parallel_for covers thousands of tiny tensors without a task each.
template <typename scalar_t, bool kToFlat>
void copy_segments(scalar_t* flat, const std::vector<scalar_t*>& ptrs,
                   const std::vector<int64_t>& offsets, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t s = static_cast<acc_t>(scale);
  const bool plain = scale == 1.0;
  at::parallel_for(0, offsets.back(), kGrain, [&](int64_t begin, int64_t end) {
    auto it = std::upper_bound(offsets.begin(), offsets.end(), begin);
    size_t idx = static_cast<size_t>(it - offsets.begin()) - 1;
    int64_t pos = begin;
    while (pos < end) {
      while (offsets[idx + 1] <= pos) ++idx;  // skip empty tensors
      const int64_t seg_end = std::min(end, offsets[idx + 1]);
      const int64_t n = seg_end - pos;
      scalar_t* tensor_ptr = ptrs[idx] + (pos - offsets[idx]);
      scalar_t* flat_ptr = flat + pos;
      scalar_t* dst = kToFlat ? flat_ptr : tensor_ptr;
      const scalar_t* src = kToFlat ? tensor_ptr : flat_ptr;
      if (plain) {
        std::memcpy(dst, src, sizeof(scalar_t) * n);
      } else {
        for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<scalar_t>(static_cast<acc_t>(src[k]) * s);
      }
      pos = seg_end;
    }
  });
}

template <bool kToFlat>
void pack_or_unpack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale,
                    const char* op) {
  check_same_dtype(tensors, flat, op);
  const auto offsets = offsets_of(tensors, flat.numel(), op);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "pack_or_unpack", [&] {
    std::vector<scalar_t*> ptrs;
    ptrs.reserve(tensors.size());
    for (const auto& t : tensors) ptrs.push_back(t.data_ptr<scalar_t>());
    copy_segments<scalar_t, kToFlat>(flat.data_ptr<scalar_t>(), ptrs, offsets, scale);
  });
}

}  // namespace

// Accumulation type of weighted_combine: float for half/bfloat16, double otherwise.
template <typename scalar_t>
using combine_acc_t = std::conditional_t<std::is_same_v<scalar_t, float>, double, at::opmath_type<scalar_t>>;

void pack(const std::vector<at::Tensor>& tensors, at::Tensor flat, double scale) {
  pack_or_unpack<true>(tensors, flat, scale, "pack");
}

void unpack(const at::Tensor& flat, std::vector<at::Tensor> tensors, double scale) {
  pack_or_unpack<false>(tensors, flat, scale, "unpack");
}

void weighted_combine(at::Tensor out, const at::Tensor& x, double self_weight,
                      const std::vector<at::Tensor>& ys, const std::vector<double>& weights) {
  TORCH_CHECK(ys.size() == weights.size(), "weighted_combine: ", ys.size(), " buffers but ",
              weights.size(), " weights");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous(), "weighted_combine: out and x must be contiguous");
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu(), "weighted_combine: CPU tensors expected");
  TORCH_CHECK(out.numel() == x.numel(), "weighted_combine: out has ", out.numel(),
              " elements, x has ", x.numel());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "weighted_combine: out and x differ in dtype");
  for (size_t j = 0; j < ys.size(); ++j) {
    TORCH_CHECK(ys[j].numel() == x.numel(), "weighted_combine: buffer ", j, " has ", ys[j].numel(),
                " elements, x has ", x.numel());
    TORCH_CHECK(ys[j].scalar_type() == x.scalar_type(), "weighted_combine: buffer ", j,
                " has dtype ", ys[j].scalar_type(), ", x has ", x.scalar_type());
    TORCH_CHECK(ys[j].is_contiguous() && ys[j].device().is_cpu(), "weighted_combine: buffer ", j,
                " must be a contiguous CPU tensor");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "weighted_combine", [&] {
    using acc_t = combine_acc_t<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    std::vector<const scalar_t*> yp;
    for (const auto& y : ys) yp.push_back(y.data_ptr<scalar_t>());
    std::vector<acc_t> w(weights.begin(), weights.end());
    const acc_t a = static_cast<acc_t>(self_weight);
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      acc_t acc[kBlock];
      for (int64_t b = begin; b < end; b += kBlock) {
        const int64_t n = std::min(kBlock, end - b);
        for (int64_t k = 0; k < n; ++k) acc[k] = a * static_cast<acc_t>(xp[b + k]);
        for (size_t j = 0; j < yp.size(); ++j) {
          const scalar_t* y = yp[j] + b;
          const acc_t wj = w[j];
          for (int64_t k = 0; k < n; ++k) acc[k] += wj * static_cast<acc_t>(y[k]);
        }
        for (int64_t k = 0; k < n; ++k) op[b + k] = static_cast<scalar_t>(acc[k]);
      }
    });
  });
}

// ------------------------------------------------------------------ gradient sketch
//
// Canary's gradient sketch (docs/strategies/canary.md): each piece is sent as uint8 codes
// into a 256-entry codebook of bucket means, plus its k largest-magnitude values sent
// exactly (value and index). Byte layout (no alignment assumed; the header is memcpy'd):
//   [codebook: 256 x fp32][exact values: k x fp32][exact indices: k x int32][codes: n x uint8]
// Every step is deterministic and identical to the torch reference in syncplane/kernels.py:
//  * the k values are the first k in the total order (|x| descending, index ascending),
//    found with a radix select on the bit pattern of |x| (monotone for non-negative floats);
//  * bucket boundaries come from a strided sample (outliers excluded), sorted, as a blend
//    w * quantile + (1 - w) * uniform grid over the sample's range, computed in double;
//  * bucket means are summed in 64-bit fixed point (exact, so the summation order of
//    threads cannot change a single bit), then divided in double and rounded once.
namespace sketch {

constexpr int kBuckets = 256;
constexpr int64_t kHeader = kBuckets * 4;

// llrint under the default rounding mode (to nearest, ties to even), inlined: glibc's
// llrint is a call through the PLT, and the encode loop paid it for every value.
inline int64_t round_to_int64(double v) {
#if defined(__SSE2__)
  return _mm_cvtsd_si64(_mm_set_sd(v));
#else
  return std::llrint(v);
#endif
}

inline uint32_t abs_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits & 0x7fffffffu;
}

// Number of the 255 sorted boundaries strictly below v (torch.bucketize, right=False).
// A binary search costs 8 dependent loads per value; instead v's cell among kCells equal
// cells of [b[0], b[254]] (clamped at both ends) is looked up in a table. The cell of a value
// never decreases as the value grows (a rounded subtract and multiply are monotone), so in a
// cell that holds no boundary's cell every value has the same answer, the table's: the
// number of boundaries in cells below. Only in a cell that holds a boundary (or for every cell,
// if the boundaries are not sorted or hold a NaN) a walk from the table's guess compares v
// with the boundaries themselves, so the answer is exact whatever the rounding. A NaN (in cell
// 0, which always holds b[0]) is above every boundary, as torch.bucketize has it.
class Bucketizer {
 public:
  static constexpr int kCells = 16384;
  static constexpr uint16_t kWalk = 0x100;   // the cell holds a boundary: compare

  explicit Bucketizer(const float* bounds) : b_(bounds) {
    lo_ = bounds[0];
    const float span = bounds[kBuckets - 2] - lo_;
    scale_ = span > 0.0f && std::isfinite(span) ? kCells / span : 0.0f;
    bool sorted = true;
    for (int j = 0; j < kBuckets - 1; ++j) sorted = sorted && !std::isnan(b_[j]) && (j == 0 || b_[j - 1] <= b_[j]);
    int below = 0;
    for (int c = 0; c < kCells; ++c) {
      while (below < kBuckets - 1 && cell(b_[below]) < c) ++below;
      const bool holds = below < kBuckets - 1 && cell(b_[below]) == c;
      table_[c] = static_cast<uint16_t>(below | (holds || !sorted ? kWalk : 0));
    }
  }

  int cell(float v) const {
    float t = (v - lo_) * scale_;
    t = t > 0.0f ? t : 0.0f;                                        // and NaN -> 0
    t = t < static_cast<float>(kCells - 1) ? t : static_cast<float>(kCells - 1);
    return static_cast<int>(t);
  }

  int operator()(float v) const {
    const int entry = table_[cell(v)];
    if (__builtin_expect((entry & kWalk) == 0, 1)) return entry;
    if (std::isnan(v)) return kBuckets - 1;                         // torch.bucketize: NaN sorts last
    int code = entry & (kWalk - 1);
    while (code > 0 && b_[code - 1] >= v) --code;
    while (code < kBuckets - 1 && b_[code] < v) ++code;
    return code;
  }

 private:
  const float* b_;
  float lo_ = 0.0f, scale_ = 0.0f;
  uint16_t table_[kCells];
};

// Bits of the fixed-point scale: every non-outlier |v| < 2^bound_exp, and a sum of n
// values of magnitude < 2^frac_bits stays below 2^62.
inline int frac_bits_for(int64_t n) {
  int bits = 0;
  for (int64_t m = n + 1; m > 0; m >>= 1) ++bits;
  return 62 - bits;
}

// Splits [0, n) into one contiguous chunk per thread (fixed, so results never depend on
// the scheduler) and runs fn(t, begin, end) for each in parallel.
template <typename F>
void for_chunks(int64_t n, int64_t chunks, const F& fn) {
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) fn(c, n * c / chunks, n * (c + 1) / chunks);
  });
}

inline int64_t chunks_for(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kGrain));
}

using Candidate = std::pair<uint32_t, int32_t>;  // (|x| key, index)

// The total order of the exact values: key descending, index ascending.
inline bool before(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Every index whose key is at least `threshold`, ascending, in one parallel pass. About 2% of
// the values qualify, so the pass tests four at once (SSE2) and looks at each only where one
// of the four does: a branch per value was mispredicted on every chosen one.
std::vector<Candidate> at_least(const float* x, int64_t n, uint32_t threshold) {
  const int64_t chunks = chunks_for(n);
  std::vector<std::vector<Candidate>> found(chunks);
  for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
    std::vector<Candidate>& mine = found[c];
    auto one = [&](int64_t i) {
      const uint32_t key = abs_key(x[i]);
      if (key >= threshold) mine.push_back({key, static_cast<int32_t>(i)});
    };
    int64_t i = b;
#if defined(__SSE2__)
    if (threshold > 0 && threshold <= 0x7fffffffu) {      // keys and threshold compare as int32
      const __m128i magnitude = _mm_set1_epi32(0x7fffffff);
      const __m128i below = _mm_set1_epi32(static_cast<int32_t>(threshold - 1));
      for (; i + 4 <= e; i += 4) {
        const __m128i keys = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)), magnitude);
        if (_mm_movemask_epi8(_mm_cmpgt_epi32(keys, below)) != 0) {
          for (int64_t j = i; j < i + 4; ++j) one(j);
        }
      }
    }
#endif
    for (; i < e; ++i) one(i);
  });
  std::vector<Candidate> all;
  for (auto& part : found) all.insert(all.end(), part.begin(), part.end());
  return all;
}

// Indices (ascending) of the first k of `candidates` (ascending, at least k of them) in the
// total order: the k-th is found on a copy, then every candidate not after it is kept, in
// the order it came (no sort of the k indices).
std::vector<int32_t> first_k(const std::vector<Candidate>& candidates, int64_t k) {
  std::vector<Candidate> order(candidates);
  std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), before);
  const Candidate last = order[k - 1];
  std::vector<int32_t> picked;
  picked.reserve(k);
  for (const Candidate& c : candidates) {
    if (!before(last, c)) picked.push_back(c.second);
  }
  return picked;
}

// Indices (ascending) of the k largest |x| (ties: lower index first). First guess: a
// threshold from the strided sample with about 2k values above it, one pass collecting
// them; only if that guess was too high, a threshold from a histogram of the top 16 key bits.
std::vector<int32_t> top_k(const float* x, int64_t n, int64_t k, int64_t stride) {
  if (k <= 0) return {};
  std::vector<uint32_t> keys;
  for (int64_t i = 0; i < n; i += stride) keys.push_back(abs_key(x[i]));
  const int64_t m = static_cast<int64_t>(keys.size());
  const int64_t rank = std::min<int64_t>(m - 1, 2 * k * m / n + 8);
  std::nth_element(keys.begin(), keys.begin() + rank, keys.end(), std::greater<uint32_t>());
  std::vector<Candidate> candidates = at_least(x, n, keys[rank]);
  if (static_cast<int64_t>(candidates.size()) >= k) return first_k(candidates, k);
  const int64_t chunks = chunks_for(n);
  constexpr int kBins = 1 << 16;  // the top 16 bits of the key
  std::vector<std::vector<int64_t>> hist(chunks, std::vector<int64_t>(kBins, 0));
  for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
    int64_t* h = hist[c].data();
    for (int64_t i = b; i < e; ++i) ++h[abs_key(x[i]) >> 16];
  });
  int64_t above = 0;
  int bin = kBins - 1;
  for (; bin >= 0; --bin) {
    int64_t count = 0;
    for (int64_t c = 0; c < chunks; ++c) count += hist[c][bin];
    if (above + count >= k) break;
    above += count;
  }
  return first_k(at_least(x, n, static_cast<uint32_t>(bin) << 16), k);
}

// Ascending, by an LSD radix sort on the order-preserving keys of the float bits (three
// passes of 11 bits): under std::sort the sample's sort was more than half of the encode of a
// piece of 60 k values (0.84 ms, now 0.37). The same values in the same order, except that -0 sorts before +0 (std::sort
// leaves their order open; no boundary compares differently) and NaNs go to the ends.
void sort_floats(std::vector<float>& values) {
  constexpr int kBits = 11, kDigits = 1 << kBits, kPasses = 3;
  const size_t m = values.size();
  std::vector<uint32_t> a(m), b(m);
  std::array<std::array<uint32_t, kDigits>, kPasses> counts{};
  for (size_t i = 0; i < m; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &values[i], 4);
    const uint32_t key = bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u);
    a[i] = key;
    for (int p = 0; p < kPasses; ++p) ++counts[p][(key >> (p * kBits)) & (kDigits - 1)];
  }
  for (int p = 0; p < kPasses; ++p) {
    uint32_t next = 0;
    bool one_digit = false;
    for (uint32_t& c : counts[p]) {
      one_digit = one_digit || c == m;
      const uint32_t here = c;
      c = next;
      next += here;
    }
    if (one_digit) continue;     // every key has this digit: the pass would move nothing
    for (size_t i = 0; i < m; ++i) b[counts[p][(a[i] >> (p * kBits)) & (kDigits - 1)]++] = a[i];
    a.swap(b);
  }
  for (size_t i = 0; i < m; ++i) {
    const uint32_t key = a[i];
    const uint32_t bits = key ^ ((key >> 31) ? 0x80000000u : 0xffffffffu);
    std::memcpy(&values[i], &bits, 4);
  }
}

}  // namespace sketch

void sketch_encode(const at::Tensor& x, int64_t k, int64_t sample, double quantile_weight, at::Tensor out) {
  using namespace sketch;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "sketch_encode: x must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous(),
              "sketch_encode: out must be a contiguous uint8 CPU tensor");
  const int64_t n = x.numel();
  TORCH_CHECK(n < (int64_t(1) << 31), "sketch_encode: a piece holds at most 2^31 - 1 values, got ", n);
  TORCH_CHECK(k >= 0 && k <= n, "sketch_encode: k=", k, " must be in [0, ", n, "]");
  TORCH_CHECK(sample >= 1, "sketch_encode: sample must be at least 1, got ", sample);
  TORCH_CHECK(out.numel() == kHeader + 8 * k + n, "sketch_encode: out has ", out.numel(), " bytes, expected ",
              kHeader + 8 * k + n);
  const float* xp = x.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  uint8_t* codes = op + kHeader + 8 * k;

  const int64_t stride = std::max<int64_t>(1, n / sample);
  const std::vector<int32_t> exact = top_k(xp, n, k, stride);
  for (int64_t j = 0; j < k; ++j) {
    std::memcpy(op + kHeader + 4 * j, xp + exact[j], 4);
    std::memcpy(op + kHeader + 4 * k + 4 * j, &exact[j], 4);
  }
  // fixed-point scale from the smallest exact magnitude (or the largest one when k = 0):
  // every value that is summed is at most that large
  uint32_t bound_key = 0;
  if (k > 0) {
    bound_key = abs_key(xp[exact[0]]);
    for (int32_t i : exact) bound_key = std::min(bound_key, abs_key(xp[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) bound_key = std::max(bound_key, abs_key(xp[i]));
  }

  // sample (strided, outliers excluded), sorted
  std::vector<float> s;
  s.reserve((n + stride - 1) / stride);
  auto skip = exact.begin();                    // both ascending: one walk, no search per pick
  for (int64_t i = 0; i < n; i += stride) {
    while (skip != exact.end() && *skip < i) ++skip;
    if (skip == exact.end() || *skip != i) s.push_back(xp[i]);
  }
  sort_floats(s);
  float bounds[kBuckets - 1];
  const int64_t m = static_cast<int64_t>(s.size());
  if (m == 0) {
    std::fill(bounds, bounds + kBuckets - 1, 0.0f);
  } else {
    const double lo = s.front(), hi = s.back();
    for (int i = 1; i < kBuckets; ++i) {
      const double q = s[(i * m) / kBuckets];
      const double u = lo + (hi - lo) * (static_cast<double>(i) / kBuckets);
      bounds[i - 1] = static_cast<float>(quantile_weight * q + (1.0 - quantile_weight) * u);
    }
  }

  // codes, and per-bucket fixed-point sums of the non-exact values
  const int frac = frac_bits_for(n);
  const int bound_exp = static_cast<int>(bound_key >> 23) - 126;  // |v| < 2^bound_exp
  const double to_fixed = std::ldexp(1.0, frac - bound_exp);
  const int64_t chunks = chunks_for(n);
  const Bucketizer code_of(bounds);
  std::vector<std::array<int64_t, kBuckets>> sums(chunks), counts(chunks);
  for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
    // locals, not the captured references: a store to a uint8_t may alias anything, so
    // through references every pointer and the bucketizer were loaded again per value
    const Bucketizer code_at = code_of;
    const float* __restrict in = xp;
    uint8_t* __restrict out_codes = codes;
    int64_t* __restrict sum = sums[c].data();
    int64_t* __restrict count = counts[c].data();
    const double scale = to_fixed;
    std::fill(sum, sum + kBuckets, 0);
    std::fill(count, count + kBuckets, 0);
    auto next = std::lower_bound(exact.begin(), exact.end(), static_cast<int32_t>(b));
    const auto last = exact.end();
    int64_t skip = next == last ? e : *next;
    for (int64_t i = b; i < e; ++i) {
      const float v = in[i];
      const int code = code_at(v);
      out_codes[i] = static_cast<uint8_t>(code);
      if (i == skip) {
        ++next;
        skip = next == last ? e : *next;
        continue;
      }
      sum[code] += round_to_int64(static_cast<double>(v) * scale);
      ++count[code];
    }
  });
  float codebook[kBuckets];
  const double from_fixed = std::ldexp(1.0, bound_exp - frac);
  for (int b = 0; b < kBuckets; ++b) {
    int64_t total = 0, count = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      total += sums[c][b];
      count += counts[c][b];
    }
    codebook[b] = count == 0 ? 0.0f
                             : static_cast<float>(static_cast<double>(total) / static_cast<double>(count) * from_fixed);
  }
  std::memcpy(op, codebook, kHeader);
}

void sketch_decode(const at::Tensor& data, int64_t k, at::Tensor out) {
  using namespace sketch;
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.is_contiguous(),
              "sketch_decode: data must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "sketch_decode: out must be a contiguous float32 CPU tensor");
  const int64_t n = out.numel();
  TORCH_CHECK(k >= 0 && k <= n && data.numel() == kHeader + 8 * k + n, "sketch_decode: ", data.numel(),
              " bytes do not hold a sketch of ", n, " values with ", k, " exact ones");
  const uint8_t* dp = data.data_ptr<uint8_t>();
  float codebook[kBuckets];
  std::memcpy(codebook, dp, kHeader);
  const uint8_t* codes = dp + kHeader + 8 * k;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[i] = codebook[codes[i]];
  });
  for (int64_t j = 0; j < k; ++j) {
    int32_t idx;
    std::memcpy(&idx, dp + kHeader + 4 * k + 4 * j, 4);
    TORCH_CHECK(idx >= 0 && idx < n, "sketch_decode: exact index ", idx, " is outside [0, ", n, ")");
    std::memcpy(op + idx, dp + kHeader + 4 * j, 4);
  }
}

// out += scale * decode(data), scale = +1 or -1 (the sum of a piece, or what error feedback
// keeps), in one pass and without the decoded buffer: bit for bit out + scale * sketch_decode(data)
// (scale * value is exact for +-1, so contraction to an FMA rounds the same). An exact position
// takes its own value instead of the codebook's (the last one, if an index repeats): its new
// value is computed from the old one before the pass and put back after it.
void sketch_decode_add(const at::Tensor& data, int64_t k, at::Tensor out, double scale) {
  using namespace sketch;
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.is_contiguous(),
              "sketch_decode_add: data must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "sketch_decode_add: out must be a contiguous float32 CPU tensor");
  TORCH_CHECK(scale == 1.0 || scale == -1.0, "sketch_decode_add: scale must be 1 or -1, got ", scale);
  const int64_t n = out.numel();
  TORCH_CHECK(k >= 0 && k <= n && data.numel() == kHeader + 8 * k + n, "sketch_decode_add: ", data.numel(),
              " bytes do not hold a sketch of ", n, " values with ", k, " exact ones");
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const float s = static_cast<float>(scale);
  float codebook[kBuckets];
  std::memcpy(codebook, dp, kHeader);
  for (float& c : codebook) c *= s;
  const uint8_t* codes = dp + kHeader + 8 * k;
  float* op = out.data_ptr<float>();
  std::vector<std::pair<int32_t, float>> exact(k);
  for (int64_t j = 0; j < k; ++j) {
    int32_t idx;
    float value;
    std::memcpy(&idx, dp + kHeader + 4 * k + 4 * j, 4);
    std::memcpy(&value, dp + kHeader + 4 * j, 4);
    TORCH_CHECK(idx >= 0 && idx < n, "sketch_decode_add: exact index ", idx, " is outside [0, ", n, ")");
    exact[j] = {idx, op[idx] + s * value};
  }
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    float* __restrict o = op;
    for (int64_t i = b; i < e; ++i) o[i] += codebook[codes[i]];
  });
  for (const auto& [idx, value] : exact) op[idx] = value;
}

// ------------------------------------------------------------------ chunked top-k (sparse)
//
// SparseLoCo's pseudo-gradient codec; the layout, quantizer and bit order are defined in
// syncplane/kernels.py (sparse_encode_reference), and these functions equal it bit for bit:
//  * per chunk, the k first in the order (|x| descending, index ascending): the k-th largest
//    |x| bit pattern T by nth_element, then in index order every key above T and the first
//    keys equal to T (a second nth_element over the kept keys gives the median that clips
//    the scale);
//  * m = clamp(nearbyint((|v| / a) * M) - 1, 0, M - 1) in fp32, round-half-even like
//    torch.round; decoding computes (m + 1) * (a / M), negates, multiplies by the scale and
//    adds: the same fp32 operations in the same order as the reference.
// Chunks are independent (each writes its own bytes, each decodes into its own range), so
// they run in parallel and the result never depends on the thread count.
namespace sparse {

void check_layout(int64_t numel, int64_t k, int64_t chunk, int64_t bits, const char* op) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, op, ": bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(chunk >= 1 && chunk < (int64_t(1) << 31), op, ": chunk must be in [1, 2^31), got ", chunk);
  TORCH_CHECK(k >= 1 && k <= chunk, op, ": k must be in [1, chunk=", chunk, "], got ", k);
  TORCH_CHECK(numel >= 0, op, ": negative numel");
}

// c_bits of kernels.py's SPARSE_CLIP: the scale is at most this many median kept magnitudes
inline float clip_for(int bits) {
  return bits == 2 ? 2.0f : bits == 4 ? 16.0f : std::numeric_limits<float>::infinity();
}

void encode_chunk(const float* x, int64_t length, const Layout& L, float* scale_out, uint8_t* index_out,
                  uint8_t* codes_out, std::vector<uint32_t>& keys, std::vector<int32_t>& chosen) {
  const float clip = clip_for(L.bits);
  const int64_t kept = L.kept(length);
  const int levels = 1 << (L.bits - 1);
  // the kept-th largest key T: every key above it is kept, and of the keys equal to it the
  // lowest indices fill the rest -- one pass in index order, so `chosen` comes out sorted
  keys.resize(length);
  uint32_t max_key = 0;
  for (int64_t i = 0; i < length; ++i) {
    keys[i] = sketch::abs_key(x[i]);
    max_key = std::max(max_key, keys[i]);
  }
  std::nth_element(keys.begin(), keys.begin() + (kept - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t threshold = keys[kept - 1];
  int64_t above = 0;
  for (int64_t j = 0; j < length; ++j) above += keys[j] > threshold;
  int64_t ties = kept - above;   // keys equal to the threshold still to take
  chosen.clear();
  for (int64_t i = 0; i < length && static_cast<int64_t>(chosen.size()) < kept; ++i) {
    const uint32_t key = sketch::abs_key(x[i]);
    if (key > threshold || (key == threshold && ties-- > 0)) chosen.push_back(static_cast<int32_t>(i));
  }
  // the median kept magnitude: rank (kept - 1) / 2 among the kept, largest first
  const int64_t mid = (kept - 1) / 2;
  for (int64_t j = 0; j < kept; ++j) keys[j] = sketch::abs_key(x[chosen[j]]);
  std::nth_element(keys.begin(), keys.begin() + mid, keys.begin() + kept, std::greater<uint32_t>());
  const uint32_t median_key = keys[mid];
  float largest, median;
  std::memcpy(&largest, &max_key, 4);
  std::memcpy(&median, &median_key, 4);
  const float a = median > 0.0f ? std::min(largest, median * clip) : largest;
  *scale_out = a;
  const float safe = a > 0.0f ? a : 1.0f;
  const float m_levels = static_cast<float>(levels);
  std::memset(index_out, 0, L.index_bytes(length));
  std::memset(codes_out, 0, L.value_bytes(length));
  const IndexCodec index(L, length);
  for (int64_t j = 0; j < kept; ++j) {
    const float v = x[chosen[j]];
    const float t = (std::fabs(v) / safe) * m_levels;
    const float r = std::nearbyint(t) - 1.0f;
    const int m = static_cast<int>(std::min(std::max(r, 0.0f), static_cast<float>(levels - 1)));
    const uint32_t code = (static_cast<uint32_t>(std::signbit(v) ? 1 : 0) << (L.bits - 1)) | static_cast<uint32_t>(m);
    put_bits(codes_out, j * L.bits, code, L.bits);
    index.put(index_out, j, chosen[j]);
  }
}

// out[i] += scale * value for the chunk's kept values (positions relative to the chunk)
void decode_add_chunk(const uint8_t* payload, int64_t c, const Layout& L, float scale, float* out) {
  const int64_t length = L.length_of(c);
  const int64_t kept = L.kept(length);
  const int levels = 1 << (L.bits - 1);
  float a;
  std::memcpy(&a, payload + 4 * c, 4);
  const float step = a / static_cast<float>(levels);
  const uint8_t* index_in = payload + L.index_at(c);
  const uint8_t* codes_in = payload + L.codes_at(c);
  IndexReader index(L, index_in, length);
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t offset = index.next(j);
    TORCH_CHECK(offset >= 0, "sparse_decode_add: chunk ", c, "'s indices do not hold ", kept,
                " ascending positions inside its ", length, " values (corrupt payload)");
    const uint32_t code = get_bits(codes_in, j * L.bits, L.bits);
    float v = static_cast<float>((code & static_cast<uint32_t>(levels - 1)) + 1) * step;
    if (code >> (L.bits - 1)) v = -v;
    v = v * scale;
    out[offset] = out[offset] + v;
  }
  TORCH_CHECK(index.rest_clear(), "sparse_decode_add: chunk ", c, "'s indices hold more than ", kept,
              " positions (corrupt payload)");
}

}  // namespace sparse

void sparse_encode(const at::Tensor& x, int64_t k, int64_t chunk, int64_t bits, at::Tensor out) {
  using namespace sparse;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "sparse_encode: x must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous(),
              "sparse_encode: out must be a contiguous uint8 CPU tensor");
  check_layout(x.numel(), k, chunk, bits, "sparse_encode");
  const Layout L(x.numel(), k, chunk, static_cast<int>(bits));
  TORCH_CHECK(out.numel() == L.nbytes(), "sparse_encode: out has ", out.numel(), " bytes, expected ", L.nbytes());
  const float* xp = x.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, L.chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<uint32_t> keys;
    std::vector<int32_t> chosen;
    for (int64_t c = c0; c < c1; ++c) {
      float scale;
      encode_chunk(xp + c * L.chunk, L.length_of(c), L, &scale, op + L.index_at(c), op + L.codes_at(c), keys,
                   chosen);
      std::memcpy(op + 4 * c, &scale, 4);
    }
  });
}

void sparse_decode_add(const std::vector<at::Tensor>& payloads, at::Tensor out, int64_t k, int64_t chunk,
                       int64_t bits, double scale) {
  using namespace sparse;
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "sparse_decode_add: out must be a contiguous 1-D float32 CPU tensor");
  check_layout(out.numel(), k, chunk, bits, "sparse_decode_add");
  const Layout L(out.numel(), k, chunk, static_cast<int>(bits));
  std::vector<const uint8_t*> ptrs;
  for (size_t p = 0; p < payloads.size(); ++p) {
    const auto& data = payloads[p];
    TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.is_contiguous() &&
                    data.numel() == L.nbytes(),
                "sparse_decode_add: payload ", p, " must be ", L.nbytes(), " contiguous uint8 CPU bytes");
    ptrs.push_back(data.data_ptr<uint8_t>());
  }
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // chunks in parallel, payloads in order inside a chunk: the same additions in the same order
  at::parallel_for(0, L.chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for (const uint8_t* p : ptrs) decode_add_chunk(p, c, L, s, op + c * L.chunk);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "syncplane CPU kernels: flat-buffer pack/unpack, fused weighted combine, gradient sketch, sparse codec";
  m.def("pack", &pack, "Copy tensors (times scale) into one flat buffer",
        pybind11::arg("tensors"), pybind11::arg("flat"), pybind11::arg("scale") = 1.0);
  m.def("unpack", &unpack, "Copy a flat buffer (times scale) back into tensors",
        pybind11::arg("flat"), pybind11::arg("tensors"), pybind11::arg("scale") = 1.0);
  m.def("weighted_combine", &weighted_combine, "out = a*x + sum_j w_j*y_j in one pass",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("self_weight"),
        pybind11::arg("ys"), pybind11::arg("weights"));
  m.def("sketch_encode", &sketch_encode, "Gradient sketch of a piece: codes, codebook, k exact values",
        pybind11::arg("x"), pybind11::arg("k"), pybind11::arg("sample"), pybind11::arg("quantile_weight"),
        pybind11::arg("out"));
  m.def("sketch_decode", &sketch_decode, "Values of a gradient sketch", pybind11::arg("data"),
        pybind11::arg("k"), pybind11::arg("out"));
  m.def("sketch_decode_add", &sketch_decode_add, "out += scale * (values of a gradient sketch), scale +-1",
        pybind11::arg("data"), pybind11::arg("k"), pybind11::arg("out"), pybind11::arg("scale"));
  m.def("sparse_encode", &sparse_encode, "Chunked top-k payload: per-chunk scale, indices, 2/4/8-bit codes",
        pybind11::arg("x"), pybind11::arg("k"), pybind11::arg("chunk"), pybind11::arg("bits"), pybind11::arg("out"));
  m.def("sparse_decode_add", &sparse_decode_add, "out += scale * decode(p) for each payload, in order",
        pybind11::arg("payloads"), pybind11::arg("out"), pybind11::arg("k"), pybind11::arg("chunk"),
        pybind11::arg("bits"), pybind11::arg("scale"));
}

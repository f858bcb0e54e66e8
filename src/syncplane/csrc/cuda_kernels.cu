// CUDA twins of cpu_kernels.cpp: same functions, same semantics, so the Python
// layer dispatches on the tensor's device and nothing above a kernel differs.
// They are compiled and linked on machines without a GPU; they run only on one.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "sparse_layout.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBuffers = 16;  // neighbour buffers combined per launch

template <typename scalar_t>
__global__ void scaled_copy_kernel(scalar_t* __restrict__ dst, const scalar_t* __restrict__ src,
                                   int64_t n, float scale) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)blockDim.x * gridDim.x) {
    dst[i] = static_cast<scalar_t>(static_cast<acc_t>(src[i]) * static_cast<acc_t>(scale));
  }
}

// Accumulation type of the combine: float for half/bfloat16, double for float/double
// (same rule as cpu_kernels.cpp), so an fp32 average is rounded once, at the end.
template <typename scalar_t>
using combine_acc_t = std::conditional_t<std::is_same_v<scalar_t, float>, double, at::opmath_type<scalar_t>>;

template <typename scalar_t>
struct BufferBatch {
  const scalar_t* ptr[kMaxBuffers];
  combine_acc_t<scalar_t> weight[kMaxBuffers];
  int count;
};

// out = base_weight * base + sum_j w_j * y_j. With more than kMaxBuffers neighbours
// the partial sums go through a scratch buffer of the accumulation type (base_t /
// out_t = acc_t), never through the input dtype.
template <typename scalar_t, typename base_t, typename out_t>
__global__ void combine_kernel(out_t* __restrict__ out, const base_t* base, combine_acc_t<scalar_t> base_weight,
                               BufferBatch<scalar_t> batch, int64_t n) {
  using acc_t = combine_acc_t<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)blockDim.x * gridDim.x) {
    acc_t acc = base_weight * static_cast<acc_t>(base[i]);
    for (int j = 0; j < batch.count; ++j) {
      acc += batch.weight[j] * static_cast<acc_t>(batch.ptr[j][i]);
    }
    out[i] = static_cast<out_t>(acc);
  }
}

int blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535));
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* op, bool any_format = false) {
  // pack/unpack copy raw memory, so any dense memory format (channels_last) will do;
  // weighted_combine works on flat buffers and wants them contiguous
  TORCH_CHECK(t.is_cuda() && (any_format ? t.is_non_overlapping_and_dense() : t.is_contiguous()), op,
              any_format ? ": dense CUDA tensors expected" : ": contiguous CUDA tensors expected");
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": dtype ", t.scalar_type(),
              " differs from ", ref.scalar_type());
  TORCH_CHECK(t.get_device() == ref.get_device(), op, ": tensors on different devices");
}

template <bool kToFlat>
void pack_or_unpack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale,
                    const char* op) {
  TORCH_CHECK(flat.is_cuda() && flat.is_contiguous(), op, ": flat buffer must be contiguous CUDA");
  const c10::cuda::CUDAGuard guard(flat.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  int64_t offset = 0;
  for (const auto& t : tensors) {
    check_cuda(t, flat, op, /*any_format=*/true);
    offset += t.numel();
  }
  TORCH_CHECK(offset <= flat.numel(), op, ": tensors hold ", offset, " elements but the flat buffer only ",
              flat.numel());
  offset = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "pack_or_unpack", [&] {
    scalar_t* flat_ptr = flat.data_ptr<scalar_t>();
    for (const auto& t : tensors) {
      const int64_t n = t.numel();
      if (n == 0) continue;
      scalar_t* tensor_ptr = t.data_ptr<scalar_t>();
      scalar_t* dst = kToFlat ? flat_ptr + offset : tensor_ptr;
      const scalar_t* src = kToFlat ? tensor_ptr : flat_ptr + offset;
      if (scale == 1.0) {
        C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(scalar_t), cudaMemcpyDeviceToDevice, stream));
      } else {
        scaled_copy_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(dst, src, n,
                                                                             static_cast<float>(scale));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      offset += n;
    }
  });
}

}  // namespace

void pack_cuda(const std::vector<at::Tensor>& tensors, at::Tensor flat, double scale) {
  pack_or_unpack<true>(tensors, flat, scale, "pack");
}

void unpack_cuda(const at::Tensor& flat, std::vector<at::Tensor> tensors, double scale) {
  pack_or_unpack<false>(tensors, flat, scale, "unpack");
}

void weighted_combine_cuda(at::Tensor out, const at::Tensor& x, double self_weight,
                           const std::vector<at::Tensor>& ys, const std::vector<double>& weights) {
  TORCH_CHECK(ys.size() == weights.size(), "weighted_combine: ", ys.size(), " buffers but ",
              weights.size(), " weights");
  check_cuda(out, x, "weighted_combine");
  check_cuda(x, x, "weighted_combine");
  TORCH_CHECK(out.numel() == x.numel(), "weighted_combine: out and x differ in size");
  for (const auto& y : ys) {
    check_cuda(y, x, "weighted_combine");
    TORCH_CHECK(y.numel() == x.numel(), "weighted_combine: a buffer differs in size from x");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  if (n == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "weighted_combine", [&] {
    using acc_t = combine_acc_t<scalar_t>;
    const size_t total = ys.size();
    auto batch_from = [&](size_t& j) {
      BufferBatch<scalar_t> batch{};
      batch.count = 0;
      for (; j < total && batch.count < kMaxBuffers; ++j, ++batch.count) {
        batch.ptr[batch.count] = ys[j].data_ptr<scalar_t>();
        batch.weight[batch.count] = static_cast<acc_t>(weights[j]);
      }
      return batch;
    };
    const acc_t a = static_cast<acc_t>(self_weight);
    size_t j = 0;
    if (total <= static_cast<size_t>(kMaxBuffers)) {
      combine_kernel<scalar_t, scalar_t, scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
          out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), a, batch_from(j), n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    at::Tensor scratch = at::empty({n}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    acc_t* acc = scratch.data_ptr<acc_t>();
    combine_kernel<scalar_t, scalar_t, acc_t><<<blocks_for(n), kThreads, 0, stream>>>(
        acc, x.data_ptr<scalar_t>(), a, batch_from(j), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    while (j < total) {
      auto batch = batch_from(j);
      if (j < total) {
        combine_kernel<scalar_t, acc_t, acc_t><<<blocks_for(n), kThreads, 0, stream>>>(acc, acc, acc_t(1), batch, n);
      } else {
        combine_kernel<scalar_t, acc_t, scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
            out.data_ptr<scalar_t>(), acc, acc_t(1), batch, n);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

// ------------------------------------------------------------------ gradient sketch
// Same layout and rules as cpu_kernels.cpp (and kernels.sketch_encode_reference): the
// selection, sample sort and codebook arithmetic use ATen ops in the same order as the
// reference; the two O(n) passes (codes + fixed-point sums, decode) are kernels here.
namespace {

constexpr int kSketchBuckets = 256;
constexpr int64_t kSketchHeader = kSketchBuckets * 4;

// codes (count of boundaries < v) and per-bucket fixed-point sums of the non-exact values
__global__ void sketch_codes_kernel(const float* __restrict__ x, const bool* __restrict__ is_exact,
                                    const float* __restrict__ bounds, double to_fixed, int64_t n,
                                    uint8_t* __restrict__ codes, unsigned long long* __restrict__ sums,
                                    unsigned long long* __restrict__ counts) {
  __shared__ float b[kSketchBuckets - 1];
  __shared__ unsigned long long s_sum[kSketchBuckets];
  __shared__ unsigned long long s_count[kSketchBuckets];
  for (int i = threadIdx.x; i < kSketchBuckets; i += blockDim.x) {
    if (i < kSketchBuckets - 1) b[i] = bounds[i];
    s_sum[i] = 0;
    s_count[i] = 0;
  }
  __syncthreads();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    const float v = x[i];
    int pos = 0;
    for (int step = 128; step >= 1; step >>= 1) pos += (b[pos + step - 1] < v) ? step : 0;
    if (isnan(v)) pos = kSketchBuckets - 1;      // torch.bucketize: NaN sorts last
    codes[i] = static_cast<uint8_t>(pos);
    if (!is_exact[i]) {
      // two's complement: adding the unsigned image of a negative int64 subtracts
      atomicAdd(&s_sum[pos], static_cast<unsigned long long>(__double2ll_rn(static_cast<double>(v) * to_fixed)));
      atomicAdd(&s_count[pos], 1ULL);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kSketchBuckets; i += blockDim.x) {
    if (s_count[i]) {
      atomicAdd(&sums[i], s_sum[i]);
      atomicAdd(&counts[i], s_count[i]);
    }
  }
}

__global__ void sketch_lookup_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ codebook,
                                     int64_t n, float* __restrict__ out) {
  __shared__ float table[kSketchBuckets];
  for (int i = threadIdx.x; i < kSketchBuckets; i += blockDim.x) table[i] = codebook[i];
  __syncthreads();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
    out[i] = table[codes[i]];
  }
}

}  // namespace

void sketch_encode_cuda(const at::Tensor& x, int64_t k, int64_t sample, double quantile_weight, at::Tensor out) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "sketch_encode: x must be a contiguous 1-D float32 CUDA tensor");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kByte && out.is_contiguous(),
              "sketch_encode: out must be a contiguous uint8 CUDA tensor");
  const int64_t n = x.numel();
  TORCH_CHECK(n < (int64_t(1) << 31), "sketch_encode: a piece holds at most 2^31 - 1 values, got ", n);
  TORCH_CHECK(k >= 0 && k <= n, "sketch_encode: k=", k, " must be in [0, ", n, "]");
  TORCH_CHECK(sample >= 1, "sketch_encode: sample must be at least 1, got ", sample);
  TORCH_CHECK(out.numel() == kSketchHeader + 8 * k + n, "sketch_encode: out has ", out.numel(),
              " bytes, expected ", kSketchHeader + 8 * k + n);
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto i64 = x.options().dtype(at::kLong);
  const at::Tensor keys = x.abs().view(at::kInt).to(at::kLong);
  // (key, index) as one int64 ordered like the total order: key descending, index ascending
  const int64_t kIdxMask = (int64_t(1) << 31) - 1;
  at::Tensor exact = at::empty({0}, i64);
  int64_t bound_key = 0;
  if (k > 0) {
    const at::Tensor composite = keys.mul(int64_t(1) << 31).add(at::arange(n, i64).neg().add(kIdxMask));
    const at::Tensor top = std::get<0>(at::topk(composite, k));
    exact = std::get<0>(at::sort(top.bitwise_and(kIdxMask).neg().add(kIdxMask)));
    bound_key = top.min().item<int64_t>() >> 31;
  } else if (n > 0) {
    bound_key = keys.max().item<int64_t>();
  }
  at::Tensor is_exact = at::zeros({n}, x.options().dtype(at::kBool));
  if (k > 0) is_exact.index_fill_(0, exact, true);
  const int64_t stride = std::max<int64_t>(1, n / sample);
  const at::Tensor picks = at::arange(0, n, stride, i64);
  const at::Tensor s = std::get<0>(at::sort(x.index_select(0, picks).masked_select(is_exact.index_select(0, picks).logical_not())));
  const int64_t m = s.numel();
  at::Tensor bounds;
  if (m == 0) {
    bounds = at::zeros({kSketchBuckets - 1}, x.options());
  } else {
    const at::Tensor i = at::arange(1, kSketchBuckets, i64);
    const double lo = s[0].item<float>(), hi = s[m - 1].item<float>();
    const at::Tensor q = s.index_select(0, i.mul(m).div(kSketchBuckets, "floor")).to(at::kDouble);
    const at::Tensor u = i.to(at::kDouble).div(static_cast<double>(kSketchBuckets)).mul(hi - lo).add(lo);
    bounds = q.mul(quantile_weight).add(u.mul(1.0 - quantile_weight)).to(at::kFloat).contiguous();
  }
  int bits = 0;
  for (int64_t v = n + 1; v > 0; v >>= 1) ++bits;
  const int frac = 62 - bits;
  const int bound_exp = static_cast<int>(bound_key >> 23) - 126;
  at::Tensor sums = at::zeros({kSketchBuckets}, i64);
  at::Tensor counts = at::zeros({kSketchBuckets}, i64);
  at::Tensor codes = out.narrow(0, kSketchHeader + 8 * k, n);
  if (n > 0) {
    sketch_codes_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        x.data_ptr<float>(), is_exact.data_ptr<bool>(), bounds.data_ptr<float>(), std::ldexp(1.0, frac - bound_exp),
        n, codes.data_ptr<uint8_t>(), reinterpret_cast<unsigned long long*>(sums.data_ptr<int64_t>()),
        reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor means = sums.to(at::kDouble).div(counts.clamp_min(1).to(at::kDouble)).mul(std::ldexp(1.0, bound_exp - frac));
  const at::Tensor codebook = at::where(counts.gt(0), means, at::zeros_like(means)).to(at::kFloat);
  out.narrow(0, 0, kSketchHeader).copy_(codebook.view(at::kByte));
  if (k > 0) {
    out.narrow(0, kSketchHeader, 4 * k).copy_(x.index_select(0, exact).view(at::kByte));
    out.narrow(0, kSketchHeader + 4 * k, 4 * k).copy_(exact.to(at::kInt).view(at::kByte));
  }
}

void sketch_decode_cuda(const at::Tensor& data, int64_t k, at::Tensor out) {
  TORCH_CHECK(data.is_cuda() && data.scalar_type() == at::kByte && data.is_contiguous(),
              "sketch_decode: data must be a contiguous uint8 CUDA tensor");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "sketch_decode: out must be a contiguous float32 CUDA tensor");
  const int64_t n = out.numel();
  TORCH_CHECK(k >= 0 && k <= n && data.numel() == kSketchHeader + 8 * k + n, "sketch_decode: ", data.numel(),
              " bytes do not hold a sketch of ", n, " values with ", k, " exact ones");
  const c10::cuda::CUDAGuard guard(data.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor codebook = data.narrow(0, 0, kSketchHeader).clone().view(at::kFloat);
  if (n > 0) {
    sketch_lookup_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        data.data_ptr<uint8_t>() + kSketchHeader + 8 * k, codebook.data_ptr<float>(), n, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (k > 0) {
    const at::Tensor values = data.narrow(0, kSketchHeader, 4 * k).clone().view(at::kFloat);
    const at::Tensor indices = data.narrow(0, kSketchHeader + 4 * k, 4 * k).clone().view(at::kInt).to(at::kLong);
    out.index_put_({indices}, values);
  }
}

// ------------------------------------------------------------------ chunked top-k (sparse)
// Same layout (sparse_layout.h) and arithmetic as cpu_kernels.cpp and the torch reference.
// The per-chunk selection and scale use ATen (topk of a unique 64-bit key, |x| bits << 32 |
// ~index, so the kept set and the median kept magnitude are exactly the reference's); quantize + pack and unpack + scatter-add are
// kernels, one thread per chunk (each owns its bytes and its range of `out`). The fp32
// operations carry explicit _rn intrinsics so nvcc cannot contract them into FMAs: the
// bits must equal the CPU's.
namespace {

__global__ void sparse_pack_kernel(const float* __restrict__ x, const int64_t* __restrict__ chosen,
                                   const float* __restrict__ scales, sparse::Layout L, int64_t first,
                                   int64_t rows, int64_t length, uint8_t* __restrict__ out) {
  const int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int64_t c = first + r;
  const int64_t kept = L.kept(length);
  const int levels = 1 << (L.bits - 1);
  const float a = scales[r];
  const float safe = a > 0.0f ? a : 1.0f;
  const float m_levels = static_cast<float>(levels);
  uint8_t* index_out = out + L.index_at(c);
  uint8_t* codes_out = out + L.codes_at(c);
  const sparse::IndexCodec index(L, length);
  const float* xc = x + c * L.chunk;
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t i = chosen[r * kept + j];
    const float v = xc[i];
    const float t = __fmul_rn(__fdiv_rn(fabsf(v), safe), m_levels);
    const float q = __fsub_rn(rintf(t), 1.0f);
    const int m = static_cast<int>(fminf(fmaxf(q, 0.0f), static_cast<float>(levels - 1)));
    const uint32_t code = (static_cast<uint32_t>(signbit(v) ? 1 : 0) << (L.bits - 1)) | static_cast<uint32_t>(m);
    sparse::put_bits(codes_out, j * L.bits, code, L.bits);
    index.put(index_out, j, i);
  }
  memcpy(out + 4 * c, &a, 4);
}

// out[c * chunk + offset] += scale * value; returns (through *bad) a malformed chunk
__global__ void sparse_unpack_add_kernel(const uint8_t* __restrict__ payload, sparse::Layout L, float scale,
                                         float* __restrict__ out, int* __restrict__ bad) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= L.chunks) return;
  const int64_t length = L.length_of(c);
  const int64_t kept = L.kept(length);
  const int levels = 1 << (L.bits - 1);
  float a;
  memcpy(&a, payload + 4 * c, 4);
  const float step = __fdiv_rn(a, static_cast<float>(levels));
  const uint8_t* index_in = payload + L.index_at(c);
  const uint8_t* codes_in = payload + L.codes_at(c);
  sparse::IndexReader index(L, index_in, length);
  float* oc = out + c * L.chunk;
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t offset = index.next(j);
    if (offset < 0) { atomicExch(bad, 1); return; }
    const uint32_t code = sparse::get_bits(codes_in, j * L.bits, L.bits);
    float v = __fmul_rn(static_cast<float>((code & static_cast<uint32_t>(levels - 1)) + 1), step);
    if (code >> (L.bits - 1)) v = -v;
    oc[offset] = __fadd_rn(oc[offset], __fmul_rn(v, scale));
  }
  if (!index.rest_clear()) atomicExch(bad, 1);
}

// c_bits of kernels.py's SPARSE_CLIP (as in cpu_kernels.cpp)
float clip_for(int bits) { return bits == 2 ? 2.0f : bits == 4 ? 16.0f : INFINITY; }

void check_sparse_layout(int64_t numel, int64_t k, int64_t chunk, int64_t bits, const char* op) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, op, ": bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(chunk >= 1 && chunk < (int64_t(1) << 31), op, ": chunk must be in [1, 2^31), got ", chunk);
  TORCH_CHECK(k >= 1 && k <= chunk, op, ": k must be in [1, chunk=", chunk, "], got ", k);
}

}  // namespace

void sparse_encode_cuda(const at::Tensor& x, int64_t k, int64_t chunk, int64_t bits, at::Tensor out) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
              "sparse_encode: x must be a contiguous 1-D float32 CUDA tensor");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.get_device() == x.get_device(),
              "sparse_encode: out must be a contiguous uint8 tensor on x's GPU");
  check_sparse_layout(x.numel(), k, chunk, bits, "sparse_encode");
  const sparse::Layout L(x.numel(), k, chunk, static_cast<int>(bits));
  TORCH_CHECK(out.numel() == L.nbytes(), "sparse_encode: out has ", out.numel(), " bytes, expected ", L.nbytes());
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (L.nbytes() > 4 * L.chunks) out.narrow(0, 4 * L.chunks, L.nbytes() - 4 * L.chunks).zero_();
  const int64_t kLow = 0xffffffffLL;
  // the full chunks as rows, then the tail as one row
  const int64_t parts[2][3] = {{0, L.full, L.chunk}, {L.full, L.tail > 0 ? 1 : 0, L.tail}};
  for (const auto& part : parts) {
    const int64_t first = part[0], rows = part[1], length = part[2];
    if (rows == 0) continue;
    const at::Tensor block = x.narrow(0, first * L.chunk, rows * length).view({rows, length});
    const at::Tensor magnitude = block.abs();
    const at::Tensor index = at::arange(length, x.options().dtype(at::kLong));
    const at::Tensor composite = magnitude.view(at::kInt).to(at::kLong).mul(kLow + 1).add(index.neg().add(kLow));
    const int64_t kept = L.kept(length);
    const at::Tensor top = std::get<0>(composite.topk(kept, 1, /*largest=*/true, /*sorted=*/true));
    const at::Tensor chosen = std::get<0>(top.bitwise_and(kLow).neg().add(kLow).sort(1)).contiguous();
    // scale: the largest magnitude, clipped to c_bits x the median kept one (kernels.py)
    const auto key_of = [&](int64_t rank) {
      return top.select(1, rank).div(kLow + 1, "floor").to(at::kInt).view(at::kFloat);
    };
    const at::Tensor largest = key_of(0), median = key_of((kept - 1) / 2);
    const at::Tensor scales =
        at::where(median.gt(0), at::minimum(largest, median.mul(static_cast<double>(clip_for(L.bits)))), largest)
            .contiguous();
    sparse_pack_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        x.data_ptr<float>(), chosen.data_ptr<int64_t>(), scales.data_ptr<float>(), L, first, rows, length,
        out.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void sparse_decode_add_cuda(const std::vector<at::Tensor>& payloads, at::Tensor out, int64_t k, int64_t chunk,
                            int64_t bits, double scale) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 1,
              "sparse_decode_add: out must be a contiguous 1-D float32 CUDA tensor");
  check_sparse_layout(out.numel(), k, chunk, bits, "sparse_decode_add");
  const sparse::Layout L(out.numel(), k, chunk, static_cast<int>(bits));
  for (size_t p = 0; p < payloads.size(); ++p) {
    const auto& data = payloads[p];
    TORCH_CHECK(data.is_cuda() && data.get_device() == out.get_device() && data.scalar_type() == at::kByte &&
                    data.is_contiguous() && data.numel() == L.nbytes(),
                "sparse_decode_add: payload ", p, " must be ", L.nbytes(), " contiguous uint8 bytes on out's GPU");
  }
  if (L.chunks == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor bad = at::zeros({1}, out.options().dtype(at::kInt));
  for (const auto& data : payloads) {   // in order: launches on one stream run one after another
    sparse_unpack_add_kernel<<<blocks_for(L.chunks), kThreads, 0, stream>>>(
        data.data_ptr<uint8_t>(), L, static_cast<float>(scale), out.data_ptr<float>(), bad.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  TORCH_CHECK(bad.item<int>() == 0, "sparse_decode_add: a payload's indices do not fit its layout (corrupt payload)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "syncplane CUDA kernels: flat-buffer pack/unpack, fused weighted combine, gradient sketch, sparse codec";
  m.def("pack", &pack_cuda, pybind11::arg("tensors"), pybind11::arg("flat"), pybind11::arg("scale") = 1.0);
  m.def("unpack", &unpack_cuda, pybind11::arg("flat"), pybind11::arg("tensors"),
        pybind11::arg("scale") = 1.0);
  m.def("weighted_combine", &weighted_combine_cuda, pybind11::arg("out"), pybind11::arg("x"),
        pybind11::arg("self_weight"), pybind11::arg("ys"), pybind11::arg("weights"));
  m.def("sketch_encode", &sketch_encode_cuda, pybind11::arg("x"), pybind11::arg("k"), pybind11::arg("sample"),
        pybind11::arg("quantile_weight"), pybind11::arg("out"));
  m.def("sketch_decode", &sketch_decode_cuda, pybind11::arg("data"), pybind11::arg("k"), pybind11::arg("out"));
  m.def("sparse_encode", &sparse_encode_cuda, pybind11::arg("x"), pybind11::arg("k"), pybind11::arg("chunk"),
        pybind11::arg("bits"), pybind11::arg("out"));
  m.def("sparse_decode_add", &sparse_decode_add_cuda, pybind11::arg("payloads"), pybind11::arg("out"),
        pybind11::arg("k"), pybind11::arg("chunk"), pybind11::arg("bits"), pybind11::arg("scale"));
}

// CUDA twins of cpu_kernels.cpp: same functions, same semantics, so the Python
// layer dispatches on the tensor's device and nothing above a kernel differs.
// They are compiled and linked on machines without a GPU; they run only on one.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <type_traits>
#include <vector>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "syncplane CUDA kernels: flat-buffer pack/unpack and fused weighted combine";
  m.def("pack", &pack_cuda, pybind11::arg("tensors"), pybind11::arg("flat"), pybind11::arg("scale") = 1.0);
  m.def("unpack", &unpack_cuda, pybind11::arg("flat"), pybind11::arg("tensors"),
        pybind11::arg("scale") = 1.0);
  m.def("weighted_combine", &weighted_combine_cuda, pybind11::arg("out"), pybind11::arg("x"),
        pybind11::arg("self_weight"), pybind11::arg("ys"), pybind11::arg("weights"));
}

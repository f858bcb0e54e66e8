// CUDA twins of cpu_kernels.cpp: same functions, same semantics, so the Python
// layer dispatches on the tensor's device and nothing above a kernel differs.
// They are compiled and linked on machines without a GPU; they run only on one.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

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

template <typename scalar_t>
struct BufferBatch {
  const scalar_t* ptr[kMaxBuffers];
  float weight[kMaxBuffers];
  int count;
};

// out = base_weight * base + sum_j w_j * y_j; `base` is x on the first launch and
// out itself on later ones (when a rank has more than kMaxBuffers neighbours).
template <typename scalar_t>
__global__ void combine_kernel(scalar_t* __restrict__ out, const scalar_t* base, float base_weight,
                               BufferBatch<scalar_t> batch, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)blockDim.x * gridDim.x) {
    acc_t acc = static_cast<acc_t>(base_weight) * static_cast<acc_t>(base[i]);
    for (int j = 0; j < batch.count; ++j) {
      acc += static_cast<acc_t>(batch.weight[j]) * static_cast<acc_t>(batch.ptr[j][i]);
    }
    out[i] = static_cast<scalar_t>(acc);
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
    const scalar_t* base = x.data_ptr<scalar_t>();
    float base_weight = static_cast<float>(self_weight);
    size_t j = 0;
    do {
      BufferBatch<scalar_t> batch{};
      batch.count = 0;
      for (; j < ys.size() && batch.count < kMaxBuffers; ++j, ++batch.count) {
        batch.ptr[batch.count] = ys[j].data_ptr<scalar_t>();
        batch.weight[batch.count] = static_cast<float>(weights[j]);
      }
      combine_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(out.data_ptr<scalar_t>(), base,
                                                                       base_weight, batch, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      base = out.data_ptr<scalar_t>();
      base_weight = 1.0f;
    } while (j < ys.size());
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

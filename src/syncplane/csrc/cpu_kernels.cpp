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
#include <cstring>
#include <type_traits>
#include <vector>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "syncplane CPU kernels: flat-buffer pack/unpack and fused weighted combine";
  m.def("pack", &pack, "Copy tensors (times scale) into one flat buffer",
        pybind11::arg("tensors"), pybind11::arg("flat"), pybind11::arg("scale") = 1.0);
  m.def("unpack", &unpack, "Copy a flat buffer (times scale) back into tensors",
        pybind11::arg("flat"), pybind11::arg("tensors"), pybind11::arg("scale") = 1.0);
  m.def("weighted_combine", &weighted_combine, "out = a*x + sum_j w_j*y_j in one pass",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("self_weight"),
        pybind11::arg("ys"), pybind11::arg("weights"));
}

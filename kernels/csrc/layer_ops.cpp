// The small per-layer ops of a decoder fused into one pass each on CPU: RMSNorm with the residual add before it,
// rotary position embedding, and SwiGLU's silu(gate) * up. Unfused, each is two to six PyTorch ops over the same
// rows (a decode step runs hundreds of them), where dispatch, not arithmetic, is the cost. Oracles: the *_ref
// functions of kernels.layer_ops; this rounds to the model dtype wherever they do, so the results are theirs up to
// the order of the fp32 sum of squares.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace {

using tsukimi_kernels::exp_clamped;
using tsukimi_kernels::from_float;
using tsukimi_kernels::to_float;

// Rows per task: small batches (a decode step's) stay on one thread, where a fork would cost more than the work.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// sum = x + residual (rounded to the dtype, as `x + residual` is), or x; normed = weight * dtype(rms_norm_fp32(sum)).
template <typename scalar_t>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, float eps,
                       at::Tensor& normed, at::Tensor* sum) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* rp = residual ? residual->const_data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.const_data_ptr<scalar_t>();
  scalar_t* np = normed.data_ptr<scalar_t>();
  scalar_t* sp = sum ? sum->data_ptr<scalar_t>() : nullptr;
  const int64_t x_stride = x.stride(0), r_stride = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = xp + r * x_stride;
      scalar_t* nr = np + r * hidden;
      const scalar_t* source = xr;  // the row normalised: x, or the sum written below
      if (rp != nullptr) {
        const scalar_t* rr = rp + r * r_stride;
        scalar_t* sr = sp + r * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) sr[d] = from_float<scalar_t>(to_float(xr[d]) + to_float(rr[d]));
        source = sr;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < hidden; ++d) squares += to_float(source[d]) * to_float(source[d]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) {
        const float scaled = to_float(from_float<scalar_t>(to_float(source[d]) * inv));
        nr[d] = from_float<scalar_t>(to_float(wp[d]) * scaled);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, hidden] with contiguous rows, got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight ", weight.sizes(),
              " does not fit rows of ", x.size(1));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "dtypes differ: ", x.scalar_type(), ", ", weight.scalar_type());
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                residual->scalar_type() == x.scalar_type(), "residual ", residual->sizes(), " must match x ",
                x.sizes());
  }
  at::Tensor normed = at::empty(x.sizes(), x.options());
  // Without a residual the sum is x itself, which the caller has: an empty tensor here, never an alias of an input
  // (the schema promises fresh outputs).
  at::Tensor sum = at::empty(residual.has_value() ? x.sizes() : at::IntArrayRef{0}, x.options());
  const at::Tensor* res = residual.has_value() ? &residual.value() : nullptr;
  at::Tensor* sum_out = residual.has_value() ? &sum : nullptr;
  switch (x.scalar_type()) {
    case at::kFloat: add_rms_norm_rows<float>(x, res, weight, static_cast<float>(eps), normed, sum_out); break;
    case at::kBFloat16: add_rms_norm_rows<c10::BFloat16>(x, res, weight, static_cast<float>(eps), normed, sum_out);
      break;
    case at::kHalf: add_rms_norm_rows<c10::Half>(x, res, weight, static_cast<float>(eps), normed, sum_out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return {normed, sum};
}

// out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as the reference's ops round.
template <typename scalar_t>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* cp = cos.const_data_ptr<scalar_t>();
  const scalar_t* sp = sin.const_data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t x_stride = x.stride(0), x_head_stride = x.stride(1);
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cp + t * head_dim;
      const scalar_t* s = sp + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* xr = xp + t * x_stride + h * x_head_stride;
        scalar_t* o = op + (t * heads + h) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
          const float rotated = d < half ? -to_float(xr[d + half]) : to_float(xr[d - half]);
          const float a = to_float(from_float<scalar_t>(to_float(xr[d]) * to_float(c[d])));
          const float b = to_float(from_float<scalar_t>(rotated * to_float(s[d])));
          o[d] = from_float<scalar_t>(a + b);
        }
      }
    }
  });
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [tokens, heads, head_dim] with "
              "contiguous heads and an even head_dim, got ", x.sizes());
  const std::vector<int64_t> table{x.size(0), 1, x.size(2)};
  TORCH_CHECK(cos.sizes() == table && sin.sizes() == table && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous ", table, ", got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtypes differ");
  at::Tensor out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rotary_rows<float>(x, cos, sin, out); break;
    case at::kBFloat16: rotary_rows<c10::BFloat16>(x, cos, sin, out); break;
    case at::kHalf: rotary_rows<c10::Half>(x, cos, sin, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return out;
}

// out = dtype(silu(gate)) * up, rounded as the reference's two ops round; gate_up: [rows, 2 * width], gate first.
template <typename scalar_t>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1), stride = gate_up.stride(0);
  const scalar_t* gp = gate_up.const_data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = gp + r * stride;
      const scalar_t* up = gate + width;
      scalar_t* o = op + r * width;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) {
        const float g = to_float(gate[d]);
        const float silu = to_float(from_float<scalar_t>(g / (1.0f + exp_clamped(-g))));
        o[d] = from_float<scalar_t>(silu * to_float(up[d]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, "
              "2 * width] with contiguous rows, got ", gate_up.sizes());
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_and_mul_rows<float>(gate_up, out); break;
    case at::kBFloat16: silu_and_mul_rows<c10::BFloat16>(gate_up, out); break;
    case at::kHalf: silu_and_mul_rows<c10::Half>(gate_up, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tsukimi_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("apply_rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("apply_rotary", c10::DispatchKey::CPU, TORCH_FN(apply_rotary));
}

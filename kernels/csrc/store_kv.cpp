// Writing a step's new K and V rows into the paged pool on CPU: each token's row of each KV head copied to its slot
// (block_id * block_size + offset). The oracle is kernels.paged_attention.store_kv_ref, two `index_copy_` calls per
// layer whose dispatch over a 4-D view cost 30-40 us each at a decode step's 32 rows (a copy of 12 KB). Rows are
// copied as bytes, so the pool holds exactly what the reference stores.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// Rows per task: a decode step's few stay on one thread; a prefill step's thousands are split.
constexpr int64_t kGrainTokens = 256;

void store_rows(const at::Tensor& rows, at::Tensor& cache, const int64_t* slots, int64_t num_tokens) {
  const int64_t num_kv_heads = cache.size(0), head_slots = cache.size(1) * cache.size(2), head_dim = cache.size(3);
  const int64_t item = static_cast<int64_t>(cache.element_size()), row_bytes = head_dim * item;
  const char* src = static_cast<const char*>(rows.const_data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t token_stride = rows.stride(0) * item, head_stride = rows.stride(1) * item;
  at::parallel_for(0, num_tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::memcpy(dst + (h * head_slots + slots[t]) * row_bytes, src + t * token_stride + h * head_stride,
                    row_bytes);
      }
    }
  });
}

void check_rows(const at::Tensor& rows, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(0) && rows.size(2) == cache.size(3), name, " ",
              rows.sizes(), " must be [tokens, ", cache.size(0), " KV heads, ", cache.size(3), "]");
  TORCH_CHECK(rows.stride(2) == 1, "each of ", name, "'s head rows must be contiguous");
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type(), name, " is ", rows.scalar_type(), ", the pool ",
              cache.scalar_type());
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "the pools ", k_cache.sizes(), ", ",
              v_cache.sizes(), " must be [kv_heads, blocks, block_size, head_dim] alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pools must be contiguous");
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 vector");
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK(k.size(0) == num_tokens && v.size(0) == num_tokens, "k, v have ", k.size(0), ", ", v.size(0),
              " rows for ", num_tokens, " slots");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < num_tokens; ++t) {  // a bad slot would write outside the pool
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " is not a slot of ",
                "the pool (", num_slots, ")");
  }
  store_rows(k, k_cache, slots, num_tokens);
  store_rows(v, v_cache, slots, num_tokens);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tsukimi_cpu, m) {
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(store_kv));
}

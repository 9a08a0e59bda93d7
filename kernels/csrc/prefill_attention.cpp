// Prefill attention on CPU straight from the paged pool, bf16, by AVX512-BF16 dot products: each query of a chunk of
// new tokens attends causally over its sequence's context (cached prefix, earlier chunks, this chunk; this step's
// K/V already stored). The oracle is kernels.paged_attention.paged_prefill_attention_ref; the pool layout is
// kernels.kv_layout's: K and V each [num_kv_heads, num_blocks, block_size, head_dim].
//
// First each (sequence, KV head)'s keys are laid out from the pool in the layouts `vdpbf16ps` multiplies from (K as
// pairs of dims, V as pairs of keys). Then work units of (sequence, KV head, tile of query tokens), costliest first,
// taken by whichever thread is free: per query token, the group's query heads together (each load of K or V serves
// them all), scores, one exact softmax over the row, and V weighted by the probabilities rounded to bf16 (as the
// reference rounds them), the sums in fp32.
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

using tsukimi_kernels::exp_clamped;
using tsukimi_kernels::from_float;

constexpr int64_t kTileTokens = 32;  // query tokens per work unit
constexpr int64_t kKeyStep = 32;     // keys per pass of the score loop (two registers of sixteen)

struct Rows {  // q: [tokens, heads, head_dim] with any token stride
  const c10::BFloat16* data;
  int64_t token_stride;
  int64_t head_dim;
  const c10::BFloat16* at(int64_t token, int64_t head) const { return data + token * token_stride + head * head_dim; }
};

struct PoolHead {  // one KV head's blocks of one sequence in the pool
  const c10::BFloat16* k;  // the head's first block
  const c10::BFloat16* v;
  const int32_t* table;
  int64_t block_size;
  int64_t head_dim;
  int64_t row(int64_t key) const { return (table[key / block_size] * block_size + key % block_size) * head_dim; }
};

inline uint32_t pair_at(const c10::BFloat16* p) {  // two adjacent bf16 as one 32-bit lane
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

// One (sequence, KV head)'s keys laid out for the dot products, zeros past its context up to `padded`.
struct PackedKeys {
  uint32_t* k_pairs;  // [head_dim / 2][padded]: dims (2p, 2p+1) of each key
  uint16_t* v_pairs;  // [padded / 2][head_dim][2]: keys (2j, 2j+1) of each dim
  int64_t padded;

  void pack(const PoolHead& head, int64_t count) const {
    const int64_t dim = head.head_dim;
    for (int64_t p = 0; p < dim / 2; ++p) std::fill(k_pairs + p * padded + count, k_pairs + (p + 1) * padded, 0u);
    std::fill(v_pairs + count / 2 * dim * 2, v_pairs + padded * dim, uint16_t{0});
    for (int64_t j0 = 0; j0 < count; j0 += 16) {  // sixteen keys at a time: each K store fills a cache line
      const int64_t n = std::min<int64_t>(16, count - j0);
      for (int64_t p = 0; p < dim / 2; ++p) {
        for (int64_t j = j0; j < j0 + n; ++j) k_pairs[p * padded + j] = pair_at(head.k + head.row(j) + 2 * p);
      }
    }
    for (int64_t j = 0; j < count; ++j) {
      const c10::BFloat16* value = head.v + head.row(j);
      uint16_t* v_row = v_pairs + (j / 2) * dim * 2 + (j % 2);
      for (int64_t d = 0; d < dim; ++d) v_row[2 * d] = value[d].x;
    }
  }
};

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// scores[r][j] = q_r . k_j for keys [0, count) of kHeads query heads, sixteen keys a register, two registers a pass.
template <int64_t kHeadDim, int kHeads>
inline void scores_for(const c10::BFloat16* const* queries, const PackedKeys& keys, int64_t count, float* scores,
                       int64_t score_stride) {
  for (int64_t j0 = 0; j0 < count; j0 += kKeyStep) {
    __m512 acc[kHeads][2];
    for (int r = 0; r < kHeads; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t* column = keys.k_pairs + j0;
    for (int64_t p = 0; p < kHeadDim / 2; ++p) {
      const __m512bh low = as_bh(_mm512_loadu_si512(column + p * keys.padded));
      const __m512bh high = as_bh(_mm512_loadu_si512(column + p * keys.padded + 16));
      for (int r = 0; r < kHeads; ++r) {
        const __m512bh q = as_bh(_mm512_set1_epi32(static_cast<int>(pair_at(queries[r] + 2 * p))));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], low, q);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], high, q);
      }
    }
    for (int r = 0; r < kHeads; ++r) {
      _mm512_storeu_ps(scores + r * score_stride + j0, acc[r][0]);
      _mm512_storeu_ps(scores + r * score_stride + j0 + 16, acc[r][1]);
    }
  }
}

// Softmax of scale * scores over [0, count): probabilities rounded to bf16 into `probs` (zeros past `count` up to
// the next multiple of sixteen, so an odd count's pad key weighs nothing), returning the fp32 sum of the unrounded ones.
inline float softmax_row(float* scores, int64_t count, float scale, c10::BFloat16* probs) {
  const int64_t whole = count / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (count - whole)) - 1);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < whole; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + j));
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, scores + whole));
  const float row_max = _mm512_reduce_max_ps(top);
  for (int64_t j = 0; j < count; ++j) scores[j] = exp_clamped((scores[j] - row_max) * scale);  // vectorizes
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 16) {  // the last sixteen stored whole: zeros past `count`
    const __m512 e = j < whole ? _mm512_loadu_ps(scores + j) : _mm512_maskz_loadu_ps(tail, scores + j);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// out_r = (sum_j probs_r[j] v_j) / sums[r] for kHeads query heads, pairs of keys a dot product.
template <int64_t kHeadDim, int kHeads>
inline void weigh_values(const c10::BFloat16* probs, int64_t prob_stride, const float* sums, const PackedKeys& keys,
                         int64_t count, c10::BFloat16* const* outs) {
  constexpr int kChunks = kHeadDim / 16;
  __m512 acc[kHeads][kChunks];
  for (int r = 0; r < kHeads; ++r)
    for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < (count + 1) / 2; ++jp) {
    const uint16_t* pair_rows = keys.v_pairs + jp * kHeadDim * 2;
    // An odd count's last pair: its second key (a later token's V, maybe not finite) is zeroed, not just unweighted.
    const __mmask32 keys_in = 2 * jp + 1 < count ? ~__mmask32{0} : __mmask32{0x55555555u};
    __m512bh values[kChunks];
    for (int c = 0; c < kChunks; ++c) values[c] = as_bh(_mm512_maskz_loadu_epi16(keys_in, pair_rows + 32 * c));
    for (int r = 0; r < kHeads; ++r) {
      const __m512bh weight = as_bh(_mm512_set1_epi32(static_cast<int>(pair_at(probs + r * prob_stride + 2 * jp))));
      for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], values[c], weight);
    }
  }
  for (int r = 0; r < kHeads; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
    for (int c = 0; c < kChunks; ++c) {
      alignas(64) float row[16];
      _mm512_store_ps(row, _mm512_mul_ps(acc[r][c], inverse));
      for (int i = 0; i < 16; ++i) outs[r][16 * c + i] = from_float<c10::BFloat16>(row[i]);
    }
  }
}

// One query token, kHeads of its group's heads: scores, softmax, values.
template <int64_t kHeadDim, int kHeads>
void attend_token(const c10::BFloat16* const* queries, c10::BFloat16* const* outs, const PackedKeys& keys,
                  int64_t count, float scale, std::vector<float>& scores, std::vector<c10::BFloat16>& probs) {
  const int64_t stride = keys.padded;
  scores_for<kHeadDim, kHeads>(queries, keys, count, scores.data(), stride);
  float sums[kHeads];
  for (int r = 0; r < kHeads; ++r) sums[r] = softmax_row(scores.data() + r * stride, count, scale,
                                                         probs.data() + r * stride);
  weigh_values<kHeadDim, kHeads>(probs.data(), stride, sums, keys, count, outs);
}

// Query heads a pass takes together: the V accumulators (heads x head_dim / 16 registers) stay within sixteen.
template <int64_t kHeadDim>
constexpr int kMaxHeads = 256 / kHeadDim;

template <int64_t kHeadDim>
void attend_group(const Rows& q, c10::BFloat16* out, int64_t num_heads, int64_t token, int64_t first_head,
                  int64_t group, const PackedKeys& keys, int64_t count, float scale, std::vector<float>& scores,
                  std::vector<c10::BFloat16>& probs) {
  for (int64_t h0 = 0; h0 < group; h0 += kMaxHeads<kHeadDim>) {
    const int64_t n = std::min<int64_t>(kMaxHeads<kHeadDim>, group - h0);
    const c10::BFloat16* queries[kMaxHeads<kHeadDim>];
    c10::BFloat16* outs[kMaxHeads<kHeadDim>];
    for (int64_t r = 0; r < n; ++r) {
      queries[r] = q.at(token, first_head + h0 + r);
      outs[r] = out + (token * num_heads + first_head + h0 + r) * kHeadDim;
    }
    switch (n) {
      case 1: attend_token<kHeadDim, 1>(queries, outs, keys, count, scale, scores, probs); break;
      case 2: attend_token<kHeadDim, 2>(queries, outs, keys, count, scale, scores, probs); break;
      case 3:
        if constexpr (kMaxHeads<kHeadDim> >= 3) attend_token<kHeadDim, 3>(queries, outs, keys, count, scale, scores,
                                                                          probs);
        break;
      default:
        if constexpr (kMaxHeads<kHeadDim> >= 4) attend_token<kHeadDim, 4>(queries, outs, keys, count, scale, scores,
                                                                          probs);
        break;
    }
  }
}
#endif

struct Scratch {  // a thread's rows of scores and probabilities
  std::vector<float> scores;
  std::vector<c10::BFloat16> probs;
};

// Runs `work(i, scratch)` for i in [0, count), each index taken by whichever thread is free (units differ in cost).
template <typename Work>
void run_units(int64_t count, int64_t scratch_len, const Work& work) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch{std::vector<float>(scratch_len), std::vector<c10::BFloat16>(scratch_len)};
    for (int64_t i = next++; i < count; i = next++) work(i, scratch);
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& context_lens,
                                   const at::Tensor& query_starts, double scale) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "paged_prefill_attention: built for a CPU without AVX512-BF16");
#else
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "q ", q.sizes(),
              " must be [tokens, heads, head_dim] and the pools ", k_cache.sizes(), ", ", v_cache.sizes(),
              " [kv_heads, blocks, block_size, head_dim] alike");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "paged_prefill_attention: bf16 only");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pools must be contiguous");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head size 64 or 128, got ", head_dim);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, num_heads, " heads of ", head_dim,
              " do not fit ", num_kv_heads, " KV heads of ", k_cache.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              query_starts.scalar_type() == at::kInt, "block tables, lengths and query starts must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous() &&
              query_starts.is_contiguous(), "block tables must be a contiguous [sequences, max_blocks]");
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == num_seqs && query_starts.dim() == 1 &&
              query_starts.size(0) == num_seqs + 1, "lengths ", context_lens.sizes(), " and query starts ",
              query_starts.sizes(), " do not fit ", num_seqs, " sequences");
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_starts.const_data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_tokens, "query starts must run from 0 to ", num_tokens);
  std::vector<int64_t> padded(num_seqs), offsets(num_seqs + 1, 0);  // per sequence: its keys' layout, where it lies
  for (int64_t s = 0; s < num_seqs; ++s) {  // a bad length, start or block id would read outside q or the pool
    const int64_t num_new = starts[s + 1] - starts[s];
    TORCH_CHECK(num_new >= 1 && num_new <= lens[s] && lens[s] <= max_blocks * block_size, "sequence ", s, ": ",
                num_new, " new tokens of a context of ", lens[s], " (at most ", max_blocks * block_size, ")");
    for (int64_t j = 0; j < (lens[s] + block_size - 1) / block_size; ++j) {
      const int32_t id = tables[s * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", s, ", ", j, "] = ", id, " is not a block of the pool");
    }
    padded[s] = (lens[s] + kKeyStep - 1) / kKeyStep * kKeyStep;
    offsets[s + 1] = offsets[s] + padded[s] * head_dim;
  }
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, q.options());
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_stride = num_blocks * block_size * head_dim;
  const Rows qs{q.const_data_ptr<c10::BFloat16>(), q.stride(0), head_dim};
  const c10::BFloat16* k_ptr = k_cache.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* v_ptr = v_cache.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* out_data = out.data_ptr<c10::BFloat16>();
  const float softmax_scale = static_cast<float>(scale);

  // Left uninitialized: `pack` writes every element (the keys, then zeros to `padded`).
  std::unique_ptr<uint32_t[]> k_pairs(new uint32_t[offsets[num_seqs] / 2 * num_kv_heads]);
  std::unique_ptr<uint16_t[]> v_pairs(new uint16_t[offsets[num_seqs] * num_kv_heads]);
  auto keys_of = [&](int64_t s, int64_t g) {
    const int64_t at = offsets[s] * num_kv_heads + g * padded[s] * head_dim;
    return PackedKeys{k_pairs.get() + at / 2, v_pairs.get() + at, padded[s]};
  };
  run_units(num_seqs * num_kv_heads, 0, [&](int64_t pair, Scratch&) {
    const int64_t s = pair / num_kv_heads, g = pair % num_kv_heads;
    keys_of(s, g).pack(PoolHead{k_ptr + g * head_stride, v_ptr + g * head_stride, tables + s * max_blocks,
                                block_size, head_dim}, lens[s]);
  });

  struct Unit { int64_t seq, kv_head, first, last, cost; };  // queries [first, last) of the sequence's new tokens
  std::vector<Unit> units;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = starts[s + 1] - starts[s], cached = lens[s] - num_new;
    for (int64_t first = 0; first < num_new; first += kTileTokens) {
      const int64_t last = std::min(num_new, first + kTileTokens);
      for (int64_t g = 0; g < num_kv_heads; ++g) units.push_back({s, g, first, last, (last - first) * (cached + last)});
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  const int64_t longest = *std::max_element(padded.begin(), padded.end());
  run_units(static_cast<int64_t>(units.size()), group * longest, [&](int64_t u, Scratch& scratch) {
    const Unit& unit = units[u];
    const int64_t num_new = starts[unit.seq + 1] - starts[unit.seq], cached = lens[unit.seq] - num_new;
    const PackedKeys keys = keys_of(unit.seq, unit.kv_head);
    for (int64_t i = unit.first; i < unit.last; ++i) {
      const int64_t row = starts[unit.seq] + i, count = cached + i + 1;
      if (head_dim == 64) {
        attend_group<64>(qs, out_data, num_heads, row, unit.kv_head * group, group, keys, count, softmax_scale,
                         scratch.scores, scratch.probs);
      } else {
        attend_group<128>(qs, out_data, num_heads, row, unit.kv_head * group, group, keys, count, softmax_scale,
                          scratch.scores, scratch.probs);
      }
    }
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tsukimi_cpu, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "Tensor query_starts, float scale) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
}

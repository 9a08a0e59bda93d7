// Causal attention of whole prompts over their own k, v on CPU, bf16, by AVX512-BF16 dot products. The oracle is
// kernels.paged_attention.fresh_prefill_attention_ref (PyTorch's SDPA, whose CPU kernel reaches about a sixth of the
// matmuls' rate on prompts of a few hundred tokens).
//
// Work unit: one (sequence, KV head, tile of query tokens). It first lays out the keys the tile can see in the
// layouts `vdpbf16ps` multiplies from (K as pairs of dims, V as pairs of keys), then for each query token and the
// group's query heads together (each load of K or V serves them all): scores, one exact softmax over the row, and V
// weighted by the probabilities rounded to bf16 (as the reference rounds them), the sums in fp32.
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using tsukimi_kernels::exp_clamped;
using tsukimi_kernels::from_float;

constexpr int64_t kTileTokens = 32;  // query tokens per work unit
constexpr int64_t kKeyStep = 32;     // keys per pass of the score loop (two registers of sixteen)

struct Rows {  // one of q, k, v: [tokens, heads, head_dim] with any token stride
  const c10::BFloat16* data;
  int64_t token_stride;
  int64_t head_dim;
  const c10::BFloat16* at(int64_t token, int64_t head) const { return data + token * token_stride + head * head_dim; }
};

inline uint32_t pair_at(const c10::BFloat16* p) {  // two adjacent bf16 as one 32-bit lane
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

// One (sequence, KV head)'s keys laid out for the dot products, zeros past the prompt's length up to `padded`.
struct PackedKeys {
  uint32_t* k_pairs;  // [head_dim / 2][padded]: dims (2p, 2p+1) of each key
  uint16_t* v_pairs;  // [padded / 2][head_dim][2]: keys (2j, 2j+1) of each dim
  int64_t padded;

  void pack(const Rows& k, const Rows& v, int64_t first_token, int64_t kv_head, int64_t count) const {
    const int64_t dim = k.head_dim;
    for (int64_t p = 0; p < dim / 2; ++p) std::fill(k_pairs + p * padded + count, k_pairs + (p + 1) * padded, 0u);
    std::fill(v_pairs + count / 2 * dim * 2, v_pairs + padded * dim, uint16_t{0});
    for (int64_t j0 = 0; j0 < count; j0 += 16) {  // sixteen keys at a time: each K store fills a cache line
      const int64_t n = std::min<int64_t>(16, count - j0);
      for (int64_t p = 0; p < dim / 2; ++p) {
        for (int64_t j = j0; j < j0 + n; ++j) k_pairs[p * padded + j] = pair_at(k.at(first_token + j, kv_head) + 2 * p);
      }
    }
    for (int64_t j = 0; j < count; ++j) {
      const c10::BFloat16* value = v.at(first_token + j, kv_head);
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

Rows rows_of(const at::Tensor& x) {
  return Rows{x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(2)};
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_seqs,
                             double scale) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "prefill_attention: built for a CPU without AVX512-BF16");
#else
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q, k, v must be [tokens, heads, dim]");
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->scalar_type() == at::kBFloat16, "prefill_attention: bf16 only");
    TORCH_CHECK(x->device().is_cpu(), "prefill_attention: CPU tensors only");
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "prefill_attention: each row's heads side by side");
  }
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k.size(1);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "prefill_attention: head size 64 or 128, got ", head_dim);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == num_tokens && k.size(2) == head_dim,
              "prefill_attention: k and v must be [tokens, kv_heads, head_dim] of q's tokens and head size");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "prefill_attention: query heads must be a multiple "
              "of KV heads");
  TORCH_CHECK(num_seqs > 0 && num_tokens % num_seqs == 0, "prefill_attention: ", num_tokens,
              " tokens are not num_seqs=", num_seqs, " prompts of one length");
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, q.options());
  const int64_t length = num_tokens / num_seqs, group = num_heads / num_kv_heads;
  const int64_t num_tiles = (length + kTileTokens - 1) / kTileTokens;
  const Rows qs = rows_of(q), ks = rows_of(k), vs = rows_of(v);
  c10::BFloat16* out_data = out.data_ptr<c10::BFloat16>();
  const float softmax_scale = static_cast<float>(scale);
  // Every (sequence, KV head)'s keys laid out once, then the units: (sequence, KV head, tile of query tokens) in
  // slot order, where slots pair the first tile with the last, the second with the one before, and so on: later
  // tiles see more keys, and the threads' contiguous ranges of units get equal shares of both.
  const int64_t padded = (length + kKeyStep - 1) / kKeyStep * kKeyStep;
  std::vector<uint32_t> k_pairs(num_seqs * num_kv_heads * head_dim / 2 * padded);
  std::vector<uint16_t> v_pairs(num_seqs * num_kv_heads * padded * head_dim);
  auto keys_of = [&](int64_t pair) {
    return PackedKeys{k_pairs.data() + pair * head_dim / 2 * padded, v_pairs.data() + pair * padded * head_dim,
                      padded};
  };
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      keys_of(pair).pack(ks, vs, pair / num_kv_heads * length, pair % num_kv_heads, length);
    }
  });
  at::parallel_for(0, num_tiles * num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * padded);
    std::vector<c10::BFloat16> probs(group * padded);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t slot = unit / (num_seqs * num_kv_heads), pair = unit % (num_seqs * num_kv_heads);
      const int64_t tile = slot % 2 == 0 ? slot / 2 : num_tiles - 1 - slot / 2;
      const int64_t seq_start = pair / num_kv_heads * length, kv_head = pair % num_kv_heads;
      const PackedKeys keys = keys_of(pair);
      for (int64_t i = tile * kTileTokens; i < std::min(length, (tile + 1) * kTileTokens); ++i) {
        if (head_dim == 64) {
          attend_group<64>(qs, out_data, num_heads, seq_start + i, kv_head * group, group, keys, i + 1,
                           softmax_scale, scores, probs);
        } else {
          attend_group<128>(qs, out_data, num_heads, seq_start + i, kv_head * group, group, keys, i + 1,
                            softmax_scale, scores, probs);
        }
      }
    }
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tsukimi_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int num_seqs, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}

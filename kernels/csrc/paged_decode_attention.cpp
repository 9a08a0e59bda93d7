// Paged decode attention on CPU: one query token per sequence attends over its context straight from the paged
// pool (no gather). The oracle is kernels.paged_attention.paged_decode_attention_ref; the layout is
// kernels.kv_layout's: K and V each [num_kv_heads, num_blocks, block_size, head_dim].
//
// Work unit: one (sequence, KV head) pair, its query heads together (grouped-query attention reads each K/V row
// once for the whole group). Scores for the whole context, one softmax, then V weighted by the probabilities; all
// in fp32, the output in the query's dtype. bf16 on a CPU with AMX: decode_attention_amx.h's tiles; otherwise AVX-512
// intrinsics where the CPU has them (head sizes 64 and 128), loops written for the compiler's vectorizer elsewhere
// (-O3 -march=native).
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "decode_attention_amx.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using tsukimi_kernels::exp_clamped;
using tsukimi_kernels::to_float;

#if defined(__AVX512F__)
// AVX-512 paths for head sizes that are multiples of 16: the query (or the accumulator) stays in registers, and
// sixteen rows' dot products are summed across lanes together (`lane_sums`) instead of one by one.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 lane_sums(__m512 v[16]) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2k], b = v[2k+1]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  for (int m = 0; m < 4; ++m) {  // per 128-bit lane: the partial sums of v[4m .. 4m+3]
    x[m] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[i] = the sum of the lanes of dot(i) for `count` rows, sixteen rows reduced across lanes together.
template <typename RowDot>
inline void lane_summed_rows(int64_t count, float* scores, RowDot dot) {
  for (int64_t start = 0; start < count; start += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, count - start));
    __m512 dots[16];
    for (int i = 0; i < 16; ++i) dots[i] = i < n ? dot(start + i) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(scores + start, static_cast<__mmask16>((1u << n) - 1), lane_sums(dots));
  }
}

// scores[i] = query . rows[i] for `count` rows of kHeadDim.
template <typename scalar_t, int64_t kHeadDim>
inline void row_scores(const float* query, const scalar_t* rows, int64_t count, float* scores) {
  constexpr int kChunks = kHeadDim / 16;
  __m512 q[kChunks];
  for (int c = 0; c < kChunks; ++c) q[c] = _mm512_loadu_ps(query + 16 * c);
  lane_summed_rows(count, scores, [&](int64_t i) {
    __m512 dot = _mm512_setzero_ps();
    for (int c = 0; c < kChunks; ++c) dot = _mm512_fmadd_ps(q[c], load16(rows + i * kHeadDim + 16 * c), dot);
    return dot;
  });
}

#if defined(__AVX512BF16__)
// `row_scores` for bf16 rows and a bf16 query (unscaled), by vdpbf16ps: pairs of bf16 products summed into fp32
// lanes, no conversion of the rows (a quarter of the instructions of the fp32 path). The products are exact in
// fp32; only the order of the sums differs from the reference.
template <int64_t kHeadDim>
inline void row_scores_bf16(const c10::BFloat16* query, const c10::BFloat16* rows, int64_t count, float* scores) {
  constexpr int kChunks = kHeadDim / 32;
  __m512bh q[kChunks];
  for (int c = 0; c < kChunks; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
  lane_summed_rows(count, scores, [&](int64_t i) {
    __m512 dot = _mm512_setzero_ps();
    for (int c = 0; c < kChunks; ++c) {
      dot = _mm512_dpbf16_ps(dot, q[c], (__m512bh)_mm512_loadu_si512(rows + i * kHeadDim + 32 * c));
    }
    return dot;
  });
}

// For query heads g0 .. g0 + tile - 1: acc[g][.] += sum_i probs[g * stride + i] * rows[i] over `count` bf16 rows,
// by vdpbf16ps on pairs of rows: rows i and i + 1 interleaved element by element (unpacklo/hi_epi16, within each
// 128-bit lane), their two probabilities (bf16, as the reference rounds them before its matmul) broadcast as a pair.
// acc: per head and 32-dim chunk, a "lo" and a "hi" register whose lanes hold the dims in the order the unpacks
// leave them (see `store_unpacked`).
template <int64_t kHeadDim, int kTile>
inline void weighted_rows_bf16(const uint16_t* probs, int64_t stride, int tile, const c10::BFloat16* rows,
                               int64_t count, __m512* acc) {
  constexpr int kChunks = kHeadDim / 32;
  for (int64_t i = 0; i < count; i += 2) {
    const bool pair = i + 1 < count;  // an odd last row is paired with zeros (the next row may be garbage)
    __m512i lo[kChunks], hi[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(rows + i * kHeadDim + 32 * c);
      const __m512i b = pair ? _mm512_loadu_si512(rows + (i + 1) * kHeadDim + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < kTile; ++g) {
      if (g < tile) {
        const uint16_t* p = probs + g * stride + i;
        const uint32_t both = pair ? (static_cast<uint32_t>(p[1]) << 16) | p[0] : p[0];
        const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(both));
        for (int c = 0; c < kChunks; ++c) {
          __m512* out = acc + (g * kChunks + c) * 2;
          out[0] = _mm512_dpbf16_ps(out[0], (__m512bh)lo[c], weight);
          out[1] = _mm512_dpbf16_ps(out[1], (__m512bh)hi[c], weight);
        }
      }
    }
  }
}

// The 32 dims of one chunk back in order from `weighted_rows_bf16`'s lo and hi registers: 128-bit lane L of lo holds
// dims 8L .. 8L+3, of hi dims 8L+4 .. 8L+7.
inline void store_unpacked(__m512 lo, __m512 hi, float* dims) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(dims, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(dims + 16, _mm512_permutex2var_ps(lo, second, hi));
}
#endif

// For query heads g0 .. g0 + tile - 1: acc[g][.] += sum_i weights[g * stride + i] * rows[i] over `count` rows of
// kHeadDim. Each row is loaded (and widened to fp32) once for the whole tile; acc: kTile * kHeadDim / 16 registers.
template <typename scalar_t, int64_t kHeadDim, int kTile>
inline void weighted_rows(const float* weights, int64_t stride, int tile, const scalar_t* rows, int64_t count,
                          __m512* acc) {
  constexpr int kChunks = kHeadDim / 16;
  for (int64_t i = 0; i < count; ++i) {
    __m512 row[kChunks];
    for (int c = 0; c < kChunks; ++c) row[c] = load16(rows + i * kHeadDim + 16 * c);
    for (int g = 0; g < kTile; ++g) {
      if (g < tile) {
        const __m512 weight = _mm512_set1_ps(weights[g * stride + i]);
        for (int c = 0; c < kChunks; ++c) acc[g * kChunks + c] = _mm512_fmadd_ps(weight, row[c], acc[g * kChunks + c]);
      }
    }
  }
}
#endif

// The next block of a sequence is anywhere in the pool: ask for it while this one is computed (the hardware
// prefetcher does not cross into it; perf put the K and V row loads at a quarter of an earlier version's time; the
// prefetch's own gain was not measured apart).
inline void prefetch_block(const void* block, int64_t num_bytes) {
  const char* bytes = static_cast<const char*>(block);
  for (int64_t offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch(bytes + offset);
}

// Block j of a sequence's table (blocks of block_elems elements), the next one asked for meanwhile.
template <typename scalar_t>
inline const scalar_t* table_block(const scalar_t* pool, const int32_t* table, int64_t j, int64_t num_blocks,
                                   int64_t block_elems) {
  if (j + 1 < num_blocks) {
    prefetch_block(pool + static_cast<int64_t>(table[j + 1]) * block_elems,
                   block_elems * static_cast<int64_t>(sizeof(scalar_t)));
  }
  return pool + static_cast<int64_t>(table[j]) * block_elems;
}

// One (sequence, KV head) of the pool: its blocks of K and V in table order, the next one prefetched.
template <typename scalar_t>
struct HeadBlocks {
  const scalar_t* k_cache;  // this KV head's first block
  const scalar_t* v_cache;
  const int32_t* table;
  int64_t context_len, block_size, head_dim;

  int64_t num_blocks() const { return (context_len + block_size - 1) / block_size; }
  int64_t first(int64_t j) const { return j * block_size; }  // the position of block j's first token
  int64_t count(int64_t j) const { return std::min(block_size, context_len - first(j)); }
  const scalar_t* keys(int64_t j) const { return table_block(k_cache, table, j, num_blocks(), block_size * head_dim); }
  const scalar_t* values(int64_t j) const {
    return table_block(v_cache, table, j, num_blocks(), block_size * head_dim);
  }
};

#if defined(__AVX512BF16__)
template <typename scalar_t, int64_t kHeadDim>
constexpr bool kBf16Dots = std::is_same_v<scalar_t, c10::BFloat16> && kHeadDim > 0 && kHeadDim % 32 == 0;
#endif

// scores[g * context_len + t] = the query of head g . key t, for the group's `groups` query heads (q: the first).
// Returns what the softmax must multiply them by: `scale`, or 1 where the query was scaled first.
template <typename scalar_t, int64_t kHeadDim>
float compute_scores(const scalar_t* q, const HeadBlocks<scalar_t>& head, int64_t groups, float scale, float* query,
                     float* scores) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : head.head_dim, context_len = head.context_len;
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dots<scalar_t, kHeadDim>) {
    for (int64_t j = 0; j < head.num_blocks(); ++j) {
      const scalar_t* block = head.keys(j);
      for (int64_t g = 0; g < groups; ++g) {
        row_scores_bf16<kHeadDim>(q + g * head_dim, block, head.count(j), scores + g * context_len + head.first(j));
      }
    }
    return scale;
  }
#endif
  for (int64_t g = 0; g < groups; ++g) {
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = to_float(q[g * head_dim + d]) * scale;
  }
  for (int64_t j = 0; j < head.num_blocks(); ++j) {
    const scalar_t* block = head.keys(j);
    const int64_t first = head.first(j), count = head.count(j);
#if defined(__AVX512F__)
    if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
      for (int64_t g = 0; g < groups; ++g) {
        row_scores<scalar_t, kHeadDim>(query + g * head_dim, block, count, scores + g * context_len + first);
      }
      continue;
    }
#endif
    for (int64_t i = 0; i < count; ++i) {
      const scalar_t* key = block + i * head_dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = query + g * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(key[d]);
        scores[g * context_len + first + i] = dot;
      }
    }
  }
  return 1.0f;
}

// Each of the `groups` rows of `context_len` scores, times `score_scale`, into probabilities.
inline void softmax_rows(float* scores, int64_t groups, int64_t context_len, float score_scale) {
  for (int64_t g = 0; g < groups; ++g) {
    float* row = scores + g * context_len;
    float top = -FLT_MAX;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < context_len; ++t) top = row[t] > top ? row[t] : top;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < context_len; ++t) {
      row[t] = exp_clamped((row[t] - top) * score_scale);  // <= 0: never past the clamp above
      total += row[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < context_len; ++t) row[t] *= inv;
  }
}

// acc[g * head_dim + d] = sum_t probs[g * context_len + t] * value t [d], for the group's query heads.
template <typename scalar_t, int64_t kHeadDim>
void weigh_values(const float* probs, const HeadBlocks<scalar_t>& head, int64_t groups, uint16_t* probs16,
                  float* acc) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : head.head_dim, context_len = head.context_len;
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dots<scalar_t, kHeadDim>) {
    const int64_t total = groups * context_len;  // the rows are back to back: to bf16 in one pass
    for (int64_t t = 0; t < total; t += 16) {
      const __mmask16 mask = static_cast<__mmask16>(total - t >= 16 ? 0xFFFF : (1u << (total - t)) - 1);
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, probs + t));
      _mm256_mask_storeu_epi16(probs16 + t, mask, (__m256i)half);
    }
    constexpr int kChunks = kHeadDim / 32, kTile = 8 / kChunks;  // 16 accumulator registers (lo and hi)
    for (int64_t g0 = 0; g0 < groups; g0 += kTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kTile, groups - g0));
      __m512 sums[kTile * kChunks * 2];
      for (auto& sum : sums) sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < head.num_blocks(); ++j) {
        weighted_rows_bf16<kHeadDim, kTile>(probs16 + g0 * context_len + head.first(j), context_len, tile,
                                            head.values(j), head.count(j), sums);
      }
      for (int g = 0; g < tile; ++g) {
        for (int c = 0; c < kChunks; ++c) {
          store_unpacked(sums[(g * kChunks + c) * 2], sums[(g * kChunks + c) * 2 + 1],
                         acc + (g0 + g) * head_dim + 32 * c);
        }
      }
    }
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
    constexpr int kChunks = kHeadDim / 16, kTile = 16 / kChunks;  // 16 accumulator registers
    for (int64_t g0 = 0; g0 < groups; g0 += kTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kTile, groups - g0));
      __m512 sums[kTile * kChunks];
      for (auto& sum : sums) sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < head.num_blocks(); ++j) {
        weighted_rows<scalar_t, kHeadDim, kTile>(probs + g0 * context_len + head.first(j), context_len, tile,
                                                 head.values(j), head.count(j), sums);
      }
      for (int g = 0; g < tile; ++g) {
        for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + (g0 + g) * head_dim + 16 * c, sums[g * kChunks + c]);
      }
    }
    return;
  }
#endif
  std::memset(acc, 0, sizeof(float) * groups * head_dim);
  for (int64_t j = 0; j < head.num_blocks(); ++j) {
    const scalar_t* block = head.values(j);
    const int64_t first = head.first(j);
    for (int64_t i = 0; i < head.count(j); ++i) {
      const scalar_t* value = block + i * head_dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float p = probs[g * context_len + first + i];
        float* ag = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_float(value[d]);
      }
    }
  }
}

// kHeadDim > 0: the head size known at compile time (the inner loops unroll; per-row loop overhead otherwise costs
// more than the arithmetic at head sizes of 64-128); 0: taken from `head.head_dim`. Likewise in the stages.
template <typename scalar_t, int64_t kHeadDim>
void decode_one(const scalar_t* q, const HeadBlocks<scalar_t>& head, int64_t groups, float scale, float* scores,
                float* query, float* acc, uint16_t* probs16, scalar_t* out) {
  // q and out point at this KV head's first query head.
  const float score_scale = compute_scores<scalar_t, kHeadDim>(q, head, groups, scale, query, scores);
  softmax_rows(scores, groups, head.context_len, score_scale);
  weigh_values<scalar_t, kHeadDim>(scores, head, groups, probs16, acc);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : head.head_dim;
  for (int64_t g = 0; g < groups; ++g) {
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d]);
  }
}

template <typename scalar_t>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t head_stride = num_blocks * block_size * head_dim;
  const scalar_t* q_ptr = q.const_data_ptr<scalar_t>();
  const int64_t q_row_stride = q.stride(0);
  const scalar_t* k_ptr = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.const_data_ptr<scalar_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t longest = max_blocks * block_size;
  for (int64_t b = 0; b < batch; ++b) {  // a bad length or block id would read outside the pool
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= longest, "context_lens[", b, "] = ", lens[b], " outside [1, ", longest, "]");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j) {
      const int32_t id = tables[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id, " is not a block of the pool");
    }
  }
#if defined(TSUKIMI_DECODE_AMX)
  namespace amx = tsukimi_kernels::amx;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (amx::fits(head_dim, block_size, groups) && amx::tiles_permitted()) {
      at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        amx::Scratch scratch(longest);
        amx::configure_tiles();
        for (int64_t unit = begin; unit < end; ++unit) {
          const int64_t b = unit / num_kv_heads, h = unit % num_kv_heads, first_head = h * groups * head_dim;
          const scalar_t* q_unit = q_ptr + b * q_row_stride + first_head;
          const scalar_t *k_head = k_ptr + h * head_stride, *v_head = v_ptr + h * head_stride;
          scalar_t* out_unit = out_ptr + b * num_heads * head_dim + first_head;
          const auto decode_unit = head_dim == 64 ? amx::decode_unit<64> : amx::decode_unit<128>;
          decode_unit(q_unit, k_head, v_head, tables + b * max_blocks, block_size, lens[b], groups,
                      static_cast<float>(scale), scratch, out_unit);
        }
        amx::release_tiles();
      });
      return;
    }
  }
#endif
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * longest), query(groups * head_dim), acc(groups * head_dim);
    std::vector<uint16_t> probs16(groups * longest);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / num_kv_heads, h = unit % num_kv_heads;
      const int64_t first_head = h * groups * head_dim;
      const scalar_t* k_head = k_ptr + h * head_stride;
      const scalar_t* v_head = v_ptr + h * head_stride;
      const int32_t* table = tables + b * max_blocks;
      auto run = [&](auto head_dim_constant) {
        const HeadBlocks<scalar_t> head{k_head, v_head, table, lens[b], block_size, head_dim};
        decode_one<scalar_t, decltype(head_dim_constant)::value>(
            q_ptr + b * q_row_stride + first_head, head, groups, static_cast<float>(scale), scores.data(),
            query.data(), acc.data(), probs16.data(), out_ptr + b * num_heads * head_dim + first_head);
      };
      if (head_dim == 64) {
        run(std::integral_constant<int64_t, 64>{});
      } else if (head_dim == 128) {
        run(std::integral_constant<int64_t, 128>{});
      } else {
        run(std::integral_constant<int64_t, 0>{});
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "q ", q.sizes(),
              " must be [rows, heads, head_dim] and the pools ", k_cache.sizes(), ", ", v_cache.sizes(),
              " [kv_heads, blocks, block_size, head_dim] alike");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pools must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes differ: ",
              q.scalar_type(), ", ", k_cache.scalar_type(), ", ", v_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block tables and lengths must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block tables must be a contiguous [rows, max_blocks], lengths contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), q.size(1), " heads of ", q.size(2),
              " do not fit ", k_cache.size(0), " KV heads of ", k_cache.size(3));
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.dim() == 1 && context_lens.size(0) == q.size(0),
              "block tables ", block_tables.sizes(), " and lengths ", context_lens.sizes(), " need one row per query ",
              "row (", q.size(0), ")");
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: decode_all<float>(q, k_cache, v_cache, block_tables, context_lens, scale, out); break;
    case at::kBFloat16: decode_all<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, scale, out); break;
    case at::kHalf: decode_all<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, scale, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tsukimi_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}

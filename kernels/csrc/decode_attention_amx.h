// Paged decode attention on AMX tiles (Intel Xeon from Sapphire Rapids on): the bf16 path of
// paged_decode_attention.cpp where the CPU has them. One (sequence, KV head) at a time, as there:
//
// - scores: K's rows are tdpbf16ps's A operand as they lie in the pool (16 tokens x 32 dims a tile), the group's
//   queries its B operand (Q^T in pairs of dims, built once per unit), so a 16-token tile of scores for all the
//   group's heads is head_dim / 32 instructions, where vdpbf16ps needs 3 x 16 x head_dim / 32 and a reduction across
//   lanes. The tile comes out token-major; each head's row of scores is gathered from it.
// - softmax in fp32, probabilities rounded to bf16 (as the reference does before its matmul);
// - values: the probabilities are the A operand (a row per query head, 32 tokens a tile), V the B operand, which
//   tdpbf16ps wants in pairs of tokens: two rows interleaved element by element (unpacklo/hi within 128-bit lanes,
//   so each 32-dim half comes out in the permuted order `unpacked_dims` puts back).
//
// On a 2-core Xeon (SmolLM2's 3 KV heads x 3 queries x 64, context 280) vdpbf16ps ran at 1.1 G instructions a second
// and kept the other path compute-bound at about 4.5 us a unit; this one is bound by memory (figures:
// docs/experiments/performance.md, "Decode attention on AMX tiles").
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TSUKIMI_DECODE_AMX 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tsukimi_kernels::amx {

constexpr int kTileRows = 16;  // every tile the kernel configures: 16 rows of 64 bytes
constexpr int kTileBytes = 64;
constexpr int64_t kTokensPerTile = 32;  // bf16 probabilities: 32 tokens in a row of 64 bytes

// Linux gives a process AMX's tile state only on request; without it the first tile instruction faults.
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the kernel's tile shapes on the calling thread; `release_tiles` hands the state back (oneDNN and PyTorch's
// brgemm configure their own before each use).
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

inline void release_tiles() { _tile_release(); }

// Whether a pool of this shape takes this path: tiles of 16 tokens inside a block, 32-dim chunks, at most 16 query
// heads a KV head (a tile's columns).
inline bool fits(int64_t head_dim, int64_t block_size, int64_t groups) {
  return (head_dim == 64 || head_dim == 128) && block_size % kTileRows == 0 && groups <= kTileRows;
}

// One thread's buffers, sized for the longest context of the call.
struct Scratch {
  alignas(64) uint32_t query[4][kTileRows][16] = {};  // per 32-dim chunk: Q^T, pairs of dims x query heads
  alignas(64) uint16_t values[4][kTileRows][32];      // per 16 dims: 16 pairs of tokens x 16 dims x 2
  alignas(64) float sums[4][kTileRows][16];           // the weighted values: query heads x 16 dims, per chunk
  std::vector<float> by_token;                        // [padded][16]: the tiles of scores, 16 heads a token
  std::vector<float> scores;                          // [groups][padded]: each head's scores, then e^(s - max)
  std::vector<uint16_t> probs;                        // [16][padded] bf16: the A operand of the values' tiles

  explicit Scratch(int64_t longest) {
    const int64_t padded = (longest + kTokensPerTile - 1) / kTokensPerTile * kTokensPerTile;
    by_token.resize(padded * 16);
    scores.resize(kTileRows * padded);
    probs.assign(kTileRows * padded, 0);  // rows past the group's are read by the tile and never used
  }
};

// e^x for x <= 0, as `exp_clamped` (cpu_math.h) computes it, sixteen lanes at once.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 round = _mm512_set1_ps(12582912.0f);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Each head's scores [0, context_len), times `scale`, into bf16 probabilities in `probs` (row g at g * padded),
// zeros from context_len to padded.
inline void softmax_to_bf16(float* scores, int64_t groups, int64_t context_len, int64_t padded, float scale,
                            uint16_t* probs) {
  for (int64_t g = 0; g < groups; ++g) {
    float* row = scores + g * padded;
    __m512 top = _mm512_set1_ps(-3.0e38f);
    for (int64_t t = 0; t < context_len; t += 16) {
      const __mmask16 live = context_len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (context_len - t)) - 1);
      top = _mm512_mask_max_ps(top, live, top, _mm512_loadu_ps(row + t));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale), scaled = _mm512_set1_ps(scale);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < context_len; t += 16) {
      const __mmask16 live = context_len - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (context_len - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + t), scaled,
                                                                                 shift)));
      _mm512_storeu_ps(row + t, e);
      total = _mm512_add_ps(total, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    uint16_t* out = probs + g * padded;
    for (int64_t t = 0; t < padded; t += 16) {  // past context_len: zeros (the masked load gives them)
      const __mmask16 live = t >= context_len           ? 0
                             : context_len - t >= 16 ? 0xFFFF
                                                     : static_cast<__mmask16>((1u << (context_len - t)) - 1);
      const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + t), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t), (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
}

// Dims 0 .. 31 in order from a pair of tiles' rows laid out as unpacklo/hi left them: 128-bit lane L of `lo` holds
// dims 8L .. 8L+3, of `hi` dims 8L+4 .. 8L+7.
inline void unpacked_dims(const float* lo, const float* hi, c10::BFloat16* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 a = _mm512_loadu_ps(lo), b = _mm512_loadu_ps(hi);
  const __m256bh x = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, first, b));
  const __m256bh y = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, second, b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)y);
}

// Tokens `first` .. `first` + 15 of K (16 rows of a block) against the query tiles 2 .. (Q^T, head_dim / 32 of them)
// into tile SUMS by way of tile ROWS (K), stored token-major at by_token[first * 16 ..], 16 heads' scores a token; the
// same tokens' V rows asked for meanwhile (5% faster, measured). A macro: GCC's tile intrinsics take tile numbers as
// literal tokens, not constants.
#define TSUKIMI_SCORE_TILE(SUMS, ROWS, first)                                                                 \
  do {                                                                                                        \
    const int64_t offset_ = (table[(first) / block_size] * block_size + (first) % block_size) * kHeadDim;      \
    const c10::BFloat16* rows_ = k_head + offset_;                                                            \
    const char* values_ = reinterpret_cast<const char*>(v_head + offset_);                                    \
    for (int64_t line_ = 0; line_ < kTileRows * kRowBytes; line_ += 64) _mm_prefetch(values_ + line_, _MM_HINT_T0); \
    _tile_zero(SUMS);                                                                                        \
    _tile_loadd(ROWS, rows_, kRowBytes);                                                                     \
    _tile_dpbf16ps(SUMS, ROWS, 2);                                                                           \
    _tile_loadd(ROWS, rows_ + 32, kRowBytes);                                                                \
    _tile_dpbf16ps(SUMS, ROWS, 3);                                                                           \
    if constexpr (kChunks == 4) {                                                                            \
      _tile_loadd(ROWS, rows_ + 64, kRowBytes);                                                              \
      _tile_dpbf16ps(SUMS, ROWS, 4);                                                                         \
      _tile_loadd(ROWS, rows_ + 96, kRowBytes);                                                              \
      _tile_dpbf16ps(SUMS, ROWS, 5);                                                                         \
    }                                                                                                        \
    _tile_stored(SUMS, by_token + (first) * 16, kTileBytes);                                                 \
  } while (false)

// One (sequence, KV head): the group's `groups` query heads (q, one after another) over `context_len` tokens whose
// K and V rows lie in the blocks `table` lists (k_head, v_head: this KV head's first block); the result, a row per
// query head, to `out`. The calling thread has configured its tiles (`configure_tiles`).
template <int64_t kHeadDim>
void decode_unit(const c10::BFloat16* q, const c10::BFloat16* k_head, const c10::BFloat16* v_head,
                 const int32_t* table, int64_t block_size, int64_t context_len, int64_t groups, float scale,
                 Scratch& scratch, c10::BFloat16* out) {
  constexpr int kChunks = kHeadDim / 32;
  constexpr int64_t kRowBytes = kHeadDim * 2;
  const int64_t padded = (context_len + kTokensPerTile - 1) / kTokensPerTile * kTokensPerTile;
  const int64_t block_elems = block_size * kHeadDim;

  for (int64_t g = 0; g < groups; ++g) {  // Q^T: column g of chunk c's tile is head g's dims 32c .. 32c+31 in pairs
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q + g * kHeadDim);
    for (int c = 0; c < kChunks; ++c) {
      for (int p = 0; p < kTileRows; ++p) scratch.query[c][p][g] = pairs[16 * c + p];
    }
  }
  _tile_loadd(2, scratch.query[0], kTileBytes);
  _tile_loadd(3, scratch.query[1], kTileBytes);
  if constexpr (kChunks == 4) {
    _tile_loadd(4, scratch.query[2], kTileBytes);
    _tile_loadd(5, scratch.query[3], kTileBytes);
  }
  // Every tile of scores first, token-major (two tiles of sums in turn, so that one is computed while the other is
  // stored), then each head's row gathered from them: a gather right after its tile's store waits for it.
  float* by_token = scratch.by_token.data();
  int64_t first = 0;
  for (; first + kTileRows < context_len; first += 2 * kTileRows) {
    TSUKIMI_SCORE_TILE(0, 1, first);
    TSUKIMI_SCORE_TILE(7, 6, first + kTileRows);
  }
  if (first < context_len) TSUKIMI_SCORE_TILE(0, 1, first);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  float* scores = scratch.scores.data();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < context_len; t += kTileRows) {
      _mm512_storeu_ps(scores + g * padded + t, _mm512_i32gather_ps(column, by_token + t * 16 + g, 4));
    }
  }
#undef TSUKIMI_SCORE_TILE
  softmax_to_bf16(scores, groups, context_len, padded, scale, scratch.probs.data());

  const __m512i zero = _mm512_setzero_si512();
  for (int64_t dim0 = 0; dim0 < kHeadDim; dim0 += 64) {  // 64 dims a pass: four tiles of sums
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t first = 0; first < padded; first += kTokensPerTile) {
      for (int p = 0; p < kTileRows; ++p) {  // tokens first + 2p and + 2p + 1, interleaved; zeros past the context
        const int64_t t = first + 2 * p;
        const c10::BFloat16* a =
            t < context_len ? v_head + table[t / block_size] * block_elems + (t % block_size) * kHeadDim + dim0 : q;
        for (int half = 0; half < 2; ++half) {
          const __m512i x = t < context_len ? _mm512_loadu_si512(a + 32 * half) : zero;
          const __m512i y = t + 1 < context_len ? _mm512_loadu_si512(a + kHeadDim + 32 * half) : zero;
          _mm512_store_si512(scratch.values[2 * half][p], _mm512_unpacklo_epi16(x, y));
          _mm512_store_si512(scratch.values[2 * half + 1][p], _mm512_unpackhi_epi16(x, y));
        }
      }
      _tile_loadd(4, scratch.probs.data() + first, padded * 2);
      _tile_loadd(5, scratch.values[0], kTileBytes);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, scratch.values[1], kTileBytes);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, scratch.values[2], kTileBytes);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, scratch.values[3], kTileBytes);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, scratch.sums[0], kTileBytes);
    _tile_stored(1, scratch.sums[1], kTileBytes);
    _tile_stored(2, scratch.sums[2], kTileBytes);
    _tile_stored(3, scratch.sums[3], kTileBytes);
    for (int64_t g = 0; g < groups; ++g) {
      unpacked_dims(scratch.sums[0][g], scratch.sums[1][g], out + g * kHeadDim + dim0);
      unpacked_dims(scratch.sums[2][g], scratch.sums[3][g], out + g * kHeadDim + dim0 + 32);
    }
  }
}

}  // namespace tsukimi_kernels::amx

#endif

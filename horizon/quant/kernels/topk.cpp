// The DSA indexer's exact top-k (horizon.model.dsa.topk_recent_first): per row of scores [R, L] (fp32), the
// positions of the k largest scores, equal scores preferring the larger position: exactly the set
// `_topk_by_score_then_position` (the reference) selects, which orders by (key(score), position) with
//   key(s) = bits(s + 0.0) as int32, with the magnitude bits flipped when negative
// (the same order as the float for every non-NaN value; -0.0 counts as +0.0; NaNs sort by their bits).
//
// Output order: increasing position (the reference leaves its order unspecified: sorted=False).
//
// Why a kernel: torch.topk over 64K scores for k = 2,048 takes ~0.5 ms (compiled; 1.3 ms for the reference's
// int64 form eagerly) and ~5 ms over 1M, once per DSA layer per decode step. Here: a strided sample of 1,024
// keys gives a threshold t that about 1.5 k keys pass; one pass (AVX-512: compares and a compress-store per 16
// keys) keeps the positions with key > t and counts those equal to t. If at least k passed, nth_element on
// (key, position) among those few finds the k-th largest pair exactly, and a pass over them in position order
// writes the k at or above it. If fewer passed but the ties make up the rest, the rest are the ties at the
// largest positions, found scanning back from the end: the case of a row mostly masked to -inf (a short
// sequence batched with a long one, an early query in a prefill), which would otherwise make every position
// a candidate. If even the ties do not reach k (a sample that missed), t drops to the lowest key, so the
// result is exact whatever the sample. (A radix select with a 64K-bucket histogram was slower than
// torch.topk here: its counters live in L2 and masked positions hammer one of them.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "simd.h"
#define HZ_X86 1
#endif

namespace {

// key(s) as an unsigned integer with the same order (the int32 key's sign bit flipped)
inline uint32_t ordered_bits(uint32_t bits) {
  if (bits == 0x80000000u) bits = 0;  // -0.0 -> +0.0
  const uint32_t key = (bits & 0x80000000u) ? bits ^ 0x7FFFFFFFu : bits;
  return key ^ 0x80000000u;
}

inline uint32_t ordered(const float* s, int64_t i) {
  uint32_t bits;
  std::memcpy(&bits, s + i, 4);
  return ordered_bits(bits);
}

// One thread's buffers, kept across its rows.
struct Scratch {
  std::vector<uint32_t> sample;
  std::vector<uint64_t> cand, pairs;  // (key << 32) | position
  std::vector<int64_t> ties;
  // the vector pass's compressed keys and positions: uninitialised (a zero fill would cost more than the pass)
  std::unique_ptr<uint32_t[]> keys, pos;
  int64_t capacity = 0;
  void reserve_compressed(int64_t L) {
    if (L <= capacity) return;
    keys.reset(new uint32_t[L]);
    pos.reset(new uint32_t[L]);
    capacity = L;
  }
};

// positions with key > t, as (key, position) pairs in position order; returns how many keys equal t
int64_t candidates_portable(const float* s, int64_t L, uint32_t t, std::vector<uint64_t>& out) {
  int64_t eq = 0;
  for (int64_t i = 0; i < L; ++i) {
    const uint32_t u = ordered(s, i);
    if (u > t) out.push_back((static_cast<uint64_t>(u) << 32) | static_cast<uint64_t>(i));
    eq += u == t;
  }
  return eq;
}

#ifdef HZ_X86
#define HZ_AVX512 __attribute__((target("avx512f")))

bool cpu_has_avx512f() {
  return hz::cpu_has_avx512();
}

HZ_AVX512 int64_t candidates_avx512(const float* s, int64_t L, uint32_t t, Scratch& w) {
  w.reserve_compressed(L);  // compressed keys and positions first, paired after
  uint32_t* keys = w.keys.get();
  uint32_t* pos = w.pos.get();
  std::vector<uint64_t>& out = w.cand;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(t));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = 0, i = 0, eq = 0;
  for (; i + 16 <= L; i += 16, idx = _mm512_add_epi32(idx, step)) {
    __m512i b = _mm512_loadu_si512(s + i);
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(b, sign), _mm512_setzero_si512());  // -0.0 -> +0.0
    // negative: flip the magnitude bits (srai gives all ones for them), then the sign bit for unsigned order
    const __m512i u = _mm512_xor_si512(_mm512_xor_si512(b, _mm512_and_si512(_mm512_srai_epi32(b, 31), mag)), sign);
    const __mmask16 m = _mm512_cmp_epu32_mask(u, tv, _MM_CMPINT_NLE);
    _mm512_mask_compressstoreu_epi32(keys + n, m, u);
    _mm512_mask_compressstoreu_epi32(pos + n, m, idx);
    n += __builtin_popcount(m);
    eq += __builtin_popcount(_mm512_cmpeq_epu32_mask(u, tv));
  }
  for (; i < L; ++i) {
    const uint32_t u = ordered(s, i);
    if (u > t) keys[n] = u, pos[n++] = static_cast<uint32_t>(i);
    eq += u == t;
  }
  out.resize(n);
  for (int64_t j = 0; j < n; ++j) out[j] = (static_cast<uint64_t>(keys[j]) << 32) | pos[j];
  return eq;
}
#else
bool cpu_has_avx512f() { return false; }
#endif

// One row: writes k positions to out.
void row_topk(const float* s, int64_t L, int64_t k, int64_t* out, Scratch& w, bool avx512) {
  constexpr int64_t kSample = 1024;
  uint32_t t = 0;  // every key reaches 0
  if (L > 4 * kSample && k < L / 2) {  // else most positions are candidates anyway
    const int64_t stride = L / kSample;
    w.sample.resize(kSample);
    for (int64_t j = 0; j < kSample; ++j) w.sample[j] = ordered(s, j * stride);
    // the sample's rank expected at 1.5 k of L, plus 16 for margin: a threshold about 1.5 k keys pass
    const int64_t r = std::min<int64_t>(kSample - 1, (3 * k * kSample) / (2 * L) + 16);
    std::nth_element(w.sample.begin(), w.sample.begin() + r, w.sample.end(), std::greater<uint32_t>());
    t = w.sample[r];
  }
  int64_t eq = 0;
  for (;;) {
    w.cand.clear();
#ifdef HZ_X86
    if (avx512)
      eq = candidates_avx512(s, L, t, w);
    else
#endif
      eq = candidates_portable(s, L, t, w.cand);
    if (static_cast<int64_t>(w.cand.size()) + eq >= k || t == 0) break;
    t = 0;  // the sample's threshold was too high: every position
  }
  const int64_t above = static_cast<int64_t>(w.cand.size());
  if (above >= k) {
    // the k-th largest (key, position) pair, then every candidate at or above it, in position order
    w.pairs.assign(w.cand.begin(), w.cand.end());
    std::nth_element(w.pairs.begin(), w.pairs.begin() + (k - 1), w.pairs.end(), std::greater<uint64_t>());
    const uint64_t kth = w.pairs[k - 1];
    int64_t n = 0;
    for (const uint64_t c : w.cand)
      if (c >= kth) out[n++] = static_cast<int64_t>(c & 0xFFFFFFFFu);
    return;
  }
  // every key above t, and the k - above keys equal to t at the largest positions; merged in position order
  w.ties.clear();
  for (int64_t i = L - 1; i >= 0 && static_cast<int64_t>(w.ties.size()) < k - above; --i)
    if (ordered(s, i) == t) w.ties.push_back(i);
  std::reverse(w.ties.begin(), w.ties.end());
  int64_t a = 0, b = 0, n = 0;
  while (n < k) {
    const bool take_above = a < above && (b >= static_cast<int64_t>(w.ties.size()) ||
                                          static_cast<int64_t>(w.cand[a] & 0xFFFFFFFFu) < w.ties[b]);
    out[n++] = take_above ? static_cast<int64_t>(w.cand[a++] & 0xFFFFFFFFu) : w.ties[b++];
  }
}

at::Tensor topk_recent_first_rows(const at::Tensor& scores, int64_t k, bool force_portable) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat,
              "topk_recent_first_rows: scores must be fp32 [R, L]");
  TORCH_CHECK(k >= 0 && k <= scores.size(1), "topk_recent_first_rows: k must be within [0, L]");
  TORCH_CHECK(scores.size(1) < (int64_t(1) << 31), "topk_recent_first_rows: rows must be shorter than 2^31");
  const at::Tensor sc = scores.contiguous();
  const int64_t R = sc.size(0), L = sc.size(1);
  auto out = at::empty({R, k}, sc.options().dtype(at::kLong));
  if (R == 0 || k == 0) return out;
  const float* S = sc.data_ptr<float>();
  int64_t* O = out.data_ptr<int64_t>();
  const bool avx512 = !force_portable && cpu_has_avx512f();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    Scratch w;
    for (int64_t r = r0; r < r1; ++r) row_topk(S + r * L, L, k, O + r * k, w, avx512);
  });
  return out;
}

}  // namespace

// A CPU kernel with a fake registered from Python (horizon.quant.kernels): compiled decode graphs call it
// directly. The row length is whatever the scores have (dynamic in a graph); k is fixed per layer.
TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("topk_recent_first_rows(Tensor scores, int k, bool force_portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("topk_recent_first_rows", &topk_recent_first_rows); }

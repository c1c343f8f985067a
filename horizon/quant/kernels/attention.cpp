// Gated DSA's decode attention read in place from the paged latent pool (horizon.model.dsa, the absorbed form:
// MQA of H query heads over the cached rows [c_kv | k_pe]).
//
//   positions of sequence b: 0 .. L-1 (dense), or idx[b, :] (the indexer's sparse selection)
//   visible: 0 <= p < lens[b] and p's block assigned;  row(b, p) = table[b, p / bs] * bs + p % bs
//   s_p = scale * (pool[row(b, p)] . q[b, h]);   out[b, h, :] = sum_p softmax_p(s) * pool[row(b, p), :V]
//   (a sequence with nothing visible gets zeros)
//
// pool: the layer's latent rows, fp32 [R, W]; table: int64 [B, nb]; q: fp32 [B, H, W]; lens: int64 [B];
// idx: int64 [B, k] or undefined; out: fp32 [B, H, V], V <= W (the c_kv part of each row: the caller applies
// W_kvb's value half to it).
//
// Why a kernel: the PyTorch reference gathers every visible row into a new [B, L, W] tensor, then runs two
// skinny matmuls and a softmax over [B, H, L] scores, reading the rows' bytes four times. At 16 sequences of
// ~2K tokens that is ~35% of a `small` decode step (docs/benchmarks.md). Here each row is read where it lies,
// once into L1, and used there for both products (one pass, online softmax as in flash attention).
//
// Layout of the work: each sequence's positions are cut into chunks of CHUNK (parallel over (sequence,
// chunk) pairs, so one long sequence also uses every thread); a chunk keeps a running max, sum and output
// per head, and the chunks of a sequence are merged at the end. Inside a chunk the AVX-512 path takes 16
// visible rows at a time: per head, the 16 dot products accumulate in 16 registers (one load of each row
// vector per FMA) and are reduced together by a transpose tree, so the 16 scores land in one vector and the
// exponentials are vectorised; then each row vector is loaded once and added into every head's output. The
// AVX2 path does the same with 8 rows on 8 lanes.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HZ_X86 1
#include "simd.h"
#endif

namespace {

constexpr int64_t CHUNK = 256;  // positions per work item: ~20 us of work at `small`, more than a thread's wake-up
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Where one chunk's positions come from, and the running state it leaves for the merge.
struct Problem {
  const float* pool;
  int64_t R, W, V, H, bs, nb;
  const int64_t* table;  // [B, nb]
  const int64_t* idx;    // [B, n] or nullptr (dense: position = index)
  int64_t n;             // positions per sequence
  float scale;
  // the row of sequence b's position p, or nullptr when it is not visible
  const float* row(int64_t b, int64_t p, int64_t len) const {
    if (p < 0 || p >= len || p / bs >= nb) return nullptr;
    const int64_t blk = table[b * nb + p / bs];
    if (blk < 0 || (blk + 1) * bs > R) return nullptr;
    return pool + (blk * bs + p % bs) * W;
  }
};

// Sequence b's visible rows among its positions i0 .. i1 - 1, in order: calls f(row) for each. Dense positions
// resolve their block once per block (a division per row costs as much as a row's scores at small widths).
template <typename F>
__attribute__((always_inline)) inline void for_each_row(const Problem& P, int64_t b, int64_t i0, int64_t i1,
                                                       int64_t len, F&& f) {
  if (P.idx) {
    for (int64_t i = i0; i < i1; ++i)
      if (const float* r = P.row(b, P.idx[b * P.n + i], len)) f(r);
    return;
  }
  for (int64_t p = i0; p < std::min(i1, len);) {
    const int64_t end = std::min({i1, len, (p / P.bs + 1) * P.bs});  // the end of p's block
    const float* r = P.row(b, p, len);
    if (r)
      for (int64_t q = p; q < end; ++q, r += P.W) f(r);
    p = end;
  }
}

struct Partial {  // one chunk's softmax state per head: max m, sum l, unnormalised output acc [H, V]
  float* m;
  float* l;
  float* acc;
};

// The portable path (and the reference for the vector ones): one row at a time, scalar online softmax. GCC
// vectorises the row's dot products (32 explicit partial sums) for SSE2 at most: the kernels are built without
// -march.
__attribute__((always_inline)) inline void row_update(const Problem& P, const float* r, const float* q, Partial s) {
  for (int64_t h = 0; h < P.H; ++h) {
    const float* qh = q + h * P.W;
    float part[32] = {0.0f};  // four vectors of partial sums on AVX2: four FMA chains, not one
    int64_t j = 0;
    for (; j + 32 <= P.W; j += 32)
      for (int u = 0; u < 32; ++u) part[u] += r[j + u] * qh[j + u];
    float dot = 0.0f;
    for (; j < P.W; ++j) dot += r[j] * qh[j];
    // the partial sums folded as a tree (vector adds), not one serial chain of 32 scalar adds
    for (int width = 16; width >= 1; width /= 2)
      for (int u = 0; u < width; ++u) part[u] += part[u + width];
    dot += part[0];
    const float sc = dot * P.scale;
    float* acc = s.acc + h * P.V;
    if (sc > s.m[h]) {  // a new maximum: rescale what is there (exp(-inf) = 0 on the first row)
      const float c = std::exp(s.m[h] - sc);
      s.l[h] *= c;
      for (int64_t k = 0; k < P.V; ++k) acc[k] *= c;
      s.m[h] = sc;
    }
    const float e = std::exp(sc - s.m[h]);
    s.l[h] += e;
    for (int64_t k = 0; k < P.V; ++k) acc[k] += e * r[k];
  }
}

void chunk_portable(const Problem& P, int64_t b, int64_t i0, int64_t i1, int64_t len, const float* q, Partial s) {
  for_each_row(P, b, i0, i1, len, [&](const float* r) __attribute__((always_inline)) { row_update(P, r, q, s); });
}

// Sequence b's visible rows among positions i0 .. i1 - 1 in groups of G, each group collected one ahead of the
// one computed, so its rows can be fetched while the one before computes: group(rows, n, ahead, n_ahead), the
// first n of the G rows visible and the rest pointing at `zeros` (the vector paths mask their lanes out).
template <int G, typename F>
__attribute__((always_inline)) inline void for_each_group(const Problem& P, int64_t b, int64_t i0, int64_t i1,
                                                         int64_t len, const float* zeros, F&& group) {
  const float* bufs[2][G];
  const float** cur = bufs[0];
  const float** next = bufs[1];
  int n_cur = 0, n_next = 0;
  for_each_row(P, b, i0, i1, len, [&](const float* r) {
    next[n_next++] = r;
    if (n_next == G) {
      if (n_cur) group(cur, n_cur, next, n_next);
      std::swap(cur, next);
      n_cur = G;
      n_next = 0;
    }
  });
  std::fill(next + n_next, next + G, zeros);  // the last group's missing rows
  if (n_cur) group(cur, n_cur, next, n_next);
  if (n_next) group(next, n_next, cur, 0);
}

#ifdef HZ_X86
#define HZ_AVX512 __attribute__((target("avx512f")))

bool cpu_has_avx512f() {
  return hz::cpu_has_avx512();
}

// 16 vectors -> one vector whose lanes hold their 16 horizontal sums, in the order TREE_LANE gives: four
// rounds, each adding the two halves of pairs (256-bit, 128-bit, 64-bit, 32-bit) of the vectors left.
HZ_AVX512 inline __m512 sum16(__m512* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

// TREE_LANE[i]: the lane of sum16's result that holds vector i's sum (found once by running it on v_i = i).
HZ_AVX512 __m512i tree_order() {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i) * 16.0f);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum16(v));  // lane k = 16 * 16 * (the vector it came from)
  alignas(64) int32_t order[16];
  for (int k = 0; k < 16; ++k) order[static_cast<int>(lanes[k] / 256.0f + 0.5f)] = k;
  return _mm512_load_si512(order);
}

HZ_AVX512 inline __mmask16 lanes_upto(int64_t n) {  // the first n lanes (none for n <= 0)
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}

// One group of 16 rows, the first n of them visible, into the chunk's state; the rest point at a row of
// zeros (so every loop has 16 fixed trips, fully unrolled, and the 16 dot products stay in registers) and
// their lanes are masked out of the softmax.
// `ahead`: the next group's `n_ahead` rows, fetched into the cache while this group computes (cold rows at
// ~2K-token contexts otherwise left the kernel at a third of the memory bandwidth).
HZ_AVX512 void group_avx512(const Problem& P, const float* const* rows, int n, const float* const* ahead,
                            int n_ahead, const float* q, Partial s, const __m512i& order, float* probs /* [H, 16] */) {
  const int64_t W = P.W, V = P.V, H = P.H;
  const __mmask16 live = lanes_upto(n);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = h; i < n_ahead; i += H)  // spread over the heads: a few rows each
      for (int64_t b = 0; b < W * 4; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead[i]) + b, _MM_HINT_T0);
    const float* qh = q + h * W;
    __m512 d[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) d[i] = _mm512_setzero_ps();
    // eight rows at a time: their pointers fit in general registers (sixteen would be reloaded per FMA)
    for (int half = 0; half < 16; half += 8) {
      const float* r0 = rows[half];
      const float *r1 = rows[half + 1], *r2 = rows[half + 2], *r3 = rows[half + 3], *r4 = rows[half + 4],
                  *r5 = rows[half + 5], *r6 = rows[half + 6], *r7 = rows[half + 7];
      __m512 a0 = d[half], a1 = d[half + 1], a2 = d[half + 2], a3 = d[half + 3], a4 = d[half + 4],
             a5 = d[half + 5], a6 = d[half + 6], a7 = d[half + 7];
      for (int64_t j = 0; j < W; j += 16) {
        const __mmask16 m = lanes_upto(W - j);
        const __m512 qv = _mm512_maskz_loadu_ps(m, qh + j);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r0 + j), qv, a0);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r1 + j), qv, a1);
        a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r2 + j), qv, a2);
        a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r3 + j), qv, a3);
        a4 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r4 + j), qv, a4);
        a5 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r5 + j), qv, a5);
        a6 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r6 + j), qv, a6);
        a7 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r7 + j), qv, a7);
      }
      d[half] = a0, d[half + 1] = a1, d[half + 2] = a2, d[half + 3] = a3, d[half + 4] = a4, d[half + 5] = a5,
      d[half + 6] = a6, d[half + 7] = a7;
    }
    __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(order, sum16(d)), _mm512_set1_ps(P.scale));
    sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(NEG_INF), sc);
    const float top = std::max(s.m[h], _mm512_reduce_max_ps(sc));
    if (top > s.m[h]) {  // a new maximum: rescale (the first group: l and acc are 0, exp(-inf) is 0)
      const float c = std::exp(s.m[h] - top);
      s.l[h] *= c;
      const __m512 cv = _mm512_set1_ps(c);
      float* acc = s.acc + h * V;
      for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 m = lanes_upto(V - j);
        _mm512_mask_storeu_ps(acc + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + j), cv));
      }
      s.m[h] = top;
    }
    const __m512 e = _mm512_maskz_mov_ps(live, hz::exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(top))));
    s.l[h] += _mm512_reduce_add_ps(e);
    _mm512_storeu_ps(probs + h * 16, e);
  }
  // acc[h] += sum_i probs[h, i] * row_i[:V]: each row vector loaded once for all heads
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = lanes_upto(V - j);
    __m512 r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(m, rows[i] + j);
    for (int64_t h = 0; h < H; ++h) {
      float* acc = s.acc + h * V + j;
      const float* p = probs + h * 16;
      __m512 a = _mm512_maskz_loadu_ps(m, acc);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) a = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), r[i], a);
      _mm512_mask_storeu_ps(acc, m, a);
    }
  }
}

// probs: scratch of H * 16; zeros: a row of W zeros (both the calling thread's, kept across its chunks)
HZ_AVX512 void chunk_avx512(const Problem& P, int64_t b, int64_t i0, int64_t i1, int64_t len, const float* q,
                            Partial s, std::vector<float>& probs, const std::vector<float>& zeros) {
  static const __m512i order = tree_order();
  for_each_group<16>(P, b, i0, i1, len, zeros.data(),
                     [&](const float* const* rows, int n, const float* const* ahead, int n_ahead) {
                       group_avx512(P, rows, n, ahead, n_ahead, q, s, order, probs.data());
                     });
}

// The AVX2 path (AVX2 and FMA without AVX-512): group_avx512's plan on 8 lanes, 8 rows a group. Before it such
// CPUs ran the portable row-at-a-time code compiled for AVX2, whose scalar exponentials and per-row softmax
// made it slower than the PyTorch reference at long contexts (16 sequences x 2,048 sparse picks: 8.3 ms against
// the reference's 5.8, compiled; the AVX-512 kernel 1.7; a Xeon with HORIZON_AVX512=0).
#define HZ_AVX2 __attribute__((target("avx2,fma")))

// 8 vectors -> one vector whose lane i holds v[i]'s horizontal sum: two rounds of pairwise adds within 128-bit
// halves, then the halves of the two results added.
HZ_AVX2 inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // [0 1 2 3 | 0 1 2 3]
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // [4 5 6 7 | 4 5 6 7]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

HZ_AVX2 inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// One group of 8 rows, the first n of them visible (as group_avx512).
HZ_AVX2 void group_avx2(const Problem& P, const float* const* rows, int n, const float* const* ahead, int n_ahead,
                        const float* q, Partial s, float* probs /* [H, 8] */) {
  const int64_t W = P.W, V = P.V, H = P.H;
  const __m256 live = _mm256_castsi256_ps(hz::lanes_below(n));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = h; i < n_ahead; i += H)  // spread over the heads: a few rows each
      for (int64_t b = 0; b < W * 4; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead[i]) + b, _MM_HINT_T0);
    const float* qh = q + h * W;
    const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3], *r4 = rows[4], *r5 = rows[5],
                *r6 = rows[6], *r7 = rows[7];
    __m256 d[8];
    for (int i = 0; i < 8; ++i) d[i] = _mm256_setzero_ps();
    // whole vectors, then a masked tail (masked loads cost more than plain ones, on AMD cores especially)
    int64_t j = 0;
    for (; j + 8 <= W; j += 8) {
      const __m256 qv = _mm256_loadu_ps(qh + j);
      d[0] = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + j), qv, d[0]);
      d[1] = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + j), qv, d[1]);
      d[2] = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + j), qv, d[2]);
      d[3] = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + j), qv, d[3]);
      d[4] = _mm256_fmadd_ps(_mm256_loadu_ps(r4 + j), qv, d[4]);
      d[5] = _mm256_fmadd_ps(_mm256_loadu_ps(r5 + j), qv, d[5]);
      d[6] = _mm256_fmadd_ps(_mm256_loadu_ps(r6 + j), qv, d[6]);
      d[7] = _mm256_fmadd_ps(_mm256_loadu_ps(r7 + j), qv, d[7]);
    }
    if (j < W) {
      const __m256i m = hz::lanes_below(W - j);
      const __m256 qv = _mm256_maskload_ps(qh + j, m);
      for (int i = 0; i < 8; ++i) d[i] = _mm256_fmadd_ps(_mm256_maskload_ps(rows[i] + j, m), qv, d[i]);
    }
    __m256 sc = _mm256_mul_ps(sum8(d), _mm256_set1_ps(P.scale));
    sc = _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), sc, live);
    const float top = std::max(s.m[h], hmax8(sc));
    if (top > s.m[h]) {  // a new maximum: rescale (the first group: l and acc are 0, exp(-inf) is 0)
      const float c = std::exp(s.m[h] - top);
      s.l[h] *= c;
      const __m256 cv = _mm256_set1_ps(c);
      float* acc = s.acc + h * V;
      for (int64_t j = 0; j < V; j += 8) {
        const __m256i m = hz::lanes_below(V - j);
        _mm256_maskstore_ps(acc + j, m, _mm256_mul_ps(_mm256_maskload_ps(acc + j, m), cv));
      }
      s.m[h] = top;
    }
    const __m256 e = _mm256_and_ps(live, hz::exp_nonpositive(_mm256_sub_ps(sc, _mm256_set1_ps(top))));
    s.l[h] += hz::hsum8(e);
    _mm256_storeu_ps(probs + h * 8, e);
  }
  // acc[h] += sum_i probs[h, i] * row_i[:V]: each row vector loaded once for all heads
  for (int64_t j = 0; j < V; j += 8) {
    const __m256i m = hz::lanes_below(V - j);
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_maskload_ps(rows[i] + j, m);
    for (int64_t h = 0; h < H; ++h) {
      float* acc = s.acc + h * V + j;
      const float* p = probs + h * 8;
      __m256 a = _mm256_maskload_ps(acc, m);
      for (int i = 0; i < 8; ++i) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i), r[i], a);
      _mm256_maskstore_ps(acc, m, a);
    }
  }
}

HZ_AVX2 void chunk_avx2(const Problem& P, int64_t b, int64_t i0, int64_t i1, int64_t len, const float* q, Partial s,
                        std::vector<float>& probs, const std::vector<float>& zeros) {
  for_each_group<8>(P, b, i0, i1, len, zeros.data(),
                    [&](const float* const* rows, int n, const float* const* ahead, int n_ahead) {
                      group_avx2(P, rows, n, ahead, n_ahead, q, s, probs.data());
                    });
}
#else
bool cpu_has_avx512f() { return false; }
#endif

at::Tensor latent_attention_paged(const at::Tensor& pool, const at::Tensor& table, const at::Tensor& q,
                                  const at::Tensor& lens, const c10::optional<at::Tensor>& idx, int64_t L,
                                  int64_t block_size, double scale, int64_t v_width, bool force_portable) {
  TORCH_CHECK(pool.dim() == 2 && pool.scalar_type() == at::kFloat && pool.is_contiguous(),
              "latent_attention_paged: pool must be contiguous fp32 [R, W]");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong,
              "latent_attention_paged: table must be int64 [B, nb]");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(0) == table.size(0) && q.size(2) == pool.size(1),
              "latent_attention_paged: q must be fp32 [B, H, W] with the table's B and the pool's W");
  TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == at::kLong && lens.size(0) == q.size(0),
              "latent_attention_paged: lens must be int64 [B]");
  TORCH_CHECK(v_width >= 0 && v_width <= pool.size(1), "latent_attention_paged: v_width must be within [0, W]");
  TORCH_CHECK(block_size >= 1 && L >= 0, "latent_attention_paged: block_size must be >= 1 and L >= 0");
  const bool sparse = idx.has_value() && idx->defined();
  if (sparse)
    TORCH_CHECK(idx->dim() == 2 && idx->scalar_type() == at::kLong && idx->size(0) == q.size(0),
                "latent_attention_paged: idx must be int64 [B, k]");
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), V = v_width;
  auto out = at::zeros({B, H, V}, pool.options());
  const at::Tensor qc = q.contiguous(), tc = table.contiguous(), lc = lens.contiguous();
  const at::Tensor ic = sparse ? idx->contiguous() : at::Tensor();
  Problem P{pool.data_ptr<float>(), pool.size(0), W, V, H, block_size, tc.size(1), tc.data_ptr<int64_t>(),
            sparse ? ic.data_ptr<int64_t>() : nullptr, sparse ? ic.size(1) : L, static_cast<float>(scale)};
  if (B == 0 || H == 0 || P.n == 0) return out;
  const int64_t chunks = (P.n + CHUNK - 1) / CHUNK, items = B * chunks;
  std::vector<float> m(items * H, NEG_INF), l(items * H, 0.0f), acc(items * H * V, 0.0f);
  const float* Q = qc.data_ptr<float>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const bool avx512 = !force_portable && cpu_has_avx512f();
#ifdef HZ_X86
  const bool avx2 = !force_portable && !avx512 && hz::cpu_has_avx2();
#else
  const bool avx2 = false;
#endif
  at::parallel_for(0, items, 1, [&](int64_t t0, int64_t t1) {
    const bool vector = avx512 || avx2;  // probs: scratch of H x a group's rows; zeros: a group's missing rows
    std::vector<float> probs(vector ? H * 16 : 0), zeros(vector ? W : 0, 0.0f);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, i0 = (t % chunks) * CHUNK, i1 = std::min(P.n, i0 + CHUNK);
      const Partial s{m.data() + t * H, l.data() + t * H, acc.data() + t * H * V};
#ifdef HZ_X86
      if (avx512) {
        chunk_avx512(P, b, i0, i1, lp[b], Q + b * H * W, s, probs, zeros);
        continue;
      }
      if (avx2) {
        chunk_avx2(P, b, i0, i1, lp[b], Q + b * H * W, s, probs, zeros);
        continue;
      }
#endif
      chunk_portable(P, b, i0, i1, lp[b], Q + b * H * W, s);
    }
  });
  // merge each sequence's chunks: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
  float* O = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      float top = NEG_INF;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, m[(b * chunks + c) * H + h]);
      if (top == NEG_INF) continue;  // nothing visible: zeros
      float total = 0.0f;
      float* o = O + (b * H + h) * V;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t = b * chunks + c;
        if (m[t * H + h] == NEG_INF) continue;
        const float w = std::exp(m[t * H + h] - top);
        total += w * l[t * H + h];
        const float* a = acc.data() + (t * H + h) * V;
        for (int64_t j = 0; j < V; ++j) o[j] += w * a[j];
      }
      const float inv = 1.0f / total;
      for (int64_t j = 0; j < V; ++j) o[j] *= inv;
    }
  return out;
}

}  // namespace

// A CPU kernel with a fake registered from Python (horizon.quant.kernels), so compiled decode graphs call it
// directly; L is a SymInt (the context length, dynamic in a graph).
TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("latent_attention_paged(Tensor pool, Tensor table, Tensor q, Tensor lens, Tensor? idx, SymInt L, "
        "int block_size, float scale, int v_width, bool force_portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("latent_attention_paged", &latent_attention_paged); }

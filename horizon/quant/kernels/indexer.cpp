// The lightning indexer's decode scores read in place from the paged cache (horizon.model.dsa).
//
//   out[b, p] = sum_h w[b, h] * relu(K[row(b, p)] . q[b, h])      for p < L
//   row(b, p) = table[b, p / block_size] * block_size + p % block_size
//
// pool: the layer's indexer keys, fp32 [R, d] (the paged pool: R = blocks x block_size rows); table: int64
// [B, nb], each sequence's block ids (-1: unassigned, scored 0: only positions past a sequence's end are
// unassigned, and the caller masks those); q: fp32 [B, H, d]; w: fp32 [B, H] (scales already applied).
//
// Why a kernel: the PyTorch reference gathers every key row of the context into a new [B, L, d] tensor and
// then runs a skinny matmul over it, reading the keys' bytes three times (gather read, gather write, matmul
// read) at a fraction of the memory bandwidth; at long contexts that is most of a decode step (64K tokens:
// 16 MB of keys per DSA layer at `small`). Here each block of 64 rows is read once, where it lies.
//
// Layout of the work: parallel over (sequence, block) pairs (at::parallel_for); per row, the heads sit in
// the vector lanes (q transposed to [d, H]) and each key element is broadcast once, so there is no
// horizontal sum per head; four independent accumulators break the FMA dependency chain.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "simd.h"
#define HZ_X86 1
#endif

namespace {

// One row's score: heads in lanes, any H (the portable path, and the reference for the vector ones).
__attribute__((always_inline)) inline float row_score_portable(const float* key, const float* qt, const float* w,
                                                              int64_t d, int64_t H, float* acc) {
  std::fill(acc, acc + H, 0.0f);
  for (int64_t j = 0; j < d; ++j) {
    const float kj = key[j];
    const float* qj = qt + j * H;
    for (int64_t h = 0; h < H; ++h) acc[h] += kj * qj[h];
  }
  float s = 0.0f;
  for (int64_t h = 0; h < H; ++h) s += w[h] * std::max(acc[h], 0.0f);
  return s;
}

// SSE2 at most (the kernels are built without -march).
void rows_portable(const float* keys, int64_t n, const float* qt, const float* w, int64_t d, int64_t H,
                   float* out) {
  std::vector<float> acc(H);
  for (int64_t r = 0; r < n; ++r) out[r] = row_score_portable(keys + r * d, qt, w, d, H, acc.data());
}

// `ahead` (or nullptr): the next block's keys, fetched into the cache a row for each row scored here (rows read
// in place cross page boundaries from block to block, where the hardware prefetcher stops).
inline void prefetch_row(const float* ahead, int64_t r, int64_t d) {
  if (!ahead) return;
  const char* p = reinterpret_cast<const char*>(ahead + r * d);
  for (int64_t b = 0; b < d * 4; b += 64) __builtin_prefetch(p + b, 0, 3);
}

#ifdef HZ_X86
#define HZ_AVX2 __attribute__((target("avx2,fma")))

// q's 8 lanes of heads at p (masked: a last chunk of fewer, the lanes past it zero; masked loads cost more than
// plain ones, on AMD cores especially, so full chunks take plain ones).
template <bool kMasked>
HZ_AVX2 inline __m256 load_heads(const float* p, __m256i m) {
  if constexpr (kMasked) return _mm256_maskload_ps(p, m);
  return _mm256_loadu_ps(p);
}

// Rows k0 and k1 against the 8 heads from h0 (lanes m), their relu'd scores weighted into total0 / total1.
template <bool kMasked>
HZ_AVX2 inline void head_chunk(const float* k0, const float* k1, const float* qt, const float* w, int64_t d,
                               int64_t H, int64_t h0, __m256i m, __m256& total0, __m256& total1) {
  const __m256 zero = _mm256_setzero_ps();
  const float* q = qt + h0;
  __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, b0 = zero, b1 = zero, b2 = zero, b3 = zero;
  int64_t j = 0;
  for (; j + 4 <= d; j += 4) {
    const __m256 q0 = load_heads<kMasked>(q + j * H, m), q1 = load_heads<kMasked>(q + (j + 1) * H, m),
                 q2 = load_heads<kMasked>(q + (j + 2) * H, m), q3 = load_heads<kMasked>(q + (j + 3) * H, m);
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(k0 + j), q0, a0);
    b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(k1 + j), q0, b0);
    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(k0 + j + 1), q1, a1);
    b1 = _mm256_fmadd_ps(_mm256_broadcast_ss(k1 + j + 1), q1, b1);
    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(k0 + j + 2), q2, a2);
    b2 = _mm256_fmadd_ps(_mm256_broadcast_ss(k1 + j + 2), q2, b2);
    a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(k0 + j + 3), q3, a3);
    b3 = _mm256_fmadd_ps(_mm256_broadcast_ss(k1 + j + 3), q3, b3);
  }
  for (; j < d; ++j) {
    const __m256 q0 = load_heads<kMasked>(q + j * H, m);
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(k0 + j), q0, a0);
    b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(k1 + j), q0, b0);
  }
  const __m256 wv = load_heads<kMasked>(w + h0, m);  // zero past H: those lanes add nothing
  const __m256 heads0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  const __m256 heads1 = _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3));
  total0 = _mm256_fmadd_ps(_mm256_max_ps(heads0, zero), wv, total0);
  total1 = _mm256_fmadd_ps(_mm256_max_ps(heads1, zero), wv, total1);
}

// The AVX2 path (AVX2 and FMA without AVX-512): heads in chunks of 8 lanes (the last one masked), per chunk 4
// accumulators over j mod 4, and two rows at a time, so a row's 4 chains of d / 4 dependent FMAs overlap with
// the other's (one row, as in the portable code compiled for AVX2 that it replaced, was bound by one chain's
// latency: 64K keys took 4.8 ms against 1.0 on the AVX-512 path; a Xeon with HORIZON_AVX512=0).
HZ_AVX2 void rows_avx2(const float* keys, int64_t n, const float* qt, const float* w, int64_t d, int64_t H,
                       float* out, const float* ahead) {
  const __m256i m = hz::lanes_below(H % 8);  // the last chunk's lanes
  for (int64_t r = 0; r < n; r += 2) {
    prefetch_row(ahead, r, d);
    prefetch_row(ahead, r + 1, d);
    const float* k0 = keys + r * d;
    const float* k1 = r + 1 < n ? k0 + d : k0;  // an odd last row: scored twice, kept once
    __m256 total0 = _mm256_setzero_ps(), total1 = _mm256_setzero_ps();
    int64_t h0 = 0;
    for (; h0 + 8 <= H; h0 += 8) head_chunk<false>(k0, k1, qt, w, d, H, h0, m, total0, total1);
    if (h0 < H) head_chunk<true>(k0, k1, qt, w, d, H, h0, m, total0, total1);
    out[r] = hz::hsum8(total0);
    if (r + 1 < n) out[r + 1] = hz::hsum8(total1);
  }
}
#endif

#ifdef HZ_X86
#define HZ_AVX512 __attribute__((target("avx512f")))

bool cpu_has_avx512f() {
  return hz::cpu_has_avx512();
}

// Heads in chunks of 16 lanes (the last one masked); per chunk, 4 accumulators over j mod 4.
HZ_AVX512 void rows_avx512(const float* keys, int64_t n, const float* qt, const float* w, int64_t d,
                           int64_t H, float* out, const float* ahead) {
  for (int64_t r = 0; r < n; ++r) {
    prefetch_row(ahead, r, d);
    const float* key = keys + r * d;
    __m512 total = _mm512_setzero_ps();
    for (int64_t h0 = 0; h0 < H; h0 += 16) {
      const int64_t lanes = std::min<int64_t>(16, H - h0);
      const __mmask16 m = static_cast<__mmask16>((1u << lanes) - 1u);
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
             a3 = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 4 <= d; j += 4) {
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(key[j]), _mm512_maskz_loadu_ps(m, qt + j * H + h0), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(key[j + 1]), _mm512_maskz_loadu_ps(m, qt + (j + 1) * H + h0), a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(key[j + 2]), _mm512_maskz_loadu_ps(m, qt + (j + 2) * H + h0), a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(key[j + 3]), _mm512_maskz_loadu_ps(m, qt + (j + 3) * H + h0), a3);
      }
      for (; j < d; ++j)
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(key[j]), _mm512_maskz_loadu_ps(m, qt + j * H + h0), a0);
      const __m512 acc = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
      const __m512 relu = _mm512_max_ps(acc, _mm512_setzero_ps());
      total = _mm512_fmadd_ps(relu, _mm512_maskz_loadu_ps(m, w + h0), total);
    }
    out[r] = _mm512_reduce_add_ps(total);
  }
}
// H = 8 (the small presets' indexer): eight heads fill only half of a 16-lane vector, so the lanes hold
// (head, j parity) pairs instead: lane 2h accumulates head h over even j, lane 2h + 1 over odd j. One 8-byte
// broadcast puts key[j], key[j + 1] in every pair of lanes, so a step of two j's is one FMA with no idle
// lane, and two rows share each load of q (qp: [d / 2, 16], built by the caller). d must be even.
HZ_AVX512 inline float finish_h8(__m512 acc, __m512 w_even) {
  // lane 2h + lane 2h + 1 = head h's score; relu, weight (w_even is zero on odd lanes), sum
  const __m512 heads = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));
  return _mm512_reduce_add_ps(_mm512_mul_ps(_mm512_max_ps(heads, _mm512_setzero_ps()), w_even));
}

HZ_AVX512 void rows_avx512_h8(const float* keys, int64_t n, const float* qp, const float* w, int64_t d,
                              float* out, const float* ahead) {
  alignas(64) float we[16];
  for (int h = 0; h < 8; ++h) {
    we[2 * h] = w[h];
    we[2 * h + 1] = 0.0f;
  }
  const __m512 w_even = _mm512_load_ps(we);
  const int64_t steps = d / 2;
  int64_t r = 0;
  for (; r + 2 <= n; r += 2) {
    prefetch_row(ahead, r, d);
    prefetch_row(ahead, r + 1, d);
    const double* k0 = reinterpret_cast<const double*>(keys + r * d);
    const double* k1 = reinterpret_cast<const double*>(keys + (r + 1) * d);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    int64_t m = 0;
    for (; m + 2 <= steps; m += 2) {
      const __m512 q0 = _mm512_loadu_ps(qp + m * 16), q1 = _mm512_loadu_ps(qp + (m + 1) * 16);
      a0 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k0[m])), q0, a0);
      b0 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k1[m])), q0, b0);
      a1 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k0[m + 1])), q1, a1);
      b1 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k1[m + 1])), q1, b1);
    }
    for (; m < steps; ++m) {
      const __m512 q0 = _mm512_loadu_ps(qp + m * 16);
      a0 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k0[m])), q0, a0);
      b0 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k1[m])), q0, b0);
    }
    out[r] = finish_h8(_mm512_add_ps(a0, a1), w_even);
    out[r + 1] = finish_h8(_mm512_add_ps(b0, b1), w_even);
  }
  for (; r < n; ++r) {
    const double* k0 = reinterpret_cast<const double*>(keys + r * d);
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t m = 0; m < steps; ++m)
      a0 = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(k0[m])), _mm512_loadu_ps(qp + m * 16), a0);
    out[r] = finish_h8(a0, w_even);
  }
}
#else
bool cpu_has_avx512f() { return false; }
void rows_avx512(const float* keys, int64_t n, const float* qt, const float* w, int64_t d, int64_t H,
                 float* out, const float*) {
  rows_portable(keys, n, qt, w, d, H, out);
}
#endif

at::Tensor index_scores_paged(const at::Tensor& pool, const at::Tensor& table, const at::Tensor& q,
                              const at::Tensor& w, int64_t L, int64_t block_size, bool force_portable) {
  TORCH_CHECK(pool.dim() == 2 && pool.scalar_type() == at::kFloat && pool.is_contiguous(),
              "index_scores_paged: pool must be contiguous fp32 [R, d]");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong, "index_scores_paged: table must be int64 [B, nb]");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(0) == table.size(0) && q.size(2) == pool.size(1),
              "index_scores_paged: q must be fp32 [B, H, d] with the table's B and the pool's d");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) == q.size(0) && w.size(1) == q.size(1),
              "index_scores_paged: w must be fp32 [B, H]");
  TORCH_CHECK(block_size >= 1 && L >= 0 && L <= table.size(1) * block_size,
              "index_scores_paged: L must be within the table's blocks");
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2), R = pool.size(0);
  const int64_t nblk = (L + block_size - 1) / block_size;
  auto out = at::empty({B, L}, pool.options());
  if (B == 0 || L == 0) return out;
  const at::Tensor qt = q.transpose(1, 2).contiguous();  // [B, d, H]: heads in the lanes
  const at::Tensor wc = w.contiguous();
  const at::Tensor tc = table.contiguous();
  const float* P = pool.data_ptr<float>();
  const float* Q = qt.data_ptr<float>();
  const float* W = wc.data_ptr<float>();
  const int64_t* T = tc.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const int64_t nb_table = tc.size(1);
  const bool avx512 = !force_portable && cpu_has_avx512f();
#ifdef HZ_X86
  const bool avx2 = !force_portable && !avx512 && hz::cpu_has_avx2();
#endif
#ifdef HZ_X86
  // eight heads: q in (head, j parity) lane pairs, [B, d / 2, 16] (rows_avx512_h8)
  const bool h8 = avx512 && H == 8 && d % 2 == 0;
  const at::Tensor qp = h8 ? q.view({B, 8, d / 2, 2}).permute({0, 2, 1, 3}).contiguous() : at::Tensor();
  const float* QP = h8 ? qp.data_ptr<float>() : nullptr;
#else
  const bool h8 = false;
  const float* QP = nullptr;
#endif
  // a grain of ~2K rows: a short context's few blocks stay on one thread (waking a second costs more)
  const int64_t grain = std::max<int64_t>(1, 2048 / block_size);
  at::parallel_for(0, B * nblk, grain, [&](int64_t i0, int64_t i1) {
    // the keys of this thread's item j, if it has one and its block is assigned (else nullptr)
    auto next_block = [&](int64_t j, int64_t end) -> const float* {
      if (j >= end) return nullptr;
      const int64_t id = T[(j / nblk) * nb_table + j % nblk];
      return id < 0 || (id + 1) * block_size > R ? nullptr : P + id * block_size * d;
    };
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nblk, blk = i % nblk, p0 = blk * block_size;
      const int64_t n = std::min(block_size, L - p0);
      const int64_t id = T[b * nb_table + blk];
      float* o = O + b * L + p0;
      if (id < 0 || (id + 1) * block_size > R) {  // unassigned (past the sequence's end): masked by the caller
        std::fill(o, o + n, 0.0f);
        continue;
      }
      const float* keys = P + id * block_size * d;
#ifdef HZ_X86
      if (h8) {
        rows_avx512_h8(keys, n, QP + b * d * H, W + b * H, d, o, next_block(i + 1, i1));
        continue;
      }
#endif
      if (avx512) {
        rows_avx512(keys, n, Q + b * d * H, W + b * H, d, H, o, next_block(i + 1, i1));
        continue;
      }
#ifdef HZ_X86
      if (avx2) {
        rows_avx2(keys, n, Q + b * d * H, W + b * H, d, H, o, next_block(i + 1, i1));
        continue;
      }
#endif
      rows_portable(keys, n, Q + b * d * H, W + b * H, d, H, o);
    }
  });
  return out;
}

}  // namespace

// A CPU kernel (not a catch-all): torch.compile then takes the fake (shape) function registered from Python
// with the build, and a compiled graph calls this op directly. L is a SymInt: in a graph it is the
// context length, a dynamic size (an `int` would specialise the graph to one length).
TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("index_scores_paged(Tensor pool, Tensor table, Tensor q, Tensor w, SymInt L, int block_size, "
        "bool force_portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("index_scores_paged", &index_scores_paged); }

// A few rows of activations against full-width weights: out[m, n] = sum_k x[m, k] * W_{expert[m]}[n, k].
//
// W: fp32, bf16 or int8, [E, N, K] with expert ids [M] in [0, E), or one matrix [N, K] without ids (a
// linear layer); int8 is taken raw (the caller applies its per-row scales). x: float [M, K]. Accumulation
// is fp32; the result is fp32 [M, N].
//
// Why: a batched decode step multiplies 2-64 rows by each weight matrix. PyTorch's CPU sgemm (MKL and
// inductor's C++ GEMM template alike) streams a cold [32768, 512] fp32 matrix at ~6-9 GB/s for 16 rows on
// this project's 2-core machine, a third of what the memory gives, and the routed experts' fallback reads
// an expert once per token routed to it. Here each weight row is read from memory once per call and
// applied to every row of x that needs it while it sits in L1, so the call runs near memory speed.
//
// Layout of the work (as mxfp4.cpp, whose row grouping this shares through grouping.h):
// - rows of x grouped by expert on the host (a counting sort), so an expert nobody routes to is not read;
// - parallel over output rows N (at::parallel_for), every chunk doing the same work for every expert;
// - per group, tiles of R <= 4 rows of x against NT consecutive weight rows, R * NT accumulators in
//   registers (enough independent FMA chains to hide their latency), the weights widened to fp32 in
//   registers (bf16: a 16-bit shift; int8: a sign extension and a convert; both exact);
// - AVX-512 when the CPU has it and K is a multiple of 16, else AVX2 (part_avx2: the same plan on 8 lanes)
//   when K is a multiple of 8, else portable C++ (the same sums in another order);
// - bf16 x against bf16 weights on AMX tiles where the CPU has them (run_amx below): the FMA path widens
//   every weight to fp32 and is bound by its FMAs from 8-16 rows of x on, AMX is not.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "grouping.h"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define HZ_ROWS_AVX512 1
#include <immintrin.h>

#include "simd.h"
#define HZ_AVX512F __attribute__((target("avx512f")))
#else
#define HZ_ROWS_AVX512 0
#endif

namespace {

// rows of x per register tile: 4 rows x 6 weight rows (24 accumulators) ran 55-60 GFMA/s on 16 rows of
// cold fp32 weights on a Zen 4 (K = 512), where 8 x 2 ran 48-50, and at K = 2048 45 against 31 (8 rows of
// x no longer fit L1 beside the weights); groups of more rows take several passes over an L1 slice
constexpr int kMaxRows = 4;
// x's rows (fp32) that tile_passes keeps in L1 at most
constexpr int64_t kPassesBytes = 32 * 1024;

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}
template <>
inline float widen<c10::BFloat16>(c10::BFloat16 v) {
  return static_cast<float>(v);
}

template <typename T>
struct Work {
  const T* w;              // [E, N, K]
  int64_t N, K;
  const float* xg;         // [M, K], rows in group order
  const int64_t* row_of;   // grouped position -> row of out
  float* out;              // [M, N]
  const std::vector<hz::Group>* groups;
  const T* row(int64_t e, int64_t n) const { return w + (e * N + n) * K; }
};

template <typename T>
void part_portable(const Work<T>& p, int64_t n0, int64_t n1) {
  std::vector<float> wrow(p.K);
  for (const hz::Group& g : *p.groups) {
    for (int64_t n = n0; n < n1; ++n) {
      const T* src = p.row(g.expert, n);
      for (int64_t k = 0; k < p.K; ++k) wrow[k] = widen(src[k]);
      for (int64_t i = 0; i < g.count; ++i) {
        const float* x = p.xg + (g.start + i) * p.K;
        float acc[16] = {0.0f};
        int64_t k = 0;
        for (; k + 16 <= p.K; k += 16)
          for (int j = 0; j < 16; ++j) acc[j] += x[k + j] * wrow[k + j];
        float s = 0.0f;
        for (; k < p.K; ++k) s += x[k] * wrow[k];
        for (int j = 0; j < 16; ++j) s += acc[j];
        p.out[p.row_of[g.start + i] * p.N + n] = s;
      }
    }
  }
}

#if HZ_ROWS_AVX512

bool rows_cpu_has_avx512() {
  return hz::cpu_has_avx512();
}

// 16 consecutive weights widened to fp32.
HZ_AVX512F inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
HZ_AVX512F inline __m512 load16(const c10::BFloat16* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));  // bf16 is the top half of an fp32
}
HZ_AVX512F inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The 16 lanes of each of 16 vectors summed, lane i of the result holding a[i]'s sum: a transposing tree of
// 15 adds and 30 shuffles, where 16 separate reductions take 64 of each (with it, 4-14% less time for 4 and
// 16 rows of x against warm fp32 [512 | 1024 | 32768, 512] weights; a Xeon, 2 threads, interleaved A/B).
HZ_AVX512F inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // 32-bit pairs: b[j] = lanes of a[2j] and a[2j+1] interleaved, pairwise summed
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // 64-bit pairs: per 128-bit lane, one partial sum of each of 4 vectors
    const __m512d lo = _mm512_castps_pd(b[2 * j]), hi = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int j = 0; j < 2; ++j)  // 128-bit lanes: even and odd lanes of two vectors
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// res[i] = the sum of acc[i]'s lanes, i < n, in groups of 16 through sum_lanes16 (a group padded with zero
// vectors). Every sum, a tail tile's single one too, goes through the same tree, which adds every vector's
// lanes in the same order whatever its position: a row's result never depends on the tile its batch puts it
// in (batched == alone, bit for bit; _mm512_reduce_add_ps adds in another order).
template <int n>
HZ_AVX512F inline void store_sums(const __m512* acc, float* res) {
  for (int g = 0; g < n; g += 16) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = g + i < n ? acc[g + i] : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes16(a));
    for (int i = 0; i < 16 && g + i < n; ++i) res[g + i] = sums[i];
  }
}

// Which weights a tile fetches ahead for the next L1 slice: the same NT rows `ahead` (nullptr: none) at
// every `passes`-th cache line from line `phase`, so a slice's passes between them fetch the next slice
// once, into L2, while they compute (see part_avx512). In tile_passes (Fetch other than kNextTile): this is
// pass `phase` of `passes`, and the rows are the next tile's.
struct Ahead {
  const void* rows = nullptr;
  int64_t phase = 0, passes = 1;
};

// What a tile prefetches: the next tile's rows into L1 as it goes (and `Ahead`'s slice into L2); or, in
// tile_passes, where every pass over a tile runs at once, the next tile into L2 spread over the passes (pass p
// fetches its rows p, p + passes, ...: all of them in one pass would queue more misses at once than a core
// keeps in flight) and, in the first pass, each row 1 KB ahead into L1.
enum class Fetch { kNextTile, kFirstPass, kLaterPass };
constexpr int64_t kRowAheadBytes = 1024;

// R rows of x against NT consecutive weight rows (stride K), results into res[R][NT].
template <typename T, int R, int NT, Fetch F = Fetch::kNextTile>
HZ_AVX512F void tile(const T* w, const float* x, int64_t K, float* res, Ahead ahead = {}) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const T* next = static_cast<const T*>(ahead.rows);
  // line % passes == phase, counted down (a division per step would cost as much as its FMAs)
  for (int64_t k = 0, countdown = ahead.phase; k < K; k += 16, countdown = countdown ? countdown - 1 : ahead.passes - 1) {
    __m512 wv[NT];
    const bool fetch = next != nullptr && countdown == 0;
    for (int t = 0; t < NT; ++t) {
      // the next tile's rows, one cache line per row and step: with several rows of x the FMAs take long
      // enough that the hardware prefetcher alone leaves the loads waiting on memory (measured: 7 GB/s)
      if constexpr (F == Fetch::kNextTile) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (NT + t) * K + k), _MM_HINT_T0);
        if (fetch) _mm_prefetch(reinterpret_cast<const char*>(next + t * K + k), _MM_HINT_T1);
      } else if constexpr (F == Fetch::kFirstPass) {
        _mm_prefetch(reinterpret_cast<const char*>(w + t * K + k) + kRowAheadBytes, _MM_HINT_T0);
      }
      wv[t] = load16(w + t * K + k);
    }
    if constexpr (F != Fetch::kNextTile)
      for (int64_t t = ahead.phase; t < NT; t += ahead.passes)
        _mm_prefetch(reinterpret_cast<const char*>(w + (NT + t) * K + k), _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(xv, wv[t], acc[r][t]);
    }
  }
  store_sums<R * NT>(&acc[0][0], res);
}

// Weight rows per tile for R rows of x: R * NT <= 16 accumulators (of 32 registers), enough independent
// FMA chains, and one sum_lanes16 for the tile's sums. 4 x 4 against 4 x 6 (on a Xeon, 2 threads, one
// process, interleaved): 16 rows x a [32768 x 512] fp32 matrix 4.67 against 4.90 ms cold, 4.01 against 4.20
// warm; 16 rows x [512 x 512] 90 against 95 us cold.
template <int R>
constexpr int tile_rows() {
  return R <= 2 ? 8 : 4;
}

// Rows n0..n1 of expert e's matrix; `next` / `next_rows`: the rows the next slice starts with (and how
// many), fetched ahead as `ahead` says (phase, passes).
template <typename T, int R>
HZ_AVX512F void rows_block(const Work<T>& p, int64_t e, const float* x, const int64_t* rows, int64_t n0,
                           int64_t n1, const T* next, int64_t next_rows, Ahead ahead) {
  constexpr int NT = tile_rows<R>();
  float res[R * NT];
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    ahead.rows = next != nullptr && n - n0 + NT <= next_rows ? next + (n - n0) * p.K : nullptr;
    tile<T, R, NT>(p.row(e, n), x, p.K, res, ahead);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) p.out[rows[r] * p.N + n + t] = res[r * NT + t];
  }
  for (; n < n1; ++n) {
    tile<T, R, 1>(p.row(e, n), x, p.K, res);
    for (int r = 0; r < R; ++r) p.out[rows[r] * p.N + n] = res[r];
  }
}

// R rows of x (R <= kMaxRows, known at run time) against one tile of NT weight rows.
template <typename T, int NT, Fetch F>
HZ_AVX512F void tile_r(int R, const T* w, const float* x, int64_t K, float* res, Ahead ahead = {}) {
  switch (R) {
    case 1: return tile<T, 1, NT, F>(w, x, K, res, ahead);
    case 2: return tile<T, 2, NT, F>(w, x, K, res, ahead);
    case 3: return tile<T, 3, NT, F>(w, x, K, res, ahead);
    default: return tile<T, 4, NT, F>(w, x, K, res, ahead);
  }
}

// A group of more than kMaxRows rows of x whose rows all fit L1 beside a tile: per tile of NT weight rows, every
// pass of kMaxRows rows of x at once, the first streaming the weights from memory and fetching ahead, the later
// ones reading them from L1. The same sums in the same order as slices of L1's size with passes between them
// (part_avx512's other path), faster: on a Xeon, 2 threads, cold fp32 weights, interleaved, [1024 x 512] with
// 5 / 8 / 12 / 16 rows 83 / 87 / 100 / 116 us against 117 / 115 / 106 / 132, [32768 x 512] with 8 and 16
// rows 2.47 and 3.48 ms against 3.40 and 4.04; int8 [1024 x 512] 1.11-1.12x at 5-16 rows. Spreading the
// next tile's fetch over the passes (`tile`) then gained 1.05-1.17x at 8-16 rows (none at 5, two passes).
// Covers whole tiles only: returns the first weight row it left (fewer than NT), which part_avx512 finishes.
template <typename T>
HZ_AVX512F int64_t tile_passes(const Work<T>& p, const hz::Group& g, int64_t n0, int64_t n1) {
  constexpr int NT = 4;
  float res[kMaxRows * NT];
  const float* x = p.xg + g.start * p.K;
  const int64_t* rows = p.row_of + g.start;
  const int64_t passes = (g.count + kMaxRows - 1) / kMaxRows;
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    const T* w = p.row(g.expert, n);
    for (int64_t r0 = 0, pass = 0; r0 < g.count; r0 += kMaxRows, ++pass) {
      const int R = static_cast<int>(std::min<int64_t>(kMaxRows, g.count - r0));
      const Ahead ahead{nullptr, pass, passes};  // the rows are w's next tile (`tile`, F != kNextTile)
      if (pass == 0) {
        tile_r<T, NT, Fetch::kFirstPass>(R, w, x + r0 * p.K, p.K, res, ahead);
      } else {
        tile_r<T, NT, Fetch::kLaterPass>(R, w, x + r0 * p.K, p.K, res, ahead);
      }
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) p.out[rows[r0 + r] * p.N + n + t] = res[r * NT + t];
    }
  }
  return n;
}

template <typename T>
HZ_AVX512F void part_avx512(const Work<T>& p, int64_t n0, int64_t n1) {
  using Fn = void (*)(const Work<T>&, int64_t, const float*, const int64_t*, int64_t, int64_t, const T*, int64_t,
                      Ahead);
  static const Fn block[kMaxRows] = {rows_block<T, 1>, rows_block<T, 2>, rows_block<T, 3>, rows_block<T, 4>};
  const int64_t row_bytes = p.K * static_cast<int64_t>(sizeof(float));
  for (const hz::Group& g : *p.groups) {
    // x's rows fit L1: whole tiles with every pass at once, the last few weight rows below
    const int64_t from = g.count > kMaxRows && g.count * row_bytes <= kPassesBytes ? tile_passes(p, g, n0, n1) : n0;
    // More than kMaxRows rows of x: weight rows in slices of about L1's 32 KB (of fp32), each read from
    // memory once and from L1 by the group's later row tiles; a whole number of every pass's tiles
    // (tile_rows: 4, or 8 for a last pass of 1-2 rows of x), so no slice ends in single-row tiles. One
    // pass: no slices. While a slice's passes compute, they fetch the next slice into L2, each pass a
    // share of its cache lines: a slice's first pass then reads L2, not memory, and the memory traffic
    // overlaps the FMAs instead of adding to them (fetched only by the first pass, it did not).
    const int64_t last = g.count % kMaxRows;
    const int64_t unit = last == 1 || last == 2 ? 8 : 4;
    const int64_t slice = g.count <= kMaxRows ? n1 - from : std::max(unit, (32 * 1024) / row_bytes / unit * unit);
    const int64_t passes = (g.count + kMaxRows - 1) / kMaxRows;
    for (int64_t s0 = from; s0 < n1; s0 += slice) {
      const int64_t s1 = std::min(n1, s0 + slice);
      const T* next = passes > 1 && s1 < n1 ? p.row(g.expert, s1) : nullptr;
      for (int64_t r0 = 0, pass = 0; r0 < g.count; r0 += kMaxRows, ++pass) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, g.count - r0));
        block[R - 1](p, g.expert, p.xg + (g.start + r0) * p.K, p.row_of + g.start + r0, s0, s1, next,
                     std::min(slice, n1 - s1), Ahead{nullptr, pass, passes});
      }
    }
  }
}

#else

bool rows_cpu_has_avx512() { return false; }
template <typename T>
void part_avx512(const Work<T>& p, int64_t n0, int64_t n1) {
  part_portable(p, n0, n1);
}

#endif

// AVX2 path (AVX2 and FMA without AVX-512: AMD Zen 2 and 3, Intel client cores, Haswell to Comet Lake
// servers). Without it such CPUs took the portable path, which GCC vectorises for SSE2 only (the kernels
// are built without -march): on a Zen 3 EPYC, 2 threads, 16 rows of x against fp32 [512 x 512] took ~315 us
// a call in a compiled 16-sequence step. The same plan as part_avx512 in a simpler form: tiles of R <= 4 rows
// of x against NT weight rows on 8-lane vectors (R x NT accumulators, NT weights and the FMAs' memory operand
// x within 16 registers), the next tile fetched into L1 as a tile goes, and groups of more than 4 rows in
// slices of weight rows that the later passes read from L1. Every result is one accumulator's FMAs in the
// order of K, then hsum8: a row's sum does not depend on its tile (batched == alone, bit for bit).
#if HZ_ROWS_AVX512
#define HZ_ROWS_AVX2 __attribute__((target("avx2,fma")))

bool rows_cpu_has_avx2() { return hz::cpu_has_avx2(); }

HZ_ROWS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
HZ_ROWS_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
HZ_ROWS_AVX2 inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int R>
constexpr int tile_rows_avx2() {
  return R == 1 ? 6 : R == 2 ? 4 : 3;
}

template <typename T, int R, int NT>
HZ_ROWS_AVX2 void tile_avx2(const T* w, const float* x, int64_t K, float* res) {
  constexpr int64_t kLine = 64 / sizeof(T);  // weights a cache line
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NT];
    for (int t = 0; t < NT; ++t) {
      if (k % kLine == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (NT + t) * K + k), _MM_HINT_T0);
      wv[t] = load8(w + t * K + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(xv, wv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = hz::hsum8(acc[r][t]);
}

template <typename T, int R>
HZ_ROWS_AVX2 void rows_block_avx2(const Work<T>& p, int64_t e, const float* x, const int64_t* rows, int64_t n0,
                                  int64_t n1) {
  constexpr int NT = tile_rows_avx2<R>();
  float res[R * NT];
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    tile_avx2<T, R, NT>(p.row(e, n), x, p.K, res);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) p.out[rows[r] * p.N + n + t] = res[r * NT + t];
  }
  for (; n < n1; ++n) {
    tile_avx2<T, R, 1>(p.row(e, n), x, p.K, res);
    for (int r = 0; r < R; ++r) p.out[rows[r] * p.N + n] = res[r];
  }
}

template <typename T>
void part_avx2(const Work<T>& p, int64_t n0, int64_t n1) {
  using Fn = void (*)(const Work<T>&, int64_t, const float*, const int64_t*, int64_t, int64_t);
  static const Fn block[kMaxRows] = {rows_block_avx2<T, 1>, rows_block_avx2<T, 2>, rows_block_avx2<T, 3>,
                                     rows_block_avx2<T, 4>};
  // a slice: a multiple of every tile width (6, 4, 3) filling about half of a 32 KB L1 beside x's rows
  const int64_t row_bytes = p.K * static_cast<int64_t>(sizeof(T));
  const int64_t slice_rows = std::max<int64_t>(12, (16 * 1024) / row_bytes / 12 * 12);
  for (const hz::Group& g : *p.groups) {
    const int64_t slice = g.count <= kMaxRows ? n1 - n0 : slice_rows;
    for (int64_t s0 = n0; s0 < n1; s0 += slice) {
      const int64_t s1 = std::min(n1, s0 + slice);
      for (int64_t r0 = 0; r0 < g.count; r0 += kMaxRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, g.count - r0));
        block[R - 1](p, g.expert, p.xg + (g.start + r0) * p.K, p.row_of + g.start + r0, s0, s1);
      }
    }
  }
}

#else

bool rows_cpu_has_avx2() { return false; }
template <typename T>
void part_avx2(const Work<T>& p, int64_t n0, int64_t n1) {
  part_portable(p, n0, n1);
}

#endif

#if HZ_HAS_AMX_CODE

// bf16 x [M, K] against bf16 weights on AMX tiles: C^T = W x^T, 16 weight rows (an A tile, read straight
// from W with a row stride of K) by 16 rows of x (a B tile, x's K pairs transposed once per call), so the
// weights need no repacking. Products are exact and sums fp32, as in the FMA path (in another order);
// denormal inputs count as zero (AMX flushes them; a bf16 below 2^-126 changes no sum at fp32's
// precision unless every term is that small).
constexpr int kAmxTiles = 4;  // 16-row weight tiles per pass: 4 accumulators, 2 A and 1 B tile registers
// Fewer rows of x take the FMA path: at 1-4 rows both stream the weights at memory speed (bf16 [1024 | 32768 x
// 512], 2 threads, cold, interleaved: within noise of each other), and a batch-1 step then never runs AMX code
// (bench/decode.py measured its batch-1 steps 5.1 ms without AMX, 5.9 with the LM head on AMX; a core that runs
// AMX may drop its clock for what follows)
constexpr int64_t kAmxMinRows = 8;

struct AmxWork {
  const uint16_t* w;  // [E, N, K] bf16
  int64_t N, K;
  const uint32_t* b;  // x's B tiles: per group, per chunk of 16 rows, K / 32 tiles of 16 x 16 pairs
  std::vector<int64_t> first_chunk;  // per group, its first chunk in b
  const int64_t* row_of;
  float* out;
  const std::vector<hz::Group>* groups;
  const uint16_t* row(int64_t e, int64_t n) const { return w + (e * N + n) * K; }
};

// The rows of x in group order, as B tiles: b[(chunk * K / 32 + t) * 256 + p * 16 + m] is the pair of
// columns 32t + 2p, 32t + 2p + 1 of the chunk's row m (zero past a group's last row).
void pack_b(const uint32_t* x, int64_t K, const hz::Grouping& grouping, std::vector<int64_t>& first_chunk,
            hz::AlignedVector<uint32_t>& b) {
  const int64_t nkt = K / 32, pairs = K / 2;
  int64_t chunks = 0;
  for (const hz::Group& g : grouping.groups) {
    first_chunk.push_back(chunks);
    chunks += (g.count + 15) / 16;
  }
  b.assign(chunks * nkt * 256, 0);
  for (size_t gi = 0; gi < grouping.groups.size(); ++gi) {
    const hz::Group& g = grouping.groups[gi];
    for (int64_t i = 0; i < g.count; ++i) {
      const uint32_t* src = x + grouping.row_of[g.start + i] * pairs;
      uint32_t* dst = b.data() + (first_chunk[gi] + i / 16) * nkt * 256 + i % 16;
      for (int64_t t = 0; t < nkt; ++t)
        for (int p = 0; p < 16; ++p) dst[t * 256 + p * 16] = src[t * 16 + p];
    }
  }
}

// NT weight tiles (16 rows each, from w, stride K) against one chunk's B tiles; c: [NT][16 rows][16 of x].
// `next`: next_rows weight rows the caller takes next (stride K), fetched a cache line a row per K step (the
// tile loads alone leave memory idle between them: the products take too little time to cover a miss).
template <int NT>
HZ_AMX_TARGET void amx_tiles(const uint16_t* w, int64_t K, const uint32_t* b, float* c, const uint16_t* next,
                             int64_t next_rows) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  const int64_t stride = K * 2;
  for (int64_t t = 0; t < K / 32; ++t) {
    _tile_loadd(6, b + t * 256, 64);
    _tile_loadd(4, w + t * 32, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(5, w + 16 * K + t * 32, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(4, w + 32 * K + t * 32, stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (NT > 3) {
      _tile_loadd(5, w + 48 * K + t * 32, stride);
      _tile_dpbf16ps(3, 5, 6);
    }
    for (int64_t r = 0; r < next_rows; ++r)  // into L2: into L1, the fetches crowded out the tile loads
      _mm_prefetch(reinterpret_cast<const char*>(next + r * K + t * 32), _MM_HINT_T1);
  }
  _tile_stored(0, c, 64);
  if constexpr (NT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NT > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NT > 3) _tile_stored(3, c + 768, 64);
}

// Weight tiles t0..t1 (16 rows each) of every group's expert.
HZ_AMX_TARGET void part_amx(const AmxWork& p, int64_t t0, int64_t t1) {
  using Fn = void (*)(const uint16_t*, int64_t, const uint32_t*, float*, const uint16_t*, int64_t);
  static const Fn tiles[kAmxTiles] = {amx_tiles<1>, amx_tiles<2>, amx_tiles<3>, amx_tiles<4>};
  alignas(64) float c[kAmxTiles * 256];
  const int64_t nkt = p.K / 32;
  hz::tiles_begin();
  const std::vector<hz::Group>& groups = *p.groups;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const hz::Group& g = groups[gi];
    for (int64_t t = t0; t < t1; t += kAmxTiles) {
      const int nt = static_cast<int>(std::min<int64_t>(kAmxTiles, t1 - t));
      const int64_t n0 = t * 16;
      // the rows after these: this expert's next tiles, else the next group's first ones in this range
      const bool more = t + kAmxTiles < t1;
      const uint16_t* next = more ? p.row(g.expert, n0 + 16 * kAmxTiles)
                             : gi + 1 < groups.size() ? p.row(groups[gi + 1].expert, t0 * 16)
                                                      : nullptr;
      const int64_t next_rows =
          next == nullptr ? 0 : 16 * std::min<int64_t>(kAmxTiles, more ? t1 - t - kAmxTiles : t1 - t0);
      for (int64_t i0 = 0; i0 < g.count; i0 += 16) {
        const uint32_t* b = p.b + (p.first_chunk[gi] + i0 / 16) * nkt * 256;
        // the first chunk of x fetches ahead (the weights' later chunks find in cache)
        tiles[nt - 1](p.row(g.expert, n0), p.K, b, c, next, i0 == 0 ? next_rows : 0);
        hz::scatter_tiles(c, nt, std::min<int64_t>(16, g.count - i0), p.row_of + g.start + i0, p.out, p.N, n0);
      }
    }
  }
  hz::tiles_end();
}

void run_amx(const at::Tensor& w, const at::Tensor& x, const hz::Grouping& grouping, at::Tensor& out) {
  const int64_t K = x.size(1), N = w.size(-2);
  AmxWork p{reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K, nullptr, {}, grouping.row_of.data(),
            out.data_ptr<float>(), &grouping.groups};
  hz::AlignedVector<uint32_t> b;
  pack_b(reinterpret_cast<const uint32_t*>(x.data_ptr()), K, grouping, p.first_chunk, b);
  p.b = b.data();
  at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) { part_amx(p, t0, t1); });
}

#endif

enum class Isa { kPortable, kAvx2, kAvx512 };

template <typename T>
void run(const at::Tensor& w, const at::Tensor& x, const hz::Grouping& grouping, at::Tensor& out, Isa isa) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(-2);
  // x in group order: a copy of a few rows (what every weight row is multiplied with), 64-byte aligned. With
  // one group, x already is in group order (the grouping is stable), so it is taken as it is when aligned,
  // as torch's allocator aligns it.
  const float* xd = x.data_ptr<float>();
  hz::AlignedVector<float> xg;
  const bool in_place = grouping.groups.size() == 1 && reinterpret_cast<uintptr_t>(xd) % 64 == 0;
  if (!in_place) {
    xg.resize(M * K);
    for (int64_t i = 0; i < M; ++i) std::memcpy(xg.data() + i * K, xd + grouping.row_of[i] * K, K * sizeof(float));
  }
  Work<T> p{reinterpret_cast<const T*>(w.data_ptr()), N, K, in_place ? xd : xg.data(), grouping.row_of.data(),
            out.data_ptr<float>(), &grouping.groups};
  // grain: 16 weight rows at least, so a small matrix does not pay for waking every thread
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (isa == Isa::kAvx512) {
      part_avx512(p, n0, n1);
    } else if (isa == Isa::kAvx2) {
      part_avx2(p, n0, n1);
    } else {
      part_portable(p, n0, n1);
    }
  });
}

at::Tensor rows_matmul(const at::Tensor& x_, const at::Tensor& w_, const c10::optional<at::Tensor>& expert_,
                       bool force_portable) {
  TORCH_CHECK(x_.device().is_cpu() && w_.device().is_cpu() && (!expert_ || expert_->device().is_cpu()),
              "rows_matmul: the kernel takes CPU tensors");
  TORCH_CHECK(x_.dim() == 2 && at::isFloatingType(x_.scalar_type()), "rows_matmul: x must be float [M, K], got ",
              x_.scalar_type(), " ", x_.sizes());
  const auto wt = w_.scalar_type();
  TORCH_CHECK((w_.dim() == 3 || w_.dim() == 2) && (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar),
              "rows_matmul: w must be float32, bfloat16 or int8 [N, K] or [E, N, K], got ", wt, " ", w_.sizes());
  TORCH_CHECK((w_.dim() == 3) == expert_.has_value(),
              "rows_matmul: expert ids go with stacked weights [E, N, K] and only with them");
  const at::Tensor w = w_.contiguous();  // [N, K] is [1, N, K]
  const int64_t M = x_.size(0), K = x_.size(1), E = w.dim() == 3 ? w.size(0) : 1, N = w.size(-2);
  TORCH_CHECK(w.size(-1) == K, "rows_matmul: x has ", K, " columns, w ", w.size(-1));
  at::Tensor expert;
  if (expert_) {
    TORCH_CHECK((expert_->scalar_type() == at::kLong || expert_->scalar_type() == at::kInt) && expert_->dim() == 1 &&
                    expert_->size(0) == M,
                "rows_matmul: expert must be int64 (or int32) [M] with M = ", M, ", got ", expert_->scalar_type(),
                " ", expert_->sizes());
    expert = expert_->to(at::kLong).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x_.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  // one matrix: every row in one group, in order (no sort; a projection is called ~150 times a step)
  const hz::Grouping grouping = expert_ ? hz::group_rows(expert.data_ptr<int64_t>(), M, E, "rows_matmul")
                                        : hz::one_group(M);
#if HZ_HAS_AMX_CODE
  if (wt == at::kBFloat16 && x_.scalar_type() == at::kBFloat16 && !force_portable && M >= kAmxMinRows &&
      K % 32 == 0 && N % 16 == 0 && hz::amx_usable()) {
    run_amx(w, x_.contiguous(), grouping, out);
    return out;
  }
#endif
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const Isa isa = force_portable                             ? Isa::kPortable
                  : K % 16 == 0 && rows_cpu_has_avx512()      ? Isa::kAvx512
                  : K % 8 == 0 && rows_cpu_has_avx2()         ? Isa::kAvx2
                                                              : Isa::kPortable;
  if (wt == at::kFloat) {
    run<float>(w, x, grouping, out, isa);
  } else if (wt == at::kBFloat16) {
    run<c10::BFloat16>(w, x, grouping, out, isa);
  } else {
    run<int8_t>(w, x, grouping, out, isa);
  }
  return out;
}

}  // namespace

static bool has_amx() { return hz::amx_usable(); }

TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("rows_matmul(Tensor x, Tensor w, Tensor? expert=None, bool force_portable=False) -> Tensor");
  m.def("has_amx() -> bool", &has_amx);
}

// A CPU kernel (not a composite one), so torch.compile can take the fake registered in Python
TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("rows_matmul", &rows_matmul); }

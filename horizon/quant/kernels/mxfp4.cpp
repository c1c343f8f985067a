// Fused MXFP4 x activation matmul for CPU: out[m, n] = sum_k x[m, k] * W_{expert[m]}[n, k].
//
// W_e is MXFP4 (horizon/quant/mxfp4.py): blocks uint8 [E, N, nb, 16] (element 2i in the low nibble of
// byte i, 2i+1 in the high nibble), scales uint8 [E, N, nb] (2^(s - 127), 0xFF = NaN). The packed bytes
// are decoded in registers and never written out as a full-precision matrix; accumulation is fp32, so
// the result matches "dequantise to fp32, then x @ W^T" up to summation order.
//
// Layout choices (why):
// - Rows of x are grouped by expert on the host (it is CPU memory; grouping.h), so each routed expert's weights are
//   decoded once per call and applied to every row routed to it; experts nobody routes to are not read.
// - Each 32-wide block of x is de-interleaved once per call into [16 even | 16 odd] elements: the low
//   nibbles of a block's 16 bytes are then the weights of the even half and the high nibbles those of
//   the odd half, so a decoded block needs no interleaving shuffle.
// - AVX-512: one block = 16 bytes zero-extended to 16 int32 lanes; vpermps looks each nibble up in a
//   16-entry fp32 table of E2M1 values already multiplied by the block scale (exact: the products have at
//   most 2 significant bits; NaN for 0xFF), so the decode is 2 permutes. The 256 possible tables are
//   built once (16 KB, ScaledFP4): loading a block's table instead of scaling one per block took one of
//   the ~5 vector operations a block costs before its FMAs: 2-8% of the kernel at 4-64 (token, expert) pairs.
// - Up to kFusedMaxRows rows per expert: decode straight into FMAs (the decode phase of batch decoding).
//   More rows (prefill): decode a tile of output rows into a small fp32 buffer once, then a register-
//   blocked 4x4 microkernel, so the decode cost stays once per weight while the FMAs dominate.
// - Parallel over output rows N (at::parallel_for): every chunk does the same work for every expert,
//   which balances however the tokens are routed.
// - Rows of x that are all bf16 (a bf16 model's), 3 or more to an expert, on AMX tiles where the CPU has them
//   (the AMX path below; HORIZON_AMX=0 turns it off).
// - AVX2 (CPUs without AVX-512): the same fused and buffered forms on 8 lanes, the decode through byte shuffles
//   (the AVX2 path below).
// - The AVX-512 and AVX2 functions carry __attribute__((target(...))) so the file builds with no -march flag;
//   the choice is made at run time (hz::cpu_has_avx512 / cpu_has_avx2), with a portable C++ path otherwise.
//
// Opt-in int8 activations (int8_activations=true; horizon.quant.kernels.quantize_activations is the
// definition): each 32-wide block of a row of x is rounded to int8 with its own scale amax/127 (the Q8_0
// format llama.cpp multiplies its MXFP4 weights with), and each block's dot product is then exact in
// int32, scaled once by (weight block scale x activation block scale). Why: decoding nibbles to fp32 is
// the cost of the fp32 path at 1-4 rows per expert (5 ops per 32 weights before any FMA); as int8 a
// nibble decodes with one byte shuffle per 64 weights and VNNI's vpdpbusd does 64 multiply-adds an
// instruction. Layout (AVX-512 VNNI):
// - 16 blocks (512 weights of a row) at a time: their 256 bytes are 4 loads, and a 4x4 transpose of
//   dwords puts block 4(L%4) + L/4 in dword lane L, so each int32 lane accumulates one block only and the
//   scales apply per lane, once per 512 weights, not per block;
// - vpdpbusd multiplies unsigned by signed bytes: the weights are looked up as 2*E2M1 + 12 in [0, 24]
//   (vpshufb on the nibbles) and each lane starts from -12 * (sum of its block's int8 activations), so the
//   lane ends at exactly 2 * sum(w * a); the 1/2 is folded into the activation scales;
// - x is quantised and laid out on the host once per call, in the order the lanes read it.
// On CPUs with AVX2 but no VNNI the same layout on 8 lanes, 8 blocks a pass, vpmaddubsw in place of vpdpbusd
// (the AVX2 int8 path below).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "amx.h"
#include "grouping.h"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define HZ_HAVE_AVX512 1
#include <immintrin.h>

#include "simd.h"
#define HZ_AVX512 __attribute__((target("avx512f,avx512bw")))
#else
#define HZ_HAVE_AVX512 0
#endif

namespace {

constexpr int64_t kBlock = 32;       // elements per scale
constexpr int64_t kBlockBytes = 16;  // packed bytes per block
constexpr int kFusedMaxRows = 8;     // rows per expert decoded straight into FMAs
constexpr int64_t kTileBytes = 64 * 1024;  // fp32 decode buffer per thread (buffered path), L2-resident
constexpr int64_t kRowChunk = 64;          // rows of x per pass over that buffer

alignas(64) constexpr float kFP4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) from its bits: exact for every byte (s = 0 is the subnormal 2^-127); 0xFF is NaN.
struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (uint32_t s = 0; s < 256; ++s) {
      uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0x7FC00000u : s << 23;
      std::memcpy(&v[s], &bits, sizeof(float));
    }
  }
};

const float* scale_table() {
  static const ScaleTable table;  // thread-safe initialisation (C++11 statics)
  return table.v;
}

// For every scale byte, the 16 E2M1 values times its scale (the products are exact: at most 2 significant
// bits). 16 KB, so the tables a model's scales use stay in L1, and a block's decode loads its table
// instead of multiplying one.
struct ScaledFP4 {
  alignas(64) float v[256][16];
  ScaledFP4() {
    const float* st = scale_table();
    for (int s = 0; s < 256; ++s)
      for (int i = 0; i < 16; ++i) v[s][i] = kFP4[i] * st[s];
  }
};

const ScaledFP4& scaled_fp4() {
  static const ScaledFP4 tables;
  return tables;
}

using hz::Group;

struct Problem {
  const uint8_t* blocks;   // [E, N, nb, 16]
  const uint8_t* scales;   // [E, N, nb]
  int64_t N, nb, Kp;       // Kp = nb * 32
  const float* xg;         // [M, Kp]: x's rows in group order, de-interleaved per block (on the AVX2 path in
                           // decode_block_avx2's order), zero-padded (the rows the AMX path takes left out)
  const float* x;          // [M, K]: x itself (its rows in the caller's order)
  int64_t K;
  const int64_t* row_of;   // [M]: grouped position -> row of out
  float* out;              // [M, N]
  const std::vector<Group>* groups;

  const uint8_t* blk(int64_t e, int64_t n) const { return blocks + (e * N + n) * nb * kBlockBytes; }
  const uint8_t* scl(int64_t e, int64_t n) const { return scales + (e * N + n) * nb; }
};

// ---------------------------------------------------------------------------------------------------
// Portable path: decode one output row into an L1 buffer, then plain dot products (16 partial sums, so
// the compiler vectorises them without -ffast-math).

void decode_row_portable(const uint8_t* blocks, const uint8_t* scales, int64_t nb, float* w) {
  const float* st = scale_table();
  for (int64_t b = 0; b < nb; ++b) {
    const float s = st[scales[b]];
    const uint8_t* p = blocks + b * kBlockBytes;
    float* o = w + b * kBlock;
    for (int j = 0; j < 16; ++j) {
      o[j] = kFP4[p[j] & 15] * s;
      o[16 + j] = kFP4[p[j] >> 4] * s;
    }
  }
}

float dot_portable(const float* a, const float* b, int64_t n) {
  float acc[16] = {0.0f};
  for (int64_t k = 0; k < n; k += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[k + j] * b[k + j];
  }
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

void rows_portable(const Problem& p, int64_t n0, int64_t n1) {
  std::vector<float> w(p.Kp);
  for (const Group& g : *p.groups) {
    for (int64_t n = n0; n < n1; ++n) {
      decode_row_portable(p.blk(g.expert, n), p.scl(g.expert, n), p.nb, w.data());
      for (int64_t i = 0; i < g.count; ++i) {
        p.out[p.row_of[g.start + i] * p.N + n] = dot_portable(w.data(), p.xg + (g.start + i) * p.Kp, p.Kp);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// The buffered form's loop, shared by the vector paths: T output rows of the expert decoded once into buf
// (`decode`), then MR x NR micro-kernels over them, micro[(MR - 1) * nr_max + NR - 1] (res stride 4).
using DecodeRowsFn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, float*);
using MicroFn = void (*)(const float*, const float*, int64_t, float*);

void buffered_group(const Problem& p, const Group& g, int64_t n0, int64_t n1, float* buf, int64_t tile,
                    DecodeRowsFn decode, const MicroFn* micro, int nr_max) {
  const float* x = p.xg + g.start * p.Kp;
  const int64_t* rows = p.row_of + g.start;
  float res[16];
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t T = std::min(tile, n1 - t0);
    decode(p.blk(g.expert, t0), p.scl(g.expert, t0), p.nb, T, buf);  // once per weight
    for (int64_t r0 = 0; r0 < g.count; r0 += kRowChunk) {
      const int64_t r1 = std::min(g.count, r0 + kRowChunk);
      for (int64_t j0 = 0; j0 < T; j0 += nr_max) {
        const int nr = static_cast<int>(std::min<int64_t>(nr_max, T - j0));
        for (int64_t r = r0; r < r1; r += 4) {
          const int mr = static_cast<int>(std::min<int64_t>(4, r1 - r));
          micro[(mr - 1) * nr_max + nr - 1](x + r * p.Kp, buf + j0 * p.Kp, p.Kp, res);
          for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j) p.out[rows[r + i] * p.N + t0 + j0 + j] = res[i * 4 + j];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// AVX-512 path.

#if HZ_HAVE_AVX512

bool cpu_has_avx512() {
  return hz::cpu_has_avx512();
}

// One block: (lo, hi) = weights of the block's even and odd elements.
HZ_AVX512 inline void decode_block(const uint8_t* bytes16, uint8_t scale, const ScaledFP4& tables, __m512& lo,
                                   __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16)));
  const __m512 table = _mm512_load_ps(tables.v[scale]);
  lo = _mm512_permutexvar_ps(b, table);  // vpermps reads only the index's low 4 bits: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

// How many tiles ahead fused_tile fetches weights and their scales (the scales were once left to demand
// misses): one tile ahead is ~200 ns of decoding at one row of x, about a memory latency, so cold weights
// still waited. Two tiles against one with the scales unfetched, gate_up / down of `small`, cold,
// 2 threads, modes alternated in one process (medians of 7): 4 sequences 244 -> 199 / 123 -> 107 us,
// 16 sequences 839 -> 788 / 461 -> 414 us; 3, 4 and 6 tiles did no better than 2; 1 sequence unchanged.
constexpr int64_t kFetchTiles = 2;

// R rows of x (one expert) against NT consecutive output rows, decoding straight into FMAs.
// NT > 1 when R is small keeps enough independent accumulator chains to hide the FMA latency.
template <int R, int NT>
HZ_AVX512 void fused_tile(const uint8_t* blocks, const uint8_t* scales, int64_t nb, const float* x, int64_t Kp,
                          float* res) {
  const ScaledFP4& tables = scaled_fp4();
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b & 3) == 0) {  // the tile after next: its bytes a cache line (4 blocks) per row at a time, its scales
      for (int t = 0; t < NT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(blocks + ((kFetchTiles * NT + t) * nb + b) * kBlockBytes),
                     _MM_HINT_T0);
      if (b == 0) {
        const uintptr_t first = reinterpret_cast<uintptr_t>(scales + kFetchTiles * NT * nb);
        for (uintptr_t line = first & ~uintptr_t{63}; line < first + NT * nb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
      }
    }
    for (int t = 0; t < NT; ++t) {
      __m512 lo, hi;
      decode_block(blocks + (t * nb + b) * kBlockBytes, scales[t * nb + b], tables, lo, hi);
      for (int r = 0; r < R; ++r) {
        const float* xp = x + r * Kp + b * kBlock;
        acc[r][t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + 16), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = _mm512_reduce_add_ps(acc[r][t]);
}

template <int R>
HZ_AVX512 void fused_group(const Problem& p, const Group& g, int64_t n0, int64_t n1) {
  constexpr int NT = R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1;
  const float* x = p.xg + g.start * p.Kp;
  const int64_t* rows = p.row_of + g.start;
  float res[R * NT];
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    fused_tile<R, NT>(p.blk(g.expert, n), p.scl(g.expert, n), p.nb, x, p.Kp, res);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) p.out[rows[r] * p.N + n + t] = res[r * NT + t];
  }
  for (; n < n1; ++n) {
    fused_tile<R, 1>(p.blk(g.expert, n), p.scl(g.expert, n), p.nb, x, p.Kp, res);
    for (int r = 0; r < R; ++r) p.out[rows[r] * p.N + n] = res[r];
  }
}

using FusedFn = void (*)(const Problem&, const Group&, int64_t, int64_t);
const FusedFn kFused[kFusedMaxRows] = {fused_group<1>, fused_group<2>, fused_group<3>, fused_group<4>,
                                       fused_group<5>, fused_group<6>, fused_group<7>, fused_group<8>};

// T consecutive output rows of one expert -> buf [T, Kp] (de-interleaved like xg).
HZ_AVX512 void decode_rows(const uint8_t* blocks, const uint8_t* scales, int64_t nb, int64_t T, float* buf) {
  const ScaledFP4& tables = scaled_fp4();
  for (int64_t i = 0; i < T * nb; ++i) {  // rows are contiguous in the packed storage
    __m512 lo, hi;
    decode_block(blocks + i * kBlockBytes, scales[i], tables, lo, hi);
    _mm512_storeu_ps(buf + i * kBlock, lo);
    _mm512_storeu_ps(buf + i * kBlock + 16, hi);
  }
}

// MR rows of x against NR decoded weight rows: MR x NR dot products of length Kp (res stride 4).
template <int MR, int NR>
HZ_AVX512 void micro(const float* x, const float* w, int64_t Kp, float* res) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * Kp + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * Kp + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) res[i * 4 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

const MicroFn kMicro[4][4] = {
    {micro<1, 1>, micro<1, 2>, micro<1, 3>, micro<1, 4>},
    {micro<2, 1>, micro<2, 2>, micro<2, 3>, micro<2, 4>},
    {micro<3, 1>, micro<3, 2>, micro<3, 3>, micro<3, 4>},
    {micro<4, 1>, micro<4, 2>, micro<4, 3>, micro<4, 4>},
};

// One whole 32-wide block of x -> [16 even | 16 odd]: two loads, two two-source permutes.
HZ_AVX512 void split_block_avx512(const float* src, float* dst) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  _mm512_store_ps(dst, _mm512_permutex2var_ps(a, even, b));
  _mm512_store_ps(dst + 16, _mm512_permutex2var_ps(a, odd, b));
}

// Output rows per decoded tile of the buffered path: a multiple of 4 that keeps the buffer near kTileBytes.
int64_t buffer_tile(const Problem& p) { return std::max<int64_t>(4, (kTileBytes / (4 * p.Kp)) / 4 * 4); }

// Output rows n0..n1-1 of group g on the FMA path: fused for a few rows, buffered for more (buf sized on first use).
void group_avx512(const Problem& p, const Group& g, int64_t n0, int64_t n1, std::vector<float>& buf, int64_t tile) {
  if (g.count <= kFusedMaxRows) {
    kFused[g.count - 1](p, g, n0, n1);
  } else {
    if (buf.empty()) buf.resize(tile * p.Kp);
    buffered_group(p, g, n0, n1, buf.data(), tile, decode_rows, &kMicro[0][0], 4);
  }
}

void rows_avx512(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t tile = buffer_tile(p);
  std::vector<float> buf;
  for (const Group& g : *p.groups) group_avx512(p, g, n0, n1, buf, tile);
}

#else

bool cpu_has_avx512() { return false; }
void rows_avx512(const Problem& p, int64_t n0, int64_t n1) { rows_portable(p, n0, n1); }
void split_block_avx512(const float*, float*) {}

#endif

// ---------------------------------------------------------------------------------------------------
// AVX2 path (CPUs with AVX2 and FMA but no AVX-512: AMD Zen 2 and 3, Intel client cores, Haswell to Comet
// Lake servers): the fused and buffered forms above on 8-lane vectors. Without it such CPUs took the portable
// path, whose decode is a scalar table look-up a weight: on a Zen 3 EPYC (2 threads) a batch-1 `small`
// gate_up call (4 experts) took ~0.9 ms, ~1.2 GB/s of packed weights.
// AVX2 has no 16-entry fp32 permute, but every scaled E2M1 value is exactly a bf16 (at most 2 significant bits),
// so a block decodes through byte shuffles: the 32 nibbles in the bytes of one vector, two vpshufb look up the
// high and low bytes of their bf16 forms in the block scale's tables, and unpacking those bytes into words and
// the words into the high halves of zeroed dwords gives the fp32 weights. 12 shuffle and logic operations a
// block (32 weights), which Zen 3 issues on two or more pipes. The first form, 8-entry vpermps look-ups of the
// magnitudes and the sign set by an XOR (2 widening loads, 4 permutes, 6 shifts, 4 XORs a block), took 0.70-1.92x
// this one's time per call (`small`'s gate_up, 2 threads, 6 alternated pairs of processes on a noisy Zen 3;
// medians 1.35x at 4 rows, 1.44x at 16, 1.27x at 64, 0.96x at 256).
// The words come out in an order of their own (decode_block_avx2), which x is laid out to match.

#if HZ_HAVE_AVX512
#define HZ_AVX2 __attribute__((target("avx2,fma")))

bool cpu_has_avx2() { return hz::cpu_has_avx2(); }

// Per scale byte, the high and the low byte of the bf16 form of its 16 scaled E2M1 values: the fp32 products of
// ScaledFP4 have at most 2 significant bits, so their low 16 bits are zero and each is exactly a bf16.
struct ScaledFP4Avx2 {
  alignas(16) uint8_t hi[256][16], lo[256][16];
  ScaledFP4Avx2() {
    const ScaledFP4& full = scaled_fp4();
    for (int s = 0; s < 256; ++s)
      for (int i = 0; i < 16; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &full.v[s][i], sizeof(bits));
        hi[s][i] = static_cast<uint8_t>(bits >> 24);
        lo[s][i] = static_cast<uint8_t>(bits >> 16);
      }
  }
};

const ScaledFP4Avx2& scaled_fp4_avx2() {
  static const ScaledFP4Avx2 tables;
  return tables;
}

// One block -> w[0..3], the order x is laid out in for this path (split_block_avx2): w[q] holds elements
// 8q + 0, 2, 4, 6 in its low 128 bits and 8q + 1, 3, 5, 7 in its high 128 bits.
HZ_AVX2 inline void decode_block_avx2(const uint8_t* bytes16, uint8_t scale, const ScaledFP4Avx2& tables,
                                      __m256 w[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m128i m = _mm_set1_epi8(0x0F);
  // low nibbles (even elements) in the low lane, high nibbles (odd elements) in the high lane
  const __m256i n = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(b, m)),
                                            _mm_and_si128(_mm_srli_epi16(b, 4), m), 1);
  const __m256i th = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tables.hi[scale])));
  const __m256i tl = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tables.lo[scale])));
  const __m256i h = _mm256_shuffle_epi8(th, n), l = _mm256_shuffle_epi8(tl, n);
  const __m256i a = _mm256_unpacklo_epi8(l, h), c = _mm256_unpackhi_epi8(l, h);  // bf16 words
  const __m256i z = _mm256_setzero_si256();
  w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, a));  // bf16 -> fp32: the word in the high half
  w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, a));
  w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, c));
  w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, c));
}

HZ_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// As fused_tile: R rows of x against NT output rows. One accumulator per (row of x, output row), its FMAs in
// the order of x's columns, as micro_avx2's, so a row's result is the same whichever path its expert's row
// count sends it to (batched == alone). Two accumulators a pair, splitting each block, measured no faster.
template <int R, int NT>
HZ_AVX2 void fused_tile_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t nb, const float* x, int64_t Kp,
                             float* res) {
  const ScaledFP4Avx2& tables = scaled_fp4_avx2();
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b & 3) == 0) {  // as fused_tile: the tile after next, a cache line a row at a time, and its scales
      for (int t = 0; t < NT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(blocks + ((kFetchTiles * NT + t) * nb + b) * kBlockBytes),
                     _MM_HINT_T0);
      if (b == 0) {
        const uintptr_t first = reinterpret_cast<uintptr_t>(scales + kFetchTiles * NT * nb);
        for (uintptr_t line = first & ~uintptr_t{63}; line < first + NT * nb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
      }
    }
    for (int t = 0; t < NT; ++t) {
      __m256 w[4];
      decode_block_avx2(blocks + (t * nb + b) * kBlockBytes, scales[t * nb + b], tables, w);
      for (int r = 0; r < R; ++r) {
        const float* xp = x + r * Kp + b * kBlock;
        for (int q = 0; q < 4; ++q) acc[r][t] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xp + 8 * q), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = hsum_avx2(acc[r][t]);
}

template <int R>
HZ_AVX2 void fused_group_avx2(const Problem& p, const Group& g, int64_t n0, int64_t n1) {
  constexpr int NT = R == 1 ? 4 : R == 2 ? 2 : 1;
  const float* x = p.xg + g.start * p.Kp;
  const int64_t* rows = p.row_of + g.start;
  float res[R * NT];
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    fused_tile_avx2<R, NT>(p.blk(g.expert, n), p.scl(g.expert, n), p.nb, x, p.Kp, res);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) p.out[rows[r] * p.N + n + t] = res[r * NT + t];
  }
  for (; n < n1; ++n) {
    fused_tile_avx2<R, 1>(p.blk(g.expert, n), p.scl(g.expert, n), p.nb, x, p.Kp, res);
    for (int r = 0; r < R; ++r) p.out[rows[r] * p.N + n] = res[r];
  }
}

const FusedFn kFusedAvx2[kFusedMaxRows] = {fused_group_avx2<1>, fused_group_avx2<2>, fused_group_avx2<3>,
                                           fused_group_avx2<4>, fused_group_avx2<5>, fused_group_avx2<6>,
                                           fused_group_avx2<7>, fused_group_avx2<8>};

HZ_AVX2 void decode_rows_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t nb, int64_t T, float* buf) {
  const ScaledFP4Avx2& tables = scaled_fp4_avx2();
  for (int64_t i = 0; i < T * nb; ++i) {
    __m256 w[4];
    decode_block_avx2(blocks + i * kBlockBytes, scales[i], tables, w);
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(buf + i * kBlock + 8 * q, w[q]);
  }
}

// MR rows of x against NR decoded weight rows (res stride 4), MR x NR <= 8 accumulators.
template <int MR, int NR>
HZ_AVX2 void micro_avx2(const float* x, const float* w, int64_t Kp, float* res) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * Kp + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * Kp + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) res[i * 4 + j] = hsum_avx2(acc[i][j]);
}

const MicroFn kMicroAvx2[4][2] = {
    {micro_avx2<1, 1>, micro_avx2<1, 2>},
    {micro_avx2<2, 1>, micro_avx2<2, 2>},
    {micro_avx2<3, 1>, micro_avx2<3, 2>},
    {micro_avx2<4, 1>, micro_avx2<4, 2>},
};

void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t tile = buffer_tile(p);
  std::vector<float> buf;
  for (const Group& g : *p.groups) {
    if (g.count <= kFusedMaxRows) {
      kFusedAvx2[g.count - 1](p, g, n0, n1);
    } else {
      if (buf.empty()) buf.resize(tile * p.Kp);
      buffered_group(p, g, n0, n1, buf.data(), tile, decode_rows_avx2, &kMicroAvx2[0][0], 2);
    }
  }
}

#else

bool cpu_has_avx2() { return false; }
void rows_avx2(const Problem& p, int64_t n0, int64_t n1) { rows_portable(p, n0, n1); }

#endif

// ---------------------------------------------------------------------------------------------------
// AMX path: x whose every value is a bf16 (what a bf16 model passes, widened to fp32) against weights decoded
// to bf16, on AMX tiles. E2M1 times a power of two has 2 significant bits, so bf16 holds every decoded weight
// exactly (0xFF is NaN); each product is exact and the sums are fp32, as on the FMA path (in another order).
// Why: the FMA path's cost grows with the rows an expert gets (2 FMAs per 32 weights per row of x, after the
// decode); here a 16 x 32 tile of weights is decoded once (~2.5 cycles a block of 32, measured standalone: one
// byte widening, a table insert and two `vpermw` per two blocks) and one `tdpbf16ps` multiplies it with up to
// 16 rows of x. The tile product costs ~1 cycle a block whatever the rows, so at 1-2 rows an expert (most of a
// 16-sequence decode step) the FMA path is as fast or faster; from 3 rows on, and in prefill, AMX is faster
// (kAmxMinGroupRows; docs/benchmarks.md has the measurements).
// Layout: C^T = W x^T, as rows.cpp. For each pair of blocks q, k-tile 2q holds the even elements (low
// nibbles) of blocks 2q and 2q+1 and k-tile 2q+1 their odd ones, so a decoded pair needs no shuffle; x's B
// tiles follow that order (pack_b_mx).
// Blocks with scale byte 0 or 1 and any nonzero nibble decode to bf16 subnormals, which AMX flushes to zero:
// a panel holding one is computed by exact_rows instead (scalar; weights of ~1e-38 do not occur in trained
// models, but the format allows them). All-zero blocks, the usual scale-0 ones, decode to exact zeros. Values of x
// below 2^-126 count as zero, as in rows.cpp's AMX path (they change no sum at fp32's precision unless every
// term is that small).

#if HZ_HAS_AMX_CODE

constexpr int kAmxPanelTiles = 2;  // 16-row weight tiles decoded per panel: two accumulators per chunk of x
// The rows an expert needs for its products to go to AMX. `small`'s gate_up, 4 experts with R rows each, weights
// in cache, 2 threads (us, AMX / FMA path): R = 2: 67 / 66, 3: 69 / 91, 4: 72 / 112, 8: 75 / 220, 32: 194 / 685.
constexpr int64_t kAmxMinGroupRows = 3;

// For every scale byte, the 16 E2M1 values times its scale as bf16: the fp32 products' top halves (their low 16
// bits are zero). 8 KB.
struct ScaledFP4Bf16 {
  alignas(64) uint16_t v[256][16];
  ScaledFP4Bf16() {
    const ScaledFP4& f = scaled_fp4();
    for (int s = 0; s < 256; ++s)
      for (int i = 0; i < 16; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &f.v[s][i], sizeof(bits));
        v[s][i] = static_cast<uint16_t>(bits >> 16);
      }
  }
};

const ScaledFP4Bf16& scaled_fp4_bf16() {
  static const ScaledFP4Bf16 tables;
  return tables;
}

// Whether every value of x [n] is a bf16 (its fp32 bits end in 16 zeros).
HZ_AVX512 bool all_bf16(const float* x, int64_t n) {
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  __m512i any = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) any = _mm512_or_si512(any, _mm512_and_si512(_mm512_loadu_si512(x + i), low));
  uint32_t tail = 0;
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    tail |= bits & 0xFFFF;
  }
  return tail == 0 && _mm512_test_epi32_mask(any, any) == 0;
}

// x's rows of the AMX groups as B tiles, in the decoded k-tiles' order: for chunk c of 16 rows of group gi,
// b[((first_chunk[gi] + c) * nb + t) * 256 + p * 16 + m] holds columns 2p and 2p + 1 of k-tile t for the
// chunk's row m (zero past K and past the group's last row). Column j of k-tile 2q + h is element
// 2 (j % 16) + h of block 2q + j / 16.
void pack_b_mx(const Problem& p, const hz::Grouping& grouping, const std::vector<char>& on_amx,
               std::vector<int64_t>& first_chunk, hz::AlignedVector<uint32_t>& b) {
  const int64_t nb = p.nb, K = p.K;
  int64_t chunks = 0;
  first_chunk.assign(grouping.groups.size(), -1);
  for (size_t gi = 0; gi < grouping.groups.size(); ++gi) {
    if (!on_amx[gi]) continue;
    first_chunk[gi] = chunks;
    chunks += (grouping.groups[gi].count + 15) / 16;
  }
  b.assign(chunks * nb * 256, 0);
  // column j of a k-tile of parity h -> its offset in the pair of blocks
  int64_t offset[2][32];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 32; ++j) offset[h][j] = 32 * (j / 16) + 2 * (j % 16) + h;
  std::vector<std::pair<int64_t, int64_t>> rows;  // (grouped row, its slot in b)
  for (size_t gi = 0; gi < grouping.groups.size(); ++gi) {
    if (!on_amx[gi]) continue;
    const hz::Group& g = grouping.groups[gi];
    for (int64_t i = 0; i < g.count; ++i)
      rows.emplace_back(g.start + i, (first_chunk[gi] + i / 16) * nb * 256 + i % 16);
  }
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = p.x + grouping.row_of[rows[r].first] * K;
      uint32_t* dst = b.data() + rows[r].second;
      for (int64_t t = 0; t < nb; ++t) {
        const int64_t base = 64 * (t / 2);
        for (int q = 0; q < 16; ++q) {
          uint32_t pair = 0;
          for (int u = 0; u < 2; ++u) {
            const int64_t k = base + offset[t % 2][2 * q + u];
            uint32_t bits = 0;
            if (k < K) std::memcpy(&bits, src + k, sizeof(bits));
            pair |= (bits >> 16) << (16 * u);
          }
          dst[t * 256 + q * 16] = pair;
        }
      }
    }
  });
}

// Whether rows [n, n + rows) of expert e hold a block that decodes to bf16 subnormals (scale byte 0 or 1 with a
// nonzero nibble); their scale bytes are contiguous.
HZ_AVX512 bool has_subnormal_blocks(const Problem& p, int64_t e, int64_t n, int64_t rows) {
  const uint8_t* s = p.scl(e, n);
  const int64_t count = rows * p.nb;
  const __m512i two = _mm512_set1_epi8(2);
  for (int64_t i = 0; i < count; i += 64) {
    const __mmask64 in = count - i >= 64 ? ~0ULL : (~0ULL) >> (64 - (count - i));
    __mmask64 small = _mm512_mask_cmplt_epu8_mask(in, _mm512_maskz_loadu_epi8(in, s + i), two);
    while (small) {
      const int64_t blk = i + __builtin_ctzll(small);
      small &= small - 1;
      const uint8_t* bytes = p.blk(e, n) + blk * kBlockBytes;
      for (int j = 0; j < kBlockBytes; ++j)
        if (bytes[j] & 0x77) return true;  // a nonzero magnitude (bit 3 of a nibble is its sign)
    }
  }
  return false;
}

// Rows n0..n1-1 of group g against x's rows, one scalar dot product each over the weights decoded to fp32 in
// natural order: the exact fallback for panels with subnormal blocks.
void exact_rows(const Problem& p, const Group& g, int64_t n0, int64_t n1) {
  const float* st = scale_table();
  std::vector<float> w(p.Kp);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* bytes = p.blk(g.expert, n);
    const uint8_t* sc = p.scl(g.expert, n);
    for (int64_t b = 0; b < p.nb; ++b)
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = bytes[b * kBlockBytes + j];
        w[b * kBlock + 2 * j] = kFP4[byte & 15] * st[sc[b]];
        w[b * kBlock + 2 * j + 1] = kFP4[byte >> 4] * st[sc[b]];
      }
    for (int64_t i = 0; i < g.count; ++i) {
      const int64_t row = p.row_of[g.start + i];
      const float* xr = p.x + row * p.K;
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) acc += w[k] * xr[k];
      p.out[row * p.N + n] = acc;
    }
  }
}

// Pair of blocks q of `rows` consecutive weight rows (row strides nb blocks / nb bytes) -> two k-tiles of A tiles:
// row i's even elements to lo + (i / 16) * 512 + (i % 16) * 32, its odd ones to the same place in hi. One
// `vpmovzxbw` widens the pair's 32 bytes, and one `vpermw` per half looks the nibbles up in a 32-entry table
// holding the two blocks' scaled values (the second block's indices + 16).
HZ_AMX_TARGET inline void decode_pair(const uint8_t* blocks, const uint8_t* scales, int64_t nb, int64_t q, int64_t rows,
                                      uint16_t* lo, uint16_t* hi, const uint8_t* ahead) {
  const ScaledFP4Bf16& tables = scaled_fp4_bf16();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i second = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 0x10);  // lanes 16-31: +16
  for (int64_t i = 0; i < rows; ++i) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * nb * kBlockBytes), _MM_HINT_T0);
    const uint8_t* s = scales + i * nb + 2 * q;
    const __m512i v = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks + (i * nb + 2 * q) * kBlockBytes)));
    const __m512i table = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(tables.v[s[0]]))),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(tables.v[s[1]])), 1);
    const int64_t at = (i / 16) * 512 + (i % 16) * 32;
    _mm512_store_si512(lo + at, _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(v, low4, second, 0xEA), table));
    _mm512_store_si512(hi + at, _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(v, 4), second), table));
  }
}

struct AmxX {
  const uint32_t* b;                  // pack_b_mx
  const std::vector<int64_t>* first_chunk;
};

constexpr int64_t kAmxLag = 2;  // pairs of k-tiles the products run behind the decoding (one-chunk groups)

// Weight tiles t0..t1 (16 rows each) of group gi's expert against its rows of x, kAmxPanelTiles tiles (a panel)
// at a time, into two accumulators per chunk of 16 rows of x.
// - One chunk (the decode steps): decoding and products stream through a ring of kAmxLag + 1 slots of one pair
//   of k-tiles each; the products of a pair are issued kAmxLag pairs after it is decoded, between the decoding of
//   the pairs that follow (a tile load right after the stores that wrote its data waits for them, and a decoded
//   panel of 32 rows x 512 columns, twice over, did not fit L1: those forms ran 1.2-1.45x slower than the FMA
//   path at 16 sequences).
// - More chunks (prefill): the panel is decoded whole, then multiplied with every chunk.
HZ_AMX_TARGET void amx_group(const Problem& p, const AmxX& ax, size_t gi, int64_t t0, int64_t t1, uint16_t* buf) {
  const Group& g = (*p.groups)[gi];
  const int64_t nkt = p.nb, npairs = p.nb / 2;  // k-tiles: two per pair of blocks
  const uint32_t* bx = ax.b + (*ax.first_chunk)[gi] * nkt * 256;
  const int64_t panels = (t1 - t0 + kAmxPanelTiles - 1) / kAmxPanelTiles;
  auto tiles = [&](int64_t k) {
    return static_cast<int>(std::min<int64_t>(kAmxPanelTiles, t1 - t0 - k * kAmxPanelTiles));
  };
  auto first_row = [&](int64_t k) { return 16 * (t0 + k * kAmxPanelTiles); };
  alignas(64) float c[kAmxPanelTiles * 256];
  auto scatter = [&](int64_t k, int64_t i0) {
    hz::scatter_tiles(c, tiles(k), std::min<int64_t>(16, g.count - i0), p.row_of + g.start + i0, p.out, p.N,
                      first_row(k));
  };
  // whether panel k goes to AMX; if not, its rows are computed here and now
  auto usable = [&](int64_t k) {
    if (!has_subnormal_blocks(p, g.expert, first_row(k), 16 * tiles(k))) return true;
    exact_rows(p, g, first_row(k), first_row(k) + 16 * tiles(k));
    return false;
  };
  // what decode_pair fetches for pair q of panel k, a cache line a row: the same line of the panel two ahead's
  // rows (each line holds two pairs), with that panel's scale bytes at q = 0
  auto ahead = [&](int64_t k, int64_t q) -> const uint8_t* {
    if (k + 2 >= panels || (q * 2 * kBlockBytes) % 64 != 0) return nullptr;
    const int64_t n = first_row(k + 2);
    if (q == 0)
      for (int64_t l = 0; l < 16 * tiles(k + 2) * p.nb; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p.scl(g.expert, n) + l), _MM_HINT_T0);
    return p.blk(g.expert, n) + q * 2 * kBlockBytes;
  };
  auto products = [&](const uint16_t* a, const uint32_t* b, int nt) {  // one k-tile: A tiles a (nt of them), B b
    _tile_loadd(4, b, 64);
    _tile_loadd(2, a, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (nt > 1) {
      _tile_loadd(3, a + 512, 64);
      _tile_dpbf16ps(1, 3, 4);
    }
  };
  const int64_t slot = 2 * kAmxPanelTiles * 512;  // one pair of k-tiles
  if (g.count > 16) {
    for (int64_t k = 0; k < panels; ++k) {
      if (!usable(k)) continue;
      const int nt = tiles(k);
      for (int64_t q = 0; q < npairs; ++q) {
        decode_pair(p.blk(g.expert, first_row(k)), p.scl(g.expert, first_row(k)), p.nb, q, 16 * nt, buf + q * slot,
                    buf + q * slot + nt * 512, ahead(k, q));
      }
      // two chunks at a time: four independent accumulators (weight tile x chunk), each A and B tile loaded once
      // for two products (one chunk at a time: a 2,048-token gate_up call 14.2 ms, against 12.9)
      for (int64_t i0 = 0; i0 < g.count; i0 += 32) {
        const bool two = i0 + 16 < g.count;
        const uint32_t* b0 = bx + (i0 / 16) * nkt * 256;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < nkt; ++t) {
          const uint16_t* a = buf + (t / 2) * slot + (t % 2) * nt * 512;
          _tile_loadd(4, a, 64);
          _tile_loadd(6, b0 + t * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (nt > 1) {
            _tile_loadd(5, a + 512, 64);
            _tile_dpbf16ps(1, 5, 6);
          }
          if (two) {
            _tile_loadd(7, b0 + (nkt + t) * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            if (nt > 1) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        scatter(k, i0);
        if (two) {
          _tile_stored(2, c, 64);
          _tile_stored(3, c + 256, 64);
          scatter(k, i0 + 16);
        }
      }
    }
    return;
  }
  std::vector<char> ok(panels, 0);
  const int64_t total = panels * npairs;
  for (int64_t j = 0; j < total + kAmxLag; ++j) {
    if (j < total) {  // decode pair q of panel k into slot j % (kAmxLag + 1)
      const int64_t k = j / npairs, q = j % npairs;
      if (q == 0) ok[k] = usable(k);
      if (ok[k]) {
        uint16_t* lo = buf + (j % (kAmxLag + 1)) * slot;
        decode_pair(p.blk(g.expert, first_row(k)), p.scl(g.expert, first_row(k)), p.nb, q, 16 * tiles(k), lo,
                    lo + tiles(k) * 512, ahead(k, q));
      }
    }
    const int64_t jj = j - kAmxLag;
    if (jj < 0 || jj >= total || !ok[jj / npairs]) continue;
    const int64_t k = jj / npairs, q = jj % npairs;
    const int nt = tiles(k);
    if (q == 0) {
      _tile_zero(0);
      _tile_zero(1);
    }
    const uint16_t* lo = buf + (jj % (kAmxLag + 1)) * slot;
    products(lo, bx + 2 * q * 256, nt);
    products(lo + nt * 512, bx + (2 * q + 1) * 256, nt);
    if (q == npairs - 1) {
      _tile_stored(0, c, 64);
      _tile_stored(1, c + 256, 64);
      scatter(k, 0);
    }
  }
}

// Weight tiles t0..t1 of every group: the AMX groups on tiles, the others on the FMA path.
HZ_AMX_TARGET void amx_rows(const Problem& p, const AmxX& ax, const std::vector<char>& on_amx, int64_t t0, int64_t t1) {
  // a decoded panel (groups of more than 16 rows), or the ring of one-chunk groups, whichever is larger
  hz::AlignedVector<uint16_t> decoded(std::max<int64_t>(p.nb / 2, kAmxLag + 1) * 2 * kAmxPanelTiles * 512);
  const int64_t tile = buffer_tile(p);
  std::vector<float> buf;
  hz::tiles_begin();
  for (size_t gi = 0; gi < p.groups->size(); ++gi) {
    if (on_amx[gi]) {
      amx_group(p, ax, gi, t0, t1, decoded.data());
    } else {
      group_avx512(p, (*p.groups)[gi], 16 * t0, 16 * t1, buf, tile);
    }
  }
  hz::tiles_end();
}

#endif

// ---------------------------------------------------------------------------------------------------
// int8 activations (opt-in; see the top of the file).

constexpr int64_t kSet = 16;                   // blocks per AVX-512 pass (one int32 lane each)
constexpr int64_t kSetBytes = kSet * kBlock;   // int8 activations of one pass
constexpr int kQ8MaxRows = 4;                  // rows of x per decoded pass of weights
constexpr int kLaneBlock[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};  // dword lane -> block

// 2 * E2M1 as a signed integer (the portable path) and plus 12 as the unsigned byte vpdpbusd takes.
constexpr int8_t kFP4x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

struct Q8 {
  int64_t nsets = 0;
  // the portable path: x's rows in group order, natural column order (0 past K), and each block's scale
  hz::AlignedVector<int8_t> q;       // [M, nsets * 512]
  hz::AlignedVector<float> scale;    // [M, nsets * 16] (0 for an all-zero block, NaN for one not finite)
  // the AVX-512 path, per row and pass of 16 blocks:
  hz::AlignedVector<int8_t> lanes;   // [M, nsets, 512]: q in the order the lanes read it
  hz::AlignedVector<int32_t> init;   // [M, nsets, 16]: -12 * (sum of the lane's block of q)
  hz::AlignedVector<float> half;     // [M, nsets, 16]: the lane's block scale / 2
};

// One block's scale and int8 values: scale = amax / 127, q = round(x / scale) half to even (nearbyint
// under the default rounding mode, as torch.round), clamped to +-127. A block holding NaN or +-Inf gets a
// NaN scale and q = 0, so the outputs it touches are NaN, as they are with fp32 activations. Returns the scale.
float quantize_block(const float* src, int64_t n, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < n; ++k) {
    finite = finite && std::isfinite(src[k]);
    amax = std::max(amax, std::fabs(src[k]));
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  const float s = amax / 127.0f;
  if (s != 0.0f)
    for (int64_t k = 0; k < n; ++k) q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(src[k] / s), -127.0f, 127.0f));
  return s;
}

Q8 quantize_rows(const float* x, int64_t K, int64_t nb, const std::vector<int64_t>& row_of) {
  Q8 a;
  const int64_t M = static_cast<int64_t>(row_of.size());
  a.nsets = (nb + kSet - 1) / kSet;
  const int64_t width = a.nsets * kSetBytes, nblocks = a.nsets * kSet;
  a.q.assign(M * width, 0);
  a.scale.assign(M * nblocks, 0.0f);
  at::parallel_for(0, M, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t b = 0; b < nb; ++b)
        a.scale[i * nblocks + b] = quantize_block(x + row_of[i] * K + b * kBlock, std::min(kBlock, K - b * kBlock),
                                                  a.q.data() + i * width + b * kBlock);
  });
  return a;
}

void q8_portable(const Problem& p, const Q8& a, int64_t n0, int64_t n1) {
  const float* st = scale_table();
  const int64_t width = a.nsets * kSetBytes, nblocks = a.nsets * kSet;
  for (const Group& g : *p.groups) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wb = p.blk(g.expert, n);
      const uint8_t* ws = p.scl(g.expert, n);
      for (int64_t i = g.start; i < g.start + g.count; ++i) {
        const int8_t* q = a.q.data() + i * width;
        float acc = 0.0f;
        for (int64_t b = 0; b < p.nb; ++b) {
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) {
            const uint8_t byte = wb[b * kBlockBytes + j];
            dot += kFP4x2[byte & 15] * q[b * kBlock + 2 * j] + kFP4x2[byte >> 4] * q[b * kBlock + 2 * j + 1];
          }
          acc += static_cast<float>(dot) * (st[ws[b]] * (0.5f * a.scale[i * nblocks + b]));
        }
        p.out[p.row_of[i] * p.N + n] = acc;
      }
    }
  }
}

#if HZ_HAVE_AVX512

#define HZ_VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vnni")))

bool cpu_has_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

// quantize_rows for the VNNI path, with the same numbers (IEEE division, round half to even), written
// straight into the lane order: a block's 32 values are quantised in two registers, split into [16 even |
// 16 odd] elements (the low / high nibbles' order), and its 8 dwords go to lane kLaneBlock^-1(block) of
// the 8 (t, h) rows (kLaneBlock is a 4x4 transpose, its own inverse).
HZ_VNNI void quantize_lane_rows(Q8& a, const float* x, int64_t K, int64_t nb, const int64_t* row_of, int64_t i0,
                                int64_t i1) {
  const int64_t width = a.nsets * kSetBytes;
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t i = i0; i < i1; ++i) {
    const float* src = x + row_of[i] * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * kBlock, n = std::min(kBlock, K - k0);
      const __mmask16 m0 = n >= 16 ? 0xFFFF : (1u << n) - 1, m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : (1u << (n - 16)) - 1;
      const __m512 v0 = _mm512_maskz_loadu_ps(m0, src + k0), v1 = _mm512_maskz_loadu_ps(m1, src + k0 + 16);
      // finite: v - v is 0 (NaN for NaN and +-Inf)
      const __mmask16 f0 = _mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), _mm512_setzero_ps(), _CMP_EQ_OQ);
      const __mmask16 f1 = _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), _mm512_setzero_ps(), _CMP_EQ_OQ);
      const int64_t j = b / kSet, L = kLaneBlock[b % kSet];
      float& half = a.half[(i * a.nsets + j) * 16 + L];
      if ((f0 & f1) != 0xFFFF) {
        half = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float s = amax / 127.0f;
      half = 0.5f * s;
      if (s == 0.0f) continue;
      const __m512 sv = _mm512_set1_ps(s);
      const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_div_ps(v0, sv), rnd))));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_div_ps(v1, sv), rnd))));
      a.init[(i * a.nsets + j) * 16 + L] = -12 * (_mm512_reduce_add_epi32(q0) + _mm512_reduce_add_epi32(q1));
      const __m256i natural = _mm256_set_m128i(_mm512_cvtepi32_epi8(q1), _mm512_cvtepi32_epi8(q0));
      // per 128 bits [8 even | 8 odd]; qwords (0, 2, 1, 3): [16 even | 16 odd] = dwords (h, t) at 4h + t
      alignas(32) int32_t dw[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(dw),
                         _mm256_permute4x64_epi64(_mm256_shuffle_epi8(natural, split), 0xD8));
      int32_t* dst = reinterpret_cast<int32_t*>(a.lanes.data() + i * width + j * kSetBytes);
      for (int t = 0; t < 4; ++t)
        for (int h = 0; h < 2; ++h) dst[(t * 2 + h) * 16 + L] = dw[4 * h + t];
    }
  }
}

Q8 quantize_lanes(const float* x, int64_t K, int64_t nb, const std::vector<int64_t>& row_of) {
  Q8 a;
  const int64_t M = static_cast<int64_t>(row_of.size());
  a.nsets = (nb + kSet - 1) / kSet;
  a.lanes.assign(M * a.nsets * kSetBytes, 0);
  a.init.assign(M * a.nsets * kSet, 0);
  a.half.assign(M * a.nsets * kSet, 0.0f);
  // a lambda does not inherit the target attribute: the body is its own function
  at::parallel_for(0, M, 8, [&](int64_t i0, int64_t i1) { quantize_lane_rows(a, x, K, nb, row_of.data(), i0, i1); });
  return a;
}

// The 16 blocks of pass j of one weight row, decoded: w[2t] / w[2t + 1] = the low / high nibbles of every
// lane's dword t as 2*E2M1 + 12, and the lanes' weight scales 2^(s - 127) (from the bits, as scale_table:
// s = 0 is 2^-127, 0xFF NaN).
struct Decoded {
  __m512i w[8];
  __m512 scale;
};

HZ_VNNI inline void decode_pass(const uint8_t* wb, const uint8_t* ws, int64_t nb, int64_t j, Decoded& d) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t blocks = std::min(kSet, nb - j * kSet);  // the last pass may hold fewer than 16
  __m512i z[4];
  for (int i = 0; i < 4; ++i) {
    const int64_t bytes = std::clamp<int64_t>((blocks - 4 * i) * kBlockBytes, 0, 64);
    const uint8_t* src = wb + (j * kSet + 4 * i) * kBlockBytes;
    z[i] = bytes == 64 ? _mm512_loadu_si512(src)
           : bytes == 0 ? _mm512_setzero_si512()
                        : _mm512_maskz_loadu_epi8((~0ULL) >> (64 - bytes), src);  // zero bytes: weight 12, x 0
  }
  // 4x4 transpose of dwords: z[i] lane q dword t = block 4i+q dword t  ->  dword t of block 4i+q in lane 4q+i
  const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
  const __m512i t4[4] = {_mm512_unpacklo_epi64(a0, a2), _mm512_unpackhi_epi64(a0, a2), _mm512_unpacklo_epi64(a1, a3),
                         _mm512_unpackhi_epi64(a1, a3)};
  for (int t = 0; t < 4; ++t) {
    d.w[2 * t] = _mm512_shuffle_epi8(lut, _mm512_and_si512(t4[t], low4));
    d.w[2 * t + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(t4[t], 4), low4));
  }
  __m128i sb;
  if (blocks == kSet) {
    sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + j * kSet));
  } else {
    alignas(16) uint8_t tail[16] = {0};
    std::memcpy(tail, ws + j * kSet, blocks);
    sb = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
  }
  const __m512i s = _mm512_permutexvar_epi32(_mm512_loadu_si512(kLaneBlock), _mm512_cvtepu8_epi32(sb));
  __m512i bits = _mm512_slli_epi32(s, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
  d.scale = _mm512_castsi512_ps(bits);
}

// Four vectors -> their four sums (fewer shuffles than four reductions), each summed in the same order.
HZ_VNNI inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 e) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
  const __m512 ce = _mm512_add_ps(_mm512_unpacklo_ps(c, e), _mm512_unpackhi_ps(c, e));
  const __m512 abce = _mm512_add_ps(_mm512_shuffle_ps(ab, ce, 0x44), _mm512_shuffle_ps(ab, ce, 0xEE));  // a b c e
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abce),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abce), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// How far ahead q8_tile fetches weight rows. Without it the hardware prefetcher left the int8 path waiting on
// memory: cold weights took 1.85x as long as L3-resident ones at 16 sequences (gate_up, 2 threads), 1.39x with
// 8 rows (600 against 777 us a call; 163 against 180 at 4 sequences). 16 rows against 8, cold, alternated in
// one process: gate_up 574 -> 520 us at 16 sequences, 169 -> 122 at 4; down unchanged at 16 (350 / 356),
// 92 -> 75 at 4; 32 and 64 rows were mixed (gate_up a little faster, down slower).
constexpr int64_t kPrefetchRows = 16;

// R rows of x (grouped rows i0.., one expert) against output rows n..n+NT-1: R*NT independent chains, each
// split in two int32 accumulators (low and high nibbles) so the vpdpbusd latency overlaps.
template <int R, int NT>
HZ_VNNI void q8_tile(const Problem& p, const Q8& a, int64_t expert, int64_t i0, int64_t n, float* res) {
  const int64_t width = a.nsets * kSetBytes;
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < a.nsets; ++j) {
    for (int t = 0; t < NT; ++t) {  // one output row decoded at a time: 9 registers, no spills
      {  // this pass of the row kPrefetchRows ahead (the last row at the end): its 4 lines of blocks, its scales
        const int64_t row = std::min(n + t + kPrefetchRows, p.N - 1);
        const uint8_t* ahead = p.blk(expert, row) + j * kSet * kBlockBytes;
        for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p.scl(expert, row) + j * kSet), _MM_HINT_T0);
      }
      Decoded d;
      decode_pass(p.blk(expert, n + t), p.scl(expert, n + t), p.nb, j, d);
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + r;
        const int8_t* x = a.lanes.data() + i * width + j * kSetBytes;
        __m512i lo = _mm512_loadu_si512(a.init.data() + (i * a.nsets + j) * 16), hi = _mm512_setzero_si512();
        for (int k = 0; k < 8; k += 2) {
          lo = _mm512_dpbusd_epi32(lo, d.w[k], _mm512_loadu_si512(x + 64 * k));
          hi = _mm512_dpbusd_epi32(hi, d.w[k + 1], _mm512_loadu_si512(x + 64 * k + 64));
        }
        const __m512 half = _mm512_loadu_ps(a.half.data() + (i * a.nsets + j) * 16);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(d.scale, half),
                                    acc[r][t]);
      }
    }
  }
  // every row summed in the same order whatever R and NT are (a row's result never depends on its batch)
  for (int r = 0; r < R; ++r) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum4(acc[r][0], acc[r][1 % NT], acc[r][2 % NT], acc[r][3 % NT]));
    for (int t = 0; t < NT; ++t) res[r * NT + t] = sums[t];
  }
}

// ---------------------------------------------------------------------------------------------------
// int8 activations on AVX2 (CPUs without AVX-512 VNNI): the same numbers as the VNNI path, on 8 lanes. A pass is
// 8 blocks; a 4x4 transpose of dwords within each 128-bit half puts block kLaneBlock8[L] in dword lane L, so
// each int32 lane again accumulates one block and the scales apply per lane once per pass. Without vpdpbusd a
// lane's products go through vpmaddubsw (unsigned weights 2*E2M1 + 12 in [0, 24] times signed activations,
// pairs summed into int16: at most 2 * 24 * 127 = 6,096, so no saturation), four of those summed in int16
// (at most 24,384) and vpmaddwd against ones into int32: exact, as vpdpbusd is.

constexpr int64_t kSet8 = 8;                    // blocks per AVX2 pass
constexpr int64_t kSet8Bytes = kSet8 * kBlock;  // int8 activations of one pass
constexpr int kLaneBlock8[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // dword lane -> block (4q + i -> 2i + q)

// quantize_rows' numbers (quantize_block) in the AVX2 path's lane order: per row and pass, vector 2t + h holds in
// lane L the 4 activations that dword t of block kLaneBlock8[L] multiplies in its low (h = 0: even elements
// 8t, 8t + 2, ...) or high nibbles (h = 1: odd elements); init and half as in Q8, per lane.
Q8 quantize_lanes8(const float* x, int64_t K, int64_t nb, const std::vector<int64_t>& row_of) {
  Q8 a;
  const int64_t M = static_cast<int64_t>(row_of.size());
  a.nsets = (nb + kSet8 - 1) / kSet8;
  const int64_t width = a.nsets * kSet8Bytes;
  a.lanes.assign(M * width, 0);
  a.init.assign(M * a.nsets * kSet8, 0);
  a.half.assign(M * a.nsets * kSet8, 0.0f);
  int lane_of[8];
  for (int L = 0; L < 8; ++L) lane_of[kLaneBlock8[L]] = L;
  at::parallel_for(0, M, 8, [&](int64_t i0, int64_t i1) {
    int8_t q[kBlock];
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t b = 0; b < nb; ++b) {
        std::fill(q, q + kBlock, 0);
        const float s = quantize_block(x + row_of[i] * K + b * kBlock, std::min(kBlock, K - b * kBlock), q);
        const int64_t j = b / kSet8, L = lane_of[b % kSet8];
        a.half[(i * a.nsets + j) * kSet8 + L] = 0.5f * s;  // NaN for a block that is not finite (q all 0)
        int32_t sum = 0;
        for (int k = 0; k < kBlock; ++k) sum += q[k];
        a.init[(i * a.nsets + j) * kSet8 + L] = -12 * sum;
        int8_t* dst = a.lanes.data() + i * width + j * kSet8Bytes;
        for (int t = 0; t < 4; ++t)
          for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 4; ++e) dst[(t * 2 + h) * 32 + L * 4 + e] = q[8 * t + 2 * e + h];
      }
  });
  return a;
}

struct Decoded8 {
  __m256i w[8];
  __m256 scale;
};

// The 8 blocks of pass j of one weight row: w[2t] / w[2t + 1] = the low / high nibbles of every lane's dword t as
// 2*E2M1 + 12, and the lanes' weight scales 2^(s - 127).
HZ_AVX2 inline void decode_pass8(const uint8_t* wb, const uint8_t* ws, int64_t nb, int64_t j, Decoded8& d) {
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t blocks = std::min(kSet8, nb - j * kSet8);  // the last pass may hold fewer than 8
  const uint8_t* src = wb + j * kSet8 * kBlockBytes;
  alignas(32) uint8_t tail[kSet8 * kBlockBytes];
  if (blocks < kSet8) {  // zero bytes: weight 12 against x 0
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, src, blocks * kBlockBytes);
    src = tail;
  }
  __m256i z[4];
  for (int i = 0; i < 4; ++i) z[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * i));
  // per 128-bit half q: z[i] dword t = block 2i+q dword t  ->  dword t of block 2i+q in lane 4q+i
  const __m256i a0 = _mm256_unpacklo_epi32(z[0], z[1]), a1 = _mm256_unpackhi_epi32(z[0], z[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(z[2], z[3]), a3 = _mm256_unpackhi_epi32(z[2], z[3]);
  const __m256i t4[4] = {_mm256_unpacklo_epi64(a0, a2), _mm256_unpackhi_epi64(a0, a2), _mm256_unpacklo_epi64(a1, a3),
                         _mm256_unpackhi_epi64(a1, a3)};
  for (int t = 0; t < 4; ++t) {
    d.w[2 * t] = _mm256_shuffle_epi8(lut, _mm256_and_si256(t4[t], low4));
    d.w[2 * t + 1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(t4[t], 4), low4));
  }
  uint64_t sb = 0;
  std::memcpy(&sb, ws + j * kSet8, blocks);
  const __m256i s = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sb))),
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLaneBlock8)));
  __m256i bits = _mm256_slli_epi32(s, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(s, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(s, _mm256_set1_epi32(255)));
  d.scale = _mm256_castsi256_ps(bits);
}

// As q8_tile, on 8 lanes.
template <int R, int NT>
HZ_AVX2 void q8_tile_avx2(const Problem& p, const Q8& a, int64_t expert, int64_t i0, int64_t n, float* res) {
  const int64_t width = a.nsets * kSet8Bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.nsets; ++j) {
    for (int t = 0; t < NT; ++t) {
      {  // this pass of the row kPrefetchRows ahead (the last row at the end): its 2 lines of blocks, its scales
        const int64_t row = std::min(n + t + kPrefetchRows, p.N - 1);
        const uint8_t* ahead = p.blk(expert, row) + j * kSet8 * kBlockBytes;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p.scl(expert, row) + j * kSet8), _MM_HINT_T0);
      }
      Decoded8 d;
      decode_pass8(p.blk(expert, n + t), p.scl(expert, n + t), p.nb, j, d);
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + r;
        const __m256i* x = reinterpret_cast<const __m256i*>(a.lanes.data() + i * width + j * kSet8Bytes);
        __m256i lane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.init.data() + (i * a.nsets + j) * kSet8));
        for (int k = 0; k < 8; k += 4) {
          __m256i s16 = _mm256_maddubs_epi16(d.w[k], _mm256_loadu_si256(x + k));
          for (int u = 1; u < 4; ++u)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(d.w[k + u], _mm256_loadu_si256(x + k + u)));
          lane = _mm256_add_epi32(lane, _mm256_madd_epi16(s16, ones));
        }
        const __m256 half = _mm256_loadu_ps(a.half.data() + (i * a.nsets + j) * kSet8);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane), _mm256_mul_ps(d.scale, half), acc[r][t]);
      }
    }
  }
  // every row summed in the same order whatever R and NT are (a row's result never depends on its batch)
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = hsum_avx2(acc[r][t]);
}

// R rows of x against output rows n0..n1-1, NT at a time, through one path's tiles (q8_tile for VNNI, q8_tile_avx2).
// A macro, not a template over the tile: each instance needs its path's target attribute for the tile to inline
// into it, and a target attribute cannot depend on a template parameter.
#define HZ_Q8_ROWS(TARGET, NAME, TILE)                                                                          \
  template <int R>                                                                                             \
  TARGET void NAME(const Problem& p, const Q8& a, int64_t expert, int64_t i0, int64_t n0, int64_t n1) {        \
    constexpr int NT = R <= 2 ? 4 : 2;                                                                         \
    float res[R * NT];                                                                                         \
    int64_t n = n0;                                                                                            \
    for (; n + NT <= n1; n += NT) {                                                                            \
      TILE<R, NT>(p, a, expert, i0, n, res);                                                                   \
      for (int r = 0; r < R; ++r)                                                                              \
        for (int t = 0; t < NT; ++t) p.out[p.row_of[i0 + r] * p.N + n + t] = res[r * NT + t];                  \
    }                                                                                                          \
    for (; n < n1; ++n) {                                                                                      \
      TILE<R, 1>(p, a, expert, i0, n, res);                                                                    \
      for (int r = 0; r < R; ++r) p.out[p.row_of[i0 + r] * p.N + n] = res[r];                                  \
    }                                                                                                          \
  }
HZ_Q8_ROWS(HZ_VNNI, q8_rows_vnni, q8_tile)
HZ_Q8_ROWS(HZ_AVX2, q8_rows_avx2, q8_tile_avx2)
#undef HZ_Q8_ROWS

using Q8Fn = void (*)(const Problem&, const Q8&, int64_t, int64_t, int64_t, int64_t);
const Q8Fn kQ8Vnni[kQ8MaxRows] = {q8_rows_vnni<1>, q8_rows_vnni<2>, q8_rows_vnni<3>, q8_rows_vnni<4>};
const Q8Fn kQ8Avx2[kQ8MaxRows] = {q8_rows_avx2<1>, q8_rows_avx2<2>, q8_rows_avx2<3>, q8_rows_avx2<4>};

// Groups of more than 4 rows go 4 at a time over a tile of output rows that stays in L1, so their weights
// are read from memory once and decoded once per 4 rows.
void q8_groups(const Q8Fn* rows, const Problem& p, const Q8& a, int64_t n0, int64_t n1) {
  constexpr int64_t kTile = 16;
  for (const Group& g : *p.groups) {
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = std::min(n1, t0 + kTile);
      for (int64_t r = 0; r < g.count; r += kQ8MaxRows)
        rows[std::min<int64_t>(kQ8MaxRows, g.count - r) - 1](p, a, g.expert, g.start + r, t0, t1);
    }
  }
}

void q8_avx512(const Problem& p, const Q8& a, int64_t n0, int64_t n1) { q8_groups(kQ8Vnni, p, a, n0, n1); }
void q8_avx2(const Problem& p, const Q8& a, int64_t n0, int64_t n1) { q8_groups(kQ8Avx2, p, a, n0, n1); }

#else

bool cpu_has_vnni() { return false; }
Q8 quantize_lanes(const float*, int64_t, int64_t, const std::vector<int64_t>&) { return {}; }
Q8 quantize_lanes8(const float*, int64_t, int64_t, const std::vector<int64_t>&) { return {}; }
void q8_avx512(const Problem& p, const Q8& a, int64_t n0, int64_t n1) { q8_portable(p, a, n0, n1); }
void q8_avx2(const Problem& p, const Q8& a, int64_t n0, int64_t n1) { q8_portable(p, a, n0, n1); }

#endif

// ---------------------------------------------------------------------------------------------------

at::Tensor mxfp4_expert_matmul(const at::Tensor& x_, const at::Tensor& blocks_, const at::Tensor& scales_,
                               const at::Tensor& expert_, bool force_portable, bool int8_activations) {
  TORCH_CHECK(x_.device().is_cpu() && blocks_.device().is_cpu() && scales_.device().is_cpu() &&
                  expert_.device().is_cpu(),
              "mxfp4_expert_matmul: the kernel takes CPU tensors");
  TORCH_CHECK(x_.dim() == 2 && at::isFloatingType(x_.scalar_type()), "mxfp4_expert_matmul: x must be float [M, K], got ",
              x_.scalar_type(), " ", x_.sizes());
  TORCH_CHECK(blocks_.scalar_type() == at::kByte && blocks_.dim() == 4 && blocks_.size(3) == kBlockBytes,
              "mxfp4_expert_matmul: blocks must be uint8 [E, N, nb, 16], got ", blocks_.scalar_type(), " ",
              blocks_.sizes());
  TORCH_CHECK(scales_.scalar_type() == at::kByte && scales_.dim() == 3 && scales_.size(0) == blocks_.size(0) &&
                  scales_.size(1) == blocks_.size(1) && scales_.size(2) == blocks_.size(2),
              "mxfp4_expert_matmul: scales must be uint8 [E, N, nb] matching blocks ", blocks_.sizes(), ", got ",
              scales_.scalar_type(), " ", scales_.sizes());
  const int64_t M = x_.size(0), K = x_.size(1);
  const int64_t E = blocks_.size(0), N = blocks_.size(1), nb = blocks_.size(2), Kp = nb * kBlock;
  TORCH_CHECK((expert_.scalar_type() == at::kLong || expert_.scalar_type() == at::kInt) && expert_.dim() == 1 &&
                  expert_.size(0) == M,
              "mxfp4_expert_matmul: expert must be int64 (or int32) [M] with M = ", M, ", got ", expert_.scalar_type(),
              " ", expert_.sizes());
  TORCH_CHECK(K <= Kp, "mxfp4_expert_matmul: x has ", K, " columns but the weights only ", nb, " blocks of 32");

  at::Tensor out = at::empty({M, N}, x_.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  if (nb == 0) return out.zero_();
  // fp32 activations (bf16 converts exactly), int64 ids; no-ops when they already are
  const at::Tensor x = x_.to(at::kFloat).contiguous(), expert = expert_.to(at::kLong).contiguous();
  const at::Tensor blocks = blocks_.contiguous(), scales = scales_.contiguous();

  // Group rows by expert: a counting sort on the host.
  const hz::Grouping grouping = hz::group_rows(expert.data_ptr<int64_t>(), M, E, "mxfp4_expert_matmul");
  const std::vector<int64_t>& row_of = grouping.row_of;
  Problem p;
  p.groups = &grouping.groups;
  p.blocks = blocks.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<uint8_t>();
  p.N = N;
  p.nb = nb;
  p.Kp = Kp;
  p.row_of = row_of.data();
  p.out = out.data_ptr<float>();
  if (int8_activations) {
    const bool vnni = !force_portable && cpu_has_vnni();
    const bool avx2 = !force_portable && !vnni && cpu_has_avx2();
    const Q8 q8 = vnni ? quantize_lanes(x.data_ptr<float>(), K, nb, row_of)
                  : avx2 ? quantize_lanes8(x.data_ptr<float>(), K, nb, row_of)
                         : quantize_rows(x.data_ptr<float>(), K, nb, row_of);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (vnni) {
        q8_avx512(p, q8, n0, n1);
      } else if (avx2) {
        q8_avx2(p, q8, n0, n1);
      } else {
        q8_portable(p, q8, n0, n1);
      }
    });
    return out;
  }

  // x in group order, each block de-interleaved to [even | odd], zero past column K. As a scalar loop on one
  // thread (the other waiting) this took ~24 us of a 16-sequence step's 400-600 us expert call (`small`, 64
  // rows); vectorised and split over the threads, ~12 us: what is left is moving x and its copy through
  // caches that the previous call's weights have just swept.
  const bool avx512 = !force_portable && cpu_has_avx512();
  const float* xd = x.data_ptr<float>();
  p.x = xd;
  p.K = K;
  // Which groups take the AMX path: x all bf16, and enough rows (kAmxMinGroupRows); their rows need no xg.
  const std::vector<Group>& groups = grouping.groups;
  std::vector<char> on_amx(groups.size(), 0), row_on_amx(M, 0);
  bool amx = false;
#if HZ_HAS_AMX_CODE
  if (avx512 && N % 16 == 0 && nb % 2 == 0 && hz::amx_usable() &&
      std::any_of(groups.begin(), groups.end(), [](const Group& g) { return g.count >= kAmxMinGroupRows; }) &&
      all_bf16(xd, M * K)) {
    amx = true;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      on_amx[gi] = groups[gi].count >= kAmxMinGroupRows;
      if (on_amx[gi]) std::fill(row_on_amx.begin() + groups[gi].start, row_on_amx.begin() + groups[gi].start + groups[gi].count, 1);
    }
  }
#endif
  at::Tensor xg = at::empty({M, Kp}, x.options());  // 64-byte aligned rows (Kp is a multiple of 32)
  float* xgd = xg.data_ptr<float>();
  const bool avx2 = !force_portable && !avx512 && cpu_has_avx2();
  const int64_t whole = avx512 ? K / kBlock : 0;  // blocks without a tail past K
  at::parallel_for(0, M, 32, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (row_on_amx[i]) continue;
      const float* src = xd + row_of[i] * K;
      float* dst = xgd + i * Kp;
      for (int64_t b = 0; b < whole; ++b) split_block_avx512(src + b * kBlock, dst + b * kBlock);
      if (avx2) {  // decode_block_avx2's order: per 8 columns, the 4 even ones, then the 4 odd ones
        for (int64_t c = 0; c < Kp; ++c) {
          const int64_t k = (c & ~int64_t{7}) + 2 * (c & 3) + ((c >> 2) & 1);
          dst[c] = k < K ? src[k] : 0.0f;
        }
        continue;
      }
      for (int64_t b = whole; b < nb; ++b) {
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t k = b * kBlock + 2 * j;
          dst[b * kBlock + j] = k < K ? src[k] : 0.0f;
          dst[b * kBlock + 16 + j] = k + 1 < K ? src[k + 1] : 0.0f;
        }
      }
    }
  });

  p.xg = xgd;
#if HZ_HAS_AMX_CODE
  if (amx) {
    std::vector<int64_t> first_chunk;
    hz::AlignedVector<uint32_t> b;
    pack_b_mx(p, grouping, on_amx, first_chunk, b);
    const AmxX ax{b.data(), &first_chunk};
    at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) { amx_rows(p, ax, on_amx, t0, t1); });
    return out;
  }
#endif
  // grain: at least 16 output rows per thread, so a tiny matrix does not pay for waking every thread
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (avx512) {
      rows_avx512(p, n0, n1);
    } else if (avx2) {
      rows_avx2(p, n0, n1);
    } else {
      rows_portable(p, n0, n1);
    }
  });
  return out;
}

bool has_avx512() { return cpu_has_avx512(); }
bool has_avx2() { return !cpu_has_avx512() && cpu_has_avx2(); }
// Which path int8 activations take here: "vnni", "avx2" (also on an AVX-512 CPU without VNNI) or "portable".
std::string int8_path() { return cpu_has_vnni() ? "vnni" : cpu_has_avx2() ? "avx2" : "portable"; }

}  // namespace

// Its own namespace: horizon.quant.kernels wraps this in the `horizon::` custom op (the reference fallback
// included); compiled graphs on a CPU with the kernel built call this one directly.
TORCH_LIBRARY(horizon_kernels, m) {
  m.def("mxfp4_expert_matmul(Tensor x, Tensor blocks, Tensor scales, Tensor expert, bool force_portable=False, "
        "bool int8_activations=False) -> Tensor");
  m.def("has_avx512() -> bool", &has_avx512);
  m.def("has_avx2() -> bool", &has_avx2);
  m.def("int8_path() -> str", &int8_path);
}

// A CPU kernel (not a composite one): a compiled graph calls it directly, with the fake registered in Python
TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("mxfp4_expert_matmul", &mxfp4_expert_matmul); }

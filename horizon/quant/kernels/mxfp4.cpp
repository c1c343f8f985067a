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
//   16-entry fp32 table of E2M1 values already multiplied by the block scale (built from bits, exact:
//   the products have at most 2 significant bits; NaN for 0xFF), so the decode is 2 permutes.
// - Up to kFusedMaxRows rows per expert: decode straight into FMAs (the decode phase of batch decoding).
//   More rows (prefill): decode a tile of output rows into a small fp32 buffer once, then a register-
//   blocked 4x4 microkernel, so the decode cost stays once per weight while the FMAs dominate.
// - Parallel over output rows N (at::parallel_for): every chunk does the same work for every expert,
//   which balances however the tokens are routed.
// - The AVX-512 functions carry __attribute__((target(...))) so the file builds with no -march flag;
//   the choice is made at run time (__builtin_cpu_supports), with a portable C++ path otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "grouping.h"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define HZ_HAVE_AVX512 1
#include <immintrin.h>
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

using hz::Group;

struct Problem {
  const uint8_t* blocks;   // [E, N, nb, 16]
  const uint8_t* scales;   // [E, N, nb]
  int64_t N, nb, Kp;       // Kp = nb * 32
  const float* xg;         // [M, Kp]: x's rows in group order, de-interleaved per block, zero-padded
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
// AVX-512 path.

#if HZ_HAVE_AVX512

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

// One block: (lo, hi) = weights of the block's even and odd elements.
HZ_AVX512 inline void decode_block(const uint8_t* bytes16, float scale, __m512 fp4, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16)));
  const __m512 table = _mm512_mul_ps(fp4, _mm512_set1_ps(scale));
  lo = _mm512_permutexvar_ps(b, table);  // vpermps reads only the index's low 4 bits: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

// R rows of x (one expert) against NT consecutive output rows, decoding straight into FMAs.
// NT > 1 when R is small keeps enough independent accumulator chains to hide the FMA latency.
template <int R, int NT>
HZ_AVX512 void fused_tile(const uint8_t* blocks, const uint8_t* scales, int64_t nb, const float* x, int64_t Kp,
                          float* res) {
  const float* st = scale_table();
  const __m512 fp4 = _mm512_load_ps(kFP4);
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b & 3) == 0) {  // the next tile's bytes, a cache line (4 blocks) per row at a time: see rows.cpp
      for (int t = 0; t < NT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(blocks + ((NT + t) * nb + b) * kBlockBytes), _MM_HINT_T0);
    }
    for (int t = 0; t < NT; ++t) {
      __m512 lo, hi;
      decode_block(blocks + (t * nb + b) * kBlockBytes, st[scales[t * nb + b]], fp4, lo, hi);
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
  const float* st = scale_table();
  const __m512 fp4 = _mm512_load_ps(kFP4);
  for (int64_t i = 0; i < T * nb; ++i) {  // rows are contiguous in the packed storage
    __m512 lo, hi;
    decode_block(blocks + i * kBlockBytes, st[scales[i]], fp4, lo, hi);
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

using MicroFn = void (*)(const float*, const float*, int64_t, float*);
const MicroFn kMicro[4][4] = {
    {micro<1, 1>, micro<1, 2>, micro<1, 3>, micro<1, 4>},
    {micro<2, 1>, micro<2, 2>, micro<2, 3>, micro<2, 4>},
    {micro<3, 1>, micro<3, 2>, micro<3, 3>, micro<3, 4>},
    {micro<4, 1>, micro<4, 2>, micro<4, 3>, micro<4, 4>},
};

HZ_AVX512 void buffered_group(const Problem& p, const Group& g, int64_t n0, int64_t n1, float* buf, int64_t tile) {
  const float* x = p.xg + g.start * p.Kp;
  const int64_t* rows = p.row_of + g.start;
  float res[16];
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t T = std::min(tile, n1 - t0);
    decode_rows(p.blk(g.expert, t0), p.scl(g.expert, t0), p.nb, T, buf);  // once per weight
    for (int64_t r0 = 0; r0 < g.count; r0 += kRowChunk) {
      const int64_t r1 = std::min(g.count, r0 + kRowChunk);
      for (int64_t j0 = 0; j0 < T; j0 += 4) {
        const int nr = static_cast<int>(std::min<int64_t>(4, T - j0));
        for (int64_t r = r0; r < r1; r += 4) {
          const int mr = static_cast<int>(std::min<int64_t>(4, r1 - r));
          kMicro[mr - 1][nr - 1](x + r * p.Kp, buf + j0 * p.Kp, p.Kp, res);
          for (int i = 0; i < mr; ++i)
            for (int j = 0; j < nr; ++j) p.out[rows[r + i] * p.N + t0 + j0 + j] = res[i * 4 + j];
        }
      }
    }
  }
}

void rows_avx512(const Problem& p, int64_t n0, int64_t n1) {
  // output rows per decoded tile: a multiple of 4 that keeps the buffer near kTileBytes
  const int64_t tile = std::max<int64_t>(4, (kTileBytes / (4 * p.Kp)) / 4 * 4);
  std::vector<float> buf;
  for (const Group& g : *p.groups) {
    if (g.count <= kFusedMaxRows) {
      kFused[g.count - 1](p, g, n0, n1);
    } else {
      if (buf.empty()) buf.resize(tile * p.Kp);
      buffered_group(p, g, n0, n1, buf.data(), tile);
    }
  }
}

#else

bool cpu_has_avx512() { return false; }
void rows_avx512(const Problem& p, int64_t n0, int64_t n1) { rows_portable(p, n0, n1); }

#endif

// ---------------------------------------------------------------------------------------------------

at::Tensor mxfp4_expert_matmul(const at::Tensor& x_, const at::Tensor& blocks_, const at::Tensor& scales_,
                               const at::Tensor& expert_, bool force_portable) {
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

  // x in group order, each block de-interleaved to [even | odd], zero past column K.
  std::vector<float> xg(M * Kp);
  const float* xd = x.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    const float* src = xd + row_of[i] * K;
    float* dst = xg.data() + i * Kp;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t k = b * kBlock + 2 * j;
        dst[b * kBlock + j] = k < K ? src[k] : 0.0f;
        dst[b * kBlock + 16 + j] = k + 1 < K ? src[k + 1] : 0.0f;
      }
    }
  }

  p.blocks = blocks.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<uint8_t>();
  p.N = N;
  p.nb = nb;
  p.Kp = Kp;
  p.xg = xg.data();
  p.row_of = row_of.data();
  p.out = out.data_ptr<float>();
  const bool avx512 = !force_portable && cpu_has_avx512();
  // grain: at least 16 output rows per thread, so a tiny matrix does not pay for waking every thread
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (avx512) {
      rows_avx512(p, n0, n1);
    } else {
      rows_portable(p, n0, n1);
    }
  });
  return out;
}

bool has_avx512() { return cpu_has_avx512(); }

}  // namespace

// Its own namespace: horizon.quant.kernels wraps this in the `horizon::` custom op (the reference fallback
// included); compiled graphs on a CPU with the kernel built call this one directly.
TORCH_LIBRARY(horizon_kernels, m) {
  m.def("mxfp4_expert_matmul(Tensor x, Tensor blocks, Tensor scales, Tensor expert, bool force_portable=False) "
        "-> Tensor");
  m.def("has_avx512() -> bool", &has_avx512);
}

// A CPU kernel (not a composite one): a compiled graph calls it directly, with the fake registered in Python
TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("mxfp4_expert_matmul", &mxfp4_expert_matmul); }

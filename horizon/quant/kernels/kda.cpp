// Kimi Delta Attention on the CPU: a batch's decode step on the cached states in place (`kda_decode_`, here
// first) and the chunkwise prefill (`kda_chunk_forward_`, "The chunked prefill" at the end).
//
// One decode step for a batch, each sequence's state updated in place in the cache
// (horizon.model.kda: `kda_recurrent` for one token is the reference). Per sequence b and head h, with
// S = state[slot[b], h] (d_k x d_v, fp32) and alpha = exp(g) computed by the caller:
//
//     S <- Diag(alpha) S;  u = S^T k;  S <- S + (beta k) (v - u)^T;  o = S^T (q * scale)
//
// Why: the same step in PyTorch (even compiled) gathers the batch's states out of the cache, makes several
// passes over them and scatters them back: ~390 us for 16 sequences x 8 heads of 64 x 64 (2 MB of state) on
// this project's 2-core machine, against ~60 us for one read and one write of those 2 MB. Here each (sequence,
// head) state is read once into L1 (16 KB), updated, and written back once.
//
// Rows of S are d_v wide: the AVX-512 path takes d_v of 16, 32, 64 or 128 and keeps u and o in registers; on
// CPUs without it the portable code runs compiled for AVX2 (head_avx2), else as it is (the same sums in the same
// order; the AVX-512 and AVX2 paths fuse each multiply-add, so they differ from it in the last bits, as each does
// from the reference's summation order). Work is parallel over (slot, head) pairs; sequences that share a slot
// (the engine's padding rows) update it in batch order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "grouping.h"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define HZ_KDA_AVX512 1
#include <immintrin.h>
#define HZ_KDA_TARGET __attribute__((target("avx512f,fma")))
#include "simd.h"
#else
#define HZ_KDA_AVX512 0
#endif

namespace {

struct Step {
  float* state;                  // [S, H, K, V]
  const int64_t* slot;           // [B]
  const float *q, *k, *v, *alpha, *beta;  // [B, H, K], [B, H, K], [B, H, V], [B, H, K], [B, H]
  float* o;                      // [B, H, V]
  int64_t H, K, V;
  float scale;
};

// The reference's operations, one (b, h) at a time: Diag(alpha) S, u = S^T k, S + bk d^T with bk = beta * k
// and d = v - u, o = S^T (q * scale). Compiled twice: head_portable (SSE2 at most: the kernels are built without
// -march) and, on x86, head_avx2 for CPUs with AVX2 and FMA but no AVX-512, where GCC vectorises the same loops
// on 8 lanes with fused multiply-adds.
__attribute__((always_inline)) inline void head_body(const Step& p, int64_t b, int64_t h, float* u) {
  const int64_t K = p.K, V = p.V, bh = b * p.H + h;
  float* S = p.state + (p.slot[b] * p.H + h) * K * V;
  const float *q = p.q + bh * K, *k = p.k + bh * K, *v = p.v + bh * V, *alpha = p.alpha + bh * K;
  const float beta = p.beta[bh];
  float* o = p.o + bh * V;
  std::fill(u, u + V, 0.0f);
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= alpha[i];
      u[j] += k[i] * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) u[j] = v[j] - u[j];  // d
  std::fill(o, o + V, 0.0f);
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const float bk = beta * k[i], qs = q[i] * p.scale;
    for (int64_t j = 0; j < V; ++j) {
      row[j] += bk * u[j];
      o[j] += qs * row[j];
    }
  }
}

void head_portable(const Step& p, int64_t b, int64_t h, float* u) { head_body(p, b, h, u); }

#if HZ_KDA_AVX512
__attribute__((target("avx2,fma"))) void head_avx2(const Step& p, int64_t b, int64_t h, float* u) {
  head_body(p, b, h, u);
}
#else
void head_avx2(const Step& p, int64_t b, int64_t h, float* u) { head_body(p, b, h, u); }
#endif

using HeadFn = void (*)(const Step&, int64_t, int64_t);

#if HZ_KDA_AVX512

bool kda_cpu_has_avx512() { return hz::cpu_has_avx512(); }
bool kda_cpu_has_avx2() { return hz::cpu_has_avx2(); }

// d_v = 16 * NV: a row of S is NV registers; u and o stay in registers for the whole head.
template <int NV>
HZ_KDA_TARGET void head_avx512(const Step& p, int64_t b, int64_t h) {
  const int64_t K = p.K, V = p.V, bh = b * p.H + h;
  float* S = p.state + (p.slot[b] * p.H + h) * K * V;
  const float *q = p.q + bh * K, *k = p.k + bh * K, *v = p.v + bh * V, *alpha = p.alpha + bh * K;
  __m512 u[NV], o[NV];
  for (int c = 0; c < NV; ++c) u[c] = o[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const __m512 a = _mm512_set1_ps(alpha[i]), ki = _mm512_set1_ps(k[i]);
    for (int c = 0; c < NV; ++c) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), a);
      _mm512_storeu_ps(row + 16 * c, s);
      u[c] = _mm512_fmadd_ps(ki, s, u[c]);
    }
  }
  for (int c = 0; c < NV; ++c) u[c] = _mm512_sub_ps(_mm512_loadu_ps(v + 16 * c), u[c]);  // d
  const float beta = p.beta[bh];
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const __m512 bk = _mm512_set1_ps(beta * k[i]), qs = _mm512_set1_ps(q[i] * p.scale);
    for (int c = 0; c < NV; ++c) {
      const __m512 s = _mm512_fmadd_ps(bk, u[c], _mm512_loadu_ps(row + 16 * c));
      _mm512_storeu_ps(row + 16 * c, s);
      o[c] = _mm512_fmadd_ps(qs, s, o[c]);
    }
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(p.o + bh * V + 16 * c, o[c]);
}

HeadFn head_avx512_for(int64_t V) {
  switch (V) {
    case 16: return head_avx512<1>;
    case 32: return head_avx512<2>;
    case 64: return head_avx512<4>;
    case 128: return head_avx512<8>;
    default: return nullptr;
  }
}

// rows [16, K] -> [K, 16]: 16 consecutive rows with one column of each per vector
HZ_KDA_TARGET inline void transpose_block(const float* src, int64_t K, float* dst) {
  for (int64_t j = 0; j < 16; ++j)
    for (int64_t d = 0; d < K; ++d) dst[d * 16 + j] = src[j * K + d];
}

// One chunk's scores (see "The chunked prefill" below), k, q and G [C, K] contiguous: out_k[i][j] =
// sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d]) and out_q[i][j] the same with q_i, for j <= i; 0 above. buf: 3 C K + 18 K.
HZ_KDA_TARGET void chunk_scores_avx512(const float* k, const float* q, const float* G, int64_t C, int64_t K,
                                       float* out_k, float* out_q, float* buf) {
  // block-transposed [C / 16][K][16] copies: one vector holds a column d of 16 consecutive rows j (ET: the
  // diagonal blocks' decays, carried from row to row)
  float *kT = buf, *ET = kT + C * K, *rT = ET + C * K, *tmp = rT + C * K, *s = tmp + 16 * K;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t J = 0; J < C / 16; ++J) {
    const float* Gr = G + (16 * J + 15) * K;  // block J's last row
    for (int64_t j = 0; j < 16; ++j) {  // the right factor k_j exp(G_r - G_j), formed once per chunk
      const int64_t row = (16 * J + j) * K;
      for (int64_t c = 0; c < K; c += 16) {
        const __m512 e = hz::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(Gr + c), _mm512_loadu_ps(G + row + c)));
        _mm512_storeu_ps(tmp + j * K + c, _mm512_mul_ps(_mm512_loadu_ps(k + row + c), e));
      }
    }
    transpose_block(tmp, K, rT + J * 16 * K);
    transpose_block(k + J * 16 * K, K, kT + J * 16 * K);
  }
  for (int64_t i = 0; i < C; ++i) {
    const int64_t I = i / 16;
    const float *Gi = G + i * K, *ki = k + i * K, *qi = q + i * K;
    float *ok = out_k + i * C, *oq = out_q + i * C;
    for (int64_t J = 0; J < I; ++J) {  // blocks before i's own: the left factor x_i exp(G_i - G_r)
      const float* Gr = G + (16 * J + 15) * K;
      for (int64_t c = 0; c < K; c += 16) {
        const __m512 e = hz::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(Gi + c), _mm512_loadu_ps(Gr + c)));
        _mm512_storeu_ps(s + c, _mm512_mul_ps(_mm512_loadu_ps(ki + c), e));
        _mm512_storeu_ps(s + K + c, _mm512_mul_ps(_mm512_loadu_ps(qi + c), e));
      }
      const float* R = rT + J * 16 * K;
      __m512 ak0 = zero, ak1 = zero, aq0 = zero, aq1 = zero;  // two chains each: half the FMA latency
      for (int64_t d = 0; d < K; d += 2) {
        const __m512 r0 = _mm512_loadu_ps(R + d * 16), r1 = _mm512_loadu_ps(R + (d + 1) * 16);
        ak0 = _mm512_fmadd_ps(_mm512_set1_ps(s[d]), r0, ak0);
        aq0 = _mm512_fmadd_ps(_mm512_set1_ps(s[K + d]), r0, aq0);
        ak1 = _mm512_fmadd_ps(_mm512_set1_ps(s[d + 1]), r1, ak1);
        aq1 = _mm512_fmadd_ps(_mm512_set1_ps(s[K + d + 1]), r1, aq1);
      }
      _mm512_storeu_ps(ok + 16 * J, _mm512_add_ps(ak0, ak1));
      _mm512_storeu_ps(oq + 16 * J, _mm512_add_ps(aq0, aq1));
    }
    // i's own block: E(i, j) = exp(G_i - G_j) = E(i - 1, j) exp(G_i - G_{i-1}) for j < i, 1 at j = i, 0 past it,
    // carried from row to row in ETI ([K][16]): one multiply per (d, 16 columns) where exp(G_i - G_j) took a
    // vector exponential. Values below 1e-30 are flushed to 0 (they are nothing beside 1, and would otherwise
    // go subnormal, which is slow, under strong decay).
    const int li = static_cast<int>(i % 16);
    const float* KT = kT + I * 16 * K;
    float* ETI = ET + I * 16 * K;
    if (li)
      for (int64_t c = 0; c < K; c += 16)
        _mm512_storeu_ps(tmp + c, hz::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(Gi + c),
                                                                    _mm512_loadu_ps(Gi - K + c))));
    const __m512 tiny = _mm512_set1_ps(1e-30f), one = _mm512_set1_ps(1.0f);
    const __mmask16 self = static_cast<__mmask16>(1u << li);
    __m512 ak = zero, aq = zero;
    for (int64_t d = 0; d < K; ++d) {
      __m512 e = li ? _mm512_mul_ps(_mm512_loadu_ps(ETI + d * 16), _mm512_set1_ps(tmp[d])) : zero;
      e = _mm512_mask_mov_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, tiny, _CMP_GE_OQ), e), self, one);
      _mm512_storeu_ps(ETI + d * 16, e);
      const __m512 kd = _mm512_mul_ps(_mm512_loadu_ps(KT + d * 16), e);
      ak = _mm512_fmadd_ps(_mm512_set1_ps(ki[d]), kd, ak);
      aq = _mm512_fmadd_ps(_mm512_set1_ps(qi[d]), kd, aq);
    }
    const __mmask16 upto = static_cast<__mmask16>((2u << (i % 16)) - 1u);  // lanes j <= i
    _mm512_storeu_ps(ok + 16 * I, _mm512_maskz_mov_ps(upto, ak));
    _mm512_storeu_ps(oq + 16 * I, _mm512_maskz_mov_ps(upto, aq));
    std::fill(ok + 16 * (I + 1), ok + C, 0.0f);
    std::fill(oq + 16 * (I + 1), oq + C, 0.0f);
  }
}

// out[i][:] (=, or += with add) alpha * sum_{d < D} a(i, d) B[d][:] for rows i < M, where a(i, d) = A[i * ars + d * acs]
// and rows of B and out are 16 NV wide (strides ldb, ldc). lower: A is zero past its diagonal, so row i stops at
// d = i + 1 (i + 2 for a pair of rows). Two rows at a time: 2 NV independent chains of FMAs.
template <int NV>
HZ_KDA_TARGET void gemm_rows(int64_t M, int64_t D, const float* A, int64_t ars, int64_t acs, const float* Bm,
                             int64_t ldb, float* out, int64_t ldc, float alpha, bool add, bool lower) {
  const __m512 zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < M; i += 2) {
    const bool two = i + 1 < M;
    const int64_t Di = lower ? std::min(D, i + 2) : D;
    const float *a0 = A + i * ars, *a1 = A + (two ? i + 1 : i) * ars;
    __m512 c0[NV], c1[NV];
    for (int c = 0; c < NV; ++c) c0[c] = c1[c] = zero;
    for (int64_t d = 0; d < Di; ++d) {
      const float* b = Bm + d * ldb;
      const __m512 x0 = _mm512_set1_ps(a0[d * acs]), x1 = _mm512_set1_ps(a1[d * acs]);
      for (int c = 0; c < NV; ++c) {
        const __m512 bv = _mm512_loadu_ps(b + 16 * c);
        c0[c] = _mm512_fmadd_ps(x0, bv, c0[c]);
        c1[c] = _mm512_fmadd_ps(x1, bv, c1[c]);
      }
    }
    for (int r = 0; r < (two ? 2 : 1); ++r) {
      float* o = out + (i + r) * ldc;
      for (int c = 0; c < NV; ++c) {
        __m512 v = _mm512_mul_ps(scale, r ? c1[c] : c0[c]);
        if (add) v = _mm512_add_ps(v, _mm512_loadu_ps(o + 16 * c));
        _mm512_storeu_ps(o + 16 * c, v);
      }
    }
  }
}

// X <- (I + L)^-1 X for L strictly lower triangular [C][C] (the diagonal and above are not read) and X of C rows
// 16 N wide (row stride ldx): forward substitution, X_i -= sum_{j < i} L_ij X_j, row i in registers, even and odd
// j in separate chains.
template <int N>
HZ_KDA_TARGET void forward_substitute(int64_t C, const float* L, float* X, int64_t ldx) {
  for (int64_t i = 1; i < C; ++i) {
    float* xi = X + i * ldx;
    __m512 even[N], odd[N];
    for (int c = 0; c < N; ++c) {
      even[c] = _mm512_loadu_ps(xi + 16 * c);
      odd[c] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 1 < i; j += 2) {
      const __m512 l0 = _mm512_set1_ps(L[i * C + j]), l1 = _mm512_set1_ps(L[i * C + j + 1]);
      const float *x0 = X + j * ldx, *x1 = x0 + ldx;
      for (int c = 0; c < N; ++c) {
        even[c] = _mm512_fnmadd_ps(l0, _mm512_loadu_ps(x0 + 16 * c), even[c]);
        odd[c] = _mm512_fnmadd_ps(l1, _mm512_loadu_ps(x1 + 16 * c), odd[c]);
      }
    }
    if (j < i) {
      const __m512 l0 = _mm512_set1_ps(L[i * C + j]);
      for (int c = 0; c < N; ++c) even[c] = _mm512_fnmadd_ps(l0, _mm512_loadu_ps(X + j * ldx + 16 * c), even[c]);
    }
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(xi + 16 * c, _mm512_add_ps(even[c], odd[c]));
  }
}

// One chunked-prefill problem (see "The chunked prefill" below): q, k, g [B, T, H, K], v [B, T, H, V], beta
// [B, T, H], o [B, T, H, V], S [B, H, K, V] the entering states, updated in place into the final ones.
struct Chunked {
  const float *q, *k, *v, *g, *beta;
  float *o, *S;
  int64_t T, H, C;
  float scale;
};

inline int64_t chunk_buffer_floats(int64_t C, int64_t K) { return 5 * C * K + 2 * C * K + 2 * C * C + 3 * C * K + 18 * K + C; }

// Every chunk of sequence b, head h, in order (K = V = 16 N). buf: chunk_buffer_floats(C, K).
template <int N>
HZ_KDA_TARGET void chunked_head(const Chunked& p, int64_t b, int64_t h, float* buf) {
  constexpr int64_t K = 16 * N, V = K, W = K + V;
  const int64_t C = p.C, H = p.H, T = p.T;
  float *qc = buf, *kc = qc + C * K, *G = kc + C * K, *dec = G + C * K, *gl = dec + C * K;
  float *X = gl + C * K, *A = X + C * W, *Aq = A + C * C, *sbuf = Aq + C * C, *beta = sbuf + 3 * C * K + 18 * K;
  float* S = p.S + (b * H + h) * K * V;
  const __m512 zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(p.scale);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t n = std::min(C, T - t0);
    // the chunk's rows, contiguous; past n zeros with g = beta = 0 (the state passes through them unchanged)
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = (b * T + t0 + i) * H + h;
      const bool real = i < n;
      for (int c = 0; c < N; ++c) {
        const int64_t o = 16 * c;
        const __m512 gi = real ? _mm512_loadu_ps(p.g + row * K + o) : zero;
        _mm512_storeu_ps(G + i * K + o, i ? _mm512_add_ps(_mm512_loadu_ps(G + (i - 1) * K + o), gi) : gi);
        _mm512_storeu_ps(qc + i * K + o, real ? _mm512_mul_ps(_mm512_loadu_ps(p.q + row * K + o), scale) : zero);
        _mm512_storeu_ps(kc + i * K + o, real ? _mm512_loadu_ps(p.k + row * K + o) : zero);
        _mm512_storeu_ps(X + i * W + K + o, real ? _mm512_loadu_ps(p.v + row * V + o) : zero);
      }
      beta[i] = real ? p.beta[row] : 0.0f;
    }
    chunk_scores_avx512(kc, qc, G, C, K, A, Aq, sbuf);
    // (I + diag(beta) A) [W | U] = diag(beta) [k exp(G) | v]
    for (int64_t i = 0; i < C; ++i) {
      const __m512 bi = _mm512_set1_ps(beta[i]);
      for (int64_t j = 0; j < i; j += 16)
        _mm512_storeu_ps(A + i * C + j, _mm512_mul_ps(bi, _mm512_loadu_ps(A + i * C + j)));
      for (int c = 0; c < N; ++c) {
        const int64_t o = 16 * c;
        const __m512 e = hz::exp_nonpositive(_mm512_loadu_ps(G + i * K + o));
        _mm512_storeu_ps(X + i * W + o, _mm512_mul_ps(bi, _mm512_mul_ps(_mm512_loadu_ps(kc + i * K + o), e)));
        _mm512_storeu_ps(X + i * W + K + o, _mm512_mul_ps(bi, _mm512_loadu_ps(X + i * W + K + o)));
        _mm512_storeu_ps(dec + i * K + o, _mm512_mul_ps(_mm512_loadu_ps(qc + i * K + o), e));  // q exp(G)
        const __m512 last = _mm512_loadu_ps(G + (C - 1) * K + o);  // k exp(G_last - G)
        _mm512_storeu_ps(gl + i * K + o, _mm512_mul_ps(_mm512_loadu_ps(kc + i * K + o),
                                                       hz::exp_nonpositive(_mm512_sub_ps(last, _mm512_loadu_ps(G + i * K + o)))));
      }
    }
    forward_substitute<2 * N>(C, A, X, W);
    float *U = X + K, *out = p.o + ((b * T + t0) * H + h) * V;
    gemm_rows<N>(C, K, X, W, 1, S, V, U, W, -1.0f, true, false);            // v_new = U - W S, in U's place
    gemm_rows<N>(n, K, dec, K, 1, S, V, out, H * V, 1.0f, false, false);   // o = q exp(G) S
    gemm_rows<N>(n, C, Aq, C, 1, U, W, out, H * V, 1.0f, true, true);      //   + Aqk v_new
    for (int c = 0; c < N; ++c)  // S <- exp(G_last) S + (k exp(G_last - G))^T v_new
      _mm512_storeu_ps(sbuf + 16 * c, hz::exp_nonpositive(_mm512_loadu_ps(G + (C - 1) * K + 16 * c)));
    for (int64_t d = 0; d < K; ++d) {
      const __m512 a = _mm512_set1_ps(sbuf[d]);
      for (int c = 0; c < N; ++c) _mm512_storeu_ps(S + d * V + 16 * c, _mm512_mul_ps(a, _mm512_loadu_ps(S + d * V + 16 * c)));
    }
    gemm_rows<N>(K, C, gl, 1, K, U, W, S, V, 1.0f, true, false);
  }
}

using ChunkedFn = void (*)(const Chunked&, int64_t, int64_t, float*);

ChunkedFn chunked_head_for(int64_t K) {
  switch (K) {
    case 16: return chunked_head<1>;
    case 32: return chunked_head<2>;
    case 64: return chunked_head<4>;
    case 128: return chunked_head<8>;
    default: return nullptr;
  }
}

#else

bool kda_cpu_has_avx512() { return false; }
bool kda_cpu_has_avx2() { return false; }
HeadFn head_avx512_for(int64_t) { return nullptr; }
using ChunkedFn = void (*)();
ChunkedFn chunked_head_for(int64_t) { return nullptr; }

#endif

// t is a float32 CPU tensor of exactly this shape
void check_rows(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.sizes() == shape, op, ": ", name,
              " must be a float32 CPU tensor ", shape, ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

at::Tensor kda_decode_(at::Tensor& state, const at::Tensor& slot_, const at::Tensor& q_, const at::Tensor& k_,
                       const at::Tensor& v_, const at::Tensor& alpha_, const at::Tensor& beta_, double scale,
                       bool force_portable) {
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kFloat && state.dim() == 4 && state.is_contiguous(),
              "kda_decode_: state must be a contiguous float32 CPU tensor [slots, H, K, V], got ", state.scalar_type(),
              " ", state.sizes(), " on ", state.device());
  const int64_t S = state.size(0), H = state.size(1), K = state.size(2), V = state.size(3);
  TORCH_CHECK(slot_.device().is_cpu() && slot_.dim() == 1 &&
                  (slot_.scalar_type() == at::kLong || slot_.scalar_type() == at::kInt),
              "kda_decode_: slots must be an int64 (or int32) CPU tensor [B], got ", slot_.scalar_type(), " ",
              slot_.sizes());
  const int64_t B = slot_.size(0);
  check_rows("kda_decode_", q_, "q", {B, H, K});
  check_rows("kda_decode_", k_, "k", {B, H, K});
  check_rows("kda_decode_", v_, "v", {B, H, V});
  check_rows("kda_decode_", alpha_, "alpha", {B, H, K});
  check_rows("kda_decode_", beta_, "beta", {B, H});
  const at::Tensor slot = slot_.to(at::kLong).contiguous();
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), alpha = alpha_.contiguous(),
                   beta = beta_.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "kda_decode_: slots[", b, "] = ", sp[b], " is not in [0, ", S, ")");
  // rows by slot, in batch order within a slot: rows sharing one (the engine's padding rows) update it in turn
  const hz::Grouping by_slot = hz::group_rows(sp, B, S, "kda_decode_");
  const std::vector<hz::Group>& groups = by_slot.groups;
  const int64_t G = static_cast<int64_t>(groups.size());

  at::Tensor out = at::empty({B, H, V}, q.options());
  if (B == 0 || H == 0 || V == 0) return out;
  Step p{state.data_ptr<float>(), sp, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
         alpha.data_ptr<float>(), beta.data_ptr<float>(), out.data_ptr<float>(), H, K, V, static_cast<float>(scale)};
  const HeadFn fast = force_portable || !kda_cpu_has_avx512() ? nullptr : head_avx512_for(V);
  const bool avx2 = !force_portable && fast == nullptr && kda_cpu_has_avx2();
  // one work item per (slot, head): no two threads touch the same state
  at::parallel_for(0, G * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> u(V);
    for (int64_t i = i0; i < i1; ++i) {
      const hz::Group& g = groups[i / H];
      const int64_t h = i % H;
      for (int64_t j = g.start; j < g.start + g.count; ++j) {
        if (fast) {
          fast(p, by_slot.row_of[j], h);
        } else if (avx2) {
          head_avx2(p, by_slot.row_of[j], h, u.data());
        } else {
          head_portable(p, by_slot.row_of[j], h, u.data());
        }
      }
    }
  });
  return out;
}

// ---- The chunked prefill: horizon.model.kda.kda_chunkwise_reference, whole ----
// Per sequence b and head h, chunk after chunk of C tokens, with G the cumulative log-decay from the chunk's
// start and S the state entering it (the reference's docstring has the derivation):
//     A[i, j]   = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])  (j < i);  Aqk the same with q_i, j <= i
//     (I + A) [W | U] = diag(beta) [k exp(G) | v]                   (forward substitution)
//     v_new = U - W S;   o = (q exp(G)) S + Aqk v_new;   S <- exp(G_last) S + (k exp(G_last - G))^T v_new
// Why: the reference makes ~30 PyTorch calls a group of chunks and ~8 a chunk, over [.., C, C, K]-sized decay
// temporaries: 20 ms for 512 tokens of `small`'s 8 heads of 64, a fifth of an eager 512-token prefill. Here
// one (sequence, head) keeps its chunk's rows, scores and state in L1 and L2 (~200 KB at C = K = 64).
// The scores: one row i against 16 columns j at once (a vector, j in lanes); a block J of columns before i's
// block factorises through J's last row r, as in the reference, (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)), the
// right factor formed once per chunk; i's own block carries exp(G_i - G_j) from row i - 1 as a running product of
// the per-token decays exp(G_i - G_{i-1}) (one multiply per (d, 16 columns), where a vector exponential each
// made the kernel 1.2x slower). Every exponent is <= 0 (g = log alpha <= 0) and every product <= 1, so nothing
// overflows however strong the decay.
// AVX-512 only, K = V in {16, 32, 64, 128}, C a multiple of 16: elsewhere (and with gradients: no backward) the
// caller runs the reference, which PyTorch vectorises; a scalar loop here would be slower. Work: parallel over
// (sequence, head) pairs; positions past a sequence's length are whatever the caller padded them with (the
// engine's batches: g = beta = 0, which leave the state unchanged).
at::Tensor kda_chunk_forward_(at::Tensor& state, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                              const at::Tensor& g_, const at::Tensor& beta_, double scale, int64_t chunk) {
  TORCH_CHECK(q_.dim() == 4, "kda_chunk_forward_: q must be [B, T, H, K], got ", q_.sizes());
  const int64_t B = q_.size(0), T = q_.size(1), H = q_.size(2), K = q_.size(3);
  check_rows("kda_chunk_forward_", q_, "q", {B, T, H, K});
  check_rows("kda_chunk_forward_", k_, "k", {B, T, H, K});
  check_rows("kda_chunk_forward_", v_, "v", {B, T, H, K});
  check_rows("kda_chunk_forward_", g_, "g", {B, T, H, K});
  check_rows("kda_chunk_forward_", beta_, "beta", {B, T, H});
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kFloat && state.is_contiguous() &&
                  state.sizes() == at::IntArrayRef({B, H, K, K}),
              "kda_chunk_forward_: state must be a contiguous float32 CPU tensor [", B, ", ", H, ", ", K, ", ", K,
              "], got ", state.scalar_type(), " ", state.sizes());
  TORCH_CHECK(chunk > 0 && chunk % 16 == 0, "kda_chunk_forward_: the chunk size must be a positive multiple of 16, got ",
              chunk);
  const ChunkedFn fn = kda_cpu_has_avx512() ? chunked_head_for(K) : nullptr;
  TORCH_CHECK(fn, "kda_chunk_forward_: needs AVX-512 and K = V in {16, 32, 64, 128}, got K = ", K,
              " (horizon.model.kda.kda_chunkwise_reference otherwise)");
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), g = g_.contiguous(),
                   beta = beta_.contiguous();
  at::Tensor out = at::empty({B, T, H, K}, q.options());
#if HZ_KDA_AVX512
  const Chunked p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                  beta.data_ptr<float>(), out.data_ptr<float>(), state.data_ptr<float>(), T, H, chunk,
                  static_cast<float>(scale)};
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(chunk_buffer_floats(chunk, K));
    for (int64_t i = i0; i < i1; ++i) fn(p, i / H, i % H, buf.data());
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("kda_decode_(Tensor(a!) state, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor alpha, Tensor beta, "
        "float scale, bool force_portable=False) -> Tensor");
  m.def("kda_chunk_forward_(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
        "int chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) {
  m.impl("kda_decode_", &kda_decode_);
  m.impl("kda_chunk_forward_", &kda_chunk_forward_);
}

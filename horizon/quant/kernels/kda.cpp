// One decode step of Kimi Delta Attention for a batch, each sequence's state updated in place in the cache
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
// Rows of S are d_v wide: the AVX-512 path takes d_v of 16, 32, 64 or 128 and keeps u and o in registers;
// portable C++ otherwise (the same sums in the same order; the AVX-512 path fuses each multiply-add, so the two
// differ in the last bits, as either does from the reference's summation order). Work is parallel over
// (slot, head) pairs; sequences that share a slot (the engine's padding rows) update it in batch order.

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
// and d = v - u, o = S^T (q * scale).
void head_portable(const Step& p, int64_t b, int64_t h, float* u) {
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

using HeadFn = void (*)(const Step&, int64_t, int64_t);

#if HZ_KDA_AVX512

bool kda_cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

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

// One chunk of one head (see "The chunked prefill's decayed scores" below). buf: 3 C K + 18 K floats.
HZ_KDA_TARGET void chunk_scores_avx512(const float* k, const float* q, const float* G, int64_t C, int64_t K,
                                       float* out_k, float* out_q, float* buf) {
  // block-transposed [C / 16][K][16] copies: one vector holds a column d of 16 consecutive rows j
  float *kT = buf, *GT = kT + C * K, *rT = GT + C * K, *tmp = rT + C * K, *s = tmp + 16 * K;
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
    transpose_block(G + J * 16 * K, K, GT + J * 16 * K);
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
    // i's own block: exp(G_i - G_j) pairwise; lanes j > i clamped to exp(0) and zeroed on the store
    const float *KT = kT + I * 16 * K, *GTI = GT + I * 16 * K;
    __m512 ak = zero, aq = zero;
    for (int64_t d = 0; d < K; ++d) {
      const __m512 x = _mm512_min_ps(_mm512_sub_ps(_mm512_set1_ps(Gi[d]), _mm512_loadu_ps(GTI + d * 16)), zero);
      const __m512 kd = _mm512_mul_ps(_mm512_loadu_ps(KT + d * 16), hz::exp_nonpositive(x));
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

#else

bool kda_cpu_has_avx512() { return false; }
HeadFn head_avx512_for(int64_t) { return nullptr; }

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
  // one work item per (slot, head): no two threads touch the same state
  at::parallel_for(0, G * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> u(V);
    for (int64_t i = i0; i < i1; ++i) {
      const hz::Group& g = groups[i / H];
      const int64_t h = i % H;
      for (int64_t j = g.start; j < g.start + g.count; ++j) {
        if (fast) {
          fast(p, by_slot.row_of[j], h);
        } else {
          head_portable(p, by_slot.row_of[j], h, u.data());
        }
      }
    }
  });
  return out;
}

// ---- The chunked prefill's decayed scores: horizon.model.kda.decayed_scores(stack((k, q)), k, G) ----
// For each chunk r of one head, with k, q and G [C, K] (G the cumulative log-decay from the chunk's start, so
// non-increasing down the rows):
//     out[0][r][i][j] = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d]),  out[1][r][i][j] the same with q_i;  j <= i, 0 above.
// Why: the PyTorch reference forms [sub, sub, K] and [n, n, sub, K] decay tensors and makes a dozen elementwise
// passes over them: ~50 ms for 16 chunks of 8 heads at `small`, ~85% of a KDA layer's 2,048-token prefill. Here
// one row i is computed against 16 columns j at once (a vector, j in lanes), in L1:
// - a block J of 16 columns before i's block factorises through J's last row r, as in the reference:
//   (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)), the right factor formed once per chunk: K exponentials per (i, J);
// - i's own block takes exp(G_i - G_j) for every (d, j): K vector exponentials per row.
// Every exponent is <= 0, so nothing overflows however strong the decay. AVX-512 only, C and K multiples of 16:
// a scalar loop would be slower than the reference (which PyTorch vectorises), so the caller takes the
// reference elsewhere. Parallel over chunks.
at::Tensor kda_chunk_scores(const at::Tensor& k_, const at::Tensor& q_, const at::Tensor& G_) {
  TORCH_CHECK(k_.dim() == 3, "kda_chunk_scores: k must be [chunks, C, K], got ", k_.sizes());
  const int64_t R = k_.size(0), C = k_.size(1), K = k_.size(2);
  check_rows("kda_chunk_scores", k_, "k", {R, C, K});
  check_rows("kda_chunk_scores", q_, "q", {R, C, K});
  check_rows("kda_chunk_scores", G_, "G", {R, C, K});
  TORCH_CHECK(C % 16 == 0 && K % 16 == 0, "kda_chunk_scores: C and K must be multiples of 16, got C = ", C,
              ", K = ", K);
  TORCH_CHECK(kda_cpu_has_avx512(), "kda_chunk_scores: needs AVX-512 (horizon.model.kda.decayed_scores otherwise)");
  const at::Tensor k = k_.contiguous(), q = q_.contiguous(), G = G_.contiguous();
  at::Tensor out = at::empty({2, R, C, C}, k.options());
#if HZ_KDA_AVX512
  const float *kp = k.data_ptr<float>(), *qp = q.data_ptr<float>(), *Gp = G.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(3 * C * K + 18 * K);
    for (int64_t r = r0; r < r1; ++r)
      chunk_scores_avx512(kp + r * C * K, qp + r * C * K, Gp + r * C * K, C, K, op + r * C * C,
                          op + (R + r) * C * C, buf.data());
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("kda_decode_(Tensor(a!) state, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor alpha, Tensor beta, "
        "float scale, bool force_portable=False) -> Tensor");
  m.def("kda_chunk_scores(Tensor k, Tensor q, Tensor G) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) {
  m.impl("kda_decode_", &kda_decode_);
  m.impl("kda_chunk_scores", &kda_chunk_scores);
}

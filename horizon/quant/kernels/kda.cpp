// Kimi Delta Attention on the CPU: a batch's decode step on the cached states in place (`kda_decode_`, here
// first) and the chunkwise prefill (`kda_chunk_forward_`, "The chunked prefill" at the end; its vector code is
// kda_chunk.h, compiled here for AVX-512 and for AVX2).
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

// One input's (b, h) rows where they lie: any strides over b and h, the last dimension contiguous. Why: in a
// compiled step q, k, v and the gates arrive as views of the fused projections' outputs, and copying each into a
// contiguous tensor cost a clone a KDA layer (16 sequences: ~17 us each, ~0.16 ms a step).
struct Rows {
  const float* data;
  int64_t sb, sh;
  const float* at(int64_t b, int64_t h) const { return data + b * sb + h * sh; }
};

struct Step {
  float* state;                  // [S, H, K, V]
  const int64_t* slot;           // [B]
  Rows q, k, v, alpha, beta;     // [B, H, K], [B, H, K], [B, H, V], [B, H, K], [B, H]
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
  const float *q = p.q.at(b, h), *k = p.k.at(b, h), *v = p.v.at(b, h), *alpha = p.alpha.at(b, h);
  const float beta = *p.beta.at(b, h);
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

// One chunked-prefill problem (see "The chunked prefill" below): q, k, g [B, T, H, K], v [B, T, H, V], beta
// [B, T, H], o [B, T, H, V], S [B, H, K, V] the entering states, updated in place into the final ones.
struct Chunked {
  const float *q, *k, *v, *g, *beta;
  float *o, *S;
  int64_t T, H, C;
  float scale;
};

inline int64_t chunk_buffer_floats(int64_t C, int64_t K) { return 5 * C * K + 2 * C * K + 2 * C * C + 3 * C * K + 18 * K + C; }

using ChunkedFn = void (*)(const Chunked&, int64_t, int64_t, float*);

#if HZ_KDA_AVX512

bool kda_cpu_has_avx512() { return hz::cpu_has_avx512(); }
bool kda_cpu_has_avx2() { return hz::cpu_has_avx2(); }

// d_v = 16 * NV: a row of S is NV registers; u and o stay in registers for the whole head.
template <int NV>
HZ_KDA_TARGET void head_avx512(const Step& p, int64_t b, int64_t h) {
  const int64_t K = p.K, V = p.V, bh = b * p.H + h;
  float* S = p.state + (p.slot[b] * p.H + h) * K * V;
  const float *q = p.q.at(b, h), *k = p.k.at(b, h), *v = p.v.at(b, h), *alpha = p.alpha.at(b, h);
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
  const float beta = *p.beta.at(b, h);
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

// The chunked prefill's vector code (kda_chunk.h), compiled once for AVX-512 (16 lanes) and once for AVX2 (8).
namespace chunk_avx512 {
#define HZ_CT HZ_KDA_TARGET
constexpr int64_t L = 16;
using vec = __m512;
HZ_CT inline vec vzero() { return _mm512_setzero_ps(); }
HZ_CT inline vec set1(float x) { return _mm512_set1_ps(x); }
HZ_CT inline vec load(const float* p) { return _mm512_loadu_ps(p); }
HZ_CT inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
HZ_CT inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
HZ_CT inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
HZ_CT inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
HZ_CT inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
HZ_CT inline vec fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
HZ_CT inline vec vexp(vec x) { return hz::exp_nonpositive(x); }
HZ_CT inline vec own_decay(vec e, vec tiny, int self) {
  return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, tiny, _CMP_GE_OQ), e),
                            static_cast<__mmask16>(1u << self), _mm512_set1_ps(1.0f));
}
HZ_CT inline vec upto(vec v, int last) { return _mm512_maskz_mov_ps(static_cast<__mmask16>((2u << last) - 1u), v); }
#include "kda_chunk.h"
#undef HZ_CT
}  // namespace chunk_avx512

namespace chunk_avx2 {
#define HZ_CT __attribute__((target("avx2,fma")))
constexpr int64_t L = 8;
using vec = __m256;
HZ_CT inline vec vzero() { return _mm256_setzero_ps(); }
HZ_CT inline vec set1(float x) { return _mm256_set1_ps(x); }
HZ_CT inline vec load(const float* p) { return _mm256_loadu_ps(p); }
HZ_CT inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
HZ_CT inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
HZ_CT inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
HZ_CT inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
HZ_CT inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
HZ_CT inline vec fnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
HZ_CT inline vec vexp(vec x) { return hz::exp_nonpositive(x); }
HZ_CT inline __m256i lane_ids() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
HZ_CT inline vec own_decay(vec e, vec tiny, int self) {
  const vec kept = _mm256_and_ps(_mm256_cmp_ps(e, tiny, _CMP_GE_OQ), e);
  return _mm256_blendv_ps(kept, _mm256_set1_ps(1.0f),
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane_ids(), _mm256_set1_epi32(self))));
}
HZ_CT inline vec upto(vec v, int last) {
  return _mm256_and_ps(_mm256_castsi256_ps(hz::lanes_below(last + 1)), v);
}
#include "kda_chunk.h"
#undef HZ_CT
}  // namespace chunk_avx2

#else

bool kda_cpu_has_avx512() { return false; }
bool kda_cpu_has_avx2() { return false; }
HeadFn head_avx512_for(int64_t) { return nullptr; }
namespace chunk_avx512 {
ChunkedFn chunked_head_for(int64_t) { return nullptr; }
}
namespace chunk_avx2 {
ChunkedFn chunked_head_for(int64_t) { return nullptr; }
}

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
  // rows read in place (Rows): only an input whose last dimension is strided is copied
  const auto rows = [](const at::Tensor& t) { return t.stride(-1) != 1 ? t.contiguous() : t; };
  const at::Tensor q = rows(q_), k = rows(k_), v = rows(v_), alpha = rows(alpha_), beta = beta_;
  const auto at_rows = [](const at::Tensor& t) { return Rows{t.data_ptr<float>(), t.stride(0), t.stride(1)}; };
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "kda_decode_: slots[", b, "] = ", sp[b], " is not in [0, ", S, ")");
  // rows by slot, in batch order within a slot: rows sharing one (the engine's padding rows) update it in turn
  const hz::Grouping by_slot = hz::group_rows(sp, B, S, "kda_decode_");
  const std::vector<hz::Group>& groups = by_slot.groups;
  const int64_t G = static_cast<int64_t>(groups.size());

  at::Tensor out = at::empty({B, H, V}, q.options());
  if (B == 0 || H == 0 || V == 0) return out;
  Step p{state.data_ptr<float>(), sp, at_rows(q), at_rows(k), at_rows(v), at_rows(alpha), at_rows(beta),
         out.data_ptr<float>(), H, K, V, static_cast<float>(scale)};
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
// The scores: one row i against L columns j at once (a vector, j in lanes); a block J of columns before i's
// block factorises through J's last row r, as in the reference, (x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)), the
// right factor formed once per chunk; i's own block carries exp(G_i - G_j) from row i - 1 as a running product of
// the per-token decays exp(G_i - G_{i-1}) (one multiply per (d, L columns), where a vector exponential each
// made the kernel 1.2x slower). Every exponent is <= 0 (g = log alpha <= 0) and every product <= 1, so nothing
// overflows however strong the decay.
// AVX-512 (L = 16) or AVX2 (L = 8; kda_chunk.h holds the code, compiled for each), K = V in {16, 32, 64, 128},
// C a multiple of 16: elsewhere (and with gradients: no backward) the caller runs the reference, which PyTorch
// vectorises; a scalar loop here would be slower. Work: parallel over
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
  const ChunkedFn fn = kda_cpu_has_avx512() ? chunk_avx512::chunked_head_for(K)
                       : kda_cpu_has_avx2()   ? chunk_avx2::chunked_head_for(K)
                                              : nullptr;
  TORCH_CHECK(fn, "kda_chunk_forward_: needs AVX-512 or AVX2 and K = V in {16, 32, 64, 128}, got K = ", K,
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

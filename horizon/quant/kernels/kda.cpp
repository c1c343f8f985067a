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

#include <cstdint>
#include <vector>

#include "grouping.h"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define HZ_KDA_AVX512 1
#include <immintrin.h>
#define HZ_KDA_TARGET __attribute__((target("avx512f,fma")))
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

#else

bool kda_cpu_has_avx512() { return false; }
HeadFn head_avx512_for(int64_t) { return nullptr; }

#endif

// t is a float32 CPU tensor of exactly this shape
void check_rows(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.sizes() == shape, "kda_decode_: ", name,
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
  check_rows(q_, "q", {B, H, K});
  check_rows(k_, "k", {B, H, K});
  check_rows(v_, "v", {B, H, V});
  check_rows(alpha_, "alpha", {B, H, K});
  check_rows(beta_, "beta", {B, H});
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("kda_decode_(Tensor(a!) state, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor alpha, Tensor beta, "
        "float scale, bool force_portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("kda_decode_", &kda_decode_); }

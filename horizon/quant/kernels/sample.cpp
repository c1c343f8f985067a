// One token drawn from one row of fp32 logits at temperature T > 0: softmax(logits / T), cut to the top_k best
// logits (every token tied with the k-th stays) and to the nucleus (the fewest most likely tokens whose probability
// reaches top_p, the one that crosses it included), then the first token, in vocabulary order, at which the running
// sum of the kept weights passes u times their total. What horizon.engine.sampler's `candidates` and `draw` do in
// PyTorch (the reference), in one call.
//
// Why: the engine samples each sequence after the forward. In PyTorch that is ~20 small ops a row (0.2-0.3 ms warm
// for a 32K vocabulary on a 2-core Xeon, ~0.7 ms right after a decode step has pushed their code out of the
// caches); here a few passes over the row. How, without sorting the vocabulary: z = (logit - max) / T <= 0 puts
// each token in a bin an eighth of an octave of its weight exp(z) wide (bin 255: everything below 2^-31.9). Counts
// per bin find the bin holding the k-th logit (only its tokens are ranked); weights per bin find the bin where the
// running mass reaches top_p (only its tokens are sorted). Weights below e^-87 (1.6e-38 of the best) count as 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define HZ_SAMPLE_X86 1
#include <immintrin.h>

#include "simd.h"
#else
#define HZ_SAMPLE_X86 0
#endif

namespace {

constexpr int kBins = 256;
constexpr float kBinScale = -8.0f / 0.693147180559945309f;  // -BINS_PER_OCTAVE / ln 2, as the reference's float
constexpr float kExpMin = -87.0f;  // below: weight 0 (the vector exponentials stop there)

inline uint8_t bin_of(float z) {
  const float t = z * kBinScale;  // >= 0; +inf for z = -inf
  return t >= 255.0f ? 255 : static_cast<uint8_t>(t);
}

// w[i] = exp(z[i]) for z = (l - m) / t, 0 below kExpMin; bins[i] = bin_of(z). The vector paths differ from std::exp
// by ~2e-7 relative.
void portable_weights(const float* l, int64_t V, float m, float t, float* w, uint8_t* bins) {
  for (int64_t i = 0; i < V; ++i) {
    const float z = (l[i] - m) / t;
    w[i] = z < kExpMin ? 0.0f : std::exp(z);
    bins[i] = bin_of(z);
  }
}

#if HZ_SAMPLE_X86
__attribute__((target("avx512f"))) void avx512_weights(const float* l, int64_t V, float m, float t, float* w,
                                                        uint8_t* bins) {
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(t), lo = _mm512_set1_ps(kExpMin);
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 z = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(l + i), vm), vt);
    const __mmask16 live = _mm512_cmp_ps_mask(z, lo, _CMP_GE_OQ);
    _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(live, hz::exp_nonpositive(z)));
    const __m512 b = _mm512_min_ps(_mm512_mul_ps(z, _mm512_set1_ps(kBinScale)), _mm512_set1_ps(255.0f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bins + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(b)));
  }
  portable_weights(l + i, V - i, m, t, w + i, bins + i);
}

__attribute__((target("avx512f"))) float avx512_max(const float* l, int64_t V) {
  __m512 best = _mm512_loadu_ps(l);
  int64_t i = 16;
  for (; i + 16 <= V; i += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(l + i));
  float m = _mm512_reduce_max_ps(best);
  for (; i < V; ++i) m = std::max(m, l[i]);
  return m;
}

__attribute__((target("avx2,fma"))) void avx2_weights(const float* l, int64_t V, float m, float t, float* w,
                                                       uint8_t* bins) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(t), lo = _mm256_set1_ps(kExpMin);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 z = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), vm), vt);
    const __m256 live = _mm256_cmp_ps(z, lo, _CMP_GE_OQ);
    _mm256_storeu_ps(w + i, _mm256_and_ps(live, hz::exp_nonpositive(z)));
    for (int j = 0; j < 8; ++j) bins[i + j] = bin_of((l[i + j] - m) / t);
  }
  portable_weights(l + i, V - i, m, t, w + i, bins + i);
}
#endif

float row_max(const float* l, int64_t V, bool force_portable) {
#if HZ_SAMPLE_X86
  if (!force_portable && hz::cpu_has_avx512() && V >= 16) return avx512_max(l, V);
#endif
  float m = -INFINITY;
  for (int64_t i = 0; i < V; ++i) m = std::max(m, l[i]);
  return m;
}

void weights_of(const float* l, int64_t V, float m, float t, float* w, uint8_t* bins, bool force_portable) {
#if HZ_SAMPLE_X86
  if (!force_portable && hz::cpu_has_avx512()) return avx512_weights(l, V, m, t, w, bins);
  if (!force_portable && hz::cpu_has_avx2()) return avx2_weights(l, V, m, t, w, bins);
#endif
  portable_weights(l, V, m, t, w, bins);
}

// Per-bin sums of `w` (counts where w is null), over four interleaved copies so that tokens of the same bin do
// not wait on each other's add.
template <typename T>
std::array<T, kBins> histogram(const uint8_t* bins, const float* w, int64_t V) {
  std::array<std::array<T, kBins>, 4> part{};
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)
    for (int c = 0; c < 4; ++c) part[c][bins[i + c]] += w ? static_cast<T>(w[i + c]) : T(1);
  for (; i < V; ++i) part[0][bins[i]] += w ? static_cast<T>(w[i]) : T(1);
  std::array<T, kBins> out{};
  for (int b = 0; b < kBins; ++b) out[b] = (part[0][b] + part[1][b]) + (part[2][b] + part[3][b]);
  return out;
}

// The draw for one row l[0..V) (arguments checked by the callers); -1 when the row's best logit is not finite.
int64_t sample_one(const float* l, int64_t V, double temperature, int64_t top_k, double top_p, double u,
                   bool force_portable) {
  const float m = row_max(l, V, force_portable);
  if (!std::isfinite(m)) return -1;
  // the reference divides in float: (logits - max) / temperature
  const float t = static_cast<float>(temperature);
  std::unique_ptr<float[]> w(new float[V]);  // (no zero fill: every entry is written next)
  std::unique_ptr<uint8_t[]> bins(new uint8_t[V]);
  weights_of(l, V, m, t, w.get(), bins.get(), force_portable);

  if (top_k > 0 && top_k < V) {
    // the bin holding the k-th largest logit (bins rise as logits fall), then the k-th among its tokens
    const std::array<int64_t, kBins> count = histogram<int64_t>(bins.get(), nullptr, V);
    int kb = 0;
    int64_t above = 0;
    while (above + count[kb] < top_k) above += count[kb++];
    std::vector<float> zs;
    zs.reserve(count[kb]);
    for (int64_t i = 0; i < V; ++i)
      if (bins[i] == kb) zs.push_back((l[i] - m) / t);
    const int64_t r = top_k - above - 1;  // rank within the bin, 0 = its largest
    std::nth_element(zs.begin(), zs.begin() + r, zs.end(), std::greater<float>());
    const float kth = zs[r];
    for (int64_t i = 0; i < V; ++i)
      if (bins[i] > kb || (bins[i] == kb && (l[i] - m) / t < kth)) w[i] = 0.0f;
  }

  const std::array<double, kBins> mass = histogram<double>(bins.get(), w.get(), V);
  double total = 0;
  for (double v : mass) total += v;
  // kept(i): w[i] > 0 and, with top_p, in a bin before `last` or among the first `n` of bin `last` by (weight
  // descending, index ascending)
  int last = kBins;  // no nucleus cut
  float edge_w = 0;
  int64_t edge_i = -1;
  double kept = total;
  if (top_p < 1.0) {
    const double target = top_p * total;
    double before = 0;
    last = 0;
    while (last < kBins - 1 && before + mass[last] < target) before += mass[last++];
    std::vector<std::pair<float, int64_t>> edge;
    for (int64_t i = 0; i < V; ++i)
      if (bins[i] == last && w[i] > 0) edge.emplace_back(w[i], i);
    std::sort(edge.begin(), edge.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    kept = before;
    for (const auto& [wi, i] : edge) {  // a token stays while the mass before it is below top_p: the first does
      if (kept >= target && edge_i >= 0) break;
      kept += wi;
      edge_w = wi;
      edge_i = i;
    }
  }
  if (last < kBins) {  // the weights of the tokens the nucleus leaves out to 0 (branch-free: vectorisable)
    for (int64_t i = 0; i < V; ++i) {
      const uint8_t b = bins[i];
      const float wi = w[i];
      const bool keep = (b < last) | ((b == last) & ((wi > edge_w) | ((wi == edge_w) & (i <= edge_i))));
      w[i] = keep ? wi : 0.0f;
    }
  }
  // the first token whose running sum passes u * kept, walked 64 at a time
  const double x_at = u * kept;
  double run = 0;
  int64_t i = 0;
  for (; i + 64 <= V; i += 64) {
    double part[4] = {0, 0, 0, 0};  // four chains: no add waits on the one before
    for (int j = 0; j < 64; j += 4)
      for (int c = 0; c < 4; ++c) part[c] += w[i + j + c];
    const double block = (part[0] + part[1]) + (part[2] + part[3]);
    if (run + block > x_at) break;
    run += block;
  }
  int64_t fallback = -1;
  for (; i < V; ++i) {
    if (w[i] <= 0) continue;
    run += w[i];
    fallback = i;
    if (run > x_at) return i;
  }
  if (fallback < 0)  // u * kept rounded up to the total: the last kept token
    for (fallback = V - 1; fallback > 0 && w[fallback] <= 0; --fallback) {
    }
  return fallback;
}

void check_settings(const char* op, double temperature, int64_t top_k, double top_p, double u) {
  TORCH_CHECK(temperature > 0 && top_p > 0 && top_p <= 1 && u >= 0 && u < 1 && top_k >= 0, op,
              ": needs temperature > 0, top_p in (0, 1], u in [0, 1), top_k >= 0; got ", temperature, ", ", top_p,
              ", ", u, ", ", top_k);
}

int64_t sample_row(const at::Tensor& logits, double temperature, int64_t top_k, double top_p, double u,
                   bool force_portable) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 1 &&
                  logits.size(0) > 0,
              "sample_row: logits must be a non-empty float32 [V] CPU tensor, got ", logits.scalar_type(), " ",
              logits.sizes(), " on ", logits.device());
  check_settings("sample_row", temperature, top_k, top_p, u);
  const at::Tensor x = logits.contiguous();
  const int64_t token = sample_one(x.data_ptr<float>(), x.size(0), temperature, top_k, top_p, u, force_portable);
  TORCH_CHECK(token >= 0, "sample_row: the row's best logit is not finite (the caller checks for one)");
  return token;
}

// Rows of one step at once, in parallel (each with its own settings and uniform): one call where the engine
// would make one per sequence.
at::Tensor sample_rows(const at::Tensor& logits, at::ArrayRef<double> temperature, at::ArrayRef<int64_t> top_k,
                       at::ArrayRef<double> top_p, at::ArrayRef<double> u, bool force_portable) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.size(1) > 0,
              "sample_rows: logits must be a float32 [B, V] CPU tensor with V > 0, got ", logits.scalar_type(), " ",
              logits.sizes(), " on ", logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(static_cast<int64_t>(temperature.size()) == B && static_cast<int64_t>(top_k.size()) == B &&
                  static_cast<int64_t>(top_p.size()) == B && static_cast<int64_t>(u.size()) == B,
              "sample_rows: one temperature, top_k, top_p and u a row (", B, " rows)");
  for (int64_t b = 0; b < B; ++b) check_settings("sample_rows", temperature[b], top_k[b], top_p[b], u[b]);
  const at::Tensor x = logits.contiguous();
  const float* xp = x.data_ptr<float>();
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      op[b] = sample_one(xp + b * V, V, temperature[b], top_k[b], top_p[b], u[b], force_portable);
  });
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(op[b] >= 0, "sample_rows: row ", b, "'s best logit is not finite (the caller checks for one)");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("sample_row(Tensor logits, float temperature, int top_k, float top_p, float u, bool force_portable=False) "
        "-> int");
  m.def("sample_rows(Tensor logits, float[] temperature, int[] top_k, float[] top_p, float[] u, "
        "bool force_portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) {
  m.impl("sample_row", &sample_row);
  m.impl("sample_rows", &sample_rows);
}

// The MoE router's group-limited top-k (horizon.model.moe.Router: its PyTorch selection is the reference). Per
// token, with choice = score + bias over E experts in G groups of E / G:
//
//   group score  = the sum of the group's two largest choices (its one choice when a group has one expert)
//   kept groups  = the topk_group groups of largest group score
//   idx          = the k experts of largest choice among the kept groups, largest first
//
// Ties go to the lower index (of group, then of expert); NaN ranks above every number, as in torch.topk. The
// reference does the same with three torch.topk calls, a scatter and a masked fill: ~0.8 ms a layer for 512
// tokens of `small` (64 experts, 4 groups) on this project's 2-core machine, ~4% of an eager 512-token prefill,
// where this takes one pass over each row. Scalar C++: a row is 64-600 values, and the passes are compares, not
// arithmetic. Parallel over rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// One 64-bit key per (value, index): larger key = ranks first. The high half orders the floats (NaN above every
// number, -0 as +0), the low half is ~index, so equal values rank the lower index first and no two keys tie:
// the selections below are then integer compares, mostly without branches (branchy float compares with the
// tie and NaN rules mispredicted on nearly every element: 0.4 us a row of 64).
inline uint64_t rank_key(float v, int64_t i) {
  v += 0.0f;  // -0 -> +0
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  const uint32_t o = std::isnan(v) ? 0xFFFFFFFFu : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<uint64_t>(o) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

inline int64_t index_of(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// top[0..k) holds the k largest keys offered so far, largest first (0: empty; every real key is > 0).
inline void offer(uint64_t key, uint64_t* top, int64_t k) {
  if (key <= top[k - 1]) return;
  int64_t p = k - 1;
  for (; p > 0 && key > top[p - 1]; --p) top[p] = top[p - 1];
  top[p] = key;
}

at::Tensor grouped_topk(const at::Tensor& scores_, const at::Tensor& bias_, int64_t k, int64_t n_group,
                        int64_t topk_group) {
  TORCH_CHECK(scores_.device().is_cpu() && scores_.scalar_type() == at::kFloat && scores_.dim() == 2,
              "grouped_topk: scores must be a float32 CPU tensor [N, E], got ", scores_.scalar_type(), " ",
              scores_.sizes(), " on ", scores_.device());
  const int64_t N = scores_.size(0), E = scores_.size(1);
  TORCH_CHECK(bias_.device().is_cpu() && bias_.scalar_type() == at::kFloat && bias_.dim() == 1 && bias_.size(0) == E,
              "grouped_topk: bias must be a float32 CPU tensor [", E, "], got ", bias_.scalar_type(), " ",
              bias_.sizes());
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "grouped_topk: need n_group dividing E = ", E, " and 1 <= topk_group <= n_group, got n_group = ",
              n_group, ", topk_group = ", topk_group);
  const int64_t per = E / n_group;
  TORCH_CHECK(k >= 1 && k <= topk_group * per, "grouped_topk: k must be in [1, ", topk_group * per,
              "] (the experts of the kept groups), got ", k);
  const at::Tensor scores = scores_.contiguous(), bias = bias_.contiguous();
  at::Tensor out = at::empty({N, k}, scores.options().dtype(at::kLong));
  const float *sp = scores.data_ptr<float>(), *bp = bias.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> choice(E);
    std::vector<uint64_t> groups(topk_group), top(k);
    std::vector<int64_t> kept(topk_group);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t e = 0; e < E; ++e) choice[e] = sp[r * E + e] + bp[e];
      int64_t n_kept = 1;
      kept[0] = 0;
      if (n_group > 1) {
        std::fill(groups.begin(), groups.end(), 0);
        for (int64_t g = 0; g < n_group; ++g) {
          uint64_t m1 = 0, m2 = 0;  // the group's two largest
          for (int64_t e = g * per; e < (g + 1) * per; ++e) {
            const uint64_t key = rank_key(choice[e], e);
            m2 = std::max(m2, std::min(m1, key));
            m1 = std::max(m1, key);
          }
          const float score = per > 1 ? choice[index_of(m1)] + choice[index_of(m2)] : choice[index_of(m1)];
          offer(rank_key(score, g), groups.data(), topk_group);
        }
        n_kept = topk_group;
        for (int64_t j = 0; j < n_kept; ++j) kept[j] = index_of(groups[j]);
      }
      std::fill(top.begin(), top.end(), 0);
      for (int64_t j = 0; j < n_kept; ++j)
        for (int64_t e = kept[j] * per; e < (kept[j] + 1) * per; ++e) offer(rank_key(choice[e], e), top.data(), k);
      for (int64_t j = 0; j < k; ++j) op[r * k + j] = index_of(top[j]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(horizon_kernels, m) {
  m.def("grouped_topk(Tensor scores, Tensor bias, int k, int n_group, int topk_group) -> Tensor");
}

TORCH_LIBRARY_IMPL(horizon_kernels, CPU, m) { m.impl("grouped_topk", &grouped_topk); }

// Rows of a batch grouped by the expert (weight matrix) they are multiplied with: a counting sort on the
// host, shared by mxfp4.cpp and rows.cpp, so each expert's weights are read once per call whatever the
// routing, and experts nobody routes to are not read at all (kda.cpp groups its rows by cache slot with it).
// Also the 64-byte-aligned vector both keep their copies of the activations in.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace hz {

// A std::vector whose data starts on a cache line: a 512-bit load that straddles two lines costs two, and
// std::vector only promises 16 bytes. Rows of K floats stay aligned when K is a multiple of 16, as the
// AVX-512 paths require. (In a standalone loop with both operands misaligned, 16 rows x a warm [512 x 512]
// fp32 matrix ran 33 against 53 GFMA/s on one thread; in the kernels, where the weights already come
// aligned from torch's allocator, the difference was within noise.)
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

struct Group {
  int64_t expert, start, count;  // grouped rows start..start+count belong to `expert`
};

struct Grouping {
  std::vector<Group> groups;     // experts with rows, in expert order
  std::vector<int64_t> row_of;   // grouped position -> original row (a stable sort: one group keeps row order)
};

// Every row in one group, in order (one matrix, no expert ids).
inline Grouping one_group(int64_t M) {
  Grouping g;
  g.groups.push_back({0, 0, M});
  g.row_of.resize(M);
  for (int64_t m = 0; m < M; ++m) g.row_of[m] = m;
  return g;
}

// expert: [M] ids, each checked to be in [0, E) (`op` names the caller in the error).
inline Grouping group_rows(const int64_t* expert, int64_t M, int64_t E, const char* op) {
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(expert[m] >= 0 && expert[m] < E, op, ": expert[", m, "] = ", expert[m], " is not in [0, ", E, ")");
    ++start[expert[m] + 1];
  }
  Grouping g;
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1]) g.groups.push_back({e, start[e], start[e + 1]});
    start[e + 1] += start[e];
  }
  g.row_of.resize(M);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t m = 0; m < M; ++m) g.row_of[fill[expert[m]]++] = m;
  return g;
}

}  // namespace hz

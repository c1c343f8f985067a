// Rows of a batch grouped by the expert (weight matrix) they are multiplied with: a counting sort on the
// host, shared by mxfp4.cpp and rows.cpp, so each expert's weights are read once per call whatever the
// routing, and experts nobody routes to are not read at all.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace hz {

struct Group {
  int64_t expert, start, count;  // grouped rows start..start+count belong to `expert`
};

struct Grouping {
  std::vector<Group> groups;     // experts with rows, in expert order
  std::vector<int64_t> row_of;   // grouped position -> original row
};

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

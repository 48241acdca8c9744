#include "cli/sampling.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/philox.h"

namespace sg::cli {

int64_t draw_token(const std::vector<float>& logits, double temperature, int64_t top_k, uint64_t seed,
                   uint64_t counter) {
  SG_CHECK(!logits.empty(), "draw_token: no logits to draw from");
  if (temperature == 0) return std::max_element(logits.begin(), logits.end()) - logits.begin();
  std::vector<int64_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return logits[size_t(x)] > logits[size_t(y)]; });
  if (top_k > 0 && top_k < int64_t(order.size())) order.resize(size_t(top_k));
  const double mx = logits[size_t(order[0])];
  double z = 0;
  std::vector<double> p;
  for (int64_t i : order) z += p.emplace_back(std::exp((logits[size_t(i)] - mx) / temperature));
  double u = double(Philox::uniform(seed, 0x6e6e, counter)) * z;
  for (size_t i = 0; i < order.size(); ++i)
    if ((u -= p[i]) <= 0) return order[i];
  return order.back();
}

}  // namespace sg::cli

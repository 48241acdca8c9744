// Drawing the next token from a model's logits: `generate`, and `train --sample-tokens` at each
// evaluation.
#pragma once
#include <cstdint>
#include <vector>

namespace sg::cli {

// The next token from the last position's logits (f32, one per id that may be drawn): the likeliest
// at temperature 0; else one of the top_k likeliest (all of them when top_k is 0) with probability
// softmax(logits / temperature) over those, by Philox draw `counter` of `seed`. The same logits,
// seed and counter give the same token on every rank.
int64_t draw_token(const std::vector<float>& logits, double temperature, int64_t top_k, uint64_t seed,
                   uint64_t counter);

}  // namespace sg::cli

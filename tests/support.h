// Shared by the tests: the small GPT configuration most strategy tests train.
#pragma once
#include "models/gpt.h"

namespace sg::testing {

// 2 layers, 2 heads, width 16, 8 positions, 23 tokens (padded to 64): fast, and irregular enough.
inline nn::GPTConfig tiny_gpt() {
  nn::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = 23;
  return c;
}

}  // namespace sg::testing

#include "cli/model_from.h"

#include <filesystem>

#include "core/error.h"
#include "parallel/checkpoint.h"
#include "parallel/sharded_checkpoint.h"

namespace sg::cli {

ModelFrom model_from(const Args& a, DType dtype, Device device) {
  const std::string& cmd = a.command();
  const std::string from = a.str("from");
  SG_CHECK(!from.empty(), cmd, ": --from is required");
  const bool newest = from.rfind("auto:", 0) == 0;
  SG_CHECK(newest || std::filesystem::exists(from), cmd, ": --from ", from,
           ": no such checkpoint directory (run or step) or .safetensors file");
  ModelFrom m;
  m.file = from;
  if (newest || std::filesystem::is_directory(from)) {  // a checkpoint of any layout: its model, consolidated
    std::unique_ptr<ckpt::Checkpoint> c = ckpt::open_checkpoint(from);
    m.file = c->path();
    m.weights.path = m.file;
    for (auto& [n, t] : ckpt::hf_model_tensors(*c)) {
      m.weights.order.push_back(n);
      m.weights.tensors[n] = t;
    }
    m.weights.metadata = c->metadata();
  } else {
    m.weights = io::load_safetensors(from);
  }
  if (auto h = m.weights.metadata.find("n_head"); h != m.weights.metadata.end() && a.given("n-head"))
    SG_CHECK(std::to_string(a.i64("n-head")) == h->second, cmd, ": --n-head ", a.i64("n-head"), " does not match ",
             m.file, ", which records ", h->second, " heads (--n-head is for files that do not record it)");
  SG_CHECK(!a.given("n-head") || a.i64("n-head") >= 1, cmd, ": --n-head must be >= 1, got ", a.i64("n-head"));
  m.cfg = nn::config_from_hf(m.weights, a.i64("n-head"));
  m.model = std::make_unique<nn::GPT>(m.cfg, dtype, device);
  nn::load_hf_state(*m.model, m.weights);  // copied from the host into the device's parameters
  return m;
}

}  // namespace sg::cli

#include "models/gpt.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "autograd/ops.h"
#include "autograd/recompute.h"
#include "autograd/tape.h"
#include "core/philox.h"
#include "optim/nonfinite.h"
#include "parallel/comm/process_group.h"
#include "parallel/functional.h"
#include "parallel/tp/layers.h"

namespace sg::nn {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "selective") return Recompute::selective;
  if (s == "full") return Recompute::full;
  throw Error(str("--recompute: unknown mode '", s, "' (expected none, selective or full)"));
}

int64_t padded_vocab_rows(int64_t vocab_size, int64_t tp) {
  const int64_t tile = std::lcm<int64_t>(64, std::max<int64_t>(tp, 1));
  return (vocab_size + tile - 1) / tile * tile;
}

int64_t GPTConfig::vocab_rows() const {
  if (padded_vocab <= 0) return padded_vocab_rows(vocab_size, tp);
  const int64_t t = std::max<int64_t>(tp, 1);  // a recorded padding (a file's, a checkpoint's) split tp ways
  return (padded_vocab + t - 1) / t * t;
}

void GPTConfig::validate() const {
  SG_CHECK(n_layer >= 1, "model: n_layer must be >= 1, got ", n_layer);
  SG_CHECK(n_head >= 1, "model: n_head must be >= 1, got ", n_head);
  SG_CHECK(n_embd >= 1 && n_embd % n_head == 0, "model: n_embd ", n_embd, " is not divisible by n_head ", n_head);
  SG_CHECK(block_size >= 1, "model: block_size (seq-len) must be >= 1, got ", block_size);
  SG_CHECK(vocab_size >= 1, "model: vocab_size must be >= 1, got ", vocab_size);
  SG_CHECK(padded_vocab == 0 || padded_vocab >= vocab_size, "model: padded vocabulary ", padded_vocab,
           " is smaller than the vocabulary ", vocab_size);
  SG_CHECK(dropout >= 0 && dropout < 1, "model: dropout ", dropout, " outside [0, 1)");
  SG_CHECK(tp >= 1, "--tp must be >= 1, got ", tp);
  SG_CHECK(n_head % tp == 0, "--tp ", tp, ": ", n_head, " heads cannot be split ", tp, " ways");
  SG_CHECK(!sequence_parallel || tp > 1, "--sequence-parallel needs --tp > 1");
  const double C = double(n_embd), params = double(vocab_rows() + block_size) * C + double(n_layer) * 13 * C * C;
  SG_CHECK(params < 0x1p62, "model: about ", params, " parameters (", n_layer, " layers, width ", n_embd, ", vocab ",
           vocab_size, ", block size ", block_size, ") are past what num_params counts in int64");
  SG_CHECK(vocab_rows() % tp == 0, "--tp ", tp, ": ", vocab_rows(), " vocabulary rows cannot be split ", tp, " ways");
}

int64_t GPTConfig::num_params() const {
  const int64_t C = n_embd;
  const int64_t per_block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C);
  return vocab_rows() * C + block_size * C + n_layer * per_block + 2 * C;
}

double GPTConfig::flops_per_token(int64_t T) const {
  return 6.0 * double(num_params() - block_size * n_embd) + 12.0 * double(n_layer) * double(T) * double(n_embd);
}

int64_t GPTConfig::non_embedding_params() const { return num_params() - (vocab_rows() + block_size) * n_embd; }

GPTConfig gpt_preset(const std::string& name) {
  GPTConfig c;
  c.name = name;
  if (name == "tiny") {
    c.n_layer = 2; c.n_head = 4; c.n_embd = 64; c.block_size = 64; c.vocab_size = 256;
  } else if (name == "gpt2") {
    c.n_layer = 12; c.n_head = 12; c.n_embd = 768;
  } else if (name == "gpt2-medium") {
    c.n_layer = 24; c.n_head = 16; c.n_embd = 1024;
  } else if (name == "gpt2-large") {
    c.n_layer = 36; c.n_head = 20; c.n_embd = 1280;
  } else if (name == "gpt2-xl") {
    c.n_layer = 48; c.n_head = 25; c.n_embd = 1600;
  } else {
    throw Error(str("--model: unknown preset '", name, "' (expected tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl)"));
  }
  return c;
}

CausalSelfAttention::CausalSelfAttention(const GPTConfig& c, DType dtype, Device device)
    : n_head(c.n_head), dropout(c.dropout) {
  c_attn = register_module("c_attn", std::make_shared<Linear>(c.n_embd, 3 * c.n_embd, true, dtype, device));
  c_proj = register_module("c_proj", std::make_shared<Linear>(c.n_embd, c.n_embd, true, dtype, device));
}

Tensor causal_attention(const Tensor& qkv, int64_t n_head, bool recompute_core) {
  // straight from the packed [B, T, 3C] projection to [B, T, C]: no head split or merge copies
  auto core = [n_head](const autograd::TensorList& in) { return autograd::TensorList{attention_qkv(in[0], n_head)}; };
  // selective recompute: only the attention core is re-run in backward (its saved out and lse go)
  return recompute_core ? autograd::recompute(core, {qkv}, {})[0] : core({qkv})[0];
}

Tensor CausalSelfAttention::forward(const Tensor& x, bool recompute_core, const Tensor& residual) const {
  Tensor y = causal_attention(c_attn->forward(x), n_head, recompute_core);  // c_attn: [B, T, 3C]
  if (dropout == 0) return c_proj->forward(y, residual);
  Tensor a = sg::dropout(c_proj->forward(y), dropout, dropout_site);
  return residual.defined() ? add(residual, a) : a;
}

MLP::MLP(const GPTConfig& c, DType dtype, Device device) {
  c_fc = register_module("c_fc", std::make_shared<Linear>(c.n_embd, 4 * c.n_embd, true, dtype, device));
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * c.n_embd, c.n_embd, true, dtype, device));
}

Tensor MLP::forward(const Tensor& x, const Tensor& residual) const {
  return mlp(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias, residual);  // one node: sg::mlp
}

Block::Block(const GPTConfig& c, DType dtype, Device device, std::shared_ptr<comm::ProcessGroup> tp_group,
             int64_t layer_index)
    : dropout(c.dropout), layer(layer_index) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(c.n_embd, c.ln_eps, dtype, device));
  if (c.tp > 1) tp_attn = register_module("attn", std::make_shared<parallel::tp::ParallelAttention>(c, tp_group, dtype, device));
  else attn = register_module("attn", std::make_shared<CausalSelfAttention>(c, dtype, device));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(c.n_embd, c.ln_eps, dtype, device));
  if (c.tp > 1) tp_mlp = register_module("mlp", std::make_shared<parallel::tp::ParallelMLP>(c, tp_group, dtype, device));
  else mlp = register_module("mlp", std::make_shared<MLP>(c, dtype, device));
  if (attn) attn->dropout_site = attn_dropout_site(layer);
  else tp_attn->dropout_site = attn_dropout_site(layer);
}

Tensor Block::forward(const Tensor& x, Recompute rc) const {
  auto body = [this, rc](const autograd::TensorList& in) {
    const bool sel = rc == Recompute::selective;
    if (attn && dropout == 0) {
      // Both residual adds ride in the c_proj GEMMs (cuBLASLt's beta = 1 source): no pass of their
      // own over [B, T, C]; ln_2 reads h as stored.
      Tensor h = attn->forward(ln_1->forward(in[0]), sel, in[0]);  // x + attn
      return autograd::TensorList{mlp->forward(ln_2->forward(h), h)};  // h + mlp
    }
    Tensor a = attn ? attn->forward(ln_1->forward(in[0]), sel) : tp_attn->forward(ln_1->forward(in[0]), sel);
    auto [h, normed] = ln_2->forward_add(in[0], a);  // h = x + attn, normed = ln_2(h): one fused op
    Tensor m = mlp ? mlp->forward(normed) : tp_mlp->forward(normed);
    return autograd::TensorList{add(h, dropout > 0 ? sg::dropout(m, dropout, mlp_dropout_site(layer)) : m)};
  };
  return hooked([&] { return rc == Recompute::full ? autograd::recompute(body, {x}, parameters())[0] : body({x})[0]; });
}

GPT::GPT(const GPTConfig& c, DType dtype, Device device, std::shared_ptr<comm::ProcessGroup> tp)
    : config(c), tp_group(c.tp > 1 ? std::move(tp) : nullptr) {
  c.validate();
  SG_CHECK(c.tp == 1 || (tp_group && tp_group->size() == c.tp), "GPT: --tp ", c.tp, " needs a tensor-parallel group of ",
           c.tp, " ranks, got ", tp_group ? std::to_string(tp_group->size()) : std::string("none"));
  if (c.tp > 1) {
    tp_wte = register_module("wte", std::make_shared<parallel::tp::VocabParallelEmbedding>(c.vocab_rows(), c.n_embd, tp_group, dtype, device));
    tp_wte->sequence_parallel = c.sequence_parallel;
  } else {
    wte = register_module("wte", std::make_shared<Embedding>(c.vocab_rows(), c.n_embd, dtype, device));
  }
  wpe = register_module("wpe", std::make_shared<Embedding>(c.block_size, c.n_embd, dtype, device));
  for (int64_t i = 0; i < c.n_layer; ++i) h.push_back(register_module("h." + std::to_string(i), std::make_shared<Block>(c, dtype, device, tp_group, i)));
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(c.n_embd, c.ln_eps, dtype, device));
}

void GPT::init_weights(uint64_t seed) {
  for (auto& [name, p] : named_parameters()) init_parameter(name, p, seed);
}

void GPT::init_parameter(const std::string& name, const Tensor& p, uint64_t seed) const {
  autograd::NoGradGuard ng;
  const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const bool is_ln = name.find("ln_") != std::string::npos;
  if (is_ln) {
    fill_(p, is_bias ? 0.0 : 1.0);
  } else if (is_bias) {
    zero_(p);
  } else {
    const double std_resid = 0.02 / std::sqrt(2.0 * double(config.n_layer));
    const bool resid = name.find("c_proj.weight") != std::string::npos;
    // Drawn in place (a rank's piece of the full tensor's draws under tp): no temporary the size of
    // the parameter, let alone of the whole embedding.
    const parallel::tp::Split split = tp_group ? parallel::tp::gpt_param_split(name) : parallel::tp::Split{};
    parallel::tp::normal_shard_(p, split, tp_group ? tp_group->rank() : 0, tp_group ? tp_group->size() : 1, seed,
                                rng_stream_from_name(name.c_str()), 0.0, resid ? std_resid : 0.02);
  }
  if (name != "wte.weight") return;
  // Padded vocabulary rows are never looked up and never predicted: keep them zero.
  const int64_t V = config.vocab_size, Vp = config.vocab_rows();
  if (tp_wte) {
    const int64_t rows = p.size(0), start = tp_wte->vocab_start();
    const int64_t first_pad = std::clamp<int64_t>(V - start, 0, rows);
    if (first_pad < rows) zero_(narrow(p, 0, first_pad, rows - first_pad));
  } else if (Vp > V) {
    zero_(narrow(p, 0, V, Vp - V));
  }
}

Tensor GPT::embed(const Tensor& idx) const {
  SG_CHECK(idx.dim() == 2, "GPT: idx must be [B, T], got ", shape_str(idx.shape()));
  const int64_t T = idx.size(1);
  SG_CHECK(T <= config.block_size, "GPT: sequence length ", T, " exceeds block_size ", config.block_size);
  // Positions 0..T-1 are wpe's first T rows: a view, not a gather (no index tensor to copy to the
  // device, no sort in the backward); the narrow's gradient is the add's, summed over the batch.
  int64_t first = 0, len = T;
  if (config.sequence_parallel) {  // this rank's positions: the embedding is reduce-scattered along T
    SG_CHECK(T % config.tp == 0, "GPT: sequence parallelism needs the sequence length ", T, " to divide by --tp ", config.tp);
    first = tp_group->rank() * (T / config.tp), len = T / config.tp;
  }
  const Tensor tokens = wte ? wte->forward(idx) : tp_wte->forward(idx);
  Tensor x = add(tokens, narrow(wpe->weight, 0, first, len));  // [B, T, C] + [T, C]
  if (config.dropout > 0) x = dropout(x, config.dropout, kEmbedDropoutSite);
  return x;
}

Tensor GPT::head(const Tensor& h_out) const {
  Tensor x = ln_f->forward(h_out);
  if (tp_wte) {  // column-parallel head over this rank's vocabulary rows, the whole sequence
    x = config.sequence_parallel ? parallel::all_gather_seq(x, *tp_group) : parallel::copy_to_region(x, *tp_group);
    return linear(x, tp_wte->weight, Tensor());
  }
  // Tied head: logits = x wte^T, as a linear layer over wte [V, C] as stored: the GEMMs read it
  // transposed in place (a matmul of transpose(wte) would copy the 77 MB table to a contiguous
  // [C, V] every forward, and its gradient back, on top of x^T in the backward).
  return linear(x, wte->weight, Tensor());
}

Tensor GPT::forward(const Tensor& idx) const {
  return hooked([&] {
    Tensor x = embed(idx);
    for (const auto& block : h) x = block->forward(x, recompute);
    return head(x);
  });
}

Tensor GPT::forward_cached(const Tensor& idx, KVCache& cache) const {
  SG_CHECK(config.tp == 1, "GPT::forward_cached: the model is split --tp ", config.tp, " ways");
  SG_CHECK(idx.dim() == 2, "GPT::forward_cached: idx must be [B, T], got ", shape_str(idx.shape()));
  const int64_t B = idx.size(0), T = idx.size(1), L0 = cache.len, C = config.n_embd, H = config.n_head, D = C / H;
  SG_CHECK(L0 == 0 || T == 1, "GPT::forward_cached: ", T, " new positions after ", L0, " cached ones (a prompt goes ",
           "into an empty cache, then one token at a time)");
  SG_CHECK(L0 + T <= config.block_size, "GPT::forward_cached: positions up to ", L0 + T, " exceed block_size ",
           config.block_size);
  cache.k.resize(h.size()), cache.v.resize(h.size());
  Tensor x = add(wte->forward(idx), narrow(wpe->weight, 0, L0, T));  // positions L0 .. L0 + T - 1
  for (size_t i = 0; i < h.size(); ++i) {
    const Block& b = *h[i];
    const Tensor qkv = b.attn->c_attn->forward(b.ln_1->forward(x));  // [B, T, 3C]
    auto heads = [&](int64_t part) { return transpose(reshape(narrow(qkv, 2, part * C, C), {B, T, H, D}), 1, 2); };
    const Tensor q = heads(0);
    cache.k[i] = L0 ? cat({cache.k[i], heads(1)}, 2) : contiguous(heads(1));  // [B, H, L0 + T, D]
    cache.v[i] = L0 ? cat({cache.v[i], heads(2)}, 2) : contiguous(heads(2));
    // The prompt attends causally to itself; one new token to every position held, which needs no mask.
    const Tensor y = L0 == 0 ? attention(q, cache.k[i], cache.v[i], true)
                             : matmul(softmax(mul(matmul(q, transpose(cache.k[i], 2, 3)), 1.0 / std::sqrt(double(D)))),
                                      cache.v[i]);  // [B, H, T, D]
    const Tensor h_attn = b.attn->c_proj->forward(reshape(transpose(y, 1, 2), {B, T, C}), x);  // x + attn
    x = b.mlp->forward(b.ln_2->forward(h_attn), h_attn);                                     // + mlp
  }
  cache.len = L0 + T;
  return head(x);
}

Tensor GPT::loss_from_logits(Tensor logits, const Tensor& targets, bool sum, double scale) const {
  CrossEntropyOptions o;
  o.vocab = config.vocab_size;
  o.ignore_index = -1;
  o.sum = sum;
  o.scale = scale;
  if (tp_wte) return parallel::tp::vocab_parallel_cross_entropy(logits, targets, tp_wte->vocab_start(), *tp_group, o);
  return cross_entropy(std::move(logits), targets, o);
}

Tensor GPT::loss(const Tensor& idx, const Tensor& targets, bool sum, double scale) const {
  return loss_from_logits(forward(idx), targets, sum, scale);
}

// ---- Hugging Face names ----

namespace {
bool is_conv1d(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    std::string suf(s);
    if (name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0) return true;
  }
  return false;
}
}  // namespace

std::vector<std::string> gpt_parameter_names(const GPTConfig& c) {
  std::vector<std::string> out = {"wte.weight", "wpe.weight"};
  for (int64_t i = 0; i < c.n_layer; ++i)
    for (const char* p : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias"})
      out.push_back(str("h.", i, ".", p));
  out.push_back("ln_f.weight");
  out.push_back("ln_f.bias");
  return out;
}

io::NamedTensors hf_state_dict(const GPT& model) {
  SG_CHECK(model.config.tp == 1, "hf_state_dict: the model is split --tp ", model.config.tp, " ways (use a sharded checkpoint)");
  autograd::NoGradGuard ng;
  io::NamedTensors out;
  for (auto& [name, p] : model.named_parameters()) {
    if (name == "wte.weight") out.emplace_back(name, contiguous(narrow(p, 0, 0, model.config.vocab_size)));
    else if (is_conv1d(name)) out.emplace_back(name, contiguous(transpose(p, 0, 1)));
    else out.emplace_back(name, p);
  }
  return out;
}

static std::string strip_prefix(const std::string& n) {
  const std::string pre = "transformer.";
  return n.rfind(pre, 0) == 0 ? n.substr(pre.size()) : n;
}

void load_hf_state(GPT& model, const io::SafetensorsFile& file, const std::function<bool(const std::string&)>& only) {
  autograd::NoGradGuard ng;
  const int tp = int(model.config.tp), tp_rank = model.tp_group ? model.tp_group->rank() : 0;
  std::map<std::string, Tensor> by_name;
  for (auto& [n, t] : file.tensors) by_name[strip_prefix(n)] = t;
  std::set<std::string> used;
  for (auto& named : model.named_parameters()) {
    const std::string& name = named.first;
    Tensor& p = named.second;  // (not a structured binding: the lambda below captures it)
    // Under tp the parameter is this rank's slice: the file's tensor is checked against the whole
    // one (wte: its padded rows) and the slice cut from it.
    const parallel::tp::Split split = tp > 1 ? parallel::tp::gpt_param_split(name) : parallel::tp::Split{};
    Shape whole = p.shape();
    if (!split.replicated()) whole.at(size_t(split.dim)) *= tp;
    const auto place = [&](const Tensor& t) { copy_(p, parallel::tp::shard_of(t, split, tp_rank, tp)); };
    auto it = by_name.find(name);
    SG_CHECK(it != by_name.end(), file.path, ": tensor '", name, "' is missing (the model expects it with shape ",
             shape_str(name == "wte.weight" ? Shape{model.config.vocab_size, whole.at(1)}
                                            : (is_conv1d(name) ? Shape{whole.at(1), whole.at(0)} : whole)),
             ")");
    used.insert(name);
    if (only && !only(name)) continue;
    Tensor src = it->second;
    // A tensor the file was read without (another pipeline stage's: the parameter is not held
    // here) has its shape checked all the same, and nothing copied.
    const bool read = !src.device().is_meta();
    SG_CHECK(read || p.device().is_meta(), file.path, ": tensor '", name, "' was not read, but the model holds it on ",
             p.device().str());
    if (read) {
      const optim::NonFinite bad = optim::first_nonfinite({{name, src}});
      SG_CHECK(!bad.found(), file.path, ": tensor '", name, "' holds a non-finite value (element ", bad.index, " is ",
               bad.value, "): the file's weights are damaged");
    }
    if (name == "wte.weight") {
      SG_CHECK(src.dim() == 2 && src.size(0) == model.config.vocab_size && src.size(1) == whole.at(1), file.path,
               ": tensor 'wte.weight' has shape ", shape_str(src.shape()), " but the model expects [",
               model.config.vocab_size, ",", whole.at(1), "]");
      if (!read) continue;
      Tensor padded = zeros(whole, src.dtype(), src.device());  // the rows past the vocabulary stay 0
      copy_(narrow(padded, 0, 0, model.config.vocab_size), src);
      place(padded);
    } else if (is_conv1d(name)) {
      SG_CHECK(src.dim() == 2 && src.size(0) == whole.at(1) && src.size(1) == whole.at(0), file.path, ": tensor '", name,
               "' has shape ", shape_str(src.shape()), " but the model expects [", whole.at(1), ",", whole.at(0),
               "] (Conv1D [in, out])");
      if (read) place(transpose(src, 0, 1));
    } else {
      SG_CHECK(src.shape() == whole, file.path, ": tensor '", name, "' has shape ", shape_str(src.shape()),
               " but the model expects ", shape_str(whole));
      if (read) place(src);
    }
  }
  for (auto& [n, t] : by_name) {
    if (used.count(n)) continue;
    const bool mask_buffer = n.find(".attn.bias") != std::string::npos || n.find(".attn.masked_bias") != std::string::npos;
    if (mask_buffer) continue;  // causal masks
    if (n == "lm_head.weight") {  // the tied head: wte again, or an output layer this model cannot hold
      const Tensor& wte = by_name.at("wte.weight");
      const bool both_read = !t.device().is_meta() && !wte.device().is_meta();  // else the ranks that read them compare
      SG_CHECK(t.shape() == wte.shape() && (!both_read || to_vector<float>(t) == to_vector<float>(wte)), file.path,
               ": 'lm_head.weight' differs from 'wte.weight': an untied output layer, which this GPT-2 (its head tied "
               "to the token embedding) cannot hold; loading it would drop it");
      continue;
    }
    throw Error(str(file.path, ": unexpected tensor '", n, "' (not part of a GPT-2 with ", model.config.n_layer,
                    " layers)"));
  }
}

io::TensorFilter hf_tensors_of(std::set<std::string> names) {
  if (names.count("wte.weight")) names.insert("lm_head.weight");  // compared with wte when the file has it
  return [names = std::move(names)](const std::string& name) { return names.count(strip_prefix(name)) != 0; };
}

io::TensorFilter hf_tensors_held(const GPT& model) {
  std::set<std::string> held;
  for (const auto& [n, p] : model.named_parameters())
    if (!p.device().is_meta()) held.insert(n);
  return hf_tensors_of(std::move(held));
}

GPTConfig config_from_hf(const io::SafetensorsFile& file, int64_t n_head_hint) {
  std::map<std::string, Tensor> by_name;
  for (auto& [n, t] : file.tensors) by_name[strip_prefix(n)] = t;
  auto need = [&](const std::string& n) -> const Tensor& {
    auto it = by_name.find(n);
    SG_CHECK(it != by_name.end(), file.path, ": not a GPT-2 checkpoint (no '", n, "')");
    return it->second;
  };
  GPTConfig c;
  c.name = "from-file";
  const Tensor& wte = need("wte.weight");
  const Tensor& wpe = need("wpe.weight");
  SG_CHECK(wte.dim() == 2 && wpe.dim() == 2, file.path, ": wte/wpe must be 2-D");
  c.vocab_size = wte.size(0);
  c.n_embd = wte.size(1);
  c.block_size = wpe.size(0);
  int64_t layers = 0;
  while (by_name.count("h." + std::to_string(layers) + ".ln_1.weight")) ++layers;
  c.n_layer = layers;
  // A number the file's metadata records under key, or fallback when it records none.
  const auto recorded = [&](const char* key, int64_t fallback) -> int64_t {
    auto it = file.metadata.find(key);
    if (it == file.metadata.end()) return fallback;
    const std::string& v = it->second;
    int64_t n = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    SG_CHECK(ec == std::errc() && end == v.data() + v.size(), file.path, ": metadata '", key, "' is not a number: '",
             v.substr(0, 64), "'");
    return n;
  };
  // What the file records of its shape must be what its tensors have (a file whose wpe was cut
  // short would otherwise load as a model of a shorter context, said nowhere).
  const auto shaped = [&](const std::string& where, const char* key, int64_t recorded, const std::string& tensor,
                          int64_t actual) {
    SG_CHECK(recorded == actual, where, ": '", key, "' is ", recorded, " but ", tensor, " has ", actual,
             ": the file and what it records of its model disagree");
  };
  const std::string in_metadata = file.path + " (its metadata)";
  if (file.metadata.count("n_layer")) shaped(in_metadata, "n_layer", recorded("n_layer", 0), "the file", c.n_layer);
  if (file.metadata.count("n_embd")) shaped(in_metadata, "n_embd", recorded("n_embd", 0), "wte.weight's row", c.n_embd);
  if (file.metadata.count("block_size"))
    shaped(in_metadata, "block_size", recorded("block_size", 0), "wpe.weight's rows", c.block_size);
  c.n_head = recorded("n_head", n_head_hint);
  // A Hugging Face model folder records the head count in config.json, beside model.safetensors,
  // with the settings that would make it another model than this GPT-2: those are refused, not
  // ignored (the tensors alone cannot tell). One that is not JSON is refused too: it is this
  // folder's description of its model.
  const std::filesystem::path hf_config = std::filesystem::path(file.path).parent_path() / "config.json";
  if (std::filesystem::is_regular_file(hf_config)) {
    std::ifstream in(hf_config);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    SG_CHECK(j.is_object(), hf_config.string(), " (beside ", file.path, ") is not a JSON object: fix it, or move it away");
    const auto number = [&](const char* key) -> std::optional<int64_t> {
      if (!j.contains(key)) return std::nullopt;
      SG_CHECK(j[key].is_number_integer(), hf_config.string(), ": \"", key, "\": ", j[key].dump(), " is not a whole number");
      return j[key].get<int64_t>();
    };
    const std::string where = hf_config.string();
    if (const auto n = number("n_layer")) shaped(where, "n_layer", *n, file.path, c.n_layer);
    if (const auto n = number("n_embd")) shaped(where, "n_embd", *n, file.path + "'s wte.weight row", c.n_embd);
    if (const auto n = number("vocab_size")) shaped(where, "vocab_size", *n, file.path + "'s wte.weight rows", c.vocab_size);
    for (const char* key : {"n_positions", "n_ctx"})
      if (const auto n = number(key)) shaped(where, key, *n, file.path + "'s wpe.weight rows", c.block_size);
    if (const auto n = number("n_head")) {
      SG_CHECK(!file.metadata.count("n_head") || *n == c.n_head, where, ": \"n_head\" is ", *n, " but ", in_metadata,
               " records ", c.n_head, ": the file and what the folder says of its model disagree");
      if (c.n_head <= 0) c.n_head = *n;
    }
    const auto differs = [&](const char* key, const std::string& want) {
      throw Error(str(hf_config.string(), ": \"", key, "\": ", j[key].dump(), " makes another model than this GPT-2 (",
                      want, ")"));
    };
    if (j.contains("activation_function") && j["activation_function"] != "gelu_new" &&
        j["activation_function"] != "gelu_pytorch_tanh")
      differs("activation_function", "GELU's tanh form: \"gelu_new\"");
    if (j.contains("layer_norm_epsilon") &&
        !(j["layer_norm_epsilon"].is_number() && std::abs(j["layer_norm_epsilon"].get<double>() - c.ln_eps) <= 1e-12))
      differs("layer_norm_epsilon", str("LayerNorm's epsilon ", c.ln_eps));
    if (j.contains("n_inner") && !j["n_inner"].is_null() && j["n_inner"] != 4 * c.n_embd)
      differs("n_inner", str("an MLP of 4 x n_embd = ", 4 * c.n_embd, ", or null"));
    if (j.contains("scale_attn_weights") && j["scale_attn_weights"] != true)
      differs("scale_attn_weights", "scores scaled by 1/sqrt(head dim)");
    if (j.contains("scale_attn_by_inverse_layer_idx") && j["scale_attn_by_inverse_layer_idx"] != false)
      differs("scale_attn_by_inverse_layer_idx", "no per-layer scaling of the scores");
  }
  SG_CHECK(c.n_head > 0, file.path, ": the number of heads is not recorded (in its metadata or a config.json beside it); "
           "pass --n-head");
  c.padded_vocab = recorded("padded_vocab", c.padded_vocab);
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(str(file.path, ": ", e.what(), file.metadata.count("n_head") ? "" : " (the head count given with --n-head?)"));
  }
  return c;
}

}  // namespace sg::nn
